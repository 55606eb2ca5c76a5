//! The soft cap, `y = cap·tanh(x·scale/cap)`: Gemma 2's `attn_logit_softcapping` on the attention
//! scores (`x` the unscaled `q·kᵀ`, `scale` the score scale) and `final_logit_softcapping` on the
//! logits (`scale = 1`). No value leaves `(−cap, cap)`; the derivative is
//! `dy/dx = (1 − t²)·scale` with `t = tanh(x·scale/cap)`.
//!
//! One op, every path: the plain attention's scores ([`crate::attention`]'s capped softmax,
//! `attention/capped.rs`), the tiled kernels' tiles ([`Cap`], on the CPU in
//! `attention/tiled.rs`), the cross-entropy's logits ([`crate::ce`]) and the model's logits.
//!
//! transformers (`Gemma2Attention`, eager): `w = (q·kᵀ)·scaling; w = w / cap; w = tanh(w); w = w·cap`
//! — each a tensor of the model's dtype, so [`softcap`] rounds each step to `x`'s dtype as torch's
//! eager ops round it (nothing is rounded for f32). The tiled kernels do the same one score at a
//! time ([`Cap::eager`]) on bf16/f16 inputs, and compute in f32 throughout on f32 inputs ([`Cap`]:
//! `s·(1/cap)` with the reciprocal taken once); the paths differ by their summation order (the
//! attention tests compare them). Computed in f32 on bf16 inputs, the tiled path left
//! transformers' bf16 logits of tiny-gemma2 by 1.21e-2 (bound 1e-2).
//!
//! The op's files: this one, `tests.rs` (each form against autograd of the formula, and the forms
//! against each other).

#[cfg(test)]
mod tests;

use candle_core::{bail, DType, Result, Tensor};

/// `t = tanh(x·scale/cap)`, f32, each step rounded to `x`'s dtype as torch's eager ops round it
/// (`x·scale` is skipped when `scale` is 1: the product is `x` itself). `x` any shape, any float
/// dtype.
pub fn tanh_part(x: &Tensor, scale: f64, cap: f64) -> Result<Tensor> {
    let round = rounding(x.dtype());
    let s = x.to_dtype(DType::F32)?;
    let s = if scale == 1.0 {
        s
    } else {
        round((s * scale)?)?
    };
    let s = round((s / cap)?)?;
    round(s.tanh()?)
}

/// `y = cap·tanh(x·scale/cap)`, f32, rounded to `x`'s dtype after each step ([`tanh_part`], then
/// `·cap`): exactly the values of `x`'s dtype torch's eager steps give, held in f32 (the attention
/// adds its f32 mask to them).
pub fn softcap(x: &Tensor, scale: f64, cap: f64) -> Result<Tensor> {
    rounding(x.dtype())((tanh_part(x, scale, cap)? * cap)?)
}

/// [`softcap`]'s backward from its input: `dx = dy·(1 − t²)·scale`, f32, with `t` recomputed from
/// `x` as the forward rounded it. `dy` f32 of `x`'s shape.
pub fn softcap_backward(dy: &Tensor, x: &Tensor, scale: f64, cap: f64) -> Result<Tensor> {
    let t = tanh_part(x, scale, cap)?;
    // 1 − t² = −(t² − 1)
    let slope = (t.sqr()? - 1.0)?.neg()?;
    let dx = (dy * slope)?;
    if scale == 1.0 {
        Ok(dx)
    } else {
        dx * scale
    }
}

/// [`softcap`] with `scale = 1` in `x`'s dtype: the final-logit soft cap (transformers'
/// `logits / cap; tanh; * cap`).
pub fn softcap_logits(logits: &Tensor, cap: f64) -> Result<Tensor> {
    // `·cap` rounded once, straight to the dtype (no f32 round trip: the same bits).
    (tanh_part(logits, 1.0, cap)? * cap)?.to_dtype(logits.dtype())
}

/// [`softcap_logits`]' backward from its output (what the cross-entropy keeps):
/// `dlogits = dcapped·(1 − (capped/cap)²)`, in `dcapped`'s dtype.
pub fn softcap_logits_backward(dcapped: &Tensor, capped: &Tensor, cap: f64) -> Result<Tensor> {
    let t = (capped.to_dtype(DType::F32)? / cap)?;
    let slope = (t.sqr()? - 1.0)?.neg()?;
    (dcapped.to_dtype(DType::F32)? * slope)?.to_dtype(dcapped.dtype())
}

/// The cap as the tiled kernels take it, f32, for already scaled scores `s`: `t = tanh(s·(1/cap))`,
/// `z = cap·t`, `dz/ds = 1 − t²`. Built by [`Cap::new`] from the model's `Option<f64>`.
#[derive(Debug, Clone, Copy)]
pub struct Cap {
    cap: f32,
    inv: f32,
}

impl Cap {
    /// `None` for no cap; an error naming `op` for a cap that is not finite and positive.
    pub fn new(op: &str, softcap: Option<f64>) -> Result<Option<Cap>> {
        match softcap {
            None => Ok(None),
            Some(c) if c.is_finite() && c > 0.0 => {
                let cap = c as f32;
                Ok(Some(Cap {
                    cap,
                    inv: 1.0 / cap,
                }))
            }
            Some(c) => bail!("{op}: soft cap {c} must be finite and positive"),
        }
    }

    /// The cap itself.
    pub fn value(&self) -> f32 {
        self.cap
    }

    /// `t = tanh(s/cap)` of a scaled score.
    #[inline(always)]
    pub fn tanh(&self, s: f32) -> f32 {
        (s * self.inv).tanh()
    }

    /// `z = cap·t` given [`Cap::tanh`]'s `t`.
    #[inline(always)]
    pub fn of_tanh(&self, t: f32) -> f32 {
        self.cap * t
    }

    /// `dz/ds = 1 − t²` given [`Cap::tanh`]'s `t`.
    #[inline(always)]
    pub fn slope(t: f32) -> f32 {
        1.0 - t * t
    }

    /// `(t, z)` of an unscaled score `x` as torch's eager ops give them in a half dtype: each step
    /// (`x` itself, a product's output; `·scale`; `/cap`; `tanh`; `cap·t`) rounded by `round` to
    /// that dtype, held in f32 — [`softcap`]'s values (and [`tanh_part`]'s `t`) one element at a
    /// time, for the tiled kernels on bf16/f16 inputs. `/cap` is `·(1/cap)` as candle's scalar
    /// division computes it.
    #[inline(always)]
    pub fn eager(&self, x: f32, scale: f32, round: impl Fn(f32) -> f32) -> (f32, f32) {
        let s = round(round(x) * scale);
        let t = round(round(s * self.inv).tanh());
        (t, round(self.cap * t))
    }

    /// `z = cap·tanh(s/cap)` of scaled scores, in place.
    #[inline(always)]
    pub fn apply(&self, s: &mut [f32]) {
        s.iter_mut().for_each(|x| *x = self.of_tanh(self.tanh(*x)));
    }
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
