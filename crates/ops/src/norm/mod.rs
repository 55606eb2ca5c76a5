//! RMSNorm (transformers' `LlamaRMSNorm`): `y = T(T(x·r)·w)` with `r = 1/sqrt(mean(x²) + eps)`
//! per row in f32; backward `dx = r·g − x·r³·mean(g·x)` with `g = T(dy·w)`, `r` recomputed from `x`.
//!
//! The op's files: this one (what the model calls: [`rms_norm`] keeps what [`rms_norm_backward`]
//! needs), `op.rs` (the candle ops: checks, `cpu_fwd`, `cuda_fwd`), `cpu.rs` (the row loops),
//! `reference.rs` (plain formulations), `cuda.rs` (launchers of `kernels/norm.cuh`), `check.rs`
//! (the kernels against the reference, for `rtune selftest`), `tests.rs`.

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

pub use reference::{rms_norm_backward_reference, rms_norm_reference};

/// What [`rms_norm`]'s backward needs: the input (the backward recomputes `r` from it).
#[derive(Debug, Clone)]
pub struct NormCache {
    /// The input, in its own dtype: `(N, D)`.
    pub x: Tensor,
    pub eps: f64,
}

/// Llama's RMSNorm: `w · (x · rsqrt(mean(x²) + eps))`, statistics in f32 then cast back (as
/// transformers' `LlamaRMSNorm`). `x: (N, D)`, `w: (D)`. Fused ([`crate::norm::op::rms_norm`]);
/// [`rms_norm_reference`] is the plain formulation.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, NormCache)> {
    let y = crate::norm::op::rms_norm(x, w, eps)?;
    Ok((y, NormCache { x: x.clone(), eps }))
}

/// `dx = r·g − x·r³·mean(g·x)`, `g = dy·w` (fused: [`crate::norm::op::rms_norm_bwd`]).
pub fn rms_norm_backward(dy: &Tensor, w: &Tensor, c: &NormCache) -> Result<Tensor> {
    crate::norm::op::rms_norm_bwd(dy, &c.x, w, c.eps)
}
