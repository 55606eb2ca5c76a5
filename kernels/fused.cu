// Fused training-path ops, forward and backward: RMSNorm (norm.cuh) and the residual add fused
// into it (add_norm.cuh), the gated units (glu.cuh) with SwiGLU's and GeGLU's activations
// (swiglu.cuh, geglu.cuh), RoPE (rope.cuh; in place on q and k: rope_qk.cuh), cross-entropy and
// the soft-capped one (ce.cuh), and the widening cast to f32 (cast.cuh), compiled as one
// module (loaded once per context by rtune-backend's FusedKernels); this file holds the entry points.
//
// Reference: each op's plain candle formulation ("ops.rs" in the op files' comments), restated on
// f32 slices in its folder's reference.rs (crates/ops/src/<op>/, crates/backend/src/cast/);
// crates/ops/tests/fused_cuda.rs compares the two on random inputs. All arithmetic is f32. Where the
// plain formulation holds an intermediate as a tensor of the input type T (bf16/f16), the kernel
// rounds it to T at the same point, so a kernel's result is the plain one computed without its
// separate passes over memory. Outputs round to nearest even.
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
// Launch shapes (crates/backend/src/launch.rs):
//   row reductions (rms_norm_*, add_rms_norm*, ce_fwd, ce_capped_fwd): one block per row (grid-stride over rows), blockDim.x a
//     multiple of 32 and <= 1024;
//   elementwise (swiglu_*, geglu_*, rope_*, rope_qk*, ce_bwd, ce_capped_bwd): 256 threads, grid-stride loops.

#include "common.cuh"
#include "norm.cuh"
#include "add_norm.cuh"
#include "glu.cuh"
#include "swiglu.cuh"
#include "geglu.cuh"
#include "rope.cuh"
#include "rope_qk.cuh"
#include "ce.cuh"
#include "cast.cuh"

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
        glu_fwd<T, Silu>(g, u, h, n);                                                               \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) swiglu_bwd_##SUFFIX(                          \
        const T* __restrict__ dh, const T* __restrict__ g, const T* __restrict__ u,                 \
        T* __restrict__ out, long long n) {                                                         \
        glu_bwd<T, Silu>(dh, g, u, out, n);                                                         \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) geglu_fwd_##SUFFIX(                           \
        const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ h, long long n) {         \
        glu_fwd<T, GeluTanh>(g, u, h, n);                                                           \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) geglu_bwd_##SUFFIX(                           \
        const T* __restrict__ dh, const T* __restrict__ g, const T* __restrict__ u,                 \
        T* __restrict__ out, long long n) {                                                         \
        glu_bwd<T, GeluTanh>(dh, g, u, out, n);                                                     \
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
        ce_fwd<T>(logits, targets, out, n, v, NoCap{});                                             \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) ce_bwd_##SUFFIX(                              \
        const T* __restrict__ logits, const uint32_t* __restrict__ targets,                         \
        const float* __restrict__ lse, float scale, T* __restrict__ dlogits, int n, int v) {        \
        ce_bwd<T>(logits, targets, lse, scale, dlogits, n, v, NoCap{});                             \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) ce_capped_fwd_##SUFFIX(                      \
        const T* __restrict__ logits, const uint32_t* __restrict__ targets,                         \
        float* __restrict__ out, int n, int v, float cap, float inv_cap) {                          \
        ce_fwd<T>(logits, targets, out, n, v, SoftCap{cap, inv_cap});                               \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) ce_capped_bwd_##SUFFIX(                       \
        const T* __restrict__ logits, const uint32_t* __restrict__ targets,                         \
        const float* __restrict__ lse, float scale, T* __restrict__ dlogits, int n, int v,          \
        float cap, float inv_cap) {                                                                 \
        ce_bwd<T>(logits, targets, lse, scale, dlogits, n, v, SoftCap{cap, inv_cap});               \
    }                                                                                               \
    /* W = T (Llama's norm) and, as add_rms_norm1_*, W = f32 (the f32 weights: Gemma's 1 + w) */    \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_fwd_##SUFFIX(                   \
        const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,                \
        T* __restrict__ h, T* __restrict__ y, int rows, int dim, float eps) {                       \
        add_norm_fwd<T, T>(x, res, w, h, y, rows, dim, eps);                                        \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm1_fwd_##SUFFIX(                  \
        const T* __restrict__ x, const T* __restrict__ res, const float* __restrict__ w,            \
        T* __restrict__ h, T* __restrict__ y, int rows, int dim, float eps) {                       \
        add_norm_fwd<T, float>(x, res, w, h, y, rows, dim, eps);                                    \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_bwd_##SUFFIX(                   \
        const T* __restrict__ dy, const T* __restrict__ h, const T* __restrict__ w,                 \
        const T* dres, T* dh, int rows, int dim, float eps) {                                       \
        add_norm_bwd<T, T>(dy, h, w, dres, dh, rows, dim, eps);                                     \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm1_bwd_##SUFFIX(                  \
        const T* __restrict__ dy, const T* __restrict__ h, const float* __restrict__ w,             \
        const T* dres, T* dh, int rows, int dim, float eps) {                                       \
        add_norm_bwd<T, float>(dy, h, w, dres, dh, rows, dim, eps);                                 \
    }                                                                                               \
    /* tables of T (rope_qk_*) or f32 (rope_qk_f32t_*: rotated in f32, rounded once) */             \
    extern "C" __global__ void __launch_bounds__(256) rope_qk_fwd_##SUFFIX(                         \
        T* q, T* k, const T* __restrict__ cos, const T* __restrict__ sin, long long b,              \
        long long hq, long long hk, long long t, long long dh, long long r, long long bc) {         \
        rope_qk<T, T, false>(q, k, cos, sin, b, hq, hk, t, dh, r, bc);                              \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) rope_qk_bwd_##SUFFIX(                         \
        T* q, T* k, const T* __restrict__ cos, const T* __restrict__ sin, long long b,              \
        long long hq, long long hk, long long t, long long dh, long long r, long long bc) {         \
        rope_qk<T, T, true>(q, k, cos, sin, b, hq, hk, t, dh, r, bc);                               \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) rope_qk_f32t_fwd_##SUFFIX(                    \
        T* q, T* k, const float* __restrict__ cos, const float* __restrict__ sin, long long b,      \
        long long hq, long long hk, long long t, long long dh, long long r, long long bc) {         \
        rope_qk<T, float, false>(q, k, cos, sin, b, hq, hk, t, dh, r, bc);                          \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) rope_qk_f32t_bwd_##SUFFIX(                    \
        T* q, T* k, const float* __restrict__ cos, const float* __restrict__ sin, long long b,      \
        long long hq, long long hk, long long t, long long dh, long long r, long long bc) {         \
        rope_qk<T, float, true>(q, k, cos, sin, b, hq, hk, t, dh, r, bc);                           \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) widen_##SUFFIX(                               \
        const T* __restrict__ x, float* __restrict__ y, long long n) {                              \
        widen<T>(x, y, n);                                                                          \
    }

FUSED_KERNELS(f32, float)
FUSED_KERNELS(bf16, __nv_bfloat16)
FUSED_KERNELS(f16, __half)
