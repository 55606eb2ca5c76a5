//! Decoding with a key/value cache, for generation and for sampling inside training (GRPO): the
//! prompts run once, then each new token attends to the cached rotated keys and values of
//! everything before it. There is no forward here: each layer runs its own
//! ([`crate::layer::Layer::forward_cached`], the training forward in its cached mode), so every
//! family flag applies as in training. Inference only (no backward, no dropout).
//!
//! Rows are decoded together. Prompts of unequal lengths are left-padded to one length: a row's
//! padding slots come first in its cache and no query of the row ever sees them
//! ([`rtune_ops::AttnMask::after`]); its tokens' positions start at 0 after its padding, so each
//! row computes what it would alone. After the first call every row takes the same number of new
//! tokens a call (one, when sampling); rows that are done are dropped, and a prompt's cache is
//! repeated for its group of completions, by [`KvCache::select_rows`].

use candle_core::{DType, Tensor};

use super::Model;
use crate::layer::LayerKv;
use crate::linear::LoraCtx;
use crate::{ModelError, Result};
use rtune_ops as ops;

/// The rotated keys and values of every layer for the tokens seen so far, `B` rows of `S` slots:
/// each layer's `(B, Hkv, S, Dh)`. Row `r`'s first `first[r]` slots are its left padding.
#[derive(Default)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    first: Vec<usize>,
    len: usize,
}

impl KvCache {
    /// Slots `S` a row (padding included): the keys each new query sees at most.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows `B`.
    pub fn rows(&self) -> usize {
        self.first.len()
    }

    /// Tokens row `r` has seen (its slots less its padding).
    pub fn tokens(&self, r: usize) -> usize {
        self.len - self.first[r]
    }

    /// Keeps the rows `rows`, in that order (a row may be named more than once): drop the rows
    /// that are done, or repeat a prompt's row for each completion of its group. Padding slots
    /// that no kept row has tokens in are cut. An empty `rows` empties the cache.
    pub fn select_rows(&mut self, rows: &[usize]) -> Result<()> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= self.rows()) {
            return Err(ModelError::candle(
                "KvCache::select_rows",
                candle_core::Error::Msg(format!("row {bad} of a cache of {} rows", self.rows())),
            ));
        }
        if rows.is_empty() {
            *self = KvCache::default();
            return Ok(());
        }
        let first: Vec<usize> = rows.iter().map(|&r| self.first[r]).collect();
        let cut = first.iter().copied().min().unwrap_or(0);
        let run = || -> candle_core::Result<Vec<LayerKv>> {
            let dev = self.layers[0].0.device();
            let idx = Tensor::from_vec(
                rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
                rows.len(),
                dev,
            )?;
            // (B, Hkv, S, Dh) -> (B', Hkv, S − cut, Dh)
            let pick = |t: &Tensor| {
                t.index_select(&idx, 0)?
                    .narrow(2, cut, self.len - cut)?
                    .contiguous()
            };
            self.layers
                .iter()
                .map(|(k, v)| Ok((pick(k)?, pick(v)?)))
                .collect()
        };
        self.layers = run().map_err(|e| ModelError::candle("KvCache::select_rows", e))?;
        self.first = first.iter().map(|f| f - cut).collect();
        self.len -= cut;
        Ok(())
    }
}

/// One completion of [`Model::complete_rows`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Completion {
    /// The new tokens, the stop token not included.
    pub tokens: Vec<u32>,
    /// Ended by a stop token (`false`: cut at the most new tokens).
    pub stopped: bool,
}

impl Model {
    /// Completes every prompt `group` times, all rows decoded together: each prompt runs once
    /// and its cache is repeated for its `group` completions (completion `p·group + g` is prompt
    /// `p`'s `g`-th: a group's completions consecutive). At each step `pick(c, logits)` chooses
    /// completion `c`'s next token from its last token's logits (`(V)` f32), for the unfinished
    /// completions in increasing `c` (a seeded sampler draws in one order: reproducible); a
    /// completion ends at a token of `stop` or after `max_new` tokens, and its row leaves the
    /// batch.
    pub fn complete_rows(
        &self,
        prompts: &[Vec<u32>],
        group: usize,
        max_new: usize,
        stop: &[u32],
        lora: Option<&LoraCtx>,
        pick: &mut dyn FnMut(usize, &[f32]) -> u32,
    ) -> Result<Vec<Completion>> {
        let mut out = vec![Completion::default(); prompts.len() * group];
        if out.is_empty() || max_new == 0 {
            return Ok(out);
        }
        let host = |t: Tensor| {
            t.to_vec2::<f32>()
                .map_err(|e| ModelError::candle("decode: logits to host", e))
        };
        let mut cache = KvCache::default();
        let first = host(self.decode_rows(prompts, &mut cache, lora)?)?;
        // Row c of the batch is completion c until rows leave: `live[row]` is its completion.
        let mut live: Vec<usize> = (0..out.len()).collect();
        let rows: Vec<usize> = live.iter().map(|c| c / group).collect();
        cache.select_rows(&rows)?;
        let mut logits: Vec<Vec<f32>> = rows.iter().map(|&p| first[p].clone()).collect();
        loop {
            let (mut keep, mut next) = (Vec::new(), Vec::new());
            for (row, &c) in live.iter().enumerate() {
                let t = pick(c, &logits[row]);
                if stop.contains(&t) {
                    out[c].stopped = true;
                    continue;
                }
                out[c].tokens.push(t);
                if out[c].tokens.len() < max_new {
                    keep.push(row);
                    next.push([t]);
                }
            }
            if keep.is_empty() {
                return Ok(out);
            }
            if keep.len() < live.len() {
                cache.select_rows(&keep)?;
                live = keep.iter().map(|&r| live[r]).collect();
            }
            logits = host(self.decode_rows(&next, &mut cache, lora)?)?;
        }
    }

    /// Runs `ids` (the next tokens of one row) through the model with `cache`, extends the
    /// cache, and returns the logits of the last token: `(V)`, f32. [`Model::decode_rows`] of
    /// one row.
    pub fn decode(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        lora: Option<&LoraCtx>,
    ) -> Result<Tensor> {
        self.decode_rows(&[ids], cache, lora)?
            .squeeze(0)
            .map_err(|e| ModelError::candle("decode", e))
    }

    /// Runs the next tokens of every row (`rows[r]` row `r`'s) through the model with `cache`,
    /// extends the cache, and returns the logits of each row's last token: `(B, V)`, f32. On an
    /// empty cache the rows may differ in length (each is left-padded to the longest, see the
    /// module's notes); after that every row gives the same number of tokens, one row per row of
    /// the cache. No row may be empty.
    pub fn decode_rows<R: AsRef<[u32]>>(
        &self,
        rows: &[R],
        cache: &mut KvCache,
        lora: Option<&LoraCtx>,
    ) -> Result<Tensor> {
        let lens: Vec<usize> = rows.iter().map(|r| r.as_ref().len()).collect();
        let n = lens.iter().copied().max().unwrap_or(0);
        let fresh = cache.is_empty();
        let refuse = |why: String| Err(ModelError::candle("decode", candle_core::Error::Msg(why)));
        if lens.is_empty() || lens.contains(&0) {
            return refuse(format!(
                "rows of new tokens {lens:?}: each row needs one at least"
            ));
        }
        if !fresh && (lens.len() != cache.rows() || lens.iter().any(|&l| l != n)) {
            return refuse(format!(
                "rows of new tokens {lens:?} after a cache of {} rows: one row of the same \
                 number of tokens for each",
                cache.rows()
            ));
        }
        let _autocast = rtune_backend::blas::autocast::scope(self.autocast);
        let (b, past, d) = (lens.len(), cache.len, self.cfg.hidden_size);
        let first: Vec<usize> = match fresh {
            true => lens.iter().map(|l| n - l).collect(),
            false => cache.first.clone(),
        };
        let run = || -> candle_core::Result<(Tensor, Vec<LayerKv>)> {
            // (B, n), row-major: padding (id 0, never seen) then the row's tokens.
            let mut ids = Vec::with_capacity(b * n);
            for (r, row) in rows.iter().enumerate() {
                ids.extend(std::iter::repeat_n(0, n - lens[r]));
                ids.extend_from_slice(row.as_ref());
            }
            // A token's position counts the row's tokens before it; padding at 0. LongRoPE
            // picks its factors from these positions, as transformers does for the new tokens
            // of a cached step.
            let positions: Vec<u32> = first
                .iter()
                .flat_map(|&f| (past..past + n).map(move |s| s.saturating_sub(f) as u32))
                .collect();
            let mask_of = |w| ops::AttnMask::after(past, &first, n, w, &self.device);
            let ctx = self.ctx_with(b, n, &positions, past + n, mask_of)?;
            let mut x = self.embed_tokens(&ids, lora)?.0;
            let mut next = Vec::with_capacity(self.layers.len());
            let mut feed = self.feed(0..self.layers.len(), Vec::new());
            while let Some((i, layer)) = feed.next()? {
                let (out, kv) = layer.forward_cached(&x, &ctx, lora, cache.layers.get(i))?;
                next.push(kv);
                x = out;
            }
            // (B·n, D) -> each row's last token, (B, D)
            let last = x.reshape((b, n, d))?.narrow(1, n - 1, 1)?.reshape((b, d))?;
            let (h, _) = self.final_norm(&last)?;
            let head = self.head_rows(lora)?;
            let logits = self.lm_logits(&h, head.as_ref())?.to_dtype(DType::F32)?;
            Ok((logits, next))
        };
        let (logits, next) = run().map_err(|e| ModelError::candle("decode", e))?;
        cache.layers = next;
        cache.first = first;
        cache.len = past + n;
        Ok(logits)
    }
}

#[cfg(test)]
mod tests;
