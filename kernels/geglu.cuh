// GeGLU (Gemma's gelu_pytorch_tanh gate): device code only, included by fused.cu (one module with
// the other fused ops: its `extern "C"` entry points are there). Launchers:
// crates/ops/src/geglu/cuda.rs; reference: crates/ops/src/geglu/reference.rs (and cpu.rs, whose
// f32 steps these are, in the same order).
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// GeGLU. g, u, h, dh: (n); out: (2, n) = [dg; du].
// t = tanh((x + C·x³)·K), x³ = (x·x)·x, K = √(2/π), C = 0.044715; act = (x·0.5)·(t + 1).
// Forward: h = T(T(act)·u). Backward: du = T(dh·T(act));
// dg = T((dh·u)·((t + 1)·0.5 + ((x·K/2)·(1 − t²))·(x²·3C + 1))).

__device__ __forceinline__ float geglu_tanh(float x) {
    const float x3 = __fmul_rn(__fmul_rn(x, x), x);
    return tanhf(__fmul_rn(__fadd_rn(x, __fmul_rn(x3, 0.044715f)), 0.7978845608028654f));
}

__device__ __forceinline__ float geglu_act(float x, float t) {
    return __fmul_rn(__fmul_rn(x, 0.5f), __fadd_rn(t, 1.0f));
}

template <typename T>
__device__ __forceinline__ void geglu_bwd1(float dh, float x, float u, float& dg, float& du) {
    const float t = geglu_tanh(x);
    du = __fmul_rn(dh, round_t<T>(geglu_act(x, t)));
    const float one_minus_t2 = __fadd_rn(__fmul_rn(__fmul_rn(t, t), -1.0f), 1.0f);
    const float poly = __fadd_rn(__fmul_rn(__fmul_rn(x, x), 0.134145f), 1.0f);  // 3·0.044715
    const float d = __fadd_rn(__fmul_rn(__fadd_rn(t, 1.0f), 0.5f),
                              __fmul_rn(__fmul_rn(__fmul_rn(x, 0.3989422804014327f), one_minus_t2), poly));
    dg = __fmul_rn(__fmul_rn(dh, u), d);
}

template <typename T>
__device__ __forceinline__ void geglu_fwd(const T* __restrict__ g, const T* __restrict__ u,
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
        for (int j = 0; j < N; ++j)
            gv[j] = __fmul_rn(round_t<T>(geglu_act(gv[j], geglu_tanh(gv[j]))), uv[j]);
        store_vec(h + i * N, gv);
    }
    for (long long e = nvec * N + tid; e < n; e += stride) {  // the tail, or everything when unaligned
        const float x = to_f32(g[e]);
        h[e] = from_f32<T>(__fmul_rn(round_t<T>(geglu_act(x, geglu_tanh(x))), to_f32(u[e])));
    }
}

template <typename T>
__device__ __forceinline__ void geglu_bwd(const T* __restrict__ dh, const T* __restrict__ g,
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
        for (int j = 0; j < N; ++j) geglu_bwd1<T>(dv[j], gv[j], uv[j], gv[j], uv[j]);
        store_vec(dg + i * N, gv);
        store_vec(du + i * N, uv);
    }
    for (long long e = nvec * N + tid; e < n; e += stride) {
        float a, b;
        geglu_bwd1<T>(to_f32(dh[e]), to_f32(g[e]), to_f32(u[e]), a, b);
        dg[e] = from_f32<T>(a);
        du[e] = from_f32<T>(b);
    }
}
