//! The experts' gate: how the `(n, 2I)` output of `gate_up` becomes the `(n, I)` input of `down`,
//! forward and backward.
//!
//! - [`ExpertAct::SwiGlu`] (Qwen3-MoE, Mixtral): columns `0..I` gate `g`, `I..2I` up `u`;
//!   `silu(g)·u` ([`rtune_ops::swiglu()`]).
//! - [`ExpertAct::Clamped`] (gpt-oss, transformers 5.24's `GptOssExperts._apply_gate`): gate and up
//!   interleaved, column `2j` gate `j`, `2j + 1` up `j`; `g' = min(g, limit)`,
//!   `u' = clamp(u, −limit, limit)`, `out = (u' + 1)·g'·σ(α·g')`. Backward, with `s = σ(α·g')`:
//!   `dg = dout·(u' + 1)·(s + α·g'·s·(1 − s))·[g < limit]`, `du = dout·g'·s·[|u| < limit]`: torch
//!   2.15's clamp by a scalar passes the gradient only strictly inside the range, none at a bound
//!   itself. In bf16 a gate or up value lands exactly on the limit often enough to matter
//!   (`tiny-gpt-oss`: 3 gate and 7 up values at ±1.0 in layer 1); passing the gradient there put
//!   gpt-oss's bf16 gate_up `lora_B` gradient 0.36 of its largest entry off PEFT's.

use candle_core::{DType, Result, Tensor};

/// Which gate the experts apply.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertAct {
    SwiGlu,
    /// `alpha`: `swiglu_alpha` (1.702); `limit`: `swiglu_limit` (7.0).
    Clamped {
        alpha: f64,
        limit: f64,
    },
}

/// `(g, u)` of `gu: (n, 2I)` laid out as `act` says, each `(n, I)`.
fn split(gu: &Tensor, act: ExpertAct) -> Result<(Tensor, Tensor)> {
    let (n, i2) = gu.dims2()?;
    let i = i2 / 2;
    match act {
        ExpertAct::SwiGlu => Ok((gu.narrow(1, 0, i)?, gu.narrow(1, i, i)?)),
        ExpertAct::Clamped { .. } => {
            let p = gu.reshape((n, i, 2))?;
            Ok((
                p.narrow(2, 0, 1)?.squeeze(2)?,
                p.narrow(2, 1, 1)?.squeeze(2)?,
            ))
        }
    }
}

/// `σ(x) = 1 / (1 + e^{−x})`.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// `σ(α·g)` as torch forms it in `g`'s dtype: `α·g` in f32 (α not rounded) and rounded, then
/// the sigmoid in f32 and rounded once (in f32 both roundings are no-ops).
fn gate_sigmoid(g: &Tensor, alpha: f64) -> Result<Tensor> {
    let dt = g.dtype();
    let x = (g.to_dtype(DType::F32)? * alpha)?.to_dtype(dt)?;
    sigmoid(&x.to_dtype(DType::F32)?)?.to_dtype(dt)
}

/// `gu: (n, 2I)` → `(n, I)`.
pub fn act_forward(gu: &Tensor, act: ExpertAct) -> Result<Tensor> {
    let (g, u) = split(gu, act)?;
    match act {
        ExpertAct::SwiGlu => rtune_ops::swiglu(&g, &u),
        ExpertAct::Clamped { alpha, limit } => {
            let g = g.minimum(limit)?;
            let u = u.clamp(-limit, limit)?;
            let glu = (&g * gate_sigmoid(&g, alpha)?)?;
            (u + 1.0)? * glu
        }
    }
}

/// The backward of [`act_forward`]: `dm: (n, I)`, `gu` the forward's input → `dgu: (n, 2I)` in
/// `gu`'s layout.
pub fn act_backward(dm: &Tensor, gu: &Tensor, act: ExpertAct) -> Result<Tensor> {
    let (g, u) = split(gu, act)?;
    match act {
        ExpertAct::SwiGlu => {
            let (dg, du) = rtune_ops::swiglu_backward(dm, &g, &u)?;
            Tensor::cat(&[dg, du], 1)
        }
        ExpertAct::Clamped { alpha, limit } => {
            let dt = gu.dtype();
            // No gradient at the bounds themselves, as torch's scalar clamp (module doc).
            let g_in = g.lt(limit)?.to_dtype(dt)?;
            let u_in = (u.gt(-limit)?.to_dtype(dt)? * u.lt(limit)?.to_dtype(dt)?)?;
            let gc = g.minimum(limit)?;
            let uc = u.clamp(-limit, limit)?;
            let s = gate_sigmoid(&gc, alpha)?;
            // torch's autograd through `(u' + 1)·(g'·σ(α·g'))`, each product rounded to `dt`:
            // d_glu = dout·(u' + 1); du' = dout·glu; dg' = d_glu·s + α·R(d_glu·g'·s·(1 − s)),
            // sigmoid's backward in f32 rounded once, the two terms summed in `dt`.
            let d_glu = (dm * (uc + 1.0)?)?;
            let du = ((dm * (&gc * &s)?)? * u_in)?;
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            let sf = f(&s)?;
            let dx = (f(&(&d_glu * &gc)?)? * (&sf * sf.affine(-1.0, 1.0)?)?)?.to_dtype(dt)?;
            let dg = ((&d_glu * &s)? + (f(&dx)? * alpha)?.to_dtype(dt)?)?.mul(&g_in)?;
            let (n, i) = dg.dims2()?;
            Tensor::stack(&[dg, du], 2)?.reshape((n, 2 * i))
        }
    }
}
