// RoPE: device code only, included by fused.cu (one module with the other fused ops: its
// `extern "C"` entry points are there). Launchers: crates/ops/src/rope/cuda.rs; reference:
// crates/ops/src/rope/reference.rs.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// RoPE, rotate-half layout. x, y, dy, dx: (B, H, T, Dh); cos, sin: (B, 1, T, Dh); half = Dh/2.
// Forward (rope.rs apply): y = T(T(x·cos) + T(rotate_half(x)·sin)), rotate_half([x1, x2]) = [−x2, x1].
// Backward (apply_backward): z = T(dy·sin); dx = T(T(dy·cos) + [z2, −z1]).
// One work item = K consecutive columns c..c+K of the first half and the matching ones of the
// second (K = Vec<T>::N when half is a multiple of it and all pointers are aligned, else 1).

template <typename T, bool BWD, int K>
__device__ __forceinline__ void rope_item(const T* __restrict__ x, const T* __restrict__ cos,
                                          const T* __restrict__ sin, T* __restrict__ y, size_t xo,
                                          size_t co, size_t half) {
    float a1[K], a2[K], c1[K], c2[K], s1[K], s2[K];
    load_k<K>(x + xo, a1);
    load_k<K>(x + xo + half, a2);
    load_k<K>(cos + co, c1);
    load_k<K>(cos + co + half, c2);
    load_k<K>(sin + co, s1);
    load_k<K>(sin + co + half, s2);
#pragma unroll
    for (int j = 0; j < K; ++j) {
        float o1, o2;
        if constexpr (!BWD) {
            o1 = __fadd_rn(round_t<T>(__fmul_rn(a1[j], c1[j])), round_t<T>(__fmul_rn(-a2[j], s1[j])));
            o2 = __fadd_rn(round_t<T>(__fmul_rn(a2[j], c2[j])), round_t<T>(__fmul_rn(a1[j], s2[j])));
        } else {
            const float z1 = round_t<T>(__fmul_rn(a1[j], s1[j]));
            const float z2 = round_t<T>(__fmul_rn(a2[j], s2[j]));
            o1 = __fadd_rn(round_t<T>(__fmul_rn(a1[j], c1[j])), z2);
            o2 = __fadd_rn(round_t<T>(__fmul_rn(a2[j], c2[j])), -z1);
        }
        a1[j] = o1;
        a2[j] = o2;
    }
    store_k<K>(y + xo, a1);
    store_k<K>(y + xo + half, a2);
}

// I: the index type (32-bit when every index fits: integer division is much cheaper).
template <typename T, bool BWD, int K, typename I>
__device__ __forceinline__ void rope_loop(const T* __restrict__ x, const T* __restrict__ cos,
                                          const T* __restrict__ sin, T* __restrict__ y, I heads,
                                          I t, I dh, I items) {
    const I half = dh / 2, per_row = half / K;
    const I stride = (I)gridDim.x * blockDim.x;
    for (I it = (I)blockIdx.x * blockDim.x + threadIdx.x; it < items; it += stride) {
        const I row = it / per_row;  // (b, h, t) flattened
        const I c = (it - row * per_row) * K;
        const I b = row / (heads * t);
        rope_item<T, BWD, K>(x, cos, sin, y, row * dh + c, (b * t + row % t) * dh + c, half);
    }
}

template <typename T, bool BWD, typename I>
__device__ __forceinline__ void rope_index(const T* __restrict__ x, const T* __restrict__ cos,
                                           const T* __restrict__ sin, T* __restrict__ y, I b,
                                           I heads, I t, I dh, bool vec) {
    constexpr int N = Vec<T>::N;
    const I pairs = b * heads * t * (dh / 2);
    if (vec) rope_loop<T, BWD, N, I>(x, cos, sin, y, heads, t, dh, pairs / N);
    else rope_loop<T, BWD, 1, I>(x, cos, sin, y, heads, t, dh, pairs);
}

template <typename T, bool BWD>
__device__ __forceinline__ void rope(const T* __restrict__ x, const T* __restrict__ cos,
                                     const T* __restrict__ sin, T* __restrict__ y, long long b,
                                     long long heads, long long t, long long dh) {
    constexpr int N = Vec<T>::N;
    const bool vec = (dh / 2) % N == 0 && aligned16(x) && aligned16(cos) && aligned16(sin) && aligned16(y);
    // < 2^31 elements: 32-bit indices, and `it + stride` cannot wrap (grid·block <= items + 255).
    if (b * heads * t * dh < 0x7fffffffLL)
        rope_index<T, BWD, uint32_t>(x, cos, sin, y, (uint32_t)b, (uint32_t)heads, (uint32_t)t, (uint32_t)dh, vec);
    else
        rope_index<T, BWD, unsigned long long>(x, cos, sin, y, b, heads, t, dh, vec);
}
