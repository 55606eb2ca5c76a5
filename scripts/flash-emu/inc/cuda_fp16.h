// Host stand-in for cuda_fp16.h (scripts/flash-emu.sh): declarations only, f16 is not emulated.
#pragma once
struct __half { unsigned short x; };
inline float __half2float(__half) { return 0.0f; }
inline __half __float2half_rn(float) { return __half{0}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(unsigned short s) { return __half{s}; }
