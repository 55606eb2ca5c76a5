//! One Llama decoder layer, pre-norm:
//! `h = x + o_proj(attn(rope(q(n1)), rope(k(n1)), v(n1)))`, `out = h + down(silu(gate(n2))·up(n2))`
//! with `n1 = rmsnorm(x)`, `n2 = rmsnorm(h)`. Its backward needs only the layer input and the
//! [`LayerCache`] that [`Layer::forward`] returns, so a layer can be recomputed from its input alone
//! (gradient checkpointing: [`Layer::recompute`], which skips what the backward does not need —
//! the down projection's frozen product, the last residual add, and with the tiled attention's
//! kept output and log-sum-exp the attention itself).

use candle_core::{Result, Tensor};

use crate::group;
use crate::linear::{Grads, Linear, LinearCache, LoraCtx};
use rtune_ops::{self as ops, AttnCache, AttnMask, AttnPath, AttnShape, KeptAttn, NormCache};

#[derive(Debug, Clone)]
pub struct Layer {
    pub index: usize,
    pub input_norm: Tensor,
    pub post_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    /// Qwen3's per-head RMSNorm weights `(Dh)` on q and on k, applied before RoPE
    /// ([`crate::Variant::qk_norm`]); frozen.
    pub qk_norm: Option<(Tensor, Tensor)>,
    pub eps: f64,
    /// Uses the sliding-window mask (when the batch is longer than the window).
    pub sliding: bool,
    /// `[Wq; Wk; Wv]` and `[Wgate; Wup]` when dense: one GEMM each (see [`crate::group`]); the
    /// members' weights are then row views of these blocks.
    pub qkv: Option<Tensor>,
    pub gate_up: Option<Tensor>,
}

/// Everything the backward of one layer needs (the activations of that layer only).
pub struct LayerCache {
    n1: NormCache,
    h1: Tensor,
    cq: LinearCache,
    ck: LinearCache,
    cv: LinearCache,
    /// The q/k norms' inputs (`(N, H, Dh)`, `(N, Hkv, Dh)`) when the layer has them.
    qk: Option<(NormCache, NormCache)>,
    attn: AttnCache,
    o_in: Tensor,
    co: LinearCache,
    n2: NormCache,
    h2: Tensor,
    g: Tensor,
    u: Tensor,
    cg: LinearCache,
    cu: LinearCache,
    /// `silu(g)·u`, the down projection's input: `None` after a full forward, where the backward
    /// makes it again from `g` and `u` (one elementwise pass, and an `(N, I)` tensor less per
    /// layer kept through the step); kept by a recompute, which has just made it.
    m: Option<Tensor>,
    cd: LinearCache,
}

impl LayerCache {
    /// What [`Layer::recompute`] can reuse of this forward's attention: the tiled path's output
    /// and log-sum-exp (`(N, H·Dh)` and `(B, T, H)` f32; `None` on the plain path).
    pub fn kept_attention(&self) -> Option<KeptAttn> {
        self.attn.kept()
    }
}

/// How much of a layer [`Layer::run`] computes.
enum Pass {
    /// Output and cache ([`Layer::forward`]).
    Full,
    /// The cache only, the attention's output taken from the forward when it was kept
    /// ([`Layer::recompute`]).
    Recompute(Option<KeptAttn>),
}

/// Per-batch inputs shared by all layers.
pub struct BatchCtx {
    pub shape: AttnShape,
    /// `(B, 1, T, Dh)`
    pub cos: Tensor,
    pub sin: Tensor,
    /// Causal (and packed-row) visibility: starts for the tiled path, the dense `(B or 1, 1, 1, T,
    /// T)` additive f32 mask for the plain one.
    pub mask: AttnMask,
    /// Causal and sliding-window mask, present when a window is shorter than the batch.
    pub sliding: Option<AttnMask>,
    /// The attention every layer runs ([`AttnPath::for_device`]).
    pub path: AttnPath,
}

impl BatchCtx {
    fn mask_for(&self, sliding: bool) -> &AttnMask {
        match (&self.sliding, sliding) {
            (Some(m), true) => m,
            _ => &self.mask,
        }
    }
}

impl Layer {
    pub fn linears(&self) -> [&Linear; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
    }
    pub fn linears_mut(&mut self) -> [&mut Linear; 7] {
        [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
        ]
    }

    /// The layer's norm weights (frozen): input, post-attention, then the q/k norms if any.
    pub fn norms(&self) -> impl Iterator<Item = &Tensor> {
        let qk = self.qk_norm.as_ref().map(|(q, k)| [q, k]);
        [&self.input_norm, &self.post_norm]
            .into_iter()
            .chain(qk.into_iter().flatten())
    }

    /// Concatenates the q/k/v and gate/up weights into blocks (dense weights only).
    pub fn fuse(&mut self) -> Result<()> {
        self.qkv = group::fuse(&mut [&mut self.q, &mut self.k, &mut self.v])?;
        self.gate_up = group::fuse(&mut [&mut self.gate, &mut self.up])?;
        Ok(())
    }

    /// Qwen3's q/k norms: `q: (N, H·Dh)`, `k: (N, Hkv·Dh)` normed per head over `Dh`, shapes
    /// kept; the norms' caches (`None` and `q`, `k` as given for a layer without them).
    pub(crate) fn norm_qk(
        &self,
        q: Tensor,
        k: Tensor,
    ) -> Result<(Tensor, Tensor, Option<(NormCache, NormCache)>)> {
        let Some((wq, wk)) = &self.qk_norm else {
            return Ok((q, k, None));
        };
        let per_head = |x: &Tensor, w: &Tensor| -> Result<(Tensor, NormCache)> {
            let (n, width) = x.dims2()?;
            let dh = w.dim(0)?;
            // (N, H·Dh) -> (N, H, Dh): the norm runs over the last dim.
            let (y, c) = ops::rms_norm(&x.reshape((n, width / dh, dh))?, w, self.eps)?;
            Ok((y.reshape((n, width))?, c))
        };
        let (q, cq) = per_head(&q, wq)?;
        let (k, ck) = per_head(&k, wk)?;
        Ok((q, k, Some((cq, ck))))
    }

    /// The q/k norms' backward: `dq: (N, H·Dh)`, `dk: (N, Hkv·Dh)` through them (as given
    /// without them).
    fn norm_qk_backward(
        &self,
        dq: Tensor,
        dk: Tensor,
        caches: Option<&(NormCache, NormCache)>,
    ) -> Result<(Tensor, Tensor)> {
        let (Some((wq, wk)), Some((cq, ck))) = (&self.qk_norm, caches) else {
            return Ok((dq, dk));
        };
        let per_head = |d: &Tensor, w: &Tensor, c: &NormCache| -> Result<Tensor> {
            let dims = d.dims2()?;
            ops::rms_norm_backward(&d.reshape(c.x.shape())?, w, c)?.reshape(dims)
        };
        Ok((per_head(&dq, wq, cq)?, per_head(&dk, wk, ck)?))
    }

    fn salt(&self, module: u64) -> u64 {
        // Distinct dropout streams per (layer, module); mixed so nearby seeds do not collide.
        (self.index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ module.wrapping_mul(0xD1B5_4A32_D192_ED03)
    }

    /// `x: (N, D)` → `(N, D)` and the cache for backward.
    pub fn forward(
        &self,
        x: &Tensor,
        ctx: &BatchCtx,
        lora: Option<&LoraCtx>,
    ) -> Result<(Tensor, LayerCache)> {
        let (out, cache) = self.run(x, ctx, lora, Pass::Full)?;
        Ok((out.expect("a full pass has an output"), cache))
    }

    /// The cache [`Layer::forward`] returns for `x`, bit for bit, without the layer's output
    /// (gradient checkpointing: the output is the next layer's kept input). Skips the down
    /// projection's frozen product (only its LoRA input product is formed) and the residual add;
    /// given the tiled attention's output and log-sum-exp from the forward (`kept`,
    /// [`LayerCache::kept_attention`]), the attention is not run again either.
    pub fn recompute(
        &self,
        x: &Tensor,
        ctx: &BatchCtx,
        lora: Option<&LoraCtx>,
        kept: Option<KeptAttn>,
    ) -> Result<LayerCache> {
        Ok(self.run(x, ctx, lora, Pass::Recompute(kept))?.1)
    }

    fn run(
        &self,
        x: &Tensor,
        ctx: &BatchCtx,
        lora: Option<&LoraCtx>,
        pass: Pass,
    ) -> Result<(Option<Tensor>, LayerCache)> {
        let (h1, n1) = ops::rms_norm(x, &self.input_norm, self.eps)?;
        let qkv = group::forward(
            &[&self.q, &self.k, &self.v],
            self.qkv.as_ref(),
            &h1,
            lora,
            &[self.salt(0), self.salt(1), self.salt(2)],
        )?;
        let [(q, cq), (k, ck), (v, cv)]: [(Tensor, LinearCache); 3] =
            qkv.try_into().expect("three members");
        let (q, k, qk) = self.norm_qk(q, k)?;
        let mask = ctx.mask_for(self.sliding);
        let (o_in, attn) = match (&pass, ctx.path) {
            (Pass::Recompute(kept), AttnPath::Tiled) => ops::attention_tiled_kept(
                &q,
                &k,
                &v,
                &ctx.shape,
                &ctx.cos,
                &ctx.sin,
                &mask.starts,
                kept.clone(),
            )?,
            _ => ops::attend(&q, &k, &v, &ctx.shape, &ctx.cos, &ctx.sin, mask, ctx.path)?,
        };
        let (a, co) = self.o.forward(&o_in, lora, self.salt(3))?;
        let h = ops::add(x, &a)?;
        let (h2, n2) = ops::rms_norm(&h, &self.post_norm, self.eps)?;
        let gu = group::forward(
            &[&self.gate, &self.up],
            self.gate_up.as_ref(),
            &h2,
            lora,
            &[self.salt(4), self.salt(5)],
        )?;
        let [(g, cg), (u, cu)]: [(Tensor, LinearCache); 2] = gu.try_into().expect("two members");
        let m = ops::swiglu(&g, &u)?;
        let (out, cd, m) = match pass {
            Pass::Full => {
                let (d, cd) = self.down.forward(&m, lora, self.salt(6))?;
                (Some(ops::add(&h, &d)?), cd, None)
            }
            Pass::Recompute(_) => {
                let cd = self.down.forward_cache(&m, lora, self.salt(6))?;
                (None, cd, Some(m))
            }
        };
        Ok((
            out,
            LayerCache {
                n1,
                h1,
                cq,
                ck,
                cv,
                qk,
                attn,
                o_in,
                co,
                n2,
                h2,
                g,
                u,
                cg,
                cu,
                m,
                cd,
            },
        ))
    }

    /// `d_out: (N, D)` → `dx: (N, D)` (when `need_dx`), LoRA grads accumulated into `grads`.
    pub fn backward(
        &self,
        d_out: &Tensor,
        c: &LayerCache,
        ctx: &BatchCtx,
        lora: Option<&LoraCtx>,
        grads: &mut Grads,
        need_dx: bool,
    ) -> Result<Option<Tensor>> {
        let m = match &c.m {
            Some(m) => m.clone(),
            None => ops::swiglu(&c.g, &c.u)?, // the same op on the same inputs: the same bits
        };
        let dm = self
            .down
            .backward(d_out, &m, &c.cd, lora, grads, true)?
            .expect("dx requested");
        drop(m);
        let (dg, du) = ops::swiglu_backward(&dm, &c.g, &c.u)?;
        let dh2 = group::backward(
            &[&self.gate, &self.up],
            self.gate_up.as_ref(),
            &[dg, du],
            &c.h2,
            &[&c.cg, &c.cu],
            lora,
            grads,
            true,
        )?
        .expect("dx requested");
        let dh = ops::add(
            d_out,
            &ops::rms_norm_backward(&dh2, &self.post_norm, &c.n2)?,
        )?;
        let d_o = self
            .o
            .backward(&dh, &c.o_in, &c.co, lora, grads, true)?
            .expect("dx requested");
        let (dq, dk, dv) = ops::attention_backward(&d_o, &c.attn, &ctx.shape, &ctx.cos, &ctx.sin)?;
        let (dq, dk) = self.norm_qk_backward(dq, dk, c.qk.as_ref())?;
        // The q/k/v input gradients are only needed to continue below this layer.
        let dh1 = group::backward(
            &[&self.q, &self.k, &self.v],
            self.qkv.as_ref(),
            &[dq, dk, dv],
            &c.h1,
            &[&c.cq, &c.ck, &c.cv],
            lora,
            grads,
            need_dx,
        )?;
        let Some(dh1) = dh1 else {
            return Ok(None);
        };
        Ok(Some(ops::add(
            &dh,
            &ops::rms_norm_backward(&dh1, &self.input_norm, &c.n1)?,
        )?))
    }
}
