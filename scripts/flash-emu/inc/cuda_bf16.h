// Host stand-in for cuda_bf16.h (scripts/flash-emu.sh): bf16 as bits, round to nearest even.
#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 { unsigned short x; };
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.x << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return __nv_bfloat16{(unsigned short)(u >> 16)}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }
