//! One Llama decoder layer, pre-norm:
//! `h = x + o_proj(attn(rope(q(n1)), rope(k(n1)), v(n1)))`, `out = h + down(silu(gate(n2))·up(n2))`
//! with `n1 = rmsnorm(x)`, `n2 = rmsnorm(h)`. Its backward needs only the layer input and the
//! [`LayerCache`] that [`Layer::forward`] returns, so a layer can be recomputed from its input alone
//! (gradient checkpointing: [`Layer::recompute`], which skips what the backward does not need —
//! the down projection's frozen product, the last residual add, and with the tiled attention's
//! kept output and log-sum-exp the attention itself).
//!
//! Gemma's layer ([`crate::Variant`]) differs in three places: its norms multiply by `1 + w` in
//! f32 (`norm_f32`), the attention's and the MLP's outputs are normed before their residual adds
//! (`sandwich`: `h = x + n3(attn)`, `out = h + n4(mlp(n2(h)))`), and the MLP is GeGLU. OLMo 2's
//! has the post norms only (`input_norm` and `post_norm` absent: `h = x + n3(attn(x))`,
//! `out = h + n4(mlp(h))`), and q/k norms over the whole projection width (`qk_norm` weights of
//! `(H·Dh)` and `(Hkv·Dh)`: one group a row in `Layer::norm_qk`).
//!
//! A sparse layer (Qwen3-MoE) has [`Layer::moe`] in place of `mlp_in` and `down`: the MLP is
//! the router and the experts ([`crate::moe`]); everything else is the same layer.
//!
//! Phi-3's checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, and PEFT
//! adapts each as one module: the layer then has one member in `attn_in` (`mlp_in`) whose output
//! `(N, q + 2·kv)` (`(N, 2·I)`) is split by columns into q, k, v (gate, up), and whose gradient is
//! theirs joined ([`group::split_outputs`], [`group::join_grads`]). One LoRA pair on the fused
//! module is then exactly PEFT's: `A: (r, D)` shared by q, k and v (its gradient sums theirs),
//! `B: (q + 2·kv, r)`.

use candle_core::{Result, Tensor};

use crate::group;
use crate::linear::{Grads, Linear, LinearCache, LoraCtx};
use rtune_ops::{self as ops, AttnCache, AttnMask, AttnPath, AttnShape, KeptAttn, NormCache};

#[derive(Debug, Clone)]
pub struct Layer {
    pub index: usize,
    /// The norm before attention and the one before the MLP; `None` where the family has none
    /// there (OLMo 2: the input goes to attention and the MLP as it is).
    pub input_norm: Option<Tensor>,
    pub post_norm: Option<Tensor>,
    /// `q_proj, k_proj, v_proj`, or Phi-3's one `qkv_proj` (rows q, k, v).
    pub attn_in: Vec<Linear>,
    pub o: Linear,
    /// `gate_proj, up_proj`, or Phi-3's one `gate_up_proj` (rows gate, up); empty on a sparse
    /// layer.
    pub mlp_in: Vec<Linear>,
    /// `None` on a sparse layer, whose MLP is [`Layer::moe`].
    pub down: Option<Linear>,
    /// A sparse layer's router and experts in place of the dense MLP (Qwen3-MoE).
    pub moe: Option<crate::moe::MoeMlp>,
    /// The widths of q, k, v (`H·Dh, Hkv·Dh, Hkv·Dh`) and of gate, up (`I, I`): how a fused
    /// member's output splits.
    pub attn_widths: [usize; 3],
    pub mlp_widths: [usize; 2],
    /// The RMSNorm weights on q and on k, applied before RoPE ([`crate::Variant::qk_norm`]):
    /// per head `(Dh)` each (Qwen3, Gemma 3) or over the whole projection `(H·Dh)`, `(Hkv·Dh)`
    /// (OLMo 2); frozen.
    pub qk_norm: Option<(Tensor, Tensor)>,
    /// Every norm of the layer runs in f32 with one rounding, its weight here in f32 (Gemma's,
    /// which holds `1 + w`, and OLMo 2's: [`ops::rms_norm_plus_one`]).
    pub norm_f32: bool,
    /// Gemma's post-attention and post-feed-forward norms (`(D)` each): the attention's output
    /// and the MLP's output are normed before their residual adds. `post_norm` is then the MLP's
    /// input norm (`pre_feedforward_layernorm`).
    pub sandwich: Option<(Tensor, Tensor)>,
    /// The MLP's gate is GeGLU (tanh GELU) instead of SwiGLU.
    pub geglu: bool,
    pub eps: f64,
    /// Uses the sliding-window mask (when the batch is longer than the window).
    pub sliding: bool,
    /// gpt-oss's sink logits `self_attn.sinks: (H,)`, frozen ([`ops::attention::sinks`]).
    pub sinks: Option<Tensor>,
    /// `[Wq; Wk; Wv]` and `[Wgate; Wup]` when dense and split: one GEMM each (see
    /// [`crate::group`]); the members' weights are then row views of these blocks. `None` for a
    /// fused checkpoint, whose one weight is the block already.
    pub qkv: Option<Tensor>,
    pub gate_up: Option<Tensor>,
}

/// The q and k norms' caches (`None` for a layer without them).
type QkCaches = Option<(NormCache, NormCache)>;

/// Everything the backward of one layer needs (the activations of that layer only).
pub struct LayerCache {
    /// The pre-norms' caches (`None` without them).
    n1: Option<NormCache>,
    h1: Tensor,
    /// `attn_in`'s caches, one a member.
    c_attn_in: Vec<LinearCache>,
    /// The sandwich norms' inputs: the output projection's output and the down projection's
    /// (`(N, D)` each), when the layer has them.
    n_attn: Option<NormCache>,
    n_ff: Option<NormCache>,
    /// The q/k norms' inputs (`(N, H, Dh)`, `(N, Hkv, Dh)`) when the layer has them.
    qk: QkCaches,
    attn: AttnCache,
    o_in: Tensor,
    co: LinearCache,
    n2: Option<NormCache>,
    h2: Tensor,
    mlp: MlpCache,
}

/// The MLP's part of a [`LayerCache`].
enum MlpCache {
    Dense {
        g: Tensor,
        u: Tensor,
        /// `mlp_in`'s caches, one a member.
        c_mlp_in: Vec<LinearCache>,
        /// `silu(g)·u`, the down projection's input: `None` after a full forward, where the
        /// backward makes it again from `g` and `u` (one elementwise pass, and an `(N, I)`
        /// tensor less per layer kept through the step); kept by a recompute, which has just
        /// made it.
        m: Option<Tensor>,
        cd: LinearCache,
    },
    /// Boxed: the routing cache is ~3× the dense variant (clippy `large_enum_variant`).
    Moe(Box<crate::moe::MoeLayerCache>),
}

impl LayerCache {
    /// What [`Layer::recompute`] can reuse of this forward's attention: the tiled path's output
    /// and log-sum-exp (`(N, H·Dh)` and `(B, T, H)` f32; `None` on the plain path).
    pub fn kept_attention(&self) -> Option<KeptAttn> {
        self.attn.kept()
    }

    /// A sparse layer's routing cache (router logits, and where the aux loss's gradient goes).
    pub fn moe_mut(&mut self) -> Option<&mut crate::moe::MoeLayerCache> {
        match &mut self.mlp {
            MlpCache::Moe(c) => Some(c),
            MlpCache::Dense { .. } => None,
        }
    }
}

/// How much of a layer [`Layer::run`] computes.
enum Pass<'a> {
    /// Output and cache ([`Layer::forward`]).
    Full,
    /// The cache only, the attention's output taken from the forward when it was kept
    /// ([`Layer::recompute`]).
    Recompute(Option<KeptAttn>),
    /// Output and cache of new tokens after the cached keys and values of the tokens before
    /// them, if any ([`Layer::forward_cached`]).
    Cached(Option<&'a LayerKv>),
}

/// One layer's key/value cache: the rotated keys and the values of the tokens decoded so far,
/// `(B, Hkv, S, Dh)` each ([`Layer::forward_cached`]).
pub type LayerKv = (Tensor, Tensor);

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
    /// The sliding layers' own `(cos, sin)` when their RoPE differs (Gemma 3's local base).
    pub local_rope: Option<(Tensor, Tensor)>,
}

impl BatchCtx {
    fn mask_for(&self, sliding: bool) -> &AttnMask {
        match (&self.sliding, sliding) {
            (Some(m), true) => m,
            _ => &self.mask,
        }
    }

    /// `(cos, sin)` of a sliding (`true`) or global layer.
    fn rope_for(&self, sliding: bool) -> (&Tensor, &Tensor) {
        match (&self.local_rope, sliding) {
            (Some((c, s)), true) => (c, s),
            _ => (&self.cos, &self.sin),
        }
    }
}

impl Layer {
    /// The layer's linear modules in model order (q, k, v, o, gate, up, down; Phi-3: qkv, o,
    /// gate_up, down).
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out: Vec<&Linear> = self.attn_in.iter().collect();
        out.push(&self.o);
        out.extend(&self.mlp_in);
        out.extend(&self.down);
        out
    }

    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out: Vec<&mut Linear> = self.attn_in.iter_mut().collect();
        out.push(&mut self.o);
        out.extend(&mut self.mlp_in);
        out.extend(&mut self.down);
        out
    }

    /// `attn_in` as the group functions take it.
    fn attn_members(&self) -> Vec<&Linear> {
        self.attn_in.iter().collect()
    }

    fn mlp_members(&self) -> Vec<&Linear> {
        self.mlp_in.iter().collect()
    }

    /// Dropout salts of `attn_in` (0, 1, 2) and `mlp_in` (4, 5): a fused member takes its
    /// first part's.
    fn salts(&self, first: u64, n: usize) -> Vec<u64> {
        (0..n as u64).map(|i| self.salt(first + i)).collect()
    }

    /// The layer's norm weights (frozen): input, post-attention (or pre-feed-forward) if any,
    /// then the q/k norms and the sandwich norms if any.
    pub fn norms(&self) -> impl Iterator<Item = &Tensor> {
        let qk = self.qk_norm.as_ref().map(|(q, k)| [q, k]);
        let sandwich = self.sandwich.as_ref().map(|(a, f)| [a, f]);
        [self.input_norm.as_ref(), self.post_norm.as_ref()]
            .into_iter()
            .flatten()
            .chain(qk.into_iter().flatten())
            .chain(sandwich.into_iter().flatten())
    }

    /// This layer's RMSNorm of `x` with weight `w` (Gemma's `1 + w` form when `plus_one`).
    pub(crate) fn norm(&self, x: &Tensor, w: &Tensor) -> Result<(Tensor, NormCache)> {
        norm(self.norm_f32, x, w, self.eps)
    }

    /// [`Layer::norm`]'s backward.
    fn norm_backward(&self, dy: &Tensor, w: &Tensor, c: &NormCache) -> Result<Tensor> {
        norm_backward(self.norm_f32, dy, w, c)
    }

    /// The MLP's gate: GeGLU or SwiGLU of `g, u: (N, I)`.
    pub(crate) fn act(&self, g: &Tensor, u: &Tensor) -> Result<Tensor> {
        if self.geglu {
            ops::geglu(g, u)
        } else {
            ops::swiglu(g, u)
        }
    }

    fn act_backward(&self, dm: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.geglu {
            ops::geglu_backward(dm, g, u)
        } else {
            ops::swiglu_backward(dm, g, u)
        }
    }

    /// The optional norm `w` of `x` (`(x, None)` without one): the sandwich norms, and the
    /// pre-norms of a family that may lack them.
    pub(crate) fn sandwich_norm(
        &self,
        x: Tensor,
        w: Option<&Tensor>,
    ) -> Result<(Tensor, Option<NormCache>)> {
        match w {
            Some(w) => {
                let (y, c) = self.norm(&x, w)?;
                Ok((y, Some(c)))
            }
            None => Ok((x, None)),
        }
    }

    /// [`Layer::sandwich_norm`]'s backward (`dy` as given without one).
    fn sandwich_backward(
        &self,
        dy: &Tensor,
        w: Option<&Tensor>,
        c: Option<&NormCache>,
    ) -> Result<Tensor> {
        match (w, c) {
            (Some(w), Some(c)) => self.norm_backward(dy, w, c),
            _ => Ok(dy.clone()),
        }
    }

    /// The residual add `h = x + a` and the optional norm `w` of `h` after it (`y = h` without
    /// one): `(h, y, the norm's cache)`. One kernel on CUDA ([`ops::add_norm::add_rms_norm`]).
    fn add_norm(
        &self,
        x: &Tensor,
        a: &Tensor,
        w: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Option<NormCache>)> {
        match w {
            Some(w) => {
                let (h, y, c) = ops::add_norm::add_rms_norm(x, a, w, self.eps, self.norm_f32)?;
                Ok((h, y, Some(c)))
            }
            None => {
                let h = ops::add(x, a)?;
                Ok((h.clone(), h, None))
            }
        }
    }

    /// `d + norm_backward(dy)` of the optional norm `w` (`d + dy` without one): the residual
    /// stream's gradient plus the norm's, [`Layer::add_norm`]'s backward.
    fn add_norm_backward(
        &self,
        d: &Tensor,
        dy: &Tensor,
        w: Option<&Tensor>,
        c: Option<&NormCache>,
    ) -> Result<Tensor> {
        match (w, c) {
            (Some(w), Some(c)) => ops::add_norm::add_rms_norm_backward(d, dy, w, c, self.norm_f32),
            _ => ops::add(d, dy),
        }
    }

    /// Concatenates the q/k/v and gate/up weights into blocks (dense, split weights only).
    pub fn fuse(&mut self) -> Result<()> {
        self.qkv = group::fuse(&mut self.attn_in.iter_mut().collect::<Vec<_>>())?;
        self.gate_up = group::fuse(&mut self.mlp_in.iter_mut().collect::<Vec<_>>())?;
        Ok(())
    }

    /// The q/k norms: `q: (N, H·Dh)`, `k: (N, Hkv·Dh)` normed in groups of the weight's length
    /// — per head over `Dh` (Qwen3), or the whole row as one group (OLMo 2: the weight is the
    /// row's width) — shapes kept; the norms' caches (`None` and `q`, `k` as given for a layer
    /// without them).
    pub(crate) fn norm_qk(&self, q: Tensor, k: Tensor) -> Result<(Tensor, Tensor, QkCaches)> {
        let Some((wq, wk)) = &self.qk_norm else {
            return Ok((q, k, None));
        };
        let per_head = |x: &Tensor, w: &Tensor| -> Result<(Tensor, NormCache)> {
            let (n, width) = x.dims2()?;
            let dh = w.dim(0)?;
            // (N, H·Dh) -> (N, H, Dh), or (N, 1, H·Dh) for a whole-width weight: the norm runs
            // over the last dim.
            let (y, c) = self.norm(&x.reshape((n, width / dh, dh))?, w)?;
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
            self.norm_backward(&d.reshape(c.x.shape())?, w, c)?
                .reshape(dims)
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

    /// Decoding with a key/value cache: [`Layer::forward`] of the new tokens `x: (B·T, D)` (`ctx`
    /// for `B` rows of `T` new tokens: their positions, and an [`ops::AttnMask::after`] the
    /// cached tokens), their queries attending to `past` (this layer's keys and values of the
    /// tokens before them; `None` at the first step) and to themselves. Returns the output and
    /// the cache with the new tokens' keys and values appended, `(B, Hkv, S + T, Dh)`. The one
    /// forward: every flag of the layer applies as in training. Inference only (no backward).
    pub fn forward_cached(
        &self,
        x: &Tensor,
        ctx: &BatchCtx,
        lora: Option<&LoraCtx>,
        past: Option<&LayerKv>,
    ) -> Result<(Tensor, LayerKv)> {
        let (out, cache) = self.run(x, ctx, lora, Pass::Cached(past))?;
        let out = out.expect("a cached pass has an output");
        Ok((out, (cache.attn.k, cache.attn.v)))
    }

    fn run(
        &self,
        x: &Tensor,
        ctx: &BatchCtx,
        lora: Option<&LoraCtx>,
        pass: Pass,
    ) -> Result<(Option<Tensor>, LayerCache)> {
        let (h1, n1) = self.sandwich_norm(x.clone(), self.input_norm.as_ref())?;
        let (outs, c_attn_in): (Vec<Tensor>, Vec<LinearCache>) = group::forward(
            &self.attn_members(),
            self.qkv.as_ref(),
            &h1,
            lora,
            &self.salts(0, self.attn_in.len()),
        )?
        .into_iter()
        .unzip();
        let [q, k, v]: [Tensor; 3] = group::split_outputs(outs, &self.attn_widths)?
            .try_into()
            .expect("three parts");
        let (q, k, qk) = self.norm_qk(q, k)?;
        let mask = ctx.mask_for(self.sliding);
        let (cos, sin) = ctx.rope_for(self.sliding);
        let (o_in, attn) = match (&pass, ctx.path) {
            (Pass::Recompute(kept), AttnPath::Tiled) => {
                ops::attention_tiled_kept(&q, &k, &v, &ctx.shape, cos, sin, mask, kept.clone())?
            }
            (Pass::Cached(Some(past)), _) => {
                let past = (&past.0, &past.1);
                ops::attend_after(&q, &k, &v, &ctx.shape, cos, sin, mask, past)?
            }
            _ => match &self.sinks {
                Some(sinks) => ops::attention::sinks::attend_sinked(
                    &q, &k, &v, &ctx.shape, cos, sin, mask, ctx.path, sinks,
                )?,
                None => ops::attend(&q, &k, &v, &ctx.shape, cos, sin, mask, ctx.path)?,
            },
        };
        // The sinks join each row's softmax; `attend_sinked` has them in, and so has a
        // recompute that reused the tiled forward's kept output.
        let joined = match (&pass, ctx.path) {
            (Pass::Recompute(kept), AttnPath::Tiled) => kept.is_some(),
            (Pass::Cached(Some(_)), _) => false,
            _ => true,
        };
        let (o_in, attn) = match &self.sinks {
            Some(sinks) if !joined => {
                ops::attention::sinks::apply_sinks(&o_in, attn, &ctx.shape, sinks)?
            }
            _ => (o_in, attn),
        };
        let (a, co) = self.o.forward(&o_in, lora, self.salt(3))?;
        let sandwich = self.sandwich.as_ref();
        let (a, n_attn) = self.sandwich_norm(a, sandwich.map(|s| &s.0))?;
        let (h, h2, n2) = self.add_norm(x, &a, self.post_norm.as_ref())?;
        let (out, mlp, n_ff) = match (&self.moe, &self.down) {
            (Some(moe), _) => {
                let (d, c) = moe.forward(&h2, lora)?;
                let (d, n_ff) = self.sandwich_norm(d, sandwich.map(|s| &s.1))?;
                let out = match pass {
                    Pass::Recompute(_) => None,
                    _ => Some(ops::add(&h, &d)?),
                };
                (out, MlpCache::Moe(Box::new(c)), n_ff)
            }
            (None, Some(down)) => self.dense_mlp(&h, &h2, down, lora, pass)?,
            (None, None) => {
                candle_core::bail!("layer {}: no MLP (neither dense nor experts)", self.index)
            }
        };
        Ok((
            out,
            LayerCache {
                n1,
                h1,
                c_attn_in,
                n_attn,
                n_ff,
                qk,
                attn,
                o_in,
                co,
                n2,
                h2,
                mlp,
            },
        ))
    }

    /// The dense MLP of `h2` (the normed `h`): the layer's output `h + mlp` (`None` on a
    /// recompute), its cache and the post-feed-forward norm's.
    fn dense_mlp(
        &self,
        h: &Tensor,
        h2: &Tensor,
        down: &Linear,
        lora: Option<&LoraCtx>,
        pass: Pass,
    ) -> Result<(Option<Tensor>, MlpCache, Option<NormCache>)> {
        let sandwich = self.sandwich.as_ref();
        let (outs, c_mlp_in): (Vec<Tensor>, Vec<LinearCache>) = group::forward(
            &self.mlp_members(),
            self.gate_up.as_ref(),
            h2,
            lora,
            &self.salts(4, self.mlp_in.len()),
        )?
        .into_iter()
        .unzip();
        let [g, u]: [Tensor; 2] = group::split_outputs(outs, &self.mlp_widths)?
            .try_into()
            .expect("two parts");
        let m = self.act(&g, &u)?;
        let (out, cd, m, n_ff) = match (pass, sandwich) {
            (Pass::Full | Pass::Cached(_), _) => {
                let (d, cd) = down.forward(&m, lora, self.salt(6))?;
                let (d, n_ff) = self.sandwich_norm(d, sandwich.map(|s| &s.1))?;
                (Some(ops::add(h, &d)?), cd, None, n_ff)
            }
            // The post-feed-forward norm's backward needs the down projection's output: the
            // frozen product is formed again.
            (Pass::Recompute(_), Some((_, post_ff))) => {
                let (d, cd) = down.forward(&m, lora, self.salt(6))?;
                let (_, n_ff) = self.norm(&d, post_ff)?;
                (None, cd, Some(m), Some(n_ff))
            }
            (Pass::Recompute(_), None) => {
                let cd = down.forward_cache(&m, lora, self.salt(6))?;
                (None, cd, Some(m), None)
            }
        };
        let mlp = MlpCache::Dense {
            g,
            u,
            c_mlp_in,
            m,
            cd,
        };
        Ok((out, mlp, n_ff))
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
        let sandwich = self.sandwich.as_ref();
        let dd = self.sandwich_backward(d_out, sandwich.map(|s| &s.1), c.n_ff.as_ref())?;
        let dh2 = match (&c.mlp, &self.moe, &self.down) {
            (MlpCache::Moe(mc), Some(moe), _) => moe.backward(&dd, mc, lora, grads)?,
            (
                MlpCache::Dense {
                    g,
                    u,
                    c_mlp_in,
                    m,
                    cd,
                },
                None,
                Some(down),
            ) => {
                let m = match m {
                    Some(m) => m.clone(),
                    None => self.act(g, u)?, // the same op on the same inputs: the same bits
                };
                let dm = down
                    .backward(&dd, &m, cd, lora, grads, true)?
                    .expect("dx requested");
                drop((m, dd));
                let (dg, du) = self.act_backward(&dm, g, u)?;
                let mlp = self.mlp_members();
                group::backward(
                    &mlp,
                    self.gate_up.as_ref(),
                    &group::join_grads(vec![dg, du], &mlp)?,
                    &c.h2,
                    &c_mlp_in.iter().collect::<Vec<_>>(),
                    lora,
                    grads,
                    true,
                )?
                .expect("dx requested")
            }
            _ => candle_core::bail!("layer {}: the cache is not this layer's MLP", self.index),
        };
        let dh = self.add_norm_backward(d_out, &dh2, self.post_norm.as_ref(), c.n2.as_ref())?;
        let da = self.sandwich_backward(&dh, sandwich.map(|s| &s.0), c.n_attn.as_ref())?;
        let d_o = self
            .o
            .backward(&da, &c.o_in, &c.co, lora, grads, true)?
            .expect("dx requested");
        drop(da);
        let (cos, sin) = ctx.rope_for(self.sliding);
        let (dq, dk, dv) = ops::attention_backward(&d_o, &c.attn, &ctx.shape, cos, sin)?;
        let (dq, dk) = self.norm_qk_backward(dq, dk, c.qk.as_ref())?;
        // The q/k/v input gradients are only needed to continue below this layer.
        let attn = self.attn_members();
        let dh1 = group::backward(
            &attn,
            self.qkv.as_ref(),
            &group::join_grads(vec![dq, dk, dv], &attn)?,
            &c.h1,
            &c.c_attn_in.iter().collect::<Vec<_>>(),
            lora,
            grads,
            need_dx,
        )?;
        let Some(dh1) = dh1 else {
            return Ok(None);
        };
        Ok(Some(self.add_norm_backward(
            &dh,
            &dh1,
            self.input_norm.as_ref(),
            c.n1.as_ref(),
        )?))
    }
}

/// RMSNorm of `x` with weight `w`: Llama's, or in f32 with one rounding when `f32_weight` (`w`
/// then f32: Gemma's `1 + w`, OLMo 2's `w`). The layers' norms and the model's final one.
pub(crate) fn norm(
    f32_weight: bool,
    x: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<(Tensor, NormCache)> {
    if f32_weight {
        ops::rms_norm_plus_one(x, w, eps)
    } else {
        ops::rms_norm(x, w, eps)
    }
}

/// [`norm`]'s backward.
pub(crate) fn norm_backward(
    f32_weight: bool,
    dy: &Tensor,
    w: &Tensor,
    c: &NormCache,
) -> Result<Tensor> {
    if f32_weight {
        ops::rms_norm_plus_one_backward(dy, w, c)
    } else {
        ops::rms_norm_backward(dy, w, c)
    }
}
