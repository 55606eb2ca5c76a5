//! SwiGLU, Llama's MLP gate: `h = T(T(silu(g))·u)` (silu in f32 and rounded once, as PyTorch's
//! `act_fn(gate) * up`); backward `dg = T(dh·u·silu'(g))`, `du = T(dh·silu(g))` with
//! `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`.
//!
//! The op's files: this one (its [`Silu`] activation for `crate::glu`, which holds the candle ops,
//! CPU loops, CUDA launchers and check every gated unit shares; the kernels are
//! `kernels/glu.cuh`'s, instantiated with `silu` in `kernels/fused.cu`), `reference.rs` (plain
//! formulations), `tests.rs`.

pub mod reference;
#[cfg(test)]
mod tests;

use candle_core::{Result, Tensor};
use rtune_backend::cpu::exp;

use crate::glu::Activation;
use rtune_backend::Precision;

pub use reference::{swiglu_backward_reference, swiglu_reference};

/// `silu(x) = x / (1 + e^-x)` (candle's silu) forward; the backward's `s = 1/(e^-x + 1)`,
/// `silu = x·s`, `silu' = s·(x·(1 − s) + 1)`.
#[derive(Clone, Copy)]
pub struct Silu;

impl Activation for Silu {
    const NAME: &'static str = "swiglu";
    const BWD_NAME: &'static str = "swiglu_bwd";
    const ROUND_GATE_IN_BWD: bool = false;
    #[inline(always)]
    fn fwd(x: f32) -> f32 {
        x / (1.0 + exp(-x))
    }
    #[inline(always)]
    fn bwd(x: f32) -> (f32, f32) {
        let s = 1.0 / (exp(-x) + 1.0);
        (x * s, s * (x * (1.0 - s) + 1.0))
    }
    fn reference_fwd(g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
        reference::swiglu_fwd(g, u, p)
    }
    fn reference_bwd(dh: &[f32], g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
        reference::swiglu_bwd(dh, g, u, p)
    }
    #[cfg(feature = "kernels")]
    const KERNELS: crate::glu::cuda::Kernels = crate::glu::cuda::Kernels {
        fwd: rtune_backend::launch::GpuKernel::new(&rtune_backend::image::FUSED, "swiglu_fwd"),
        bwd: rtune_backend::launch::GpuKernel::new(&rtune_backend::image::FUSED, "swiglu_bwd"),
        check_fwd: rtune_backend::check::Op::typed("swiglu_fwd"),
        check_bwd: rtune_backend::check::Op::typed("swiglu_bwd"),
    };
}

/// SwiGLU: `silu(g) · u` (fused: [`crate::glu::op::fwd`]).
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    crate::glu::op::fwd::<Silu>(g, u)
}

/// Returns `(dg, du)` for [`swiglu`] (fused: [`crate::glu::op::bwd`]).
pub fn swiglu_backward(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    crate::glu::op::bwd::<Silu>(dh, g, u)
}
