//! Soft-capped attention scores (Gemma 2's `attn_logit_softcapping`): the scaled scores pass
//! through `cap·tanh(s/cap)` before the mask and the softmax, so no logit leaves `(−cap, cap)`.
//! Composed of candle ops in f32 on the plain path (the tiled kernels have no cap): forward and
//! backward here, their test against candle's autograd of the same formula in `tests.rs`.
//!
//! transformers (`Gemma2Attention`, eager): `w = (q·kᵀ)·scaling; w = tanh(w / cap)·cap; w += mask;
//! softmax(w, f32)`.

use candle_core::{DType, Result, Tensor, D};

/// `p = softmax(cap·tanh(raw·scale/cap) + mask)`, f32 `(1, Hkv, G·Tq, Tk)` (the steps rounded to
/// `raw`'s dtype as torch's eager ops round them, see `capped`). `raw: (1, Hkv, G·Tq, Tk)` the
/// unscaled scores in the compute dtype; `mask: (1, 1, 1, Tq, Tk)` additive f32 (0 or −∞),
/// broadcast over the kv heads and the G query heads of each (`Tq = Tk` but for a decoding
/// step's queries after cached keys).
pub fn probs(raw: &Tensor, mask: &Tensor, scale: f64, cap: f64) -> Result<Tensor> {
    let (_, hkv, gt, tk) = raw.dims4()?;
    let tq = mask.dim(D::Minus2)?;
    let z = rounding(raw.dtype())((capped(raw, scale, cap)? * cap)?)?
        .reshape((1, hkv, gt / tq, tq, tk))?
        .broadcast_add(mask)?
        .reshape((1, hkv, gt, tk))?;
    let max = z.max_keepdim(D::Minus1)?;
    let e = z.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)
}

/// [`probs`]' backward to the unscaled scores: with `dz = p·(dp − Σ_row dp·p)` (the softmax's) and
/// `t = tanh(raw·scale/cap)` (as the forward rounded it), `draw = dz·(1 − t²)·scale`, in `dp`'s dtype. `p` f32 from
/// [`probs`], `dp` and `raw` of its shape (`raw` the same scores the forward saw).
pub fn probs_bwd(p: &Tensor, dp: &Tensor, raw: &Tensor, scale: f64, cap: f64) -> Result<Tensor> {
    let dpf = dp.to_dtype(DType::F32)?;
    let row = (&dpf * p)?.sum_keepdim(D::Minus1)?;
    let dz = (p * dpf.broadcast_sub(&row)?)?;
    let t = capped(raw, scale, cap)?;
    // 1 − t² = −(t² − 1)
    let slope = (t.sqr()? - 1.0)?.neg()?;
    ((dz * slope)? * scale)?.to_dtype(dp.dtype())
}

/// `t = tanh(s/cap)` of the scaled scores `s = raw·scale`, f32, rounded to `raw`'s dtype after
/// each step as torch's eager ops round them (`w·scaling`, `/ cap`, `tanh`, each a bf16 tensor in
/// a bf16 model; nothing is rounded for f32 scores). [`probs`] multiplies by `cap` (and rounds).
fn capped(raw: &Tensor, scale: f64, cap: f64) -> Result<Tensor> {
    let round = rounding(raw.dtype());
    let s = round((raw.to_dtype(DType::F32)? * scale)?)?;
    let s = round((s / cap)?)?;
    round(s.tanh()?)
}

/// `x` (f32) rounded through `dt` and back: what storing an f32 result as a `dt` tensor keeps.
pub(crate) fn rounding(dt: DType) -> impl Fn(Tensor) -> Result<Tensor> {
    move |x: Tensor| {
        if dt == DType::F32 {
            Ok(x)
        } else {
            x.to_dtype(dt)?.to_dtype(DType::F32)
        }
    }
}
