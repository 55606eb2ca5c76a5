//! GeGLU, Gemma's MLP gate: `h = T(T(gelu_tanh(g))·u)` with transformers' `gelu_pytorch_tanh`,
//! `gelu_tanh(x) = x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` computed in f32 (torch's opmath for
//! bf16/f16) and rounded to the storage type, then the product rounded again (two torch ops).
//! Backward: `dg = T(dh·u·gelu_tanh'(g))`, `du = T(dh·T(gelu_tanh(g)))` with
//! `gelu_tanh'(x) = (1 + t)/2 + x/2·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²)`, `t` the tanh above.
//!
//! The op's files: this one (its [`GeluTanh`] activation for `crate::glu`, which holds the candle
//! ops, CPU loops, CUDA launchers and check every gated unit shares; the kernels are
//! `kernels/glu.cuh`'s, instantiated with `gelu_tanh` in `kernels/fused.cu`), `reference.rs` (the
//! f64 formulation, the chain of candle ops the fused op replaced — and equals bit for bit — and
//! the kernels' f32 rounding), `tests.rs`.

pub mod reference;
#[cfg(test)]
mod tests;

use candle_core::{Result, Tensor};

use crate::glu::Activation;
use rtune_backend::Precision;

pub use reference::{geglu_backward_reference, geglu_reference};

/// √(2/π), torch's `M_SQRT2 * M_2_SQRTPI * 0.5`.
const K: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const C: f64 = 0.044_715;

/// `tanh((x + C·x³)·K)` in f32, in the chain's order (`x.sqr().mul(x)`, then candle's affines
/// `v·m + a`, whose `+ 0.0` only turns a −0 into +0, then tanh).
#[inline(always)]
fn inner_tanh(x: f32) -> f32 {
    let x3 = (x * x) * x;
    ((x + (x3 * C as f32 + 0.0)) * K as f32 + 0.0).tanh()
}

/// `gelu_tanh(x) = (x·0.5)·(t + 1)` in f32 (the affine's `+ 0.0` kept: −0 gives +0 as the chain).
#[inline(always)]
fn act(x: f32, t: f32) -> f32 {
    (x * 0.5 + 0.0) * (t + 1.0)
}

/// `gelu_tanh'(x)` given `t`, in the chain's order:
/// `(t + 1)·0.5 + ((x·(K/2))·(1 − t²))·(x²·3C + 1)`.
#[inline(always)]
fn deriv(x: f32, t: f32) -> f32 {
    // The chain's `1 − t²` is `t²·(−1) + 1`: the same bits (negation is exact).
    let one_minus_t2 = 1.0 - t * t;
    let poly = (x * x) * (3.0 * C) as f32 + 1.0;
    (t + 1.0) * 0.5 + ((x * (0.5 * K) as f32) * one_minus_t2) * poly
}

/// transformers' `gelu_pytorch_tanh`, each f32 step as the chain of candle ops the fused op
/// replaced (so the fused op equals it bit for bit).
#[derive(Clone, Copy)]
pub struct GeluTanh;

impl Activation for GeluTanh {
    const NAME: &'static str = "geglu";
    const BWD_NAME: &'static str = "geglu_bwd";
    const ROUND_GATE_IN_BWD: bool = true;
    #[inline(always)]
    fn fwd(x: f32) -> f32 {
        act(x, inner_tanh(x))
    }
    #[inline(always)]
    fn bwd(x: f32) -> (f32, f32) {
        let t = inner_tanh(x);
        (act(x, t), deriv(x, t))
    }
    fn reference_fwd(g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
        reference::geglu_fwd(g, u, p)
    }
    fn reference_bwd(dh: &[f32], g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
        reference::geglu_bwd(dh, g, u, p)
    }
    #[cfg(feature = "kernels")]
    const KERNELS: crate::glu::cuda::Kernels = crate::glu::cuda::Kernels {
        fwd: rtune_backend::launch::GpuKernel::new(&rtune_backend::image::FUSED, "geglu_fwd"),
        bwd: rtune_backend::launch::GpuKernel::new(&rtune_backend::image::FUSED, "geglu_bwd"),
        check_fwd: rtune_backend::check::Op::typed("geglu_fwd"),
        check_bwd: rtune_backend::check::Op::typed("geglu_bwd"),
    };
}

/// `gelu_tanh(g) · u` (transformers' `gelu_pytorch_tanh` gate). `g, u: (N, I)` of one dtype
/// (fused: [`crate::glu::op::fwd`]).
pub fn geglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    crate::glu::op::fwd::<GeluTanh>(g, u)
}

/// Returns `(dg, du)` for [`geglu`] given `dh: (N, I)` (fused: [`crate::glu::op::bwd`]).
pub fn geglu_backward(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    crate::glu::op::bwd::<GeluTanh>(dh, g, u)
}
