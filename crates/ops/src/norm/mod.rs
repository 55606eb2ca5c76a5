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

use candle_core::{DType, Result, Tensor, D};

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

/// Gemma's RMSNorm: `T(f32(x)·r·w1)` with `w1 = 1 + w` given as an f32 `(D)` tensor (the caller
/// adds the 1 once, at load), everything in f32 and one rounding at the end (transformers'
/// `Gemma3RMSNorm`: `(x·w).to(dtype)`, unlike Llama's `w·x.to(dtype)`). On f32 inputs that is
/// [`rms_norm`] with `w1` (the same two f32 products); on bf16/f16 a chain of candle ops in f32.
pub fn rms_norm_plus_one(x: &Tensor, w1: &Tensor, eps: f64) -> Result<(Tensor, NormCache)> {
    if x.dtype() == DType::F32 {
        return rms_norm(x, w1, eps);
    }
    let xf = x.to_dtype(DType::F32)?;
    let r = inv_rms(&xf, eps)?;
    let y = xf
        .broadcast_mul(&r)?
        .broadcast_mul(w1)?
        .to_dtype(x.dtype())?;
    Ok((y, NormCache { x: x.clone(), eps }))
}

/// [`rms_norm_plus_one`]'s backward: `dx = T(r·g − x·r³·mean(g·x))`, `g = f32(dy)·w1`, in f32.
pub fn rms_norm_plus_one_backward(dy: &Tensor, w1: &Tensor, c: &NormCache) -> Result<Tensor> {
    if c.x.dtype() == DType::F32 {
        return rms_norm_backward(dy, w1, c);
    }
    let xf = c.x.to_dtype(DType::F32)?;
    let r = inv_rms(&xf, c.eps)?;
    let g = dy.to_dtype(DType::F32)?.broadcast_mul(w1)?;
    let mean_gx = (&g * &xf)?.mean_keepdim(D::Minus1)?;
    let r3 = r.powf(3.0)?;
    let dx = (g.broadcast_mul(&r)? - xf.broadcast_mul(&r3)?.broadcast_mul(&mean_gx)?)?;
    dx.to_dtype(c.x.dtype())
}

/// `1/sqrt(mean(x²) + eps)` over the last dim of an f32 tensor, kept as `(..., 1)`.
fn inv_rms(xf: &Tensor, eps: f64) -> Result<Tensor> {
    (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()
}
