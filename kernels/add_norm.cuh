// Residual add + RMSNorm, fused: device code only, included by fused.cu (its `extern "C"` entry
// points are there). Launchers: crates/ops/src/add_norm/cuda.rs; reference:
// crates/ops/src/add_norm/reference.rs. What the layer does as two ops, `h = ops::add(x, a)` then
// `norm(h)` (and in the backward `ops::add(d_out, norm_backward(dy))`), in one pass over a row.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// x, res, h, y, dy, dres, dh: (rows, dim) of T; w: (dim) of W, T (Llama's RMSNorm) or f32 (the f32
// weights of rms_norm_plus_one: Gemma's 1 + w, OLMo 2's w).
// Forward:  h = T(x + res)                                          (ops::add)
//           r = 1/sqrt(sum(h²)·(1/dim) + eps);  y = T(M(h·r)·w)
//           M rounds to T when W = T (LlamaRMSNorm: `w · (x·r).to(T)`); with W = f32 it is the
//           identity (Gemma3RMSNorm: all in f32, one rounding at the end).
// Backward: g = M(dy·w);  dn = T(g·r − (h·r³)·(sum(g·h)·(1/dim)))  (the norm's dx, a T tensor)
//           dh = T(dres + dn)       (ops::add: the residual stream's gradient plus the norm's)
//           dh may be dres itself: each element is read, then written, by one thread.
// One block per row (grid-stride), blockDim.x a multiple of 32 and <= 1024.

template <typename W> struct F32Weight { static constexpr bool value = false; };
template <> struct F32Weight<float> { static constexpr bool value = true; };

// M above: the product as the unfused op holds it.
template <typename T, typename W> __device__ __forceinline__ float norm_mid(float v) {
    if constexpr (F32Weight<W>::value) return v; else return round_t<T>(v);
}

// One row of the forward; K elements per access (Vec<T>::N or 1). h is written in the first pass
// and recomputed from x, res in the second (bit-identical: one rounded add), so no thread reads
// what the launch writes through the read-only cache.
template <typename T, typename W, int K>
__device__ __forceinline__ void add_norm_fwd_row(const T* __restrict__ x, const T* __restrict__ res,
                                                 const W* __restrict__ w, T* __restrict__ h,
                                                 T* __restrict__ y, int dim, float eps, float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x * K; i < dim; i += blockDim.x * K) {
        float a[K], b[K];
        load_k<K>(x + i, a);
        load_k<K>(res + i, b);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            a[j] = round_t<T>(__fadd_rn(a[j], b[j]));
            ss = fmaf(a[j], a[j], ss);
        }
        store_k<K>(h + i, a);
    }
    const float r = rms_r(block_sum2(ss, 0.0f, scratch).x, dim, eps);
    for (int i = threadIdx.x * K; i < dim; i += blockDim.x * K) {
        float a[K], b[K], wv[K];
        load_k<K>(x + i, a);
        load_k<K>(res + i, b);
        load_kw<K>(w + i, wv);
#pragma unroll
        for (int j = 0; j < K; ++j)
            a[j] = __fmul_rn(norm_mid<T, W>(__fmul_rn(round_t<T>(__fadd_rn(a[j], b[j])), r)), wv[j]);
        store_k<K>(y + i, a);
    }
}

template <typename T, typename W>
__device__ __forceinline__ void add_norm_fwd(const T* __restrict__ x, const T* __restrict__ res,
                                             const W* __restrict__ w, T* __restrict__ h,
                                             T* __restrict__ y, int rows, int dim, float eps) {
    __shared__ float scratch[64];
    constexpr int N = Vec<T>::N;
    const bool vec = dim % N == 0 && aligned16(x) && aligned16(res) && aligned16(w) && aligned16(h) &&
                     aligned16(y);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long o = (long long)row * dim;
        if (vec) add_norm_fwd_row<T, W, N>(x + o, res + o, w, h + o, y + o, dim, eps, scratch);
        else add_norm_fwd_row<T, W, 1>(x + o, res + o, w, h + o, y + o, dim, eps, scratch);
    }
}

// dres and dh may be one buffer (no __restrict__ on them; dres read with plain loads).
template <typename T, typename W, int K>
__device__ __forceinline__ void add_norm_bwd_row(const T* __restrict__ dy, const T* __restrict__ h,
                                                 const W* __restrict__ w, const T* dres, T* dh,
                                                 int dim, float eps, float* scratch) {
    float shh = 0.0f, sgh = 0.0f;
    for (int i = threadIdx.x * K; i < dim; i += blockDim.x * K) {
        float d[K], v[K], wv[K];
        load_k<K>(dy + i, d);
        load_k<K>(h + i, v);
        load_kw<K>(w + i, wv);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const float g = norm_mid<T, W>(__fmul_rn(d[j], wv[j]));
            shh = fmaf(v[j], v[j], shh);
            sgh = fmaf(g, v[j], sgh);
        }
    }
    const float2 sums = block_sum2(shh, sgh, scratch);
    const float r = rms_r(sums.x, dim, eps);
    const float r3 = __fmul_rn(__fmul_rn(r, r), r);
    const float mgh = __fmul_rn(sums.y, 1.0f / (float)dim);
    for (int i = threadIdx.x * K; i < dim; i += blockDim.x * K) {
        float d[K], v[K], wv[K], dr[K];
        load_k<K>(dy + i, d);
        load_k<K>(h + i, v);
        load_kw<K>(w + i, wv);
        load_k_rw<K>(dres + i, dr);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            const float g = norm_mid<T, W>(__fmul_rn(d[j], wv[j]));
            const float dn = round_t<T>(__fsub_rn(__fmul_rn(g, r), __fmul_rn(__fmul_rn(v[j], r3), mgh)));
            d[j] = __fadd_rn(dr[j], dn);
        }
        store_k<K>(dh + i, d);
    }
}

template <typename T, typename W>
__device__ __forceinline__ void add_norm_bwd(const T* __restrict__ dy, const T* __restrict__ h,
                                             const W* __restrict__ w, const T* dres, T* dh, int rows,
                                             int dim, float eps) {
    __shared__ float scratch[64];
    constexpr int N = Vec<T>::N;
    const bool vec = dim % N == 0 && aligned16(dy) && aligned16(h) && aligned16(w) &&
                     aligned16(dres) && aligned16(dh);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long o = (long long)row * dim;
        if (vec) add_norm_bwd_row<T, W, N>(dy + o, h + o, w, dres + o, dh + o, dim, eps, scratch);
        else add_norm_bwd_row<T, W, 1>(dy + o, h + o, w, dres + o, dh + o, dim, eps, scratch);
    }
}
