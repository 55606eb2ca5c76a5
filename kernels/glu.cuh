// Gated linear units, h = T(T(act(g))·u): device code only, included by fused.cu (one module with
// the other fused ops: its `extern "C"` entry points are there, one pair per activation). The
// activations are swiglu.cuh's Silu and geglu.cuh's GeluTanh; launchers: crates/ops/src/glu/cuda.rs;
// references: each op's crates/ops/src/<op>/reference.rs.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// g, u, h, dh: (n); out: (2, n) = [dg; du]. An activation A provides
//   static __device__ float fwd(float x);                      // act(x), f32
//   static __device__ void bwd(float x, float& a, float& da);  // the gate as the backward forms it,
//                                                              // and act'(x)
//   static constexpr bool ROUND_GATE_IN_BWD;                   // du = T(dh·T(a)) rather than T(dh·a)
// Forward: h = T(T(act(g))·u). Backward: du = T(dh·a), dg = T((dh·u)·da).

template <typename T, typename A>
__device__ __forceinline__ void glu_bwd1(float dh, float g, float u, float& dg, float& du) {
    float a, da;
    A::bwd(g, a, da);
    if (A::ROUND_GATE_IN_BWD) a = round_t<T>(a);
    du = __fmul_rn(dh, a);
    dg = __fmul_rn(__fmul_rn(dh, u), da);
}

template <typename T, typename A>
__device__ __forceinline__ void glu_fwd(const T* __restrict__ g, const T* __restrict__ u,
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
        for (int j = 0; j < N; ++j) gv[j] = __fmul_rn(round_t<T>(A::fwd(gv[j])), uv[j]);
        store_vec(h + i * N, gv);
    }
    for (long long e = nvec * N + tid; e < n; e += stride)  // the tail, or everything when unaligned
        h[e] = from_f32<T>(__fmul_rn(round_t<T>(A::fwd(to_f32(g[e]))), to_f32(u[e])));
}

template <typename T, typename A>
__device__ __forceinline__ void glu_bwd(const T* __restrict__ dh, const T* __restrict__ g,
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
        for (int j = 0; j < N; ++j) glu_bwd1<T, A>(dv[j], gv[j], uv[j], gv[j], uv[j]);
        store_vec(dg + i * N, gv);
        store_vec(du + i * N, uv);
    }
    for (long long e = nvec * N + tid; e < n; e += stride) {
        float a, b;
        glu_bwd1<T, A>(to_f32(dh[e]), to_f32(g[e]), to_f32(u[e]), a, b);
        dg[e] = from_f32<T>(a);
        du[e] = from_f32<T>(b);
    }
}
