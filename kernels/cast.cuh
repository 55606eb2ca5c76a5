// The widening cast: device code only, included by fused.cu (one module with the other fused ops: its
// `extern "C"` entry points are there). Launchers: crates/backend/src/cast/cuda.rs; reference:
// crates/backend/src/cast/reference.rs.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// Widening to f32: y = f32(x), exact (every bf16 and f16 value is an f32; a NaN keeps its payload,
// as candle's CUDA cast keeps it). crates/backend/src/cast/mod.rs sends bf16/f16 -> f32 casts here:
// candle's own cast kernel moved bf16 -> f32 at ~15% of the H200's copy bandwidth (Nsight Compute,
// 2048 x 4096 in 77 us), and the LoRA branch widens its input and output gradient at every module.
// One 16-byte vector of x per thread step (two or four float4 stores) where x and y are 16-byte
// aligned, else one element.

template <typename T>
__device__ __forceinline__ void widen(const T* __restrict__ x, float* __restrict__ y, long long n) {
    constexpr int N = Vec<T>::N;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vec = aligned16(x) && aligned16(y);
    const long long nvec = vec ? n / N : 0;
    for (long long i = tid; i < nvec; i += stride) {
        float v[N];
        load_vec(x + i * N, v);
#pragma unroll
        for (int j = 0; j < N; j += 4) store_vec(y + i * N + j, v + j);
    }
    for (long long e = nvec * N + tid; e < n; e += stride)  // the tail, or everything when unaligned
        y[e] = to_f32(x[e]);
}
