//! Trainable tokens (PEFT 0.21.2's `LoraConfig(trainable_token_indices=…)`,
//! `peft/tuners/trainable_tokens/layer.py`): a few rows of the input embedding train, the rest stay
//! frozen. PEFT keeps the rows themselves (`trainable_tokens_delta`, initialised to a copy of the
//! embedding's rows) and forms `W' = W.index_copy(0, ids, rows)` for each forward; when the
//! lm_head is tied to the embedding, PEFT wraps it with the same rows (`tied_adapter`), so the
//! logits use `W'` too and both uses add to the rows' gradient. An untied lm_head is not adapted.
//!
//! Here `W'` is never formed: the embedding's gathered `(N, D)` rows get the trained rows
//! scattered over the positions holding a trainable id (exact, no arithmetic), and the fused
//! cross-entropy (`ops::chunked_cross_entropy_with`) overwrites the logits' columns `ids` with
//! `h·rowsᵀ` chunk by chunk and forms the rows' lm_head gradient `dlogits[:, ids]ᵀ·h` from each
//! chunk — the full `(V, D)` gradient never exists.
//!
//! Gradients: embedding `d rows[k] = Σ_{p: id_p = ids[k]} dx[p]` (the gather's backward, an
//! index_add); lm_head `d rows = Σ_chunks dlogits[:, ids]ᵀ · h`, `(n, c)·(c, D)`.

use candle_core::{DType, Result, Tensor};

/// The positions of a batch whose input id is a trainable token, and which row each takes.
pub(crate) struct TokenHits {
    /// `(m,)` u32: positions into the flattened `(N,)` batch.
    pos: Tensor,
    /// `(m,)` u32: the trainable row of each position.
    which: Tensor,
}

/// The batch positions whose id is in `tokens` (`None` when none is).
pub(crate) fn hits(
    input_ids: &[u32],
    tokens: &[u32],
    dev: &candle_core::Device,
) -> Result<Option<TokenHits>> {
    let (pos, which): (Vec<u32>, Vec<u32>) = input_ids
        .iter()
        .enumerate()
        .filter_map(|(p, id)| {
            tokens
                .iter()
                .position(|t| t == id)
                .map(|k| (p as u32, k as u32))
        })
        .unzip();
    if pos.is_empty() {
        return Ok(None);
    }
    Ok(Some(TokenHits {
        pos: Tensor::new(pos.as_slice(), dev)?,
        which: Tensor::new(which.as_slice(), dev)?,
    }))
}

/// The embedding's gathered rows `x: (N, D)` with each hit position's row replaced by its trained
/// row (`rows: (n, D)` f32, cast to `x`'s dtype as PEFT's `.to(W)`).
pub(crate) fn embed(x: &Tensor, hits: &TokenHits, rows: &Tensor) -> Result<Tensor> {
    let d = x.dim(1)?;
    let src = rows.index_select(&hits.which, 0)?.to_dtype(x.dtype())?; // (m, D)
    let m = src.dim(0)?;
    let idx = hits.pos.unsqueeze(1)?.broadcast_as((m, d))?.contiguous()?; // (m, D): row p of x for every column
    x.scatter(&idx, &src, 0)
}

/// The rows' gradient from the embedding side: `dx: (N, D)` the gradient of the embedding output;
/// returns `(n, D)` f32 (rows without a hit stay 0).
pub(crate) fn embed_backward(dx: &Tensor, hits: &TokenHits, n: usize) -> Result<Tensor> {
    let picked = dx.index_select(&hits.pos, 0)?.to_dtype(DType::F32)?; // (m, D)
    Tensor::zeros((n, dx.dim(1)?), DType::F32, dx.device())?.index_add(&hits.which, &picked, 0)
}

#[cfg(test)]
mod tests;
