//! Incremental decoding with a key/value cache, for generation: the prompt is run once, then each new
//! token attends to the cached rotated keys and values of everything before it. Inference only (no
//! backward, no dropout). Checked against the full forward in `tests` below.

use candle_core::{DType, IndexOp, Tensor, D};

use super::Model;
use crate::layer::Layer;
use crate::linear::LoraCtx;
use crate::{ModelError, Result};
use rtune_ops as ops;

/// Rotated keys and values of every layer for the tokens seen so far: each `(1, Hkv, len, Dh)`.
#[derive(Default)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
}

impl KvCache {
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What the new tokens of one decoding step share across layers.
struct StepCtx<'a> {
    /// `(1, 1, n, Dh)`
    cos: &'a Tensor,
    sin: &'a Tensor,
    /// `(1, 1, 1, n, start + n)`
    mask: &'a Tensor,
    /// `(heads, kv_heads, head_dim)`
    shape: (usize, usize, usize),
    /// Scores' scale and soft cap ([`ops::AttnShape`]'s).
    scale: f64,
    softcap: Option<f64>,
}

impl Layer {
    /// `x: (n, D)` for `n` new tokens at positions `start..`; returns the output and the layer's
    /// keys/values with the new ones appended.
    fn decode(
        &self,
        x: &Tensor,
        st: &StepCtx,
        kv: Option<&(Tensor, Tensor)>,
        lora: Option<&LoraCtx>,
    ) -> candle_core::Result<(Tensor, (Tensor, Tensor))> {
        let (cos, sin, mask) = (st.cos, st.sin, st.mask);
        let (h, hkv, dh) = st.shape;
        let (n, g) = (x.dim(0)?, h / hkv);
        let (h1, _) = self.sandwich_norm(x.clone(), self.input_norm.as_ref())?;
        let (q, k, v) = self.project_qkv(&h1, lora)?;
        let (q, k, _) = self.norm_qk(q, k)?;
        // (n, H·Dh) -> (1, H, n, Dh)
        let q = q.reshape((1, n, h, dh))?.transpose(1, 2)?.contiguous()?;
        let k = k.reshape((1, n, hkv, dh))?.transpose(1, 2)?.contiguous()?;
        let v = v.reshape((1, n, hkv, dh))?.transpose(1, 2)?.contiguous()?;
        let q = rtune_ops::rope::apply(&q, cos, sin)?.reshape((1, hkv, g * n, dh))?;
        let k = rtune_ops::rope::apply(&k, cos, sin)?;
        let (k, v) = match kv {
            Some((ck, cv)) => (Tensor::cat(&[ck, &k], 2)?, Tensor::cat(&[cv, &v], 2)?),
            None => (k, v),
        };
        let total = k.dim(2)?;
        let scores = (q.matmul(&k.t()?)? * st.scale)?.to_dtype(DType::F32)?;
        let scores = match st.softcap {
            Some(cap) => ((scores / cap)?.tanh()? * cap)?,
            None => scores,
        };
        let scores = scores
            .reshape((1, hkv, g, n, total))?
            .broadcast_add(mask)?
            .reshape((1, hkv, g * n, total))?;
        let max = scores.max_keepdim(D::Minus1)?;
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let o = p.to_dtype(x.dtype())?.matmul(&v)?;
        let o = o
            .reshape((1, h, n, dh))?
            .transpose(1, 2)?
            .reshape((n, h * dh))?;
        let sandwich = self.sandwich.as_ref();
        let a = self.o.forward(&o, lora, 0)?.0;
        let a = self.sandwich_post(a, sandwich.map(|s| &s.0))?;
        let hdn = (x + a)?;
        let (h2, _) = self.sandwich_norm(hdn.clone(), self.post_norm.as_ref())?;
        let (g, u) = self.project_gate_up(&h2, lora)?;
        let m = self.act(&g, &u)?;
        let d = self.down.forward(&m, lora, 0)?.0;
        let out = (hdn + self.sandwich_post(d, sandwich.map(|s| &s.1))?)?;
        Ok((out, (k, v)))
    }

    /// A sandwich norm's output (`x` as given without one).
    fn sandwich_post(&self, x: Tensor, w: Option<&Tensor>) -> candle_core::Result<Tensor> {
        match w {
            Some(w) => Ok(self.norm(&x, w)?.0),
            None => Ok(x),
        }
    }
}

impl Model {
    /// Runs `ids` (the next tokens) through the model with `cache`, extends the cache, and returns
    /// the logits of the last token: `(V)`, f32.
    pub fn decode(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        lora: Option<&LoraCtx>,
    ) -> Result<Tensor> {
        let _autocast = rtune_backend::blas::autocast::scope(self.autocast);
        let mut run = || -> candle_core::Result<Tensor> {
            let (n, start) = (ids.len(), cache.len);
            let positions: Vec<u32> = (start..start + n).map(|p| p as u32).collect();
            // LongRoPE picks its factors from these positions, as transformers does for the
            // new tokens of a cached step.
            let tables =
                |f: &crate::rope::Freqs| f.tables(&positions, 1, n, self.dtype, &self.device);
            let (cos, sin) = tables(&self.rope)?;
            let local = self.local_rope.as_ref().map(tables).transpose()?;
            let full = ops::causal_mask_from(n, start, None, &self.device)?;
            let sliding = match self.cfg.sliding_window {
                Some(w) if w < start + n => {
                    Some(ops::causal_mask_from(n, start, Some(w), &self.device)?)
                }
                _ => None,
            };
            let shape = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
            let attn = self.attn_shape(1, n);
            let mut x = self.embed_tokens(ids, lora)?.0;
            let mut next = Vec::with_capacity(self.layers.len());
            let mut feed = self.feed(0..self.layers.len(), Vec::new());
            while let Some((i, layer)) = feed.next()? {
                let m = match (&sliding, layer.sliding) {
                    (Some(s), true) => s,
                    _ => &full,
                };
                let (cos, sin) = match (&local, layer.sliding) {
                    (Some((c, s)), true) => (c, s),
                    _ => (&cos, &sin),
                };
                let st = StepCtx {
                    cos,
                    sin,
                    mask: m,
                    shape,
                    scale: attn.scale,
                    softcap: attn.softcap,
                };
                let (out, kv) = layer.decode(&x, &st, cache.layers.get(i), lora)?;
                next.push(kv);
                x = out;
            }
            let (h, _) = self.final_norm(&x.i(n - 1..n)?)?;
            let head = self.head_rows(lora)?;
            let logits = self.lm_logits(&h, head.as_ref())?.to_dtype(DType::F32)?;
            cache.layers = next;
            cache.len = start + n;
            logits.squeeze(0)
        };
        run().map_err(|e| ModelError::candle("decode", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Inputs;
    use candle_core::Device;
    use std::path::Path;

    fn max_abs(t: &Tensor) -> f32 {
        t.abs()
            .and_then(|a| a.max_all())
            .and_then(|m| m.to_scalar::<f32>())
            .unwrap()
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
    }

    /// Prefill then one token at a time gives the full forward's last-position logits, including
    /// across a sliding window (tiny-mistral: window 5, 12 tokens), with Qwen3's q/k norms and
    /// Gemma's sandwich norms, GeGLU, soft caps (Gemma 2) and local RoPE (Gemma 3), and Phi-3's
    /// fused projections and Phi-4-mini's partial rotary.
    #[test]
    fn cached_decoding_equals_the_full_forward() {
        for name in [
            "tiny-llama3",
            "tiny-mistral",
            "tiny-qwen2",
            "tiny-qwen3",
            "tiny-gemma2",
            "tiny-gemma3",
            "tiny-phi3",
            "tiny-phi4",
        ] {
            let model = Model::load(&fixture(name), DType::F32, &Device::Cpu).unwrap();
            // tiny-phi4 (partial rotary, LongRoPE): within LongRoPE's original length of 8,
            // where the short factors hold for every position (past it transformers switches
            // the whole sequence to the long factors, which a cache of rotated keys cannot).
            let n = if name == "tiny-phi4" { 8 } else { 12 };
            let ids: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 5) % 200 + 3).collect();
            let mut cache = KvCache::default();
            let mut got = vec![model.decode(&ids[..4], &mut cache, None).unwrap()];
            for t in 4..n {
                got.push(model.decode(&ids[t..t + 1], &mut cache, None).unwrap());
            }
            assert_eq!(cache.len(), n);
            for (k, g) in got.iter().enumerate() {
                let t = 3 + k; // last position seen by this call
                let full = model
                    .forward(&Inputs::new(ids[..=t].to_vec(), 1, t + 1), None, false)
                    .unwrap();
                let want = full.logits.i((0, t)).unwrap();
                let err = max_abs(&(g - &want).unwrap());
                let scale = max_abs(&want);
                // Same ops on the same values in another grouping of the matmuls: f32 rounding only.
                assert!(err <= 1e-5 * scale, "{name} position {t}: {err} vs {scale}");
            }
        }
    }
}
