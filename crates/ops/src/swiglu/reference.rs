//! Plain formulations of SwiGLU: on tensors (a chain of candle ops, differentiable by candle's
//! autograd: what `op.rs` and the backward are tested against) and on f32 slices with the CUDA
//! kernels' rounding to a [`Precision`] (what `check.rs` compares the kernels with).

use candle_core::{DType, Result, Tensor};
use rtune_backend::Precision;

/// `1 / (1 + e^-x)`.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// [`swiglu`] as candle ops: the reference for the fused op.
pub fn swiglu_reference(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    g.silu()? * u
}

/// [`swiglu_backward`] as candle ops: the reference for the fused op.
pub fn swiglu_backward_reference(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    let dt = g.dtype();
    let gf = g.to_dtype(DType::F32)?;
    let s = sigmoid(&gf)?;
    let silu = (&gf * &s)?;
    let dhf = dh.to_dtype(DType::F32)?;
    let du = (&dhf * silu)?.to_dtype(dt)?;
    let dsilu = (&s * ((&gf * (1.0 - &s)?)? + 1.0)?)?;
    let dg = ((dhf * u.to_dtype(DType::F32)?)? * dsilu)?.to_dtype(dt)?;
    Ok((dg, du))
}

/// `silu(g) = g / (1 + e^-g)` (candle's silu).
fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// `h = T(T(silu(g))·u)`: (n).
pub fn swiglu_fwd(g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
    assert_eq!(g.len(), u.len());
    g.iter()
        .zip(u)
        .map(|(&g, &u)| p.round(p.round(silu(g)) * u))
        .collect()
}

/// `(2, n)`: `dg = T((dh·u)·silu'(g))` at `[0, n)`, `du = T(dh·silu(g))` at `[n, 2n)`, with
/// `s = 1/(e^-g + 1)`, `silu = g·s`, `silu' = s·(g·(1 − s) + 1)` ([`swiglu_backward_reference`]).
pub fn swiglu_bwd(dh: &[f32], g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
    let n = g.len();
    assert_eq!((dh.len(), u.len()), (n, n));
    let mut out = vec![0f32; 2 * n];
    let (dg, du) = out.split_at_mut(n);
    for i in 0..n {
        let s = 1.0 / ((-g[i]).exp() + 1.0);
        du[i] = p.round(dh[i] * (g[i] * s));
        let ds = s * (g[i] * (1.0 - s) + 1.0);
        dg[i] = p.round(dh[i] * u[i] * ds);
    }
    out
}
