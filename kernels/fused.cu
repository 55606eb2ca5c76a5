// Fused training-path ops, forward and backward: RMSNorm, SwiGLU, RoPE, cross-entropy.
//
// Reference: the plain candle formulations in crates/model/src/ops.rs and rope.rs, restated on f32
// slices in crates/kernels/src/fused_ref.rs; crates/kernels/tests/fused_cuda.rs compares the two on
// random inputs. All arithmetic is f32. Where ops.rs holds an intermediate as a tensor of the input
// type T (bf16/f16), the kernel rounds it to T at the same point, so a kernel's result is ops.rs's
// result computed without its separate passes over memory. Outputs round to nearest even.
//
// Elementwise steps use __fmul_rn / __fadd_rn where ops.rs has separate multiplies and adds (nvcc
// would otherwise contract them into FMAs); reductions run in a fixed order per launch shape, so
// results are deterministic.
//
// Memory: every tensor is row-major and contiguous. 16-byte vector loads/stores (4 f32 or 8 bf16/f16)
// are used when every pointer involved is 16-byte aligned and the row length is a multiple of the
// vector width — decided inside the kernel, uniformly for the whole launch; otherwise a scalar path
// gives the same results.
//
// Launch shapes (crates/kernels/src/launch.rs):
//   row reductions (rms_norm_*, ce_fwd): one block per row (grid-stride over rows), blockDim.x a
//     multiple of 32 and <= 1024;
//   elementwise (swiglu_*, rope_*, ce_bwd): 256 threads, grid-stride loops.

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

// ---------------------------------------------------------------------------------------------
// Widening to f32: y = f32(x), exact (every bf16 and f16 value is an f32; a NaN keeps its payload,
// as candle's CUDA cast keeps it). crates/model/src/fused/cast.rs sends bf16/f16 -> f32 casts here:
// candle's own cast kernel moved bf16 -> f32 at ~15% of the H200's copy bandwidth (Nsight Compute,
// 2048 x 4096 in 77 us), and the LoRA branch widens its input and output gradient at every module.
// One 16-byte vector of x per thread step (two or four float4 stores) where x and y are 16-byte
// aligned, else one element.

template <typename T>
__device__ __forceinline__ void widen(const T* __restrict__ x, float* __restrict__ y, long long n) {
    constexpr int N = Vec<T>::N;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vec = aligned16(x) && aligned16(y);
    const long long nvec = vec ? n / N : 0;
    for (long long i = tid; i < nvec; i += stride) {
        float v[N];
        load_vec(x + i * N, v);
#pragma unroll
        for (int j = 0; j < N; j += 4) store_vec(y + i * N + j, v + j);
    }
    for (long long e = nvec * N + tid; e < n; e += stride)  // the tail, or everything when unaligned
        y[e] = to_f32(x[e]);
}

// ---------------------------------------------------------------------------------------------
// Entry points, one per op and element type.

#define FUSED_KERNELS(SUFFIX, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_fwd_##SUFFIX(                       \
        const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int rows, int dim,     \
        float eps) {                                                                                \
        rms_norm_fwd<T>(x, w, y, rows, dim, eps);                                                   \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_bwd_##SUFFIX(                       \
        const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,                 \
        T* __restrict__ dx, int rows, int dim, float eps) {                                         \
        rms_norm_bwd<T>(dy, x, w, dx, rows, dim, eps);                                              \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) swiglu_fwd_##SUFFIX(                          \
        const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ h, long long n) {         \
        swiglu_fwd<T>(g, u, h, n);                                                                  \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) swiglu_bwd_##SUFFIX(                          \
        const T* __restrict__ dh, const T* __restrict__ g, const T* __restrict__ u,                 \
        T* __restrict__ out, long long n) {                                                         \
        swiglu_bwd<T>(dh, g, u, out, n);                                                            \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) rope_fwd_##SUFFIX(                            \
        const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ sin,              \
        T* __restrict__ y, long long b, long long h, long long t, long long dh) {                   \
        rope<T, false>(x, cos, sin, y, b, h, t, dh);                                                \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) rope_bwd_##SUFFIX(                            \
        const T* __restrict__ dy, const T* __restrict__ cos, const T* __restrict__ sin,             \
        T* __restrict__ dx, long long b, long long h, long long t, long long dh) {                  \
        rope<T, true>(dy, cos, sin, dx, b, h, t, dh);                                               \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) ce_fwd_##SUFFIX(                             \
        const T* __restrict__ logits, const uint32_t* __restrict__ targets,                         \
        float* __restrict__ out, int n, int v) {                                                    \
        ce_fwd<T>(logits, targets, out, n, v);                                                      \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) ce_bwd_##SUFFIX(                              \
        const T* __restrict__ logits, const uint32_t* __restrict__ targets,                         \
        const float* __restrict__ lse, float scale, T* __restrict__ dlogits, int n, int v) {        \
        ce_bwd<T>(logits, targets, lse, scale, dlogits, n, v);                                      \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) widen_##SUFFIX(                               \
        const T* __restrict__ x, float* __restrict__ y, long long n) {                              \
        widen<T>(x, y, n);                                                                          \
    }

FUSED_KERNELS(f32, float)
FUSED_KERNELS(bf16, __nv_bfloat16)
FUSED_KERNELS(f16, __half)
