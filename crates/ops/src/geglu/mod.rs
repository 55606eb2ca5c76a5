//! GeGLU, Gemma's MLP gate: `h = T(T(gelu_tanh(g))·u)` with transformers' `gelu_pytorch_tanh`,
//! `gelu_tanh(x) = x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` computed in f32 (torch's opmath for
//! bf16/f16) and rounded to the storage type, then the product rounded again (two torch ops).
//! Backward: `dg = T(dh·u·gelu_tanh'(g))`, `du = T(dh·T(gelu_tanh(g)))` with
//! `gelu_tanh'(x) = (1 + t)/2 + x/2·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²)`, `t` the tanh above.
//!
//! The op's files, as every fused op's: this one (what the model calls), `op.rs` (the candle ops),
//! `cpu.rs` (the loops: the chain of candle ops it replaced, bit for bit), `reference.rs` (the f64
//! formulation, that chain, and the kernels' f32 rounding), `cuda.rs` (launchers of
//! `kernels/geglu.cuh`), `check.rs` (for `rtune selftest`), `tests.rs`.

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

pub use reference::{geglu_backward_reference, geglu_reference};

/// √(2/π), torch's `M_SQRT2 * M_2_SQRTPI * 0.5`.
const K: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const C: f64 = 0.044_715;

/// `gelu_tanh(g) · u` (transformers' `gelu_pytorch_tanh` gate). `g, u: (N, I)` of one dtype
/// (fused: [`crate::geglu::op::geglu`]).
pub fn geglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    crate::geglu::op::geglu(g, u)
}

/// Returns `(dg, du)` for [`geglu`] given `dh: (N, I)` (fused: [`crate::geglu::op::geglu_bwd`]).
pub fn geglu_backward(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    crate::geglu::op::geglu_bwd(dh, g, u)
}
