// Host stand-in for cuda_fp16.h (the kernel emulation): f16 through GCC's _Float16 (x86-64, GCC
// 12+), conversions rounding to nearest even as the device's.
#pragma once
#include <cstring>
struct __half { unsigned short x; };
inline float __half2float(__half h) { _Float16 f; memcpy(&f, &h.x, 2); return (float)f; }
inline __half __float2half_rn(float v) { _Float16 f = (_Float16)v; __half h; memcpy(&h.x, &f, 2); return h; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __ushort_as_half(unsigned short s) { return __half{s}; }
