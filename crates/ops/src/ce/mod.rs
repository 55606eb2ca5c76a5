//! Cross-entropy over the lm_head in chunks of tokens, so the full `(N, V)` logits never exist:
//! per chunk the logits, their log-sum-exp and `dlogits = softmax − onehot` (fused), and `dh`
//! accumulated through the lm_head; trainable token rows of a tied lm_head ([`HeadRows`]).
//!
//! The op's files: this one (what the model calls), `op.rs` (the candle ops of one chunk),
//! `cpu.rs` (the loops), `reference.rs` (plain formulations), `cuda.rs` (launchers of
//! `kernels/ce.cuh`), `check.rs` (for `rtune selftest`), `tests.rs`.

#[cfg(feature = "kernels")]
pub mod check;
pub(crate) mod cpu;
#[cfg(feature = "kernels")]
pub mod cuda;
pub mod op;
pub mod reference;
#[cfg(test)]
mod tests;

use candle_core::{DType, Result, Tensor};
use rtune_backend::blas::matmul as mm;

use crate::softcap::{softcap_logits, softcap_logits_backward};

pub use reference::{cross_entropy_grad_reference, cross_entropy_reference};

/// Cross-entropy over the lm_head in chunks of tokens, so the full `(N, V)` logits never exist.
///
/// `h: (N, D)` final hidden states, `w: (V, D)` the lm_head, `targets[i]` the next-token id for row
/// `i` or `None`. Returns the summed loss (f64) and `dh: (N, D)` = `d(loss_sum · grad_scale)/dh`.
/// A target `≥ V` is an error naming it (on every device: a GPU kernel would read out of bounds).
pub fn chunked_cross_entropy(
    h: &Tensor,
    w: &Tensor,
    targets: &[Option<u32>],
    grad_scale: f64,
    chunk: usize,
) -> Result<(f64, Tensor)> {
    let o = cross_entropy_impl(
        h,
        w,
        None,
        None,
        targets,
        Some(grad_scale),
        PerRow::None,
        chunk,
    )?;
    Ok((o.loss, o.dh.expect("asked for the gradient")))
}

/// [`chunked_cross_entropy`] with trainable token rows in the (tied) lm_head: the logits' columns
/// `head.ids` come from `head.rows` (`crate::tokens`), and the third value is those rows'
/// gradient `(n, D)` f32, summed over the chunks (`None` without `head`). With `softcap`
/// (Gemma 2's `final_logit_softcapping`) the loss is taken on `cap·tanh(logits/cap)`
/// ([`crate::softcap::softcap_logits`]).
#[allow(clippy::too_many_arguments)]
pub fn chunked_cross_entropy_with(
    h: &Tensor,
    w: &Tensor,
    head: Option<&HeadRows>,
    softcap: Option<f64>,
    targets: &[Option<u32>],
    grad_scale: f64,
    chunk: usize,
) -> Result<(f64, Tensor, Option<Tensor>)> {
    let o = cross_entropy_impl(
        h,
        w,
        head,
        softcap,
        targets,
        Some(grad_scale),
        PerRow::None,
        chunk,
    )?;
    Ok((o.loss, o.dh.expect("asked for the gradient"), o.drows))
}

/// [`chunked_cross_entropy`]'s summed loss alone (evaluation: no gradient is formed).
pub fn chunked_cross_entropy_loss(
    h: &Tensor,
    w: &Tensor,
    targets: &[Option<u32>],
    chunk: usize,
) -> Result<f64> {
    Ok(cross_entropy_impl(h, w, None, None, targets, None, PerRow::None, chunk)?.loss)
}

/// [`chunked_cross_entropy_loss`] with trainable token rows in the lm_head and the logits'
/// soft cap, as [`chunked_cross_entropy_with`].
pub fn chunked_cross_entropy_loss_with(
    h: &Tensor,
    w: &Tensor,
    head: Option<&HeadRows>,
    softcap: Option<f64>,
    targets: &[Option<u32>],
    chunk: usize,
) -> Result<f64> {
    Ok(cross_entropy_impl(h, w, head, softcap, targets, None, PerRow::None, chunk)?.loss)
}

/// Each row's loss rather than their sum, for objectives that are functions of per-sequence
/// log-probabilities (DPO and kin): `nll: (N,)` f32, `−log p(target)` of row `i`, 0 where
/// `targets[i]` is `None`; with `grad`, also `dh: (N, D)` = `d(Σ nll)/dh` (unit weights): a loss
/// `Σ cᵢ·nllᵢ` has `dh` = `c ⊙ dh` row by row, since row `i`'s logits depend on `h[i]` alone.
pub fn chunked_cross_entropy_rows(
    h: &Tensor,
    w: &Tensor,
    softcap: Option<f64>,
    targets: &[Option<u32>],
    grad: bool,
    chunk: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    let scale = grad.then_some(1.0);
    let o = cross_entropy_impl(h, w, None, softcap, targets, scale, PerRow::Nll, chunk)?;
    Ok((o.rows.expect("asked for the rows' losses"), o.dh))
}

/// [`chunked_cross_entropy_rows`] with each row's entropy of its softmax beside its loss:
/// `entropy: (N,)` f32, `H = lse − Σ_v softmax(z)_v·z_v` (= `−Σ p log p`, as TRL's chunked
/// log-prob head forms it), 0 where `targets[i]` is `None`. Formed chunk by chunk from the same
/// logits as the loss (one more `(n, V)` f32 temporary a chunk); no gradient flows through it.
pub fn chunked_cross_entropy_rows_entropy(
    h: &Tensor,
    w: &Tensor,
    softcap: Option<f64>,
    targets: &[Option<u32>],
    grad: bool,
    chunk: usize,
) -> Result<(Tensor, Option<Tensor>, Tensor)> {
    let scale = grad.then_some(1.0);
    let o = cross_entropy_impl(
        h,
        w,
        None,
        softcap,
        targets,
        scale,
        PerRow::NllEntropy,
        chunk,
    )?;
    let entropy = o.entropy.expect("asked for the rows' entropy");
    Ok((o.rows.expect("asked for the rows' losses"), o.dh, entropy))
}

/// What [`cross_entropy_impl`] forms per row besides the sum.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PerRow {
    None,
    Nll,
    NllEntropy,
}

/// What [`cross_entropy_impl`] formed: the summed loss, `dh` and the head rows' gradient (with a
/// `grad_scale`), each row's loss (with `per_row`).
struct CeOut {
    loss: f64,
    dh: Option<Tensor>,
    drows: Option<Tensor>,
    rows: Option<Tensor>,
    entropy: Option<Tensor>,
}

/// The first target outside `0..vocab`, as an error naming its row, its value and the vocabulary.
fn check_targets(targets: &[Option<u32>], vocab: usize) -> Result<()> {
    match targets
        .iter()
        .enumerate()
        .find_map(|(i, t)| t.filter(|&t| t as usize >= vocab).map(|t| (i, t)))
    {
        Some((row, t)) => candle_core::bail!(
            "cross-entropy: target token id {t} (row {row}) is out of range for the lm_head's \
             vocabulary of {vocab} (ids 0..{vocab}); the tokenizer and the model do not match"
        ),
        None => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
fn cross_entropy_impl(
    h: &Tensor,
    w: &Tensor,
    head: Option<&HeadRows>,
    softcap: Option<f64>,
    targets: &[Option<u32>],
    grad_scale: Option<f64>,
    per_row: PerRow,
    chunk: usize,
) -> Result<CeOut> {
    check_targets(targets, w.dim(0)?)?;
    let dev = h.device();
    // On CUDA the soft cap runs inside the cross-entropy's kernels (`ce_capped_*`: the capped
    // logits never stored); elsewhere, or with RTUNE_UNFUSED=ce_softcap, the unfused chain.
    let fused_cap = match softcap {
        Some(cap) if crate::fused::on(dev, crate::fused::Fused::CeSoftcap)? => Some(cap),
        _ => None,
    };
    let rows: Vec<u32> = (0..targets.len())
        .filter(|&i| targets[i].is_some())
        .map(|i| i as u32)
        .collect();
    // The summed loss stays on the device (f64, chunk sums added in order): one host read at the
    // end, not one sync per chunk.
    let mut loss: Option<Tensor> = None;
    let mut dparts = Vec::new();
    let mut drows: Option<Tensor> = None;
    let mut row_parts = Vec::new();
    let mut entropy_parts = Vec::new();
    let wt = w.t()?;
    for part in rows.chunks(chunk.max(1)) {
        let idx = Tensor::new(part, dev)?;
        let tgt: Vec<u32> = part
            .iter()
            .map(|&i| targets[i as usize].expect("filtered"))
            .collect();
        let tgt = Tensor::new(tgt.as_slice(), dev)?; // (n)
                                                     // (n, V) in h's dtype; then (n, 2) f32 [lse, lse − logit[target]], each row's loss second.
        let hc = h.index_select(&idx, 0)?; // (n, D)
        let mut logits = mm(&hc, &wt)?;
        if let Some(hr) = head {
            logits = hr.fix_logits(logits, &hc)?;
        }
        let stats = match (softcap, fused_cap) {
            (_, Some(cap)) => crate::ce::op::ce_capped_fwd(&logits, &tgt, cap)?,
            (Some(cap), None) => {
                logits = softcap_logits(&logits, cap)?;
                crate::ce::op::ce_fwd(&logits, &tgt)?
            }
            (None, None) => crate::ce::op::ce_fwd(&logits, &tgt)?,
        };
        let sum = stats.narrow(1, 1, 1)?.to_dtype(DType::F64)?.sum_all()?;
        if per_row == PerRow::NllEntropy {
            // H = lse − Σ_v p_v·z_v with p = exp(z − lse), in f32.
            let lse = stats.narrow(1, 0, 1)?; // (n, 1)
            let z = logits.to_dtype(DType::F32)?;
            let pz = (z.broadcast_sub(&lse)?.exp()? * &z)?.sum(1)?; // (n)
            entropy_parts.push((lse.squeeze(1)? - pz)?.contiguous()?);
        }
        if per_row != PerRow::None {
            row_parts.push(
                stats
                    .narrow(1, 1, 1)?
                    .squeeze(1)?
                    .to_dtype(DType::F32)?
                    .contiguous()?,
            );
        }
        loss = Some(match loss {
            Some(l) => (l + sum)?,
            None => sum,
        });
        let Some(scale) = grad_scale else {
            continue;
        };
        // dlogits = (softmax − onehot) · grad_scale, in h's dtype
        let lse = stats.narrow(1, 0, 1)?.squeeze(1)?;
        let dlogits = match (softcap, fused_cap) {
            (_, Some(cap)) => crate::ce::op::ce_capped_bwd(&logits, &tgt, &lse, scale, cap)?,
            // `logits` are the capped ones here.
            (Some(cap), None) => softcap_logits_backward(
                &crate::ce::op::ce_bwd(&logits, &tgt, &lse, scale)?,
                &logits,
                cap,
            )?,
            (None, None) => crate::ce::op::ce_bwd(&logits, &tgt, &lse, scale)?,
        };
        match head {
            None => dparts.push(mm(&dlogits, w)?), // (n, D)
            Some(hr) => {
                let (dh, dr) = hr.backward(&dlogits, &hc, w)?;
                dparts.push(dh);
                drows = Some(match drows {
                    Some(prev) => (prev + dr)?,
                    None => dr,
                });
            }
        }
    }
    // Rows of a tied lm_head with no target in the batch still have a zero gradient.
    if let (Some(hr), Some(_), None) = (head, grad_scale, &drows) {
        drows = Some(Tensor::zeros(
            (hr.ids.dim(0)?, h.dim(1)?),
            DType::F32,
            h.device(),
        )?);
    }
    // dh: the rows with a target from their chunks, zero elsewhere; one scatter at the end rather
    // than a copy of the whole (N, D) gradient per chunk.
    let dh = match grad_scale {
        Some(_) if dparts.is_empty() => Some(h.zeros_like()?),
        Some(_) => {
            let idx = Tensor::new(rows.as_slice(), dev)?;
            Some(
                h.zeros_like()?
                    .index_add(&idx, &Tensor::cat(&dparts, 0)?, 0)?,
            )
        }
        None => None,
    };
    let loss = match loss {
        Some(l) => l.to_scalar::<f64>()?,
        None => 0.0,
    };
    // Each row's loss (and entropy) in its place (N,), zero where there is no target.
    let place = |parts: &[Tensor]| -> Result<Tensor> {
        let all = Tensor::zeros(targets.len(), DType::F32, dev)?;
        match parts.is_empty() {
            true => Ok(all),
            false => {
                let idx = Tensor::new(rows.as_slice(), dev)?;
                all.index_add(&idx, &Tensor::cat(parts, 0)?.contiguous()?, 0)
            }
        }
    };
    let entropy = match per_row {
        PerRow::NllEntropy => Some(place(&entropy_parts)?),
        _ => None,
    };
    let rows = match per_row {
        PerRow::None => None,
        _ => Some(place(&row_parts)?),
    };
    Ok(CeOut {
        loss,
        dh,
        drows,
        rows,
        entropy,
    })
}

/// The trained rows as the tied lm_head sees them: `ids: (n,)` u32 and `rows: (n, D)` in the
/// compute dtype (the lm_head's).
pub struct HeadRows {
    pub ids: Tensor,
    pub rows: Tensor,
}

impl HeadRows {
    /// `ids` with their `rows` (f32 master copy) cast to `dtype`.
    pub fn new(ids: &[u32], rows: &Tensor, dtype: DType) -> Result<Self> {
        Ok(Self {
            ids: Tensor::new(ids, rows.device())?,
            rows: rows.to_dtype(dtype)?,
        })
    }

    /// `(c, n)` u32: every row of a `(c, V)` block pointing at the columns `ids`.
    fn column_index(&self, c: usize) -> Result<Tensor> {
        let n = self.ids.dim(0)?;
        self.ids.unsqueeze(0)?.broadcast_as((c, n))?.contiguous()
    }

    /// Logits `(c, V) = h·Wᵀ` with the columns `ids` replaced by `h·rowsᵀ`: `h·W'ᵀ` exactly as
    /// PEFT's `F.linear(h, W')` forms them (same products, same dtype).
    pub fn fix_logits(&self, logits: Tensor, h: &Tensor) -> Result<Tensor> {
        let cols = mm(h, &self.rows.t()?)?.to_dtype(logits.dtype())?; // (c, n)
        let idx = self.column_index(logits.dim(0)?)?;
        logits.scatter(&idx, &cols, 1)
    }

    /// The backward of [`fix_logits`](Self::fix_logits) for `dlogits: (c, V)`: returns
    /// `dh = dlogits·W'` `(c, D)` (the columns `ids` through `rows`, the others through `w`) and
    /// the rows' gradient `dlogits[:, ids]ᵀ·h` `(n, D)` f32.
    pub fn backward(&self, dlogits: &Tensor, h: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
        let sel = dlogits.index_select(&self.ids, 1)?; // (c, n)
        let drows = mm(&sel.t()?.contiguous()?, h)?.to_dtype(DType::F32)?; // (n, D)
        let c = dlogits.dim(0)?;
        let zeros = Tensor::zeros((c, self.ids.dim(0)?), dlogits.dtype(), dlogits.device())?;
        let rest = dlogits.scatter(&self.column_index(c)?, &zeros, 1)?;
        let dh = (mm(&rest, w)? + mm(&sel, &self.rows)?)?;
        Ok((dh, drows))
    }
}
