//! SwiGLU, Llama's MLP gate: `h = T(T(silu(g))·u)`; backward `dg = T(dh·u·silu'(g))`,
//! `du = T(dh·silu(g))`.
//!
//! The op's files: this one (what the model calls), `op.rs` (the candle ops), `cpu.rs` (the loops),
//! `reference.rs` (plain formulations), `cuda.rs` (launchers of `kernels/swiglu.cuh`), `check.rs`
//! (for `rtune selftest`), `tests.rs`.

#[cfg(feature = "kernels")]
pub mod check;
pub(crate) mod cpu;
#[cfg(feature = "kernels")]
pub mod cuda;
pub mod op;
pub mod reference;
#[cfg(test)]
mod tests;

use candle_core::{Result, Tensor};

pub use reference::{swiglu_backward_reference, swiglu_reference};

/// SwiGLU: `silu(g) · u` (fused: [`crate::swiglu::op::swiglu`]).
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    crate::swiglu::op::swiglu(g, u)
}

/// Returns `(dg, du)` for [`swiglu`]; `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))` (fused:
/// [`crate::swiglu::op::swiglu_bwd`]).
pub fn swiglu_backward(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    crate::swiglu::op::swiglu_bwd(dh, g, u)
}
