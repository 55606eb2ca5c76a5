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

template <typename T, int K>
__device__ __forceinline__ void ce_fwd_row(const T* __restrict__ lr, int v, float& m, float& s) {
#pragma unroll 4
    for (int i = threadIdx.x * K; i < v; i += blockDim.x * K) {
        float x[K];
        load_k<K>(lr + i, x);
        lse_add<K>(m, s, x);
    }
}

template <typename T>
__device__ __forceinline__ void ce_fwd(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                                       float* __restrict__ out, int n, int v) {
    __shared__ float scratch[64];
    constexpr int N = Vec<T>::N;
    const bool vec = v % N == 0 && aligned16(logits);
    for (int row = blockIdx.x; row < n; row += gridDim.x) {
        const T* lr = logits + (long long)row * v;
        float m = -INFINITY, s = 0.0f;
        if (vec) ce_fwd_row<T, N>(lr, v, m, s);
        else ce_fwd_row<T, 1>(lr, v, m, s);
        block_lse(m, s, scratch);
        if (threadIdx.x == 0) {
            const float log_s = logf(s);
            const uint32_t tg = targets[row];
            const float picked = tg < (uint32_t)v ? to_f32(lr[tg]) : NAN;
            out[2 * (long long)row] = m + log_s;
            // (m − picked) + log s, not lse − picked: exact when the target is the max (loss ~1e-7
            // would otherwise round to 0 against lse's ulp), as ops.rs's log(Σe^z) − z[target].
            out[2 * (long long)row + 1] = (m - picked) + log_s;
        }
    }
}

template <typename T, int K>
__device__ __forceinline__ void ce_bwd_row(const T* __restrict__ lr, float lse, int tg, float scale,
                                           T* __restrict__ dr, int v) {
    const int stride = gridDim.x * blockDim.x * K;
    for (int c = (blockIdx.x * blockDim.x + threadIdx.x) * K; c < v; c += stride) {
        float x[K];
        load_k<K>(lr + c, x);
#pragma unroll
        for (int j = 0; j < K; ++j)
            x[j] = __fmul_rn(__fsub_rn(expf(x[j] - lse), c + j == tg ? 1.0f : 0.0f), scale);
        store_k<K>(dr + c, x);
    }
}

template <typename T>
__device__ __forceinline__ void ce_bwd(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                                       const float* __restrict__ lse, float scale, T* __restrict__ dl,
                                       int n, int v) {
    constexpr int N = Vec<T>::N;
    const bool vec = v % N == 0 && aligned16(logits) && aligned16(dl);
    for (int row = blockIdx.y; row < n; row += gridDim.y) {
        const long long off = (long long)row * v;
        const int tg = (int)min(targets[row], (uint32_t)v);  // out of range: v, matching no column
        if (vec) ce_bwd_row<T, N>(logits + off, lse[row], tg, scale, dl + off, v);
        else ce_bwd_row<T, 1>(logits + off, lse[row], tg, scale, dl + off, v);
    }
}
