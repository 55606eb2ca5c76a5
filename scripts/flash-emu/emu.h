// CUDA built-ins for the host emulation of the kernels (force-included before a kernel file):
// scripts/flash-emu.sh (flash_attn.cu) and scripts/flash-emu/kernels_lib.cpp (fused.cu, attn.cu, adamw.cu, nf4.cu, dropout.cu;
// built and driven by crates/ops/tests/kernels_emulated.rs).
#pragma once
#include <barrier>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <cstdio>
#include <algorithm>
struct dim3e { unsigned x = 0, y = 0, z = 0; };
extern thread_local dim3e threadIdx;
extern dim3e blockIdx, gridDim, blockDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// A block's static shared arrays: one per kernel instantiation, shared by the block's threads
// (blocks run one after another) with EMU_STATIC_SHARED; flash-emu.sh's one dynamic array is a
// global of its harness.
#ifdef EMU_STATIC_SHARED
#define __shared__ static
#else
#define __shared__
#endif
#define __restrict__
#define __launch_bounds__(x)
#define __align__(n) __attribute__((aligned(n)))
struct uint4 { uint32_t x, y, z, w; };
struct float4 { float x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct int2 { int x, y; };
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline int2 make_int2(int a, int b) { return {a, b}; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return (uint32_t)(((uint64_t)a * b) >> 32); }
inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
inline void __trap() { fprintf(stderr, "TRAP\n"); abort(); }
// Correctly rounded f32 arithmetic (the host's IEEE operations; ISO C++ contracts nothing into an
// FMA), as the _rn intrinsics are on the device.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
using std::min; using std::max; using std::isfinite; using std::isnan; using std::isinf;
void __syncthreads();
void __syncwarp();
float __shfl_xor_sync(unsigned, float v, int o);
float __shfl_sync(unsigned, float v, int src);
extern unsigned emu_smem_bytes;
