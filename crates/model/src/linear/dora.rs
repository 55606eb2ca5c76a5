//! DoRA, weight-decomposed low-rank adaptation (Liu et al. 2024, arXiv 2402.09353), as PEFT 0.21's
//! `peft/tuners/lora/dora.py` computes it for a linear layer `W: (out, in)` with LoRA `A: (r, in)`,
//! `B: (out, r)`, scaling `s` and a trained magnitude `m: (out,)`:
//!
//! - `n = ‖W + s·B·A‖` row-wise (`norm(dim=1)`), in f32 (an NF4 `W` dequantized first), **detached**:
//!   no gradient flows through `n` (section 4.3 of the paper; PEFT's `weight_norm.detach()`).
//! - `k = m / n: (out,)`.
//! - Without dropout the layer computes `y = k ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ) + b`: plain LoRA with its
//!   output columns scaled by `k` before the bias. With dropout `d(·)` on the LoRA input, PEFT
//!   recomputes the base product on the dropped input: `y = x·Wᵀ + b + (k − 1) ⊙ d(x)·Wᵀ +
//!   k ⊙ s·(d(x)·Aᵀ)·Bᵀ`.
//!
//! In both cases `y = x·Wᵀ + b − base + k ⊙ z` with `z = base + s·l`, `base` the base product the
//! DoRA term multiplies (`x·Wᵀ` or `d(x)·Wᵀ`) and `l` the LoRA product, so the backward is
//!
//! - `dm = Σ_rows(dy ⊙ z) / n` (the only new reduction),
//! - the LoRA gradients of plain LoRA on `dy ⊙ k` (`dB = s·(dy⊙k)ᵀ·xa`, `dA = (s·(dy⊙k)·B)ᵀ·d(x)`),
//! - `dx`: without dropout `(dy ⊙ k)·W + LoRA part` (so the frozen GEMM sees `dy ⊙ k` instead of
//!   `dy` and costs nothing extra); with dropout `dy·W + d'((dy⊙(k−1))·W + LoRA part)`, `d'` the
//!   same mask and scale.
//!
//! `n` depends on `A`, `B` and `W` only, so it is computed once per optimizer step and cached
//! ([`NormCache`], keyed by the identity of the A and B tensors: the optimizer replaces them on each
//! update), not once per micro-batch or per recomputed layer. Cost per step: one `(out, r)·(r, in)`
//! GEMM and a pass over `W` per module; per micro-batch: one `(N, out)` scale and one `(N, out)`
//! reduction per module.

use candle_core::{DType, Result, Tensor, TensorId};
use std::sync::{Arc, Mutex};

use rtune_lora::LoraPair;

use super::{Grads, Linear, LoraCtx};
use rtune_backend::blas::matmul as mm;

/// The cached row norms `n = ‖W + s·B·A‖: (out,)` f32 of one layer, valid while its A and B are the
/// same tensors (ids) and the scaling the same. A clone of the layer starts with an empty cache.
#[derive(Debug, Default)]
pub struct NormCache(Arc<Mutex<Option<Cached>>>);

/// `(A's id, B's id, scaling's bits, n)`.
type Cached = (TensorId, TensorId, u64, Tensor);

impl Clone for NormCache {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl NormCache {
    /// The same cache, not a fresh one (a sharded base's gathered layer keeps its model layer's
    /// norms, which depend on the weight's values alone, not on where they are held).
    pub(crate) fn share(&self) -> Self {
        Self(self.0.clone())
    }

    /// `n` for the current A, B and scaling: the cached tensor, or computed (from `w()`, read only
    /// then: an NF4 weight is dequantized once per step) and cached.
    fn get<'w>(
        &self,
        w: impl FnOnce() -> Result<std::borrow::Cow<'w, Tensor>>,
        pair: &LoraPair,
        scaling: f64,
    ) -> Result<Tensor> {
        let key = (pair.a.id(), pair.b.id(), scaling.to_bits());
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((a, b, s, n)) = slot.as_ref() {
            if (*a, *b, *s) == key {
                return Ok(n.clone());
            }
        }
        let n = weight_norm(&*w()?, &pair.a, &pair.b, scaling)?;
        *slot = Some((key.0, key.1, key.2, n.clone()));
        Ok(n)
    }
}

/// `‖W + s·B·A‖` row-wise: `w: (out, in)` any float dtype, `a: (r, in)`, `b: (out, r)` f32 →
/// `(out,)` f32. PEFT: `torch.linalg.norm(W + scaling * lora_weight, dim=1)` with W cast to the
/// adapter's dtype (f32).
pub fn weight_norm(w: &Tensor, a: &Tensor, b: &Tensor, scaling: f64) -> Result<Tensor> {
    let v = (w.to_dtype(DType::F32)? + (mm(b, a)? * scaling)?)?; // (out, in)
    v.sqr()?.sum(1)?.sqrt()
}

/// What the backward of a DoRA layer needs besides the LoRA cache.
#[derive(Debug, Clone)]
pub struct DoraCache {
    /// `k = m / n: (1, out)` f32.
    k: Tensor,
    /// `n: (1, out)` f32 (detached).
    n: Tensor,
    /// `z = base + s·l: (N, out)` f32.
    z: Tensor,
    /// The LoRA input had dropout (the base product was recomputed on it).
    dropout: bool,
}

/// The layer's output for a DoRA module: `y: (N, out)` = `x·Wᵀ` (no bias, compute dtype), `yl =
/// s·xa·Bᵀ: (N, out)` f32, `base_d = d(x)·Wᵀ` f32 when the LoRA input had dropout. Returns the
/// output in `y`'s dtype, bias added, and the cache.
pub(crate) fn output(
    lin: &Linear,
    y: Tensor,
    yl: Tensor,
    base_d: Option<Tensor>,
    ctx: &LoraCtx,
) -> Result<(Tensor, DoraCache)> {
    let slot = lin.lora.expect("adapted layer");
    let pair = &ctx.adapter.pairs[slot];
    let m = pair.m.as_ref().expect("DoRA pair");
    let n = lin
        .dora_norm
        .get(|| lin.w.dense(), pair, ctx.scaling)?
        .unsqueeze(0)?; // (1, out)
    let k = m.unsqueeze(0)?.div(&n)?; // (1, out)
    let dt = y.dtype();
    let yf = y.to_dtype(DType::F32)?;
    let (out, z, dropout) = match base_d {
        // y + (k − 1)⊙base_d + k⊙yl = y − base_d + k⊙z
        Some(bd) => {
            let z = (&bd + yl)?;
            let out = ((yf - bd)? + z.broadcast_mul(&k)?)?;
            (out, z, true)
        }
        // k⊙(y + yl)
        None => {
            let z = (yf + yl)?;
            (z.broadcast_mul(&k)?, z, false)
        }
    };
    let out = match &lin.bias {
        Some(b) => out.broadcast_add(&b.to_dtype(DType::F32)?)?,
        None => out,
    };
    Ok((out.to_dtype(dt)?, DoraCache { k, n, z, dropout }))
}

impl DoraCache {
    /// Accumulates `dm = Σ_rows(dy ⊙ z) / n` and returns the gradient the rest of the layer's
    /// backward takes: `dy ⊙ k` (in `dy`'s dtype) without dropout, `dy` unchanged with it (then
    /// [`DoraCache::lora_dy`] and [`DoraCache::extra_dx`] finish the job).
    pub(crate) fn prepare(&self, dy: &Tensor, slot: usize, grads: &mut Grads) -> Result<Tensor> {
        let dyf = dy.to_dtype(DType::F32)?;
        // dm: (out,) = 1ᵀ·(dy ⊙ z) / n — the column sums as a GEMV: candle's sum over dim 0 of a
        // contiguous matrix takes a divmod per element, several times slower.
        let p = (&dyf * &self.z)?; // (N, out)
        let ones = Tensor::ones((1, p.dim(0)?), DType::F32, p.device())?;
        let dm = mm(&ones, &p)?.div(&self.n)?.squeeze(0)?;
        Grads::add(&mut grads.m[slot], dm)?;
        if self.dropout {
            Ok(dy.clone())
        } else {
            dyf.broadcast_mul(&self.k)?.to_dtype(dy.dtype())
        }
    }

    /// The gradient the LoRA branch sees, f32: `dy ⊙ k` with dropout (without it `dy` already is).
    pub(crate) fn lora_dy(&self, dyf: Tensor) -> Result<Tensor> {
        if self.dropout {
            dyf.broadcast_mul(&self.k)
        } else {
            Ok(dyf)
        }
    }

    /// With dropout, the base product's part of `dx` before the mask: `(dy ⊙ (k − 1))·W`, f32.
    pub(crate) fn extra_dx(&self, dy: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
        if !self.dropout {
            return Ok(None);
        }
        let km1 = (&self.k - 1.0)?;
        let g = dy.to_dtype(DType::F32)?.broadcast_mul(&km1)?;
        Ok(Some(mm(&g, &w.to_dtype(DType::F32)?)?))
    }
}

/// [`Linear::dora_dy`] for each member of a group: `dys` as the rest of the group's backward takes
/// them (`dm` accumulated on the way).
pub(crate) fn prepare_all(
    members: &[&Linear],
    dys: &[Tensor],
    caches: &[&super::LinearCache],
    grads: &mut Grads,
) -> Result<Vec<Tensor>> {
    members
        .iter()
        .zip(dys)
        .zip(caches)
        .map(|((m, dy), c)| m.dora_dy(dy, c, grads))
        .collect()
}

#[cfg(test)]
mod tests;
