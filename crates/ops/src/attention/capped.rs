//! The soft-capped softmax of the plain path (Gemma 2's `attn_logit_softcapping`): the scores pass
//! through the soft cap ([`crate::softcap`]) before the mask and the softmax, so no logit leaves
//! `(−cap, cap)`. Composed of candle ops in f32: forward and backward here, their test against
//! candle's autograd of the same formula in `tests.rs`. The tiled kernels cap their tiles with the
//! same op ([`crate::softcap::Cap`]).
//!
//! transformers (`Gemma2Attention`, eager): `w = (q·kᵀ)·scaling; w = tanh(w / cap)·cap; w += mask;
//! softmax(w, f32)`.

use candle_core::{DType, Result, Tensor, D};

use crate::softcap::{softcap, softcap_backward};

/// `p = softmax(cap·tanh(raw·scale/cap) + mask)`, f32 `(1, Hkv, G·Tq, Tk)` (the steps rounded to
/// `raw`'s dtype as torch's eager ops round them, see [`crate::softcap::softcap`]). `raw: (1, Hkv,
/// G·Tq, Tk)` the unscaled scores in the compute dtype; `mask: (1, 1, 1, Tq, Tk)` additive f32 (0 or
/// −∞), broadcast over the kv heads and the G query heads of each.
pub fn probs(raw: &Tensor, mask: &Tensor, scale: f64, cap: f64) -> Result<Tensor> {
    let (_, hkv, gt, tk) = raw.dims4()?;
    // Tq = Tk but for a decoding step's queries after cached keys.
    let tq = mask.dim(D::Minus2)?;
    let z = softcap(raw, scale, cap)?
        .reshape((1, hkv, gt / tq, tq, tk))?
        .broadcast_add(mask)?
        .reshape((1, hkv, gt, tk))?;
    let max = z.max_keepdim(D::Minus1)?;
    let e = z.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)
}

/// [`probs`]' backward to the unscaled scores: with `dz = p·(dp − Σ_row dp·p)` (the softmax's),
/// `draw = dz·(1 − t²)·scale` ([`crate::softcap::softcap_backward`]), in `dp`'s dtype. `p` f32
/// from [`probs`], `dp` and `raw` of its shape (`raw` the same scores the forward saw).
pub fn probs_bwd(p: &Tensor, dp: &Tensor, raw: &Tensor, scale: f64, cap: f64) -> Result<Tensor> {
    let dpf = dp.to_dtype(DType::F32)?;
    let row = (&dpf * p)?.sum_keepdim(D::Minus1)?;
    let dz = (p * dpf.broadcast_sub(&row)?)?;
    softcap_backward(&dz, raw, scale, cap)?.to_dtype(dp.dtype())
}
