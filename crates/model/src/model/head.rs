//! The model's head: the training pass's loss under a [`HeadLoss`] (next-token cross-entropy,
//! or a per-token weighting for the preference objectives), every position's NLL, the validation
//! loss, and the chunking of the logits they share.

use candle_core::Tensor;

use super::{HeadLoss, Inputs, Model};
use crate::linear::{Grads, LoraCtx};
use crate::{ModelError, Result};
use rtune_ops as ops;

impl Model {
    /// The training head: the loss of the final hidden states `h: (N, D)` under `objective` and
    /// its gradient `dh: (N, D)` (trainable token rows' gradient added to `grads`).
    pub(super) fn head_loss(
        &self,
        h: &Tensor,
        targets: &[Option<u32>],
        lora: &LoraCtx,
        objective: &mut HeadLoss,
        grads: &mut Grads,
    ) -> candle_core::Result<(f64, Tensor)> {
        let softcap = self.cfg.variant.final_softcap;
        let head = self.head_rows(Some(lora))?;
        let lm_head = self.lm_head()?;
        let (weigh, temperature) = match objective {
            HeadLoss::Tokens { grad_scale } => {
                let (loss, dh, head_grad) = ops::chunked_cross_entropy_with(
                    h,
                    &lm_head,
                    head.as_ref(),
                    softcap,
                    targets,
                    *grad_scale,
                    self.ce_chunk(),
                )?;
                if let Some(g) = head_grad {
                    Grads::add(&mut grads.tokens, g)?;
                }
                return Ok((loss, dh));
            }
            HeadLoss::PerToken { weigh, .. } => (Weigh::Plain(weigh), 1.0),
            HeadLoss::Tempered {
                temperature, weigh, ..
            } => (Weigh::Tempered(weigh), *temperature),
        };
        if head.is_some() {
            candle_core::bail!(
                "a per-sequence objective (preference training) with trainable token rows in a tied \
                 lm_head is not supported yet"
            );
        }
        // z / T = (h / T)·Wᵀ without a soft cap: the rows scaled instead of the logits, and the
        // gradient with respect to h is 1/T times the one with respect to h / T.
        let hs = tempered(h, temperature, softcap)?;
        let chunk = self.ce_chunk();
        let (loss, weights, dh) = match weigh {
            Weigh::Plain(weigh) => {
                let (nll, dh) =
                    ops::chunked_cross_entropy_rows(&hs, &lm_head, softcap, targets, true, chunk)?;
                let (loss, weights) = weigh(&nll.to_vec1::<f32>()?)?;
                (loss, weights, dh)
            }
            Weigh::Tempered(weigh) => {
                let (nll, dh, entropy) = ops::chunked_cross_entropy_rows_entropy(
                    &hs, &lm_head, softcap, targets, true, chunk,
                )?;
                let (loss, weights) = weigh(&nll.to_vec1::<f32>()?, &entropy.to_vec1::<f32>()?)?;
                (loss, weights, dh)
            }
        };
        if weights.len() != targets.len() {
            candle_core::bail!(
                "objective: {} weights for {} positions",
                weights.len(),
                targets.len()
            );
        }
        // d(Σ cᵢ·nllᵢ)/dh = c ⊙ d(Σ nllᵢ)/dh row by row (row i's logits depend on h[i] alone).
        let inv_t = (1.0 / temperature) as f32;
        let weights: Vec<f32> = weights.iter().map(|w| w * inv_t).collect();
        let c = Tensor::new(weights.as_slice(), h.device())?
            .to_dtype(h.dtype())?
            .unsqueeze(1)?;
        let dh = dh.expect("asked for the gradient").broadcast_mul(&c)?;
        Ok((loss, dh))
    }

    /// Every position's next-token NLL `−log p(target)` (0 where `targets[i]` is `None`), no
    /// gradient: the preference objectives' reference pass (`lora: None`, the base alone) and
    /// their evaluation. Layer by layer, as [`eval_loss`](Self::eval_loss).
    pub fn token_nll(
        &self,
        inp: &Inputs,
        targets: &[Option<u32>],
        lora: Option<&LoraCtx>,
    ) -> Result<Vec<f32>> {
        self.token_nll_at(inp, targets, lora, 1.0)
    }

    /// [`token_nll`](Self::token_nll) of the logits divided by `temperature` (GRPO's old and
    /// reference log-probabilities, as TRL forms them).
    pub fn token_nll_at(
        &self,
        inp: &Inputs,
        targets: &[Option<u32>],
        lora: Option<&LoraCtx>,
        temperature: f64,
    ) -> Result<Vec<f32>> {
        let _autocast = rtune_backend::blas::autocast::scope(self.autocast);
        let run = || -> candle_core::Result<Vec<f32>> {
            let ctx = self.batch_ctx(inp)?;
            let mut x = self.embed_tokens(&inp.ids, lora)?.0;
            let mut feed = self.feed(0..self.layers.len(), Vec::new());
            while let Some((_, layer)) = feed.next()? {
                x = layer.forward(&x, &ctx, lora)?.0;
            }
            let (h, _) = self.final_norm(&x)?;
            if self.head_rows(lora)?.is_some() {
                candle_core::bail!(
                    "per-position losses with trainable token rows in a tied lm_head are not \
                     supported yet"
                );
            }
            let softcap = self.cfg.variant.final_softcap;
            let h = tempered(&h, temperature, softcap)?;
            let (nll, _) = ops::chunked_cross_entropy_rows(
                &h,
                &*self.lm_head()?,
                softcap,
                targets,
                false,
                self.ce_chunk(),
            )?;
            nll.to_vec1::<f32>()
        };
        run().map_err(|e| ModelError::candle("token_nll", e))
    }

    /// Summed next-token loss of a batch, no gradient (validation). Layer by layer, so only one
    /// layer's activations exist at a time.
    pub fn eval_loss(
        &self,
        inp: &Inputs,
        targets: &[Option<u32>],
        lora: Option<&LoraCtx>,
    ) -> Result<f64> {
        let _autocast = rtune_backend::blas::autocast::scope(self.autocast);
        let run = || -> candle_core::Result<f64> {
            let ctx = self.batch_ctx(inp)?;
            let mut x = self.embed_tokens(&inp.ids, lora)?.0;
            let mut feed = self.feed(0..self.layers.len(), Vec::new());
            let mut router_logits = Vec::new();
            let mut logits_dtype = candle_core::DType::F32;
            while let Some((_, layer)) = feed.next()? {
                let (out, mut cache) = layer.forward(&x, &ctx, lora)?;
                if let Some(m) = cache.moe_mut() {
                    router_logits.push(std::mem::take(&mut m.logits));
                    logits_dtype = m.logits_dtype;
                }
                x = out;
            }
            // transformers adds the load-balancing term to an evaluation's loss too.
            let n_targets = targets.iter().filter(|t| t.is_some()).count() as f64;
            let aux = self
                .aux_loss(
                    &router_logits,
                    logits_dtype,
                    inp.real_tokens().as_deref(),
                    0.0,
                    n_targets,
                )
                .map_or(0.0, |(_, term, _)| term);
            let (h, _) = self.final_norm(&x)?;
            let head = self.head_rows(lora)?;
            let ce = ops::chunked_cross_entropy_loss_with(
                &h,
                &*self.lm_head()?,
                head.as_ref(),
                self.cfg.variant.final_softcap,
                targets,
                self.ce_chunk(),
            )?;
            Ok(ce + aux)
        };
        run().map_err(|e| ModelError::candle("eval_loss", e))
    }

    /// `h·lm_headᵀ` for inference; under autocast through [`rtune_backend::blas::matmul`] (a bf16 head
    /// times f32 rows), otherwise candle's matmul as always.
    pub(super) fn head(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let lm_head = self.lm_head()?;
        if self.autocast {
            rtune_backend::blas::matmul(h, &lm_head.t()?)
        } else {
            h.matmul(&lm_head.t()?)
        }
    }

    /// Rows of the logits formed at once by the cross-entropy.
    ///
    /// CPU: 6 Mi f32 logits (24 MiB) a chunk, below glibc's largest mmap threshold, so the buffer is
    /// reused from the heap instead of faulted in fresh every chunk. GPU: 1024 rows, so a step
    /// reads the lm_head a few times rather than once per ~50 rows (seq 2048: 2 chunks), while the
    /// logits and their gradient stay transient (1024 × 128256 bf16: 263 MB each).
    pub(super) fn ce_chunk(&self) -> usize {
        if self.device.is_cpu() {
            ((6usize << 20) / self.cfg.vocab_size).clamp(16, 4096)
        } else {
            1024
        }
    }
}

/// The per-token function of a [`HeadLoss::PerToken`] or [`HeadLoss::Tempered`] head.
enum Weigh<'a, 'b> {
    Plain(&'b mut super::PerTokenLoss<'a>),
    Tempered(&'b mut super::TemperedLoss<'a>),
}

/// `h / T` for the logits `z / T` (`h` itself at T = 1). A soft cap sits between `h·Wᵀ` and the
/// division, so scaling the rows would not equal it: refused there.
fn tempered(h: &Tensor, temperature: f64, softcap: Option<f64>) -> candle_core::Result<Tensor> {
    if temperature == 1.0 {
        return Ok(h.clone());
    }
    if softcap.is_some() {
        candle_core::bail!(
            "log-probabilities at temperature {temperature} with a final logit soft cap are not \
             supported yet (set temperature = 1.0)"
        );
    }
    h.affine(1.0 / temperature, 0.0)
}

#[cfg(test)]
mod tests;
