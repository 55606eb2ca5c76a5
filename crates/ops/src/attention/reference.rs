//! Plain formulations of the attention softmax: on tensors (the reference of `softmax.rs`) and on
//! f32 slices with the CUDA kernel's rounding (`check.rs`).

use candle_core::{DType, Result, Tensor, D};
use rtune_backend::Precision;

/// `softmax(f32(T(f32(raw)·scale)) + mask)` as candle ops (the scaling rounded once, as torch's
/// `raw * scaling`): the reference for
/// [`crate::attention::softmax::attn_softmax`]. `raw: (1, Hkv, G·T, T)` unscaled scores; `mask: (1, 1, 1, T, T)`
/// additive f32, broadcast over the kv heads and the G query heads of each.
pub fn attention_probs_reference(raw: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let (_, hkv, gt, t) = raw.dims4()?;
    let scores = (raw.to_dtype(DType::F32)? * scale)?
        .to_dtype(raw.dtype())?
        .to_dtype(DType::F32)?
        .reshape((1, hkv, gt / t, t, t))?
        .broadcast_add(mask)?
        .reshape((1, hkv, gt, t))?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)
}

/// Softmax backward `ds = (p·(dp − Σ_row dp·p))·scale` in f32, cast to `dp`'s dtype, as candle ops:
/// the reference for [`crate::attention::softmax::attn_softmax_bwd`]. `p` f32, `dp` of its shape.
pub fn attention_grad_reference(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    let dpf = dp.to_dtype(DType::F32)?;
    let row = (&dpf * p)?.sum_keepdim(D::Minus1)?;
    ((p * dpf.broadcast_sub(&row)?)? * scale)?.to_dtype(dp.dtype())
}

/// `(rows, t)` f32: `p = softmax(f32(T(raw·scale)) + mask)` per row; the scaling rounds once, as
/// torch's `raw * scaling` on a T tensor, the mask is added in f32, `s − max` is f32, the exps, their
/// sum and the quotient f64. A fully masked row (all `−inf`) is NaN, as the CPU op.
pub fn attn_softmax_fwd(
    scores: &[f32],
    mask: &[f32],
    t: usize,
    scale: f32,
    p: Precision,
) -> Vec<f32> {
    let t1 = t.max(1);
    let mrows = mask.len() / t1;
    assert!(mask.len() == mrows * t && mrows > 0 && scores.len().is_multiple_of(mrows * t1));
    let sc = scale;
    let mut out = Vec::with_capacity(scores.len());
    for (r, row) in scores.chunks_exact(t1).enumerate() {
        let mr = &mask[(r % mrows) * t..][..t];
        let s: Vec<f32> = row
            .iter()
            .zip(mr)
            .map(|(&a, &m)| p.round(a * sc) + m)
            .collect();
        let top = s
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        let e: Vec<f64> = s.iter().map(|&v| ((v - top) as f64).exp()).collect();
        let sum: f64 = e.iter().sum();
        out.extend(e.iter().map(|&e| (e / sum) as f32));
    }
    out
}

/// `(rows, t)`: `ds = T((p·(dp − Σ_row dp·p))·scale)`, the row sum in f64 then f32, the rest f32.
pub fn attn_softmax_bwd(probs: &[f32], dp: &[f32], t: usize, scale: f32, p: Precision) -> Vec<f32> {
    assert_eq!(probs.len(), dp.len());
    let t1 = t.max(1);
    let mut out = Vec::with_capacity(dp.len());
    for (pr, dr) in probs.chunks_exact(t1).zip(dp.chunks_exact(t1)) {
        let row = pr
            .iter()
            .zip(dr)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum::<f64>() as f32;
        out.extend(
            pr.iter()
                .zip(dr)
                .map(|(&a, &b)| p.round(a * (b - row) * scale)),
        );
    }
    out
}

/// The mask the softmax kernels are checked on (`check.rs`, `tests/kernels_emulated.rs`):
/// `(tq, tk)`, causal for the last `tq` of `tk` positions, with row `tq / 2` fully masked when
/// `tq ≥ 3` (its probabilities are NaN on both sides).
pub fn check_mask(tq: usize, tk: usize) -> Vec<f32> {
    let mut mask = vec![0f32; tq * tk];
    for i in 0..tq {
        let pos = (tk + i).saturating_sub(tq);
        for (j, m) in mask[i * tk..(i + 1) * tk].iter_mut().enumerate() {
            if j > pos || (tq >= 3 && i == tq / 2) {
                *m = f32::NEG_INFINITY;
            }
        }
    }
    mask
}
