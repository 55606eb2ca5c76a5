// RMSNorm: device code only, included by fused.cu (one module with the other fused ops: its
// `extern "C"` entry points are there). Launchers: crates/ops/src/norm/cuda.rs; reference:
// crates/ops/src/norm/reference.rs.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// RMSNorm. x, y, dy, dx: (rows, dim); w: (dim).
// ops.rs: r = 1 / sqrt(sum(x²)·(1/dim) + eps); y = T(T(x·r)·w).
// Backward: g = T(dy·w) (a T tensor in ops.rs), dx = g·r − (x·r³)·(sum(g·x)·(1/dim)).

__device__ __forceinline__ float rms_r(float ss, int dim, float eps) {
    return 1.0f / sqrtf(__fadd_rn(__fmul_rn(ss, 1.0f / (float)dim), eps));
}

// One row of the forward; K elements per access (Vec<T>::N or 1).
template <typename T, int K>
__device__ __forceinline__ void rms_norm_fwd_row(const T* __restrict__ xr, const T* __restrict__ w,
                                                 T* __restrict__ yr, int dim, float eps, float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x * K; i < dim; i += blockDim.x * K) {
        float v[K];
        load_k<K>(xr + i, v);
#pragma unroll
        for (int j = 0; j < K; ++j) ss = fmaf(v[j], v[j], ss);
    }
    const float r = rms_r(block_sum2(ss, 0.0f, scratch).x, dim, eps);
    for (int i = threadIdx.x * K; i < dim; i += blockDim.x * K) {  // x again: just read, so L1/L2
        float v[K], wv[K];
        load_k<K>(xr + i, v);
        load_k<K>(w + i, wv);
#pragma unroll
        for (int j = 0; j < K; ++j) v[j] = __fmul_rn(round_t<T>(__fmul_rn(v[j], r)), wv[j]);
        store_k<K>(yr + i, v);
    }
}

template <typename T>
__device__ __forceinline__ void rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ w,
                                             T* __restrict__ y, int rows, int dim, float eps) {
    __shared__ float scratch[64];
    constexpr int N = Vec<T>::N;
    const bool vec = dim % N == 0 && aligned16(x) && aligned16(w) && aligned16(y);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long off = (long long)row * dim;
        if (vec) rms_norm_fwd_row<T, N>(x + off, w, y + off, dim, eps, scratch);
        else rms_norm_fwd_row<T, 1>(x + off, w, y + off, dim, eps, scratch);
    }
}

template <typename T, int K>
__device__ __forceinline__ void rms_norm_bwd_row(const T* __restrict__ dy, const T* __restrict__ x,
                                                 const T* __restrict__ w, T* __restrict__ dx, int dim,
                                                 float eps, float* scratch) {
    float sxx = 0.0f, sgx = 0.0f;
    for (int i = threadIdx.x * K; i < dim; i += blockDim.x * K) {
        float d[K], v[K], wv[K];
        load_k<K>(dy + i, d);
        load_k<K>(x + i, v);
        load_k<K>(w + i, wv);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const float g = round_t<T>(__fmul_rn(d[j], wv[j]));
            sxx = fmaf(v[j], v[j], sxx);
            sgx = fmaf(g, v[j], sgx);
        }
    }
    const float2 sums = block_sum2(sxx, sgx, scratch);
    const float r = rms_r(sums.x, dim, eps);
    const float r3 = __fmul_rn(__fmul_rn(r, r), r);
    const float mgx = __fmul_rn(sums.y, 1.0f / (float)dim);
    for (int i = threadIdx.x * K; i < dim; i += blockDim.x * K) {
        float d[K], v[K], wv[K];
        load_k<K>(dy + i, d);
        load_k<K>(x + i, v);
        load_k<K>(w + i, wv);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const float g = round_t<T>(__fmul_rn(d[j], wv[j]));
            d[j] = __fsub_rn(__fmul_rn(g, r), __fmul_rn(__fmul_rn(v[j], r3), mgx));
        }
        store_k<K>(dx + i, d);
    }
}

template <typename T>
__device__ __forceinline__ void rms_norm_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                                             const T* __restrict__ w, T* __restrict__ dx, int rows,
                                             int dim, float eps) {
    __shared__ float scratch[64];
    constexpr int N = Vec<T>::N;
    const bool vec = dim % N == 0 && aligned16(dy) && aligned16(x) && aligned16(w) && aligned16(dx);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long off = (long long)row * dim;
        if (vec) rms_norm_bwd_row<T, N>(dy + off, x + off, w, dx + off, dim, eps, scratch);
        else rms_norm_bwd_row<T, 1>(dy + off, x + off, w, dx + off, dim, eps, scratch);
    }
}
