// SwiGLU: device code only, included by fused.cu (one module with the other fused ops: its
// `extern "C"` entry points are there). Launchers: crates/ops/src/swiglu/cuda.rs; reference:
// crates/ops/src/swiglu/reference.rs.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// SwiGLU. g, u, h, dh: (n); out: (2, n) = [dg; du].
// ops.rs: h = T(T(silu(g))·u) with silu(g) = g / (1 + e^-g) (candle's silu, here in f32).
// Backward (ops.rs, f32): s = 1/(e^-g + 1); du = T(dh·(g·s)); dg = T((dh·u)·(s·(g·(1 − s) + 1))).

__device__ __forceinline__ float silu(float g) { return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))); }

__device__ __forceinline__ void swiglu_bwd1(float dh, float g, float u, float& dg, float& du) {
    const float s = __frcp_rn(__fadd_rn(expf(-g), 1.0f));
    du = __fmul_rn(dh, __fmul_rn(g, s));
    const float ds = __fmul_rn(s, __fadd_rn(__fmul_rn(g, __fsub_rn(1.0f, s)), 1.0f));
    dg = __fmul_rn(__fmul_rn(dh, u), ds);
}

template <typename T>
__device__ __forceinline__ void swiglu_fwd(const T* __restrict__ g, const T* __restrict__ u,
                                           T* __restrict__ h, long long n) {
    constexpr int N = Vec<T>::N;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vec = aligned16(g) && aligned16(u) && aligned16(h);
    const long long nvec = vec ? n / N : 0;
    for (long long i = tid; i < nvec; i += stride) {
        float gv[N], uv[N];
        load_vec(g + i * N, gv);
        load_vec(u + i * N, uv);
#pragma unroll
        for (int j = 0; j < N; ++j) gv[j] = __fmul_rn(round_t<T>(silu(gv[j])), uv[j]);
        store_vec(h + i * N, gv);
    }
    for (long long e = nvec * N + tid; e < n; e += stride)  // the tail, or everything when unaligned
        h[e] = from_f32<T>(__fmul_rn(round_t<T>(silu(to_f32(g[e]))), to_f32(u[e])));
}

template <typename T>
__device__ __forceinline__ void swiglu_bwd(const T* __restrict__ dh, const T* __restrict__ g,
                                           const T* __restrict__ u, T* __restrict__ out, long long n) {
    constexpr int N = Vec<T>::N;
    T* __restrict__ dg = out;
    T* __restrict__ du = out + n;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vec = aligned16(dh) && aligned16(g) && aligned16(u) && aligned16(dg) && aligned16(du);
    const long long nvec = vec ? n / N : 0;
    for (long long i = tid; i < nvec; i += stride) {
        float dv[N], gv[N], uv[N];
        load_vec(dh + i * N, dv);
        load_vec(g + i * N, gv);
        load_vec(u + i * N, uv);
#pragma unroll
        for (int j = 0; j < N; ++j) swiglu_bwd1(dv[j], gv[j], uv[j], gv[j], uv[j]);
        store_vec(dg + i * N, gv);
        store_vec(du + i * N, uv);
    }
    for (long long e = nvec * N + tid; e < n; e += stride) {
        float a, b;
        swiglu_bwd1(to_f32(dh[e]), to_f32(g[e]), to_f32(u[e]), a, b);
        dg[e] = from_f32<T>(a);
        du[e] = from_f32<T>(b);
    }
}
