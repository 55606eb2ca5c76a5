// Cross-entropy over a chunk of logits: device code only, included by fused.cu (one module with the other fused ops: its
// `extern "C"` entry points are there). Launchers: crates/ops/src/ce/cuda.rs; reference:
// crates/ops/src/ce/reference.rs.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// Log-sum-exp state: running max m and sum s of exp(x - m). (-inf, 0) is empty.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    const float mx = fmaxf(m, m2);
    if (mx == -INFINITY) return;  // both empty (or all -inf): keep (-inf, 0), avoid inf - inf
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
    m = mx;
}

__device__ __forceinline__ void block_lse(float& m, float& s, float* scratch) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = m;
        scratch[32 + warp] = s;
    }
    __syncthreads();
    m = lane < warps ? scratch[lane] : -INFINITY;
    s = lane < warps ? scratch[32 + lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, m2, s2);
    }
}

// Adds k values to a thread's lse state: one rescale for the group, one exp per value.
// NaN inputs make s NaN (fmaxf skips them, the exp does not).
template <int K> __device__ __forceinline__ void lse_add(float& m, float& s, const float* v) {
    float mc = v[0];
#pragma unroll
    for (int j = 1; j < K; ++j) mc = fmaxf(mc, v[j]);
    if (mc > m) {
        s *= expf(m - mc);  // m = -inf: s is 0 and stays 0
        m = mc;
    }
    if (m == -INFINITY) return;
#pragma unroll
    for (int j = 0; j < K; ++j) s += expf(v[j] - m);
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy over a chunk of logits. logits, dlogits: (n, V); targets: (n) u32; lse: (n) f32;
// out: (n, 2) f32 = [lse, lse − logit[target]] (NaN when target >= V).
// Forward: one block per row, a single pass (online max/sum), lse = max + log(sum(exp(x − max))).
// Backward: dlogits = T((exp(x − lse) − [i = target])·scale); grid.y over rows, grid.x over V.
//
// Soft-capped (Gemma 2's final_logit_softcapping, CAP = true; entry points ce_capped_*): the same
// over the capped logits z = softcap(x), formed on the fly from x, never stored:
//   z = T(T(tanh(T(x·inv))) · cap)  with inv = f32(1/cap)   (softcap_logits: each step a T tensor)
//   forward: lse and lse − z[target] of z;
//   backward: dz = T((exp(z − lse) − [i = target])·scale)   (ce_bwd's, a T tensor)
//             dlogits = T(dz · (1 − t²)), t = z·inv          (softcap_logits_backward, from z)
// The unfused path writes and reads z (n, V) and dz (n, V) once more each; here both stay in
// registers.

struct NoCap {};
struct SoftCap {
    float cap, inv;
};

// z of one logit: the logit itself, or its soft cap with softcap_logits' roundings.
template <typename T> __device__ __forceinline__ float cap_logit(float x, NoCap) { return x; }
template <typename T> __device__ __forceinline__ float cap_logit(float x, SoftCap c) {
    const float t = round_t<T>(tanhf(round_t<T>(__fmul_rn(x, c.inv))));
    return round_t<T>(__fmul_rn(t, c.cap));
}

template <typename T, int K, typename Cap>
__device__ __forceinline__ void ce_fwd_row(const T* __restrict__ lr, int v, float& m, float& s, Cap cap) {
#pragma unroll 4
    for (int i = threadIdx.x * K; i < v; i += blockDim.x * K) {
        float x[K];
        load_k<K>(lr + i, x);
#pragma unroll
        for (int j = 0; j < K; ++j) x[j] = cap_logit<T>(x[j], cap);
        lse_add<K>(m, s, x);
    }
}

template <typename T, typename Cap>
__device__ __forceinline__ void ce_fwd(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                                       float* __restrict__ out, int n, int v, Cap cap) {
    __shared__ float scratch[64];
    constexpr int N = Vec<T>::N;
    const bool vec = v % N == 0 && aligned16(logits);
    for (int row = blockIdx.x; row < n; row += gridDim.x) {
        const T* lr = logits + (long long)row * v;
        float m = -INFINITY, s = 0.0f;
        if (vec) ce_fwd_row<T, N>(lr, v, m, s, cap);
        else ce_fwd_row<T, 1>(lr, v, m, s, cap);
        block_lse(m, s, scratch);
        if (threadIdx.x == 0) {
            const float log_s = logf(s);
            const uint32_t tg = targets[row];
            const float picked = tg < (uint32_t)v ? cap_logit<T>(to_f32(lr[tg]), cap) : NAN;
            out[2 * (long long)row] = m + log_s;
            // (m − picked) + log s, not lse − picked: exact when the target is the max (loss ~1e-7
            // would otherwise round to 0 against lse's ulp), as ops.rs's log(Σe^z) − z[target].
            out[2 * (long long)row + 1] = (m - picked) + log_s;
        }
    }
}

template <typename T>
__device__ __forceinline__ float ce_grad(float x, float lse, bool target, float scale, NoCap) {
    return __fmul_rn(__fsub_rn(expf(x - lse), target ? 1.0f : 0.0f), scale);
}
template <typename T>
__device__ __forceinline__ float ce_grad(float x, float lse, bool target, float scale, SoftCap c) {
    const float z = cap_logit<T>(x, c);
    const float dz = round_t<T>(__fmul_rn(__fsub_rn(expf(z - lse), target ? 1.0f : 0.0f), scale));
    const float t = __fmul_rn(z, c.inv);
    return __fmul_rn(dz, __fsub_rn(1.0f, __fmul_rn(t, t)));
}

template <typename T, int K, typename Cap>
__device__ __forceinline__ void ce_bwd_row(const T* __restrict__ lr, float lse, int tg, float scale,
                                           T* __restrict__ dr, int v, Cap cap) {
    const int stride = gridDim.x * blockDim.x * K;
    for (int c = (blockIdx.x * blockDim.x + threadIdx.x) * K; c < v; c += stride) {
        float x[K];
        load_k<K>(lr + c, x);
#pragma unroll
        for (int j = 0; j < K; ++j)
            x[j] = ce_grad<T>(x[j], lse, c + j == tg, scale, cap);
        store_k<K>(dr + c, x);
    }
}

template <typename T, typename Cap>
__device__ __forceinline__ void ce_bwd(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                                       const float* __restrict__ lse, float scale, T* __restrict__ dl,
                                       int n, int v, Cap cap) {
    constexpr int N = Vec<T>::N;
    const bool vec = v % N == 0 && aligned16(logits) && aligned16(dl);
    for (int row = blockIdx.y; row < n; row += gridDim.y) {
        const long long off = (long long)row * v;
        const int tg = (int)min(targets[row], (uint32_t)v);  // out of range: v, matching no column
        if (vec) ce_bwd_row<T, N>(logits + off, lse[row], tg, scale, dl + off, v, cap);
        else ce_bwd_row<T, 1>(logits + off, lse[row], tg, scale, dl + off, v, cap);
    }
}
