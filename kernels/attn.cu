// The attention softmax of rtune's training step, forward and backward (one batch row of
// crates/ops/src (each op folder) `attention` at a time).
//
// Reference: the CPU op in crates/ops/src/attention/softmax.rs (itself tested against ops.rs's
// candle chain `attention_probs_reference` / `attention_grad_reference`), restated on f32 slices in
// crates/ops/src/attention/reference.rs (`attn_softmax_fwd`, `attn_softmax_bwd`).
//
// Forward: scores (rows, t) in T (raw, unscaled q·kᵀ), mask (mrows, t) additive f32, row r taking
// mask row r % mrows (the G query heads of a kv head are stacked along the rows: rows = Hkv·G·Tq,
// mrows = Tq); p (rows, t) f32:
//   s = f32(T(raw·scale)) + mask      (torch's `raw * scaling` on a T tensor: f32 product, one rounding)
//   p = exp(s − max(s)) / Σ exp(s − max(s))
// A row whose s are all −inf (fully masked) gives NaN, as the CPU op and the candle chain do
// (exp(−inf − (−inf))). The max ignores NaN scores (fmaxf, as the CPU op's `>`); their exp does not.
//
// Backward: p (rows, t) f32, dp (rows, t) in T; ds (rows, t) in T:
//   ds = T((p·(dp − Σ_row dp·p))·scale)
//
// Launch (crates/ops/src/attention/softmax_cuda.rs): one block per row (grid-stride over rows), blockDim.x a
// multiple of 32 and <= 1024. The forward keeps the row's s, then its exps, in dynamic shared memory
// when `cached` (t·4 bytes; the launcher sets it when that fits in the default 48 KiB), else it
// recomputes s from global memory in each of its three passes (same values, same results).
// 16-byte vector loads/stores when t is a multiple of the vector width of T and every pointer is
// 16-byte aligned, else a scalar path with the same results. Reductions run in a fixed order per
// launch shape: deterministic.

#include "common.cuh"

// K consecutive f32 (K = 1, or a multiple of 4 with p 16-byte aligned), global or shared.
template <int K> __device__ __forceinline__ void load_f32s(const float* p, float* v) {
    if constexpr (K == 1) {
        v[0] = *p;
    } else {
#pragma unroll
        for (int q = 0; q < K / 4; ++q) {
            const float4 r = *reinterpret_cast<const float4*>(p + 4 * q);
            v[4 * q] = r.x; v[4 * q + 1] = r.y; v[4 * q + 2] = r.z; v[4 * q + 3] = r.w;
        }
    }
}
template <int K> __device__ __forceinline__ void store_f32s(float* p, const float* v) {
    if constexpr (K == 1) {
        *p = v[0];
    } else {
#pragma unroll
        for (int q = 0; q < K / 4; ++q)
            *reinterpret_cast<float4*>(p + 4 * q) = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The max of v over the block (blockDim.x a multiple of 32, <= 1024); every thread gets it.
// scratch: 32 floats of shared memory.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();  // the previous reduction's readers are done with scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : -INFINITY);
}

// ---------------------------------------------------------------------------------------------
// Forward

// K scaled, masked scores at i: f32(T(raw·scale)) + mask (scale an f32, as torch's scalar).
template <typename T, int K>
__device__ __forceinline__ void scores_k(const T* __restrict__ sr, const float* __restrict__ mr, int i,
                                         float scale, float* v) {
    float m[K];
    load_k<K>(sr + i, v);
    load_f32s<K>(mr + i, m);
#pragma unroll
    for (int j = 0; j < K; ++j) v[j] = __fadd_rn(round_t<T>(__fmul_rn(v[j], scale)), m[j]);
}

// One row; K elements per access. cache: t floats of shared memory when CACHE (each thread reads
// back only the elements it wrote, so the passes need no barrier beyond the reductions').
template <typename T, int K, bool CACHE>
__device__ __forceinline__ void attn_fwd_row(const T* __restrict__ sr, const float* __restrict__ mr,
                                             float* __restrict__ pr, int t, float scale, float* cache,
                                             float* scratch) {
    const int step = blockDim.x * K;
    float mx = -INFINITY;
    for (int i = threadIdx.x * K; i < t; i += step) {
        float v[K];
        scores_k<T, K>(sr, mr, i, scale, v);
        if constexpr (CACHE) store_f32s<K>(cache + i, v);
#pragma unroll
        for (int j = 0; j < K; ++j) mx = fmaxf(mx, v[j]);
    }
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (int i = threadIdx.x * K; i < t; i += step) {
        float v[K];
        if constexpr (CACHE) load_f32s<K>(cache + i, v);
        else scores_k<T, K>(sr, mr, i, scale, v);
#pragma unroll
        for (int j = 0; j < K; ++j) {
            v[j] = expf(__fsub_rn(v[j], mx));  // all −inf: exp(NaN), the CPU op's NaN row
            sum = __fadd_rn(sum, v[j]);
        }
        if constexpr (CACHE) store_f32s<K>(cache + i, v);
    }
    sum = block_sum2(sum, 0.0f, scratch).x;
    for (int i = threadIdx.x * K; i < t; i += step) {
        float v[K];
        if constexpr (CACHE) {
            load_f32s<K>(cache + i, v);
        } else {
            scores_k<T, K>(sr, mr, i, scale, v);
#pragma unroll
            for (int j = 0; j < K; ++j) v[j] = expf(__fsub_rn(v[j], mx));
        }
#pragma unroll
        for (int j = 0; j < K; ++j) v[j] = __fdiv_rn(v[j], sum);
        store_f32s<K>(pr + i, v);
    }
}

template <typename T, int K>
__device__ __forceinline__ void attn_fwd_rows(const T* __restrict__ scores, const float* __restrict__ mask,
                                              float* __restrict__ p, int rows, int t, int mrows,
                                              float scale, bool cached, float* cache, float* scratch) {
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long off = (long long)row * t;
        const float* mr = mask + (long long)(row % mrows) * t;
        if (cached) attn_fwd_row<T, K, true>(scores + off, mr, p + off, t, scale, cache, scratch);
        else attn_fwd_row<T, K, false>(scores + off, mr, p + off, t, scale, cache, scratch);
    }
}

template <typename T>
__device__ __forceinline__ void attn_fwd(const T* __restrict__ scores, const float* __restrict__ mask,
                                         float* __restrict__ p, int rows, int t, int mrows, float scale,
                                         int cached) {
    __shared__ float scratch[64];
    // t floats when cached, else none; read as float4 by the vector path, so 16-byte aligned.
    extern __shared__ __align__(16) float cache[];
    constexpr int N = Vec<T>::N;
    const float sc = scale;  // f32, not rounded to T: torch multiplies by the f32 scalar
    const bool vec = t % N == 0 && aligned16(scores) && aligned16(mask) && aligned16(p);
    if (vec) attn_fwd_rows<T, N>(scores, mask, p, rows, t, mrows, sc, cached != 0, cache, scratch);
    else attn_fwd_rows<T, 1>(scores, mask, p, rows, t, mrows, sc, cached != 0, cache, scratch);
}

// ---------------------------------------------------------------------------------------------
// Backward

template <typename T, int K>
__device__ __forceinline__ void attn_bwd_row(const float* __restrict__ pr, const T* __restrict__ dr,
                                             T* __restrict__ o, int t, float scale, float* scratch) {
    const int step = blockDim.x * K;
    float acc = 0.0f;
    for (int i = threadIdx.x * K; i < t; i += step) {
        float pv[K], dv[K];
        load_f32s<K>(pr + i, pv);
        load_k<K>(dr + i, dv);
#pragma unroll
        for (int j = 0; j < K; ++j) acc = fmaf(dv[j], pv[j], acc);
    }
    const float row = block_sum2(acc, 0.0f, scratch).x;
    for (int i = threadIdx.x * K; i < t; i += step) {  // p and dp again: just read, so L1/L2
        float pv[K], dv[K];
        load_f32s<K>(pr + i, pv);
        load_k<K>(dr + i, dv);
#pragma unroll
        for (int j = 0; j < K; ++j) dv[j] = __fmul_rn(__fmul_rn(pv[j], __fsub_rn(dv[j], row)), scale);
        store_k<K>(o + i, dv);
    }
}

template <typename T>
__device__ __forceinline__ void attn_bwd(const float* __restrict__ p, const T* __restrict__ dp,
                                         T* __restrict__ ds, int rows, int t, float scale) {
    __shared__ float scratch[64];
    constexpr int N = Vec<T>::N;
    const bool vec = t % N == 0 && aligned16(p) && aligned16(dp) && aligned16(ds);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long off = (long long)row * t;
        if (vec) attn_bwd_row<T, N>(p + off, dp + off, ds + off, t, scale, scratch);
        else attn_bwd_row<T, 1>(p + off, dp + off, ds + off, t, scale, scratch);
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points, one per op and element type.

#define ATTN_KERNELS(SUFFIX, T)                                                                     \
    extern "C" __global__ void __launch_bounds__(1024) attn_softmax_fwd_##SUFFIX(                   \
        const T* __restrict__ scores, const float* __restrict__ mask, float* __restrict__ p,        \
        int rows, int t, int mrows, float scale, int cached) {                                      \
        attn_fwd<T>(scores, mask, p, rows, t, mrows, scale, cached);                                \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) attn_softmax_bwd_##SUFFIX(                   \
        const float* __restrict__ p, const T* __restrict__ dp, T* __restrict__ ds, int rows, int t, \
        float scale) {                                                                              \
        attn_bwd<T>(p, dp, ds, rows, t, scale);                                                     \
    }

ATTN_KERNELS(f32, float)
ATTN_KERNELS(bf16, __nv_bfloat16)
ATTN_KERNELS(f16, __half)
