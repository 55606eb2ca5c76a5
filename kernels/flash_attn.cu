// Tiled attention with an online softmax (FlashAttention-2's algorithm), forward and backward, for
// sm_80+: the CUDA side of crates/ops/src/attention/tiled.rs (same inputs, outputs and visibility).
//
// Reference: crates/ops/src/attention/flash_ref.rs restates these kernels step by step on the CPU — the
// same tiles (BR queries × BC keys), the same key ranges, the same roundings to T — and is itself
// tested against the plain attention path of crates/ops/src (each op folder) (crates/ops/src/attention/tests/
// flash_ref_tests.rs). `rtune selftest` runs these kernels against it (crates/ops/src/attention/
// flash_check.rs).
//
// Layouts (element strides in FlashParams; the head dim DH is contiguous):
//   q, dq: (B, H, T, DH)    k, v, dk, dv: (B, Hkv, T, DH)    o, dO: (B, T, H, DH)
//   lse, D: (B, T, H) f32   starts: (SB, T) u32, SB = 1 (shared by the batch) or B
// Visibility: query i of batch row b sees keys starts[b or 0][i] ..= i (causal, Mistral's sliding
// window and packed rows folded into one run per query by ops.rs's AttnMask). GQA/MQA: query head h
// reads kv head h / (H / Hkv) in place; K and V are never repeated.
//
// Forward (flash_fwd_<T>_d<DH>): one block per (query tile of BR rows, head, batch row). The keys
// the tile can see are lo = min starts over its rows .. hi = its last query + 1: key tiles of BC
// from lo up (the tiles wholly outside every row's run are never visited: causal and window tile
// skipping). Per key tile: S = Q·Kᵀ (f32), per row the running max m and sum l, p = exp(S·scale −
// m_new) (f32; P rounded to T for the tensor-core P·V), l = l·α + Σp (unrounded f32 p),
// acc = acc·α + P·V (f32), α = exp(m_old − m_new). At the end O = T(acc / l), lse = m + ln l.
// A query that sees no key (starts[i] > i, which ops.rs never builds) gets O = 0 and lse = +inf.
//
// Backward, three kernels (FA-2's math; dQ in a separate pass instead of f32 atomics: every sum
// runs in a fixed order, so the gradients are deterministic, like the CPU path's, at the cost of
// recomputing S and dP once more):
//   flash_bwd_pre_<T>: D = rowsum(dO ∘ O) per (b, i, h), f32 (one warp per row).
//   flash_bwd_dkdv_<T>_d<DH>: one block per (key tile of BC, kv head, batch row); dK and dV of the
//     tile accumulate in f32 shared memory over the G query heads of the kv head and every query
//     tile that sees a key of the tile (query tiles at multiples of BR from the key tile's first
//     key on; tiles no row of which sees a key of the tile are skipped): P = exp(S·scale − lse),
//     dP = dO·Vᵀ, dS = P·(dP − D)·scale (f32), dV += T(P)ᵀ·dO, dK += T(dS)ᵀ·Q. Written once, as T.
//   flash_bwd_dq_<T>_d<DH>: one block per query tile, the forward's key tiles: dQ += T(dS)·K in f32
//     shared memory, written once as T.
//
// Tile products: bf16/f16 through tensor cores with nvcuda::wmma (16×16×16 fragments of T, f32
// accumulators). wmma rather than raw mma.sync PTX: its fragments load from and store to shared
// memory with a stated layout (row- or column-major, any leading dimension that is a multiple of 8
// elements), so a transposed operand (Kᵀ, Pᵀ, dSᵀ) is a column-major load of the tile as stored and
// there is no hand-written register mapping to get wrong; its cost is a round trip of the f32
// accumulators through shared memory per key tile (the online-softmax rescale needs their rows,
// which a wmma fragment does not expose). f32 inputs run the same tiling with plain f32 FMAs (no
// TF32: the f32 path is exact to 1e-5 against the CPU).
//
// Threads: BR/16 warps (64 threads); warp w owns the 16-row stripe w of every BR-row product
// (S, dP, P, dS, O, dQ), so in the forward and the dQ pass everything after a tile's load is warp-
// local (__syncwarp only); in the dK/dV pass the products over the tile's keys take stripes of the
// BC key rows and need the whole P, dS: __syncthreads between.
//
// Shared memory (dynamic, carved by `Carve` in 128-byte aligned regions; the launcher in
// crates/ops/src/attention/flash_kernel.rs computes the same sizes and opts the kernel in above 48 KiB; each
// kernel traps if it was given less): T tiles with leading dimension DH + 16/sizeof(T) (one 16-byte
// pad per row: rows stay 16-byte aligned for uint4 loads and shift banks between rows), f32 tiles
// with BC + 4 or DH + 4. wmma needs 256-bit aligned fragment pointers and leading dimensions that
// are multiples of 16 bytes: every fragment starts at a row that is a multiple of 16 and a column
// that is a multiple of 16 of a 128-byte aligned region, and 16·ld·sizeof is a multiple of 32.
// Global loads are 16-byte vectors when every pointer and stride allows it (a block-uniform flag),
// else scalar, with the same values; rows past T load as zeros and are never written.
#include <mma.h>

#include "common.cuh"

using namespace nvcuda;

// Queries per tile (16 rows per warp), keys per tile. crates/ops/src/attention/flash_ref.rs and
// crates/ops/src/attention/flash_kernel.rs use the same values.
constexpr int BR = 32;
constexpr int BC = 32;
constexpr int WARPS = BR / 16;
constexpr int THREADS = WARPS * 32;
static_assert(BR % 16 == 0 && BC % 16 == 0 && BC % 32 == 0, "tiles are whole wmma fragments");

// Element strides (the kernels index with 64-bit offsets). Mirrored by `FlashParams` in
// crates/ops/src/attention/flash_kernel.rs (repr(C), same field order).
struct FlashParams {
    long long q_b, q_h, q_t;  // q, dq
    long long k_b, k_h, k_t;  // k, v, dk, dv
    long long o_b, o_h, o_t;  // o, dO
    long long l_b, l_h, l_t;  // lse, D (f32)
    int b, h, hkv, t, sb;
    float scale;
};

template <typename T> struct IsF32 { static constexpr bool v = false; };
template <bool C, typename A, typename B> struct Pick { using type = A; };
template <typename A, typename B> struct Pick<false, A, B> { using type = B; };
template <> struct IsF32<float> { static constexpr bool v = true; };

// Leading dimensions (elements): T tiles of DH, T tiles of BC (P, dS), f32 tiles of BC (S, dP) and
// of DH (the O, dQ, dK, dV accumulators).
template <typename T, int DH> struct Ld {
    static constexpr int t = DH + 16 / (int)sizeof(T);
    static constexpr int p = BC + 16 / (int)sizeof(T);
    static constexpr int s = BC + 4;
    static constexpr int a = DH + 4;
};

// Consecutive 128-byte aligned regions of the dynamic shared memory.
struct Carve {
    unsigned char* at;
    template <typename U> __device__ U* take(int n) {
        U* r = reinterpret_cast<U*>(at);
        at += (n * (int)sizeof(U) + 127) / 128 * 128;
        return r;
    }
};

extern __shared__ __align__(128) unsigned char flash_smem[];

// Traps unless the launch gave at least `need` bytes of dynamic shared memory.
__device__ __forceinline__ void check_smem(unsigned need) {
    unsigned have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < need) __trap();
}

template <typename T> __device__ __forceinline__ bool vec_ok(const T* p, long long s1, long long s2, long long s3) {
    constexpr int N = Vec<T>::N;
    return aligned16(p) && s1 % N == 0 && s2 % N == 0 && s3 % N == 0;
}

// Rows [0, valid) of a (ROWS, DH) tile, row stride `rs` in global memory, into shared `dst`
// (leading dimension LD); rows [valid, ROWS) are zeros. Whole block.
template <typename T, int ROWS, int DH, int LD>
__device__ __forceinline__ void load_tile(T* dst, const T* __restrict__ src, long long rs, int valid, bool vec) {
    if (vec) {
        constexpr int N = Vec<T>::N, PER = DH / N;
        for (int e = threadIdx.x; e < ROWS * PER; e += THREADS) {
            const int r = e / PER, c = (e % PER) * N;
            const uint4 x = r < valid ? __ldg(reinterpret_cast<const uint4*>(src + r * rs + c)) : make_uint4(0, 0, 0, 0);
            *reinterpret_cast<uint4*>(dst + r * LD + c) = x;
        }
    } else {
        for (int e = threadIdx.x; e < ROWS * DH; e += THREADS) {
            const int r = e / DH, c = e % DH;
            dst[r * LD + c] = r < valid ? src[r * rs + c] : from_f32<T>(0.0f);
        }
    }
}

// Rows [0, valid) of a shared f32 (ROWS, DH) tile (leading dimension LD) times `mul[r]` (or 1) to
// global memory as T, row stride `rs`. Whole block.
template <typename T, int ROWS, int DH, int LD>
__device__ __forceinline__ void store_tile(T* dst, const float* src, long long rs, int valid, bool vec) {
    if (vec) {
        constexpr int N = Vec<T>::N, PER = DH / N;
        for (int e = threadIdx.x; e < ROWS * PER; e += THREADS) {
            const int r = e / PER, c = (e % PER) * N;
            if (r < valid) store_vec(dst + r * rs + c, src + r * LD + c);
        }
    } else {
        for (int e = threadIdx.x; e < ROWS * DH; e += THREADS) {
            const int r = e / DH, c = e % DH;
            if (r < valid) dst[r * rs + c] = from_f32<T>(src[r * LD + c]);
        }
    }
}

// One warp: the 16-row stripe C[16][N] (f32, leading dimension ldc) = (acc ? C : 0) + A·B, A 16×K,
// B K×N, from shared memory. `a` points at the stripe's first row of A: A(i, k) = a[i·lda + k]
// (AROW) or a[i + k·lda] (the tile stored is Aᵀ, row-major). B(k, n) = b[k·ldb + n] (BROW) or
// b[k + n·ldb] (the tile stored is Bᵀ). `c` points at the stripe's first row.
template <typename T, bool AROW, bool BROW, int N, int K>
__device__ __forceinline__ void warp_mma(float* c, int ldc, const T* a, int lda, const T* b, int ldb, bool acc) {
    if constexpr (IsF32<T>::v) {
        const int lane = threadIdx.x & 31;
        for (int e = lane; e < 16 * N; e += 32) {
            const int i = e / N, n = e % N;
            float s = acc ? c[i * ldc + n] : 0.0f;
#pragma unroll 8
            for (int k = 0; k < K; ++k) {
                const float x = AROW ? a[i * lda + k] : a[i + k * lda];
                const float y = BROW ? b[k * ldb + n] : b[k + n * ldb];
                s = fmaf(x, y, s);
            }
            c[i * ldc + n] = s;
        }
    } else {
        using LA = typename Pick<AROW, wmma::row_major, wmma::col_major>::type;
        using LB = typename Pick<BROW, wmma::row_major, wmma::col_major>::type;
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> fb;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
#pragma unroll
        for (int n0 = 0; n0 < N; n0 += 16) {
            if (acc) wmma::load_matrix_sync(fc, c + n0, ldc, wmma::mem_row_major);
            else wmma::fill_fragment(fc, 0.0f);
#pragma unroll
            for (int k0 = 0; k0 < K; k0 += 16) {
                wmma::load_matrix_sync(fa, AROW ? a + k0 : a + k0 * lda, lda);
                wmma::load_matrix_sync(fb, BROW ? b + k0 * ldb + n0 : b + k0 + n0 * ldb, ldb);
                wmma::mma_sync(fc, fa, fb, fc);
            }
            wmma::store_matrix_sync(c + n0, fc, ldc, wmma::mem_row_major);
        }
    }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The first visible key of each row of a query tile into st_s (rows past T: i + 1, nothing), and
// the tile's key range [lo, hi). Whole block; st_s must be free (callers sync before).
__device__ __forceinline__ int2 tile_keys(int* st_s, const unsigned* __restrict__ starts, int i0, int t) {
    for (int r = threadIdx.x; r < BR; r += THREADS) st_s[r] = i0 + r < t ? (int)starts[i0 + r] : i0 + r + 1;
    __syncthreads();
    const int nr = min(BR, t - i0);
    int lo = 0x7fffffff;
    for (int r = 0; r < nr; ++r) lo = min(lo, st_s[r]);
    return make_int2(lo, i0 + nr);
}

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T, int DH>
__device__ __forceinline__ void flash_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                          const unsigned* __restrict__ starts, T* __restrict__ o,
                                          float* __restrict__ lse, const FlashParams p) {
    using L = Ld<T, DH>;
    Carve cv{flash_smem};
    T* q_s = cv.take<T>(BR * L::t);
    T* k_s = cv.take<T>(BC * L::t);
    T* v_s = cv.take<T>(BC * L::t);
    float* s_s = cv.take<float>(BR * L::s);
    T* p_s = cv.take<T>(BR * L::p);
    float* o_s = cv.take<float>(BR * L::a);
    float* m_s = cv.take<float>(BR);
    float* l_s = cv.take<float>(BR);
    float* a_s = cv.take<float>(BR);
    int* st_s = cv.take<int>(BR);
    if (threadIdx.x == 0) check_smem((unsigned)(cv.at - flash_smem));

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i0 = (gridDim.x - 1 - blockIdx.x) * BR;  // latest tiles (most keys) first
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.hkv);
    const T* qb = q + b * p.q_b + h * p.q_h + i0 * p.q_t;
    const T* kb = k + b * p.k_b + hk * p.k_h;
    const T* vb = v + b * p.k_b + hk * p.k_h;
    const bool vec = vec_ok(q, p.q_b, p.q_h, p.q_t) && vec_ok(k, p.k_b, p.k_h, p.k_t) && vec_ok(v, 0, 0, 0)
        && vec_ok(o, p.o_b, p.o_h, p.o_t);
    const int nr = min(BR, p.t - i0);

    load_tile<T, BR, DH, L::t>(q_s, qb, p.q_t, nr, vec);
    for (int e = threadIdx.x; e < BR * L::a; e += THREADS) o_s[e] = 0.0f;
    for (int r = threadIdx.x; r < BR; r += THREADS) {
        m_s[r] = -INFINITY;
        l_s[r] = 0.0f;
    }
    const int2 range = tile_keys(st_s, starts + (p.sb == 1 ? 0 : b) * (long long)p.t, i0, p.t);

    const int r0 = 16 * warp;  // this warp's stripe
    for (int j0 = range.x; j0 < range.y; j0 += BC) {
        const int j1 = min(j0 + BC, range.y);
        __syncthreads();  // every warp is done with the previous K, V
        load_tile<T, BC, DH, L::t>(k_s, kb + j0 * p.k_t, p.k_t, j1 - j0, vec);
        load_tile<T, BC, DH, L::t>(v_s, vb + j0 * p.k_t, p.k_t, j1 - j0, vec);
        __syncthreads();
        // S = Q·Kᵀ (K stored row-major is Kᵀ column-major)
        warp_mma<T, true, false, BC, DH>(s_s + r0 * L::s, L::s, q_s + r0 * L::t, L::t, k_s, L::t, false);
        __syncwarp();
        for (int rr = 0; rr < 16; ++rr) {
            const int r = r0 + rr, i = i0 + r;
            float mt = -INFINITY;
            float s[BC / 32];
#pragma unroll
            for (int x = 0; x < BC / 32; ++x) {
                const int c = lane + 32 * x, j = j0 + c;
                const bool vis = i < p.t && j < j1 && j >= st_s[r] && j <= i;
                s[x] = vis ? s_s[r * L::s + c] * p.scale : -INFINITY;
                mt = fmaxf(mt, s[x]);
            }
            mt = warp_max(mt);
            const float mo = m_s[r], mn = fmaxf(mo, mt);
            float sum = 0.0f;
#pragma unroll
            for (int x = 0; x < BC / 32; ++x) {
                const float e = s[x] == -INFINITY ? 0.0f : expf(s[x] - mn);
                sum += e;
                p_s[r * L::p + lane + 32 * x] = from_f32<T>(e);
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                // Before the row's first visible key m = −inf: α = 1 (acc and l are still 0).
                const float alpha = mn == -INFINITY ? 1.0f : expf(mo - mn);
                m_s[r] = mn;
                l_s[r] = l_s[r] * alpha + sum;
                a_s[r] = alpha;
            }
        }
        __syncwarp();
        for (int e = lane; e < 16 * DH; e += 32) {
            const int r = r0 + e / DH;
            o_s[r * L::a + e % DH] *= a_s[r];
        }
        __syncwarp();
        // acc += P·V
        warp_mma<T, true, true, DH, BC>(o_s + r0 * L::a, L::a, p_s + r0 * L::p, L::p, v_s, L::t, true);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < BR * DH; e += THREADS) {
        const int r = e / DH;
        const float l = l_s[r];
        o_s[r * L::a + e % DH] = l > 0.0f ? o_s[r * L::a + e % DH] / l : 0.0f;
    }
    for (int r = threadIdx.x; r < nr; r += THREADS) {
        const float l = l_s[r];
        lse[b * p.l_b + (i0 + r) * p.l_t + h * p.l_h] = l > 0.0f ? m_s[r] + logf(l) : INFINITY;
    }
    __syncthreads();
    store_tile<T, BR, DH, L::a>(o + b * p.o_b + h * p.o_h + i0 * p.o_t, o_s, p.o_t, nr, vec);
}

// ---------------------------------------------------------------------------------------------
// Backward

template <typename T>
__device__ __forceinline__ void flash_bwd_pre(const T* __restrict__ o, const T* __restrict__ d_o, float* __restrict__ dd,
                                              const FlashParams p, int dh) {
    const int lane = threadIdx.x & 31;
    const long long rows = (long long)p.b * p.t * p.h;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long n = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); n < rows; n += warps) {
        const long long b = n / ((long long)p.t * p.h), i = n / p.h % p.t, h = n % p.h;
        const long long off = b * p.o_b + h * p.o_h + i * p.o_t;
        float s = 0.0f;
        for (int c = lane; c < dh; c += 32) s = fmaf(to_f32(d_o[off + c]), to_f32(o[off + c]), s);
        s = warp_sum(s);
        if (lane == 0) dd[b * p.l_b + i * p.l_t + h * p.l_h] = s;
    }
}

// The dK/dV pass and the dQ pass share this: for the query tile at i0 (its Q, dO, lse, D and
// starts in shared memory) and the key tile j0..j1 (K, V in shared memory), the warp's stripe of
// P (T), dS (T) from S = Q·Kᵀ and dP = dO·Vᵀ.
template <typename T, int DH>
__device__ __forceinline__ void bwd_scores(float* s_s, float* dp_s, T* p_s, T* ds_s, const T* q_s, const T* do_s,
                                           const T* k_s, const T* v_s, const float* lse_s, const float* d_s,
                                           const int* st_s, int i0, int j0, int j1, const FlashParams& p) {
    using L = Ld<T, DH>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = 16 * warp;
    warp_mma<T, true, false, BC, DH>(s_s + r0 * L::s, L::s, q_s + r0 * L::t, L::t, k_s, L::t, false);
    warp_mma<T, true, false, BC, DH>(dp_s + r0 * L::s, L::s, do_s + r0 * L::t, L::t, v_s, L::t, false);
    __syncwarp();
    for (int e = lane; e < 16 * BC; e += 32) {
        const int r = r0 + e / BC, c = e % BC, i = i0 + r, j = j0 + c;
        const bool vis = i < p.t && j < j1 && j >= st_s[r] && j <= i;
        const float pr = vis ? expf(s_s[r * L::s + c] * p.scale - lse_s[r]) : 0.0f;
        const float ds = pr * (dp_s[r * L::s + c] - d_s[r]) * p.scale;
        p_s[r * L::p + c] = from_f32<T>(pr);
        ds_s[r * L::p + c] = from_f32<T>(ds);
    }
    __syncwarp();
}

// Rows of a query tile: starts (tile_keys), lse and D (0 past T).
__device__ __forceinline__ void load_rows(float* lse_s, float* d_s, const float* __restrict__ lse,
                                          const float* __restrict__ dd, int b, int h, int i0, const FlashParams& p) {
    for (int r = threadIdx.x; r < BR; r += THREADS) {
        const bool in = i0 + r < p.t;
        const long long at = b * p.l_b + (i0 + r) * p.l_t + h * p.l_h;
        lse_s[r] = in ? lse[at] : 0.0f;
        d_s[r] = in ? dd[at] : 0.0f;
    }
}

template <typename T, int DH>
__device__ __forceinline__ void flash_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                               const T* __restrict__ d_o, const float* __restrict__ lse,
                                               const float* __restrict__ dd, const unsigned* __restrict__ starts,
                                               T* __restrict__ dk, T* __restrict__ dv, const FlashParams p) {
    using L = Ld<T, DH>;
    Carve cv{flash_smem};
    T* k_s = cv.take<T>(BC * L::t);
    T* v_s = cv.take<T>(BC * L::t);
    float* dk_s = cv.take<float>(BC * L::a);
    float* dv_s = cv.take<float>(BC * L::a);
    T* q_s = cv.take<T>(BR * L::t);
    T* do_s = cv.take<T>(BR * L::t);
    float* s_s = cv.take<float>(BR * L::s);
    float* dp_s = cv.take<float>(BR * L::s);
    T* p_s = cv.take<T>(BR * L::p);
    T* ds_s = cv.take<T>(BR * L::p);
    float* lse_s = cv.take<float>(BR);
    float* d_s = cv.take<float>(BR);
    int* st_s = cv.take<int>(BR);
    if (threadIdx.x == 0) check_smem((unsigned)(cv.at - flash_smem));

    const int warp = threadIdx.x >> 5;
    const int j0 = (gridDim.x - 1 - blockIdx.x) * BC, j1 = min(j0 + BC, p.t);
    const int hk = blockIdx.y, b = blockIdx.z, g = p.h / p.hkv;
    const bool vec = vec_ok(q, p.q_b, p.q_h, p.q_t) && vec_ok(k, p.k_b, p.k_h, p.k_t) && vec_ok(v, 0, 0, 0)
        && vec_ok(d_o, p.o_b, p.o_h, p.o_t) && vec_ok(dk, 0, 0, 0) && vec_ok(dv, 0, 0, 0);
    const long long kv_off = b * p.k_b + hk * p.k_h + j0 * p.k_t;
    load_tile<T, BC, DH, L::t>(k_s, k + kv_off, p.k_t, j1 - j0, vec);
    load_tile<T, BC, DH, L::t>(v_s, v + kv_off, p.k_t, j1 - j0, vec);
    for (int e = threadIdx.x; e < BC * L::a; e += THREADS) {
        dk_s[e] = 0.0f;
        dv_s[e] = 0.0f;
    }
    const unsigned* st_row = starts + (p.sb == 1 ? 0 : b) * (long long)p.t;
    const int ntiles = (p.t + BR - 1) / BR;
    for (int h = hk * g; h < (hk + 1) * g; ++h) {
        for (int n = j0 / BR; n < ntiles; ++n) {
            const int i0 = n * BR, nr = min(BR, p.t - i0);
            __syncthreads();  // every warp is done with the previous query tile
            const int2 range = tile_keys(st_s, st_row, i0, p.t);
            // Some row i sees a key of the tile iff starts[i] < j1 and i ≥ j0 (block-uniform).
            if (range.x >= j1 || range.y <= j0) continue;
            load_rows(lse_s, d_s, lse, dd, b, h, i0, p);
            load_tile<T, BR, DH, L::t>(q_s, q + b * p.q_b + h * p.q_h + i0 * p.q_t, p.q_t, nr, vec);
            load_tile<T, BR, DH, L::t>(do_s, d_o + b * p.o_b + h * p.o_h + i0 * p.o_t, p.o_t, nr, vec);
            __syncthreads();
            bwd_scores<T, DH>(s_s, dp_s, p_s, ds_s, q_s, do_s, k_s, v_s, lse_s, d_s, st_s, i0, j0, j1, p);
            __syncthreads();  // all of P and dS
            for (int st = warp; st < BC / 16; st += WARPS) {
                // dV += Pᵀ·dO, dK += dSᵀ·Q (P, dS stored row-major by query are Pᵀ, dSᵀ column-major)
                warp_mma<T, false, true, DH, BR>(dv_s + 16 * st * L::a, L::a, p_s + 16 * st, L::p, do_s, L::t, true);
                warp_mma<T, false, true, DH, BR>(dk_s + 16 * st * L::a, L::a, ds_s + 16 * st, L::p, q_s, L::t, true);
            }
        }
    }
    __syncthreads();
    store_tile<T, BC, DH, L::a>(dk + kv_off, dk_s, p.k_t, j1 - j0, vec);
    store_tile<T, BC, DH, L::a>(dv + kv_off, dv_s, p.k_t, j1 - j0, vec);
}

template <typename T, int DH>
__device__ __forceinline__ void flash_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                             const T* __restrict__ d_o, const float* __restrict__ lse,
                                             const float* __restrict__ dd, const unsigned* __restrict__ starts,
                                             T* __restrict__ dq, const FlashParams p) {
    using L = Ld<T, DH>;
    Carve cv{flash_smem};
    T* q_s = cv.take<T>(BR * L::t);
    T* do_s = cv.take<T>(BR * L::t);
    T* k_s = cv.take<T>(BC * L::t);
    T* v_s = cv.take<T>(BC * L::t);
    float* s_s = cv.take<float>(BR * L::s);
    float* dp_s = cv.take<float>(BR * L::s);
    T* p_s = cv.take<T>(BR * L::p);
    T* ds_s = cv.take<T>(BR * L::p);
    float* dq_s = cv.take<float>(BR * L::a);
    float* lse_s = cv.take<float>(BR);
    float* d_s = cv.take<float>(BR);
    int* st_s = cv.take<int>(BR);
    if (threadIdx.x == 0) check_smem((unsigned)(cv.at - flash_smem));

    const int warp = threadIdx.x >> 5, r0 = 16 * warp;
    const int i0 = (gridDim.x - 1 - blockIdx.x) * BR, nr = min(BR, p.t - i0);
    const int h = blockIdx.y, b = blockIdx.z, hk = h / (p.h / p.hkv);
    const bool vec = vec_ok(q, p.q_b, p.q_h, p.q_t) && vec_ok(k, p.k_b, p.k_h, p.k_t) && vec_ok(v, 0, 0, 0)
        && vec_ok(d_o, p.o_b, p.o_h, p.o_t) && vec_ok(dq, 0, 0, 0);
    const T* kb = k + b * p.k_b + hk * p.k_h;
    const T* vb = v + b * p.k_b + hk * p.k_h;
    load_tile<T, BR, DH, L::t>(q_s, q + b * p.q_b + h * p.q_h + i0 * p.q_t, p.q_t, nr, vec);
    load_tile<T, BR, DH, L::t>(do_s, d_o + b * p.o_b + h * p.o_h + i0 * p.o_t, p.o_t, nr, vec);
    load_rows(lse_s, d_s, lse, dd, b, h, i0, p);
    for (int e = threadIdx.x; e < BR * L::a; e += THREADS) dq_s[e] = 0.0f;
    const int2 range = tile_keys(st_s, starts + (p.sb == 1 ? 0 : b) * (long long)p.t, i0, p.t);
    for (int j0 = range.x; j0 < range.y; j0 += BC) {
        const int j1 = min(j0 + BC, range.y);
        __syncthreads();
        load_tile<T, BC, DH, L::t>(k_s, kb + j0 * p.k_t, p.k_t, j1 - j0, vec);
        load_tile<T, BC, DH, L::t>(v_s, vb + j0 * p.k_t, p.k_t, j1 - j0, vec);
        __syncthreads();
        bwd_scores<T, DH>(s_s, dp_s, p_s, ds_s, q_s, do_s, k_s, v_s, lse_s, d_s, st_s, i0, j0, j1, p);
        // dQ += dS·K (this warp's stripe)
        warp_mma<T, true, true, DH, BC>(dq_s + r0 * L::a, L::a, ds_s + r0 * L::p, L::p, k_s, L::t, true);
    }
    __syncthreads();
    store_tile<T, BR, DH, L::a>(dq + b * p.q_b + h * p.q_h + i0 * p.q_t, dq_s, p.q_t, nr, vec);
}

// ---------------------------------------------------------------------------------------------
// Entry points: flash_{fwd,bwd_dkdv,bwd_dq}_<type>_d<DH>, flash_bwd_pre_<type>.

#define FLASH_KERNELS(T, NAME, DH)                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS)                                                     \
        flash_fwd_##NAME##_d##DH(const T* q, const T* k, const T* v, const unsigned* starts, T* o, float* lse, \
                                 const FlashParams p) {                                                       \
        flash_fwd<T, DH>(q, k, v, starts, o, lse, p);                                                          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_bwd_dkdv_##NAME##_d##DH(                       \
        const T* q, const T* k, const T* v, const T* d_o, const float* lse, const float* dd,                   \
        const unsigned* starts, T* dk, T* dv, const FlashParams p) {                                           \
        flash_bwd_dkdv<T, DH>(q, k, v, d_o, lse, dd, starts, dk, dv, p);                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_bwd_dq_##NAME##_d##DH(                         \
        const T* q, const T* k, const T* v, const T* d_o, const float* lse, const float* dd,                   \
        const unsigned* starts, T* dq, const FlashParams p) {                                                  \
        flash_bwd_dq<T, DH>(q, k, v, d_o, lse, dd, starts, dq, p);                                             \
    }

#define FLASH_TYPE(T, NAME)                                                                                    \
    extern "C" __global__ void flash_bwd_pre_##NAME(const T* o, const T* d_o, float* dd, const FlashParams p,  \
                                                    int dh) {                                                  \
        flash_bwd_pre<T>(o, d_o, dd, p, dh);                                                                   \
    }                                                                                                          \
    FLASH_KERNELS(T, NAME, 64)                                                                                 \
    FLASH_KERNELS(T, NAME, 96)                                                                                 \
    FLASH_KERNELS(T, NAME, 128)

FLASH_TYPE(float, f32)
FLASH_TYPE(__nv_bfloat16, bf16)
FLASH_TYPE(__half, f16)
