// RoPE on q and k in place, one launch for both: device code only, included by fused.cu (its
// `extern "C"` entry points are there). Launchers: crates/ops/src/rope/cuda.rs (`rope_qk_*`);
// reference: crates/ops/src/rope/reference.rs (`rope_qk`). rope.cuh's rotation without its output
// buffers, its second launch, or the copies of partial rotary and of f32 tables.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// q: (B, Hq, T, Dh), k: (B, Hk, T, Dh), T-typed, rotated in place; cos, sin: (Bc, 1, T, R) of C,
// Bc = 1 (every batch row reads it) or B; R <= Dh, even: the first R of each head rotate
// (rotate_half over those R), the other Dh − R are left as they are (partial rotary, Phi-4-mini).
// Forward: y = Rc(Rc(x·cos) + Rc(rotate_half(x)·sin)), rotate_half([x1, x2]) = [−x2, x1];
// backward (the transpose): z = Rc(dy·sin); dx = Rc(Rc(dy·cos) + [z2, −z1]); then stored as T.
// Rc rounds to C: C = T is rope.cuh's numerics (each product a T tensor in rope.rs); C = f32 with a
// bf16/f16 x is rope::apply's f32-table mode (OLMo 2: x widened, rotated in f32, rounded once).
// One work item = K consecutive columns c..c+K of a head's first rotated half and the matching
// ones of the second (K = Vec<T>::N when R/2 and Dh are multiples of it and all pointers are
// aligned, else 1); items [0, nq) are q's, [nq, nq + nk) k's.

template <typename T, typename C, bool BWD, int K>
__device__ __forceinline__ void rope_qk_item(T* x, const C* __restrict__ cos, const C* __restrict__ sin,
                                             size_t xo, size_t co, size_t half) {
    float a1[K], a2[K], c1[K], c2[K], s1[K], s2[K];
    load_k_rw<K>(x + xo, a1);  // written below by this thread: no read-only cache
    load_k_rw<K>(x + xo + half, a2);
    load_kw<K>(cos + co, c1);
    load_kw<K>(cos + co + half, c2);
    load_kw<K>(sin + co, s1);
    load_kw<K>(sin + co + half, s2);
#pragma unroll
    for (int j = 0; j < K; ++j) {
        float o1, o2;
        if constexpr (!BWD) {
            o1 = __fadd_rn(round_t<C>(__fmul_rn(a1[j], c1[j])), round_t<C>(__fmul_rn(-a2[j], s1[j])));
            o2 = __fadd_rn(round_t<C>(__fmul_rn(a2[j], c2[j])), round_t<C>(__fmul_rn(a1[j], s2[j])));
        } else {
            const float z1 = round_t<C>(__fmul_rn(a1[j], s1[j]));
            const float z2 = round_t<C>(__fmul_rn(a2[j], s2[j]));
            o1 = __fadd_rn(round_t<C>(__fmul_rn(a1[j], c1[j])), z2);
            o2 = __fadd_rn(round_t<C>(__fmul_rn(a2[j], c2[j])), -z1);
        }
        // Rc of the sum, then the store's rounding to T (the same for C = T; one rounding to T from
        // f32 for C = f32).
        a1[j] = round_t<C>(o1);
        a2[j] = round_t<C>(o2);
    }
    store_k<K>(x + xo, a1);
    store_k<K>(x + xo + half, a2);
}

// Shapes of one launch. I: the index type (32-bit when every index fits: integer division is much
// cheaper).
template <typename I> struct RopeQk {
    I hq, hk, t, dh, r, bc;
};

template <typename T, typename C, bool BWD, int K, typename I>
__device__ __forceinline__ void rope_qk_loop(T* q, T* k, const C* __restrict__ cos,
                                            const C* __restrict__ sin, RopeQk<I> s, I nq, I items) {
    const I half = s.r / 2, per_row = half / K;
    const I stride = (I)gridDim.x * blockDim.x;
    for (I it = (I)blockIdx.x * blockDim.x + threadIdx.x; it < items; it += stride) {
        const bool is_q = it < nq;
        const I i = is_q ? it : it - nq;
        const I heads = is_q ? s.hq : s.hk;
        const I row = i / per_row;  // (b, h, t) of q or k, flattened
        const I c = (i - row * per_row) * K;
        const I b = s.bc == 1 ? 0 : row / (heads * s.t);
        rope_qk_item<T, C, BWD, K>(is_q ? q : k, cos, sin, (size_t)row * s.dh + c,
                                   ((size_t)b * s.t + row % s.t) * s.r + c, half);
    }
}

template <typename T, typename C, bool BWD, typename I>
__device__ __forceinline__ void rope_qk_index(T* q, T* k, const C* __restrict__ cos,
                                             const C* __restrict__ sin, RopeQk<I> s, I b, bool vec) {
    constexpr int N = Vec<T>::N;
    const I rows_q = b * s.hq * s.t, rows_k = b * s.hk * s.t, half = s.r / 2;
    if (vec) rope_qk_loop<T, C, BWD, N, I>(q, k, cos, sin, s, rows_q * (half / N), (rows_q + rows_k) * (half / N));
    else rope_qk_loop<T, C, BWD, 1, I>(q, k, cos, sin, s, rows_q * half, (rows_q + rows_k) * half);
}

template <typename T, typename C, bool BWD>
__device__ __forceinline__ void rope_qk(T* q, T* k, const C* __restrict__ cos, const C* __restrict__ sin,
                                        long long b, long long hq, long long hk, long long t,
                                        long long dh, long long r, long long bc) {
    constexpr int N = Vec<T>::N;
    const bool vec = (r / 2) % N == 0 && dh % N == 0 && aligned16(q) && aligned16(k) && aligned16(cos) &&
                     aligned16(sin);
    // < 2^31 elements: 32-bit indices, and `it + stride` cannot wrap (grid·block <= items + 255).
    if (b * (hq + hk) * t * dh < 0x7fffffffLL && bc * t * r < 0x7fffffffLL) {
        const RopeQk<uint32_t> s{(uint32_t)hq, (uint32_t)hk, (uint32_t)t, (uint32_t)dh, (uint32_t)r, (uint32_t)bc};
        rope_qk_index<T, C, BWD, uint32_t>(q, k, cos, sin, s, (uint32_t)b, vec);
    } else {
        using U = unsigned long long;
        const RopeQk<U> s{(U)hq, (U)hk, (U)t, (U)dh, (U)r, (U)bc};
        rope_qk_index<T, C, BWD, U>(q, k, cos, sin, s, (U)b, vec);
    }
}
