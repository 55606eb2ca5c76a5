//! Causal self-attention with grouped-query heads, sliding windows and packed rows, forward and
//! backward, on two paths ([`AttnPath`]): materialized scores with the fused masked softmax
//! (`softmax.rs`, loops in `cpu.rs`, `kernels/attn.cu`), or tiled (FlashAttention-2: `tiled.rs` on
//! the CPU, `flash_kernel.rs` + `flash_cuda.rs` over `kernels/flash_attn.cu` on CUDA), which never
//! forms the `(T, T)` scores.
//!
//! The op's files: this one (what the model calls), `mask.rs` (causal, windowed and segment
//! masks), `softmax.rs`, `capped.rs` (Gemma 2's soft-capped softmax on the plain
//! path; `tiled.rs` caps its tiles with the same op, [`crate::softcap`]), `cpu.rs`, `tiled.rs`,
//! `reference.rs` (plain formulations; `flash_ref.rs`: the tiled kernels' CPU reference with their
//! tiling), `softmax_cuda.rs`, `flash_kernel.rs`,
//! `flash_cuda.rs`, `cudnn.rs` (cuDNN's fused attention on CUDA, tried first: its band, layouts,
//! fallbacks), `check.rs`, `flash_check.rs` and `cudnn_check.rs` (for `rtune selftest`),
//! `tests.rs`.

pub mod capped;
#[cfg(feature = "kernels")]
pub mod check;
pub(crate) mod cpu;
pub mod cudnn;
#[cfg(feature = "kernels")]
pub mod cudnn_check;
#[cfg(feature = "kernels")]
pub mod flash_check;
#[cfg(feature = "cuda")]
mod flash_cuda;
#[cfg(feature = "kernels")]
pub mod flash_kernel;
pub mod flash_ref;
pub mod mask;
pub mod reference;
pub mod sinks;
pub mod softmax;
#[cfg(feature = "kernels")]
pub mod softmax_cuda;
#[cfg(test)]
mod tests;
pub mod tiled;

use candle_core::{Result, Tensor};
use rtune_backend::blas::matmul as mm;

pub use mask::AttnMask;
pub use reference::{attention_grad_reference, attention_probs_reference};

/// What [`attention`]'s backward needs.
#[derive(Debug, Clone)]
pub struct AttnCache {
    /// Rotated queries grouped by kv head: `(B, Hkv, G·T, Dh)` (the same memory as `(B, H, T, Dh)`).
    pub q: Tensor,
    /// Rotated keys: `(B, Hkv, T, Dh)` (after [`attend_after`]: the past's and the new ones,
    /// `(B, Hkv, S + T, Dh)`, as `v`).
    pub k: Tensor,
    pub v: Tensor,
    /// The probabilities, f32, `(1, Hkv, G·T, T)` per batch row — kept only when small (see
    /// [`keep_probs`]); otherwise the backward recomputes them (the same ops: the same bits).
    /// Always `None` on the tiled path.
    pub p: Option<Vec<Tensor>>,
    /// What the path that ran needs besides `q, k, v`.
    pub saved: AttnSaved,
    /// gpt-oss's attention sinks ([`sinks::apply_sinks`]), when the layer has them.
    pub sink: Option<sinks::SinkCache>,
}

/// The path-specific part of an [`AttnCache`].
#[derive(Debug, Clone)]
pub enum AttnSaved {
    /// The plain path: the additive mask the scores were computed with.
    Plain { mask: Tensor },
    /// The tiled path ([`crate::attention::tiled`]): its output `o: (N, H·Dh)` (the tensor the layer
    /// returns and keeps for the output projection: no extra memory), the log-sum-exp
    /// `lse: (B, T, H)` f32 and the visible-key starts `(B or 1, T)` u32. O(T) per head.
    Tiled {
        o: Tensor,
        lse: Tensor,
        starts: Tensor,
        /// The mask as one causal band ([`AttnMask::band`]), for cuDNN on CUDA.
        band: Option<cudnn::Band>,
    },
}

/// Which attention the model runs: the plain formulation ([`attention`]) or the tiled one
/// ([`attention_tiled`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnPath {
    Plain,
    Tiled,
}

impl AttnPath {
    /// The path for a batch of rows of `t` tokens on `dev`, the head dim not known:
    /// [`Self::for_shape`] with `head_dim: None`.
    pub fn for_device(dev: &candle_core::Device, t: usize) -> Result<AttnPath> {
        Self::for_shape(dev, t, None)
    }

    /// The path for a batch of rows of `t` tokens of heads of `head_dim` on `dev`: env
    /// `RTUNE_ATTN=plain|tiled` forces one (read once per process); unset (or `auto`), on the CPU
    /// the tiled path from [`TILED_MIN_T`] tokens on (faster and O(T) memory there, see the bench
    /// figures in `tiled.rs`) and the plain one for shorter rows; on CUDA the tiled path
    /// (`kernels/flash_attn.cu`: O(T) memory, no T × T scores in global memory) wherever the
    /// kernels are built for the head dim (`crate::attention::flash_kernel::HEAD_DIMS`; `None`: assumed),
    /// else the plain one; on other devices the plain one.
    pub fn for_shape(
        dev: &candle_core::Device,
        t: usize,
        head_dim: Option<usize>,
    ) -> Result<AttnPath> {
        static CHOICE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let choice = CHOICE.get_or_init(|| std::env::var("RTUNE_ATTN").ok());
        #[cfg(feature = "cuda")]
        let cuda_kernel = dev.is_cuda()
            && head_dim.is_none_or(|d| crate::attention::flash_kernel::HEAD_DIMS.contains(&d));
        #[cfg(not(feature = "cuda"))]
        let cuda_kernel = {
            let _ = head_dim;
            false
        };
        match choice.as_deref() {
            Some("plain") => Ok(AttnPath::Plain),
            Some("tiled") if dev.is_cpu() || cuda_kernel => Ok(AttnPath::Tiled),
            Some("tiled") => candle_core::bail!(
                "RTUNE_ATTN=tiled: the tiled attention runs on the CPU and on CUDA for head dims \
                 64, 96, 128, not on {:?} with head dim {head_dim:?}",
                dev.location()
            ),
            None | Some("") | Some("auto") => {
                Ok(if (dev.is_cpu() && t >= TILED_MIN_T) || cuda_kernel {
                    AttnPath::Tiled
                } else {
                    AttnPath::Plain
                })
            }
            Some(other) => {
                candle_core::bail!("RTUNE_ATTN={other:?}: expected plain, tiled or auto")
            }
        }
    }
}

/// The row length from which [`AttnPath::for_device`] picks the tiled path on the CPU by default.
/// With its tile products as GEMMs (2026-12-02, 2-core Xeon, OpenBLAS, release build, bench-small
/// at 2048 tokens a step, two interleaved rounds, `RTUNE_ATTN=plain` vs `tiled`) the tiled path ran
/// at 1.06/1.04× the plain one's tokens/s at 64 tokens, 1.06/0.97× at 128, 0.92/1.06× at 256,
/// 1.15/1.14× at 512 and 1.99× at 2048 (benches/README.md), with less memory at every length (853
/// vs 875 MB at 64, 863 vs 1143 MB at 512). Below 64 tokens a row is one partial tile: unmeasured,
/// so the plain path (the reference) stays there.
pub const TILED_MIN_T: usize = 64;

/// Attention on the path `path` picks ([`AttnPath::for_device`] in the model): [`attention`] with
/// the dense mask, or [`attention_tiled`] with the starts. Arguments as [`attention`].
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &AttnMask,
    path: AttnPath,
) -> Result<(Tensor, AttnCache)> {
    match path {
        AttnPath::Plain => attention(q, k, v, s, cos, sin, &mask.dense()?),
        AttnPath::Tiled => attention_tiled(q, k, v, s, cos, sin, mask),
    }
}

/// [`attention`] on the tiled path ([`crate::attention::tiled::flash_attn`]): the same inputs and
/// output, the mask read as its visible-key `starts: (B or 1, T)` u32 ([`AttnMask::starts`])
/// and, on CUDA, its causal band ([`AttnMask::band`]: what cuDNN can take); the cache holds the
/// output and the log-sum-exp instead of probabilities (O(T) per head).
pub fn attention_tiled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &AttnMask,
) -> Result<(Tensor, AttnCache)> {
    attention_tiled_kept(q, k, v, s, cos, sin, mask, None)
}

/// The output and log-sum-exp of a tiled attention forward: all its backward needs besides the
/// rotated `q, k, v` (which its inputs give again). Gradient checkpointing keeps it with a
/// layer's input so the recomputed forward skips the attention ([`attention_tiled_kept`]).
#[derive(Debug, Clone)]
pub struct KeptAttn {
    /// `(N, H·Dh)`, the compute dtype.
    pub o: Tensor,
    /// `(B, T, H)` f32.
    pub lse: Tensor,
}

impl AttnCache {
    /// What [`attention_tiled_kept`] needs to rebuild this cache (`None` on the plain path).
    pub fn kept(&self) -> Option<KeptAttn> {
        match &self.saved {
            AttnSaved::Tiled { o, lse, .. } => Some(KeptAttn {
                o: o.clone(),
                lse: lse.clone(),
            }),
            AttnSaved::Plain { .. } => None,
        }
    }
}

/// [`attention_tiled`]; given the output a forward of the same `q, k, v` made (`kept`: a
/// recomputed forward under gradient checkpointing), the queries and keys are rotated again for
/// the backward and the attention itself is not run: the same output and cache, bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn attention_tiled_kept(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &AttnMask,
    kept: Option<KeptAttn>,
) -> Result<(Tensor, AttnCache)> {
    let (q, k, v) = tiled_inputs(q, k, v, s, cos, sin)?;
    let (starts, band) = (&mask.starts, mask.band());
    let kept = match kept {
        Some(kept) => kept,
        None => {
            // o: (B, T, H, Dh) = (N, H·Dh) as it comes
            let (o, lse) = crate::attention::tiled::flash_attn_with(
                &q, &k, &v, starts, band, s.scale, s.softcap,
            )?;
            let o = o.reshape((s.b * s.t, s.heads * s.head_dim))?;
            KeptAttn { o, lse }
        }
    };
    Ok((
        kept.o.clone(),
        tiled_cache(q, k, v, s, (starts, band), kept)?,
    ))
}

/// `q: (N, H·Dh)`, `k, v: (N, Hkv·Dh)` → `(B, H, T, Dh)`, `(B, Hkv, T, Dh)` contiguous, `q` and
/// `k` rotated.
fn tiled_inputs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, h, hkv, dh) = (s.b, s.t, s.heads, s.kv_heads, s.head_dim);
    // (N, H·Dh) -> (B, H, T, Dh)
    let q = q.reshape((b, t, h, dh))?.transpose(1, 2)?.contiguous()?;
    let k = k.reshape((b, t, hkv, dh))?.transpose(1, 2)?.contiguous()?;
    let v = v.reshape((b, t, hkv, dh))?.transpose(1, 2)?.contiguous()?;
    let q = crate::rope::apply(&q, cos, sin)?.contiguous()?;
    let k = crate::rope::apply(&k, cos, sin)?.contiguous()?;
    Ok((q, k, v))
}

/// The tiled path's cache: `q` regrouped by kv head, the output and log-sum-exp, the starts.
fn tiled_cache(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: &AttnShape,
    (starts, band): (&Tensor, Option<cudnn::Band>),
    kept: KeptAttn,
) -> Result<AttnCache> {
    let q = q.reshape((s.b, s.kv_heads, (s.heads / s.kv_heads) * s.t, s.head_dim))?;
    Ok(AttnCache {
        q,
        k,
        v,
        p: None,
        saved: AttnSaved::Tiled {
            o: kept.o,
            lse: kept.lse,
            starts: starts.clone(),
            band,
        },
        sink: None,
    })
}

/// Shape facts for one batch through attention.
#[derive(Debug, Clone)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// What the scores `q·kᵀ` are multiplied by: `1/√head_dim` ([`AttnShape::new`]), or Gemma's
    /// `1/√query_pre_attn_scalar`.
    pub scale: f64,
    /// Gemma 2's `attn_logit_softcapping`: scaled scores become `cap·tanh(s/cap)`
    /// ([`crate::softcap`], on the plain path and in the CPU's tiled kernels; the CUDA flash kernel
    /// does not have it).
    pub softcap: Option<f64>,
}

impl AttnShape {
    /// The usual shape: scores scaled by `1/√head_dim`, no soft-capping.
    pub fn new(b: usize, t: usize, heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            b,
            t,
            heads,
            kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f64).sqrt(),
            softcap: None,
        }
    }
}

/// Causal grouped-query attention with RoPE. `q: (N, H·Dh)`, `k, v: (N, Hkv·Dh)` with `N = B·T`;
/// `cos, sin: (B, 1, T, Dh)`; `mask: (B or 1, 1, 1, T, T)` additive f32 (0 or −∞). Returns
/// `(N, H·Dh)`. Query head `h` reads kv head `h / G` (transformers' `repeat_kv`); the G query heads of
/// a kv head are stacked along the row axis so K and V are never repeated in memory.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
) -> Result<(Tensor, AttnCache)> {
    attention_keeping(q, k, v, s, cos, sin, mask, keep_probs(s))
}

/// [`attention`] with the choice of [`keep_probs`] made by the caller (tests take both paths).
#[allow(clippy::too_many_arguments)]
pub fn attention_keeping(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
    keep: bool,
) -> Result<(Tensor, AttnCache)> {
    plain(q, k, v, s, cos, sin, mask, keep, None, None)
}

/// Attention of the new tokens `q, k, v` ([`attention`]'s shapes, `T` new tokens a row) after
/// the rotated keys and values of the tokens before them (decoding with a key/value cache):
/// `past = (k, v)`, `(B, Hkv, S, Dh)` each; `mask` an [`AttnMask::after`] with `past() = S`.
/// Always the plain path, with the same masked softmax (and soft cap) as [`attention`]: the
/// tiled kernels take queries and keys of one length, and a step's `T × (S + T)` scores are
/// small. Returns the output `(N, H·Dh)` and a cache whose `k, v` are the past's with the new
/// tokens' appended, `(B, Hkv, S + T, Dh)`: what the next step takes. Inference only
/// ([`attention_backward`] refuses the cache).
#[allow(clippy::too_many_arguments)]
pub fn attend_after(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &AttnMask,
    past: (&Tensor, &Tensor),
) -> Result<(Tensor, AttnCache)> {
    let (pk, pv) = past;
    if pk.dims() != pv.dims() || pk.dim(2)? != mask.past() {
        candle_core::bail!(
            "attend_after: past keys {:?} and values {:?} for a mask after {} keys",
            pk.dims(),
            pv.dims(),
            mask.past()
        );
    }
    plain(
        q,
        k,
        v,
        s,
        cos,
        sin,
        &mask.dense()?,
        false,
        Some(past),
        None,
    )
}

/// The plain path: [`attention_keeping`], after `past` keys and values when given
/// ([`attend_after`]), with the sinks `(H,)` joined to the softmax when given
/// ([`sinks::attend_sinked`]).
#[allow(clippy::too_many_arguments)]
fn plain(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
    keep: bool,
    past: Option<(&Tensor, &Tensor)>,
    sinks: Option<&Tensor>,
) -> Result<(Tensor, AttnCache)> {
    let (b, t, h, hkv, dh) = (s.b, s.t, s.heads, s.kv_heads, s.head_dim);
    let g = h / hkv;
    let dt = q.dtype();
    // (N, H·Dh) -> (B, H, T, Dh)
    let q = q.reshape((b, t, h, dh))?.transpose(1, 2)?.contiguous()?;
    let k = k.reshape((b, t, hkv, dh))?.transpose(1, 2)?.contiguous()?;
    let v = v.reshape((b, t, hkv, dh))?.transpose(1, 2)?.contiguous()?;
    let q = crate::rope::apply(&q, cos, sin)?;
    let k = crate::rope::apply(&k, cos, sin)?.contiguous()?;
    // Decoding: the keys and values before these tokens come first, (B, Hkv, S + T, Dh).
    let (k, v) = match past {
        Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
        None => (k, v),
    };
    // (B, H, T, Dh) = (B, Hkv, G, T, Dh) -> (B, Hkv, G·T, Dh)
    let q = q.reshape((b, hkv, g * t, dh))?;
    let mut outs = Vec::with_capacity(b);
    let mut ps = Vec::with_capacity(if keep { b } else { 0 });
    let mut p_sinks = Vec::with_capacity(if sinks.is_some() { b } else { 0 });
    for i in 0..b {
        let p = match sinks {
            Some(sk) => {
                let (p, p_sink) = sinks::joint_probs(&q, &k, mask, s, i, sk)?;
                p_sinks.push(p_sink);
                p
            }
            None => row_probs(&q, &k, mask, s, i)?,
        };
        outs.push(mm(&p.to_dtype(dt)?, &v.narrow(0, i, 1)?)?);
        if keep {
            ps.push(p);
        }
    }
    let sink = match sinks {
        Some(sk) => Some(sinks::SinkCache {
            scale: None,
            p_sink: Tensor::cat(&p_sinks, 0)?, // (B, H, T)
            joined: Some(sk.clone()),
        }),
        None => None,
    };
    // out: (B, Hkv, G·T, Dh) -> (B, H, T, Dh) -> (B, T, H, Dh) -> (N, H·Dh)
    let o = Tensor::cat(&outs, 0)?;
    let o = o
        .reshape((b, h, t, dh))?
        .transpose(1, 2)?
        .reshape((b * t, h * dh))?;
    let p = keep.then_some(ps);
    Ok((
        o,
        AttnCache {
            q,
            k,
            v,
            p,
            saved: AttnSaved::Plain { mask: mask.clone() },
            sink,
        },
    ))
}

/// Whether to keep the attention probabilities for backward (≤ 64 MiB a layer) or recompute them.
/// Storing is faster (bench-small T=512, measured before the fused softmax: ~800 vs ~740 tokens/s);
/// recomputing keeps long sequences affordable (bench-small T=2048: 537 MB a layer saved).
pub fn keep_probs(s: &AttnShape) -> bool {
    s.b * s.heads * s.t * s.t * 4 <= 64 << 20
}

/// Attention probabilities of batch row `i`, f32: `(1, Hkv, G·T, T)` = softmax of the masked,
/// scaled scores. One batch row at a time: the scores of a row are B times smaller than the
/// batch's, so they stay under the allocator's mmap threshold and are reused rather than faulted in
/// fresh. Fused ([`crate::attention::softmax::attn_softmax`]: CPU, and `kernels/attn.cu` on CUDA).
fn row_probs(q: &Tensor, k: &Tensor, mask: &Tensor, s: &AttnShape, i: usize) -> Result<Tensor> {
    let mask_i = if mask.dim(0)? == s.b && s.b > 1 {
        mask.narrow(0, i, 1)?
    } else {
        mask.clone()
    };
    // (1, Hkv, G·T, Dh)·(1, Hkv, Dh, T) -> (1, Hkv, G·T, T) in the compute dtype
    let raw = row_scores(q, k, i)?;
    match s.softcap {
        Some(cap) => crate::attention::capped::probs(&raw, &mask_i, s.scale, cap),
        None => crate::attention::softmax::attn_softmax(&raw, &mask_i, s.scale),
    }
}

/// The unscaled scores of batch row `i`: `q_i·k_iᵀ`, `(1, Hkv, G·T, T)` in the compute dtype.
fn row_scores(q: &Tensor, k: &Tensor, i: usize) -> Result<Tensor> {
    mm(&q.narrow(0, i, 1)?, &k.narrow(0, i, 1)?.t()?)
}

/// Returns `(dq, dk, dv)` shaped like [`attention`]'s inputs.
pub fn attention_backward(
    d_out: &Tensor,
    c: &AttnCache,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, h, hkv, dh) = (s.b, s.t, s.heads, s.kv_heads, s.head_dim);
    if c.k.dim(2)? != t {
        candle_core::bail!(
            "attention_backward: keys {:?} for {t} queries a row: a decoding step \
             (attend_after) has no backward",
            c.k.dims()
        );
    }
    let back = |x: Tensor, heads: usize| x.transpose(1, 2)?.reshape((b * t, heads * dh));
    let mask = match &c.saved {
        AttnSaved::Plain { mask } => mask,
        AttnSaved::Tiled {
            o,
            lse,
            starts,
            band,
        } => {
            let scale = s.scale;
            // d_out and o: (N, H·Dh) = (B, T, H, Dh); q: (B, H, T, Dh)
            let bthd = (b, t, h, dh);
            let (dq, dk, dv) = crate::attention::tiled::flash_attn_bwd_with(
                [&c.q.reshape((b, h, t, dh))?, &c.k, &c.v],
                &o.reshape(bthd)?,
                lse,
                &d_out.reshape(bthd)?,
                (starts, *band),
                scale,
                s.softcap,
            )?;
            let dq = crate::rope::apply_backward(&dq, cos, sin)?;
            let dk = crate::rope::apply_backward(&dk, cos, sin)?;
            return Ok((back(dq, h)?, back(dk, hkv)?, back(dv, hkv)?));
        }
    };
    let g = h / hkv;
    let dt = d_out.dtype();
    // d_out: (N, H·Dh) -> (B, H, T, Dh) -> (B, Hkv, G·T, Dh)
    let d_o = d_out
        .reshape((b, t, h, dh))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((b, hkv, g * t, dh))?;
    let scale = s.scale;
    let (mut dqs, mut dks, mut dvs) = (
        Vec::with_capacity(b),
        Vec::with_capacity(b),
        Vec::with_capacity(b),
    );
    for i in 0..b {
        let d_oi = d_o.narrow(0, i, 1)?;
        let pf = match &c.p {
            Some(ps) => ps[i].clone(),
            None => match c.sink.as_ref().map(|sk| (&sk.joined, &sk.scale)) {
                // Formed with the sinks joined ([`sinks::attend_sinked`]): the same ops again.
                Some((Some(joined), _)) => sinks::joint_probs(&c.q, &c.k, mask, s, i, joined)?.0,
                // The sinks' share of each row's mass, as the forward took it.
                Some((None, Some(scale))) => row_probs(&c.q, &c.k, mask, s, i)?
                    .broadcast_mul(&sinks::row_scale(scale, s, i)?)?,
                _ => row_probs(&c.q, &c.k, mask, s, i)?,
            },
        };
        let p = pf.to_dtype(dt)?;
        // dv: (1, Hkv, T, Dh) sums over the G query heads of each kv head.
        dvs.push(mm(&p.t()?, &d_oi)?);
        // dp: (1, Hkv, G·T, T) in the compute dtype; softmax backward in f32.
        let dp = mm(&d_oi, &c.v.narrow(0, i, 1)?.t()?)?;
        let ds = match s.softcap {
            Some(cap) => {
                let raw = row_scores(&c.q, &c.k, i)?;
                crate::attention::capped::probs_bwd(&pf, &dp, &raw, scale, cap)?
            }
            None => crate::attention::softmax::attn_softmax_bwd(&pf, &dp, scale)?,
        };
        dqs.push(mm(&ds, &c.k.narrow(0, i, 1)?)?); // (1, Hkv, G·T, Dh)
        dks.push(mm(&ds.t()?, &c.q.narrow(0, i, 1)?)?); // (1, Hkv, T, Dh)
    }
    let (dq, dk, dv) = (
        Tensor::cat(&dqs, 0)?,
        Tensor::cat(&dks, 0)?,
        Tensor::cat(&dvs, 0)?,
    );
    let dq = crate::rope::apply_backward(&dq.reshape((b, h, t, dh))?, cos, sin)?;
    let dk = crate::rope::apply_backward(&dk, cos, sin)?;
    Ok((back(dq, h)?, back(dk, hkv)?, back(dv, hkv)?))
}
