//! Forward and hand-written backward of every op on the training path.
//!
//! The model does not use candle's autograd: it would compute a gradient for every frozen weight
//! (candle's matmul backward always forms `lhsᵀ·grad` for the right operand) and keep every
//! intermediate alive until the end. Each op here returns what its backward needs, and its backward
//! takes exactly that. `tests::*_matches_autograd` checks each backward against candle's autograd on
//! the plain (un-fused, differentiable) formulation of the same op.

use candle_core::{DType, Result, Tensor, D};

use crate::blas::matmul as mm;
pub use crate::tokens::HeadRows;

/// What [`rms_norm`]'s backward needs: the input (the backward recomputes `r` from it).
#[derive(Debug, Clone)]
pub struct NormCache {
    /// The input, in its own dtype: `(N, D)`.
    pub x: Tensor,
    pub eps: f64,
}

/// Llama's RMSNorm: `w · (x · rsqrt(mean(x²) + eps))`, statistics in f32 then cast back (as
/// transformers' `LlamaRMSNorm`). `x: (N, D)`, `w: (D)`. Fused ([`crate::fused::rms_norm`]);
/// [`rms_norm_reference`] is the plain formulation.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, NormCache)> {
    let y = crate::fused::rms_norm(x, w, eps)?;
    Ok((y, NormCache { x: x.clone(), eps }))
}

/// `dx = r·g − x·r³·mean(g·x)`, `g = dy·w` (fused: [`crate::fused::rms_norm_bwd`]).
pub fn rms_norm_backward(dy: &Tensor, w: &Tensor, c: &NormCache) -> Result<Tensor> {
    crate::fused::rms_norm_bwd(dy, &c.x, w, c.eps)
}

/// [`rms_norm`]'s output as a chain of candle ops: the reference for the fused op.
pub fn rms_norm_reference(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dt = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    xf.broadcast_mul(&r)?.to_dtype(dt)?.broadcast_mul(w)
}

/// [`rms_norm_backward`] as a chain of candle ops: the reference for the fused op.
pub fn rms_norm_backward_reference(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let dt = dy.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let g = dy.broadcast_mul(w)?.to_dtype(DType::F32)?;
    let gx = (&g * &xf)?.mean_keepdim(D::Minus1)?;
    let r3 = r.powf(3.0)?;
    let dx = (g.broadcast_mul(&r)? - xf.broadcast_mul(&r3)?.broadcast_mul(&gx)?)?;
    dx.to_dtype(dt)
}

/// `1 / (1 + e^-x)`.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// SwiGLU: `silu(g) · u` (fused: [`crate::fused::swiglu`]).
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    crate::fused::swiglu(g, u)
}

/// Returns `(dg, du)` for [`swiglu`]; `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))` (fused:
/// [`crate::fused::swiglu_bwd`]).
pub fn swiglu_backward(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    crate::fused::swiglu_bwd(dh, g, u)
}

/// [`swiglu`] as candle ops: the reference for the fused op.
pub fn swiglu_reference(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    g.silu()? * u
}

/// [`swiglu_backward`] as candle ops: the reference for the fused op.
pub fn swiglu_backward_reference(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    let dt = g.dtype();
    let gf = g.to_dtype(DType::F32)?;
    let s = sigmoid(&gf)?;
    let silu = (&gf * &s)?;
    let dhf = dh.to_dtype(DType::F32)?;
    let du = (&dhf * silu)?.to_dtype(dt)?;
    let dsilu = (&s * ((&gf * (1.0 - &s)?)? + 1.0)?)?;
    let dg = ((dhf * u.to_dtype(DType::F32)?)? * dsilu)?.to_dtype(dt)?;
    Ok((dg, du))
}

/// What [`attention`]'s backward needs.
#[derive(Debug, Clone)]
pub struct AttnCache {
    /// Rotated queries grouped by kv head: `(B, Hkv, G·T, Dh)` (the same memory as `(B, H, T, Dh)`).
    pub q: Tensor,
    /// Rotated keys: `(B, Hkv, T, Dh)`.
    pub k: Tensor,
    pub v: Tensor,
    /// The probabilities, f32, `(1, Hkv, G·T, T)` per batch row — kept only when small (see
    /// [`keep_probs`]); otherwise the backward recomputes them (the same ops: the same bits).
    /// Always `None` on the tiled path.
    pub p: Option<Vec<Tensor>>,
    /// What the path that ran needs besides `q, k, v`.
    pub saved: AttnSaved,
}

/// The path-specific part of an [`AttnCache`].
#[derive(Debug, Clone)]
pub enum AttnSaved {
    /// The plain path: the additive mask the scores were computed with.
    Plain { mask: Tensor },
    /// The tiled path ([`crate::fused::flash`]): its output `o: (N, H·Dh)` (the tensor the layer
    /// returns and keeps for the output projection: no extra memory), the log-sum-exp
    /// `lse: (B, T, H)` f32 and the visible-key starts `(B or 1, T)` u32. O(T) per head.
    Tiled {
        o: Tensor,
        lse: Tensor,
        starts: Tensor,
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
    /// figures in `fused/flash.rs`) and the plain one for shorter rows; on CUDA the tiled path
    /// (`kernels/flash_attn.cu`: O(T) memory, no T × T scores in global memory) wherever the
    /// kernels are built for the head dim (`rtune_kernels::flash::HEAD_DIMS`; `None`: assumed),
    /// else the plain one; on other devices the plain one.
    pub fn for_shape(
        dev: &candle_core::Device,
        t: usize,
        head_dim: Option<usize>,
    ) -> Result<AttnPath> {
        static CHOICE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let choice = CHOICE.get_or_init(|| std::env::var("RTUNE_ATTN").ok());
        #[cfg(feature = "cuda")]
        let cuda_kernel =
            dev.is_cuda() && head_dim.is_none_or(|d| rtune_kernels::flash::HEAD_DIMS.contains(&d));
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

/// Which keys each query of a batch sees: one run `starts[r, i] ..= i` per query `i` of row `r`
/// (causal; Mistral's sliding window `i − j < w`; packed rows: the query's own sample only). The
/// tiled path reads `starts` alone; the plain path's dense additive mask is built from the same
/// description on first use ([`AttnMask::dense`]: exactly [`causal_mask`] / [`segment_mask`]).
#[derive(Debug, Clone)]
pub struct AttnMask {
    /// `(B or 1, T)` u32: the first key each query sees.
    pub starts: Tensor,
    segments: Option<std::sync::Arc<[u32]>>,
    b: usize,
    t: usize,
    window: Option<usize>,
    dense: std::sync::Arc<std::sync::OnceLock<Tensor>>,
}

impl AttnMask {
    /// The mask of a `(b, t)` batch: one sample a row (`segments: None`, `starts: (1, T)`) or
    /// packed rows (`segments[row·T + i]`, contiguous runs of equal ids, `starts: (B, T)`), with
    /// an optional sliding `window`.
    pub fn new(
        segments: Option<&[u32]>,
        b: usize,
        t: usize,
        window: Option<usize>,
        dev: &candle_core::Device,
    ) -> Result<AttnMask> {
        let w = window.unwrap_or(usize::MAX).max(1);
        let starts: Vec<u32> = match segments {
            None => (0..t).map(|i| i.saturating_sub(w - 1) as u32).collect(),
            Some(seg) => {
                if seg.len() != b * t {
                    candle_core::bail!(
                        "AttnMask: {} segment ids for a ({b}, {t}) batch",
                        seg.len()
                    );
                }
                let mut v = Vec::with_capacity(b * t);
                for row in seg.chunks(t.max(1)) {
                    let mut first = 0;
                    for i in 0..row.len() {
                        if i > 0 && row[i] != row[i - 1] {
                            first = i;
                        }
                        v.push(first.max(i.saturating_sub(w - 1)) as u32);
                    }
                }
                v
            }
        };
        let rows = if segments.is_some() { b } else { 1 };
        Ok(AttnMask {
            starts: Tensor::from_vec(starts, (rows, t), dev)?,
            segments: segments.map(std::sync::Arc::from),
            b,
            t,
            window,
            dense: Default::default(),
        })
    }

    /// The additive f32 mask of the plain path, `(B or 1, 1, 1, T, T)` (built once).
    pub fn dense(&self) -> Result<Tensor> {
        if let Some(m) = self.dense.get() {
            return Ok(m.clone());
        }
        let dev = self.starts.device();
        let m = match &self.segments {
            Some(seg) => segment_mask(seg, self.b, self.t, self.window, dev)?,
            None => causal_mask(self.t, self.window, dev)?,
        };
        Ok(self.dense.get_or_init(|| m).clone())
    }
}

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
        AttnPath::Tiled => attention_tiled(q, k, v, s, cos, sin, &mask.starts),
    }
}

/// [`attention`] on the tiled path ([`crate::fused::flash::flash_attn`]): the same inputs and
/// output, the mask given as its visible-key `starts: (B or 1, T)` u32 ([`AttnMask::starts`]);
/// the cache holds the output and the log-sum-exp instead of probabilities (O(T) per head).
pub fn attention_tiled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    starts: &Tensor,
) -> Result<(Tensor, AttnCache)> {
    attention_tiled_kept(q, k, v, s, cos, sin, starts, None)
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
    starts: &Tensor,
    kept: Option<KeptAttn>,
) -> Result<(Tensor, AttnCache)> {
    let (q, k, v) = tiled_inputs(q, k, v, s, cos, sin)?;
    let kept = match kept {
        Some(kept) => kept,
        None => {
            let scale = 1.0 / (s.head_dim as f64).sqrt();
            // o: (B, T, H, Dh) = (N, H·Dh) as it comes
            let (o, lse) = crate::fused::flash::flash_attn(&q, &k, &v, starts, scale)?;
            let o = o.reshape((s.b * s.t, s.heads * s.head_dim))?;
            KeptAttn { o, lse }
        }
    };
    Ok((kept.o.clone(), tiled_cache(q, k, v, s, starts, kept)?))
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
    starts: &Tensor,
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
        },
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
    let (b, t, h, hkv, dh) = (s.b, s.t, s.heads, s.kv_heads, s.head_dim);
    let g = h / hkv;
    let dt = q.dtype();
    // (N, H·Dh) -> (B, H, T, Dh)
    let q = q.reshape((b, t, h, dh))?.transpose(1, 2)?.contiguous()?;
    let k = k.reshape((b, t, hkv, dh))?.transpose(1, 2)?.contiguous()?;
    let v = v.reshape((b, t, hkv, dh))?.transpose(1, 2)?.contiguous()?;
    let q = crate::rope::apply(&q, cos, sin)?;
    let k = crate::rope::apply(&k, cos, sin)?.contiguous()?;
    // (B, H, T, Dh) = (B, Hkv, G, T, Dh) -> (B, Hkv, G·T, Dh)
    let q = q.reshape((b, hkv, g * t, dh))?;
    let mut outs = Vec::with_capacity(b);
    let mut ps = Vec::with_capacity(if keep { b } else { 0 });
    for i in 0..b {
        let p = row_probs(&q, &k, mask, s, i)?;
        outs.push(mm(&p.to_dtype(dt)?, &v.narrow(0, i, 1)?)?);
        if keep {
            ps.push(p);
        }
    }
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
/// fresh. Fused ([`crate::fused::attn_softmax`]: CPU, and `kernels/attn.cu` on CUDA).
fn row_probs(q: &Tensor, k: &Tensor, mask: &Tensor, s: &AttnShape, i: usize) -> Result<Tensor> {
    let mask_i = if mask.dim(0)? == s.b && s.b > 1 {
        mask.narrow(0, i, 1)?
    } else {
        mask.clone()
    };
    let scale = 1.0 / (s.head_dim as f64).sqrt();
    // (1, Hkv, G·T, Dh)·(1, Hkv, Dh, T) -> (1, Hkv, G·T, T) in the compute dtype
    let raw = mm(&q.narrow(0, i, 1)?, &k.narrow(0, i, 1)?.t()?)?;
    crate::fused::attn_softmax(&raw, &mask_i, scale)
}

/// `softmax(f32(raw·scale) + mask)` as candle ops: the reference for
/// [`crate::fused::attn_softmax`]. `raw: (1, Hkv, G·T, T)` unscaled scores; `mask: (1, 1, 1, T, T)`
/// additive f32, broadcast over the kv heads and the G query heads of each.
pub fn attention_probs_reference(raw: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let (_, hkv, gt, t) = raw.dims4()?;
    let scores = (raw * scale)?
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
/// the reference for [`crate::fused::attn_softmax_bwd`]. `p` f32, `dp` of its shape.
pub fn attention_grad_reference(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    let dpf = dp.to_dtype(DType::F32)?;
    let row = (&dpf * p)?.sum_keepdim(D::Minus1)?;
    ((p * dpf.broadcast_sub(&row)?)? * scale)?.to_dtype(dp.dtype())
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
    let back = |x: Tensor, heads: usize| x.transpose(1, 2)?.reshape((b * t, heads * dh));
    let mask = match &c.saved {
        AttnSaved::Plain { mask } => mask,
        AttnSaved::Tiled { o, lse, starts } => {
            let scale = 1.0 / (dh as f64).sqrt();
            // d_out and o: (N, H·Dh) = (B, T, H, Dh); q: (B, H, T, Dh)
            let bthd = (b, t, h, dh);
            let (dq, dk, dv) = crate::fused::flash::flash_attn_bwd(
                &c.q.reshape((b, h, t, dh))?,
                &c.k,
                &c.v,
                &o.reshape(bthd)?,
                lse,
                &d_out.reshape(bthd)?,
                starts,
                scale,
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
    let scale = 1.0 / (dh as f64).sqrt();
    let (mut dqs, mut dks, mut dvs) = (
        Vec::with_capacity(b),
        Vec::with_capacity(b),
        Vec::with_capacity(b),
    );
    for i in 0..b {
        let d_oi = d_o.narrow(0, i, 1)?;
        let pf = match &c.p {
            Some(ps) => ps[i].clone(),
            None => row_probs(&c.q, &c.k, mask, s, i)?,
        };
        let p = pf.to_dtype(dt)?;
        // dv: (1, Hkv, T, Dh) sums over the G query heads of each kv head.
        dvs.push(mm(&p.t()?, &d_oi)?);
        // dp: (1, Hkv, G·T, T) in the compute dtype; softmax backward in f32.
        let dp = mm(&d_oi, &c.v.narrow(0, i, 1)?.t()?)?;
        let ds = crate::fused::attn_softmax_bwd(&pf, &dp, scale)?;
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

/// Additive causal mask `(1, 1, 1, T, T)`, f32: 0 where key `j ≤ i` (and `i − j < window`), −∞ elsewhere.
pub fn causal_mask(t: usize, window: Option<usize>, dev: &candle_core::Device) -> Result<Tensor> {
    causal_mask_from(t, 0, window, dev)
}

/// [`causal_mask`] for `n` queries at positions `start..start + n` over keys `0..start + n`:
/// `(1, 1, 1, n, start + n)` (decoding with a key/value cache).
pub fn causal_mask_from(
    n: usize,
    start: usize,
    window: Option<usize>,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    let w = window.unwrap_or(usize::MAX);
    let total = start + n;
    let m: Vec<f32> = (0..n)
        .flat_map(|i| {
            let q = start + i;
            (0..total).map(move |j| {
                if j <= q && q - j < w {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(m, (1, 1, 1, n, total), dev)
}

/// Block-diagonal causal mask of packed rows `(B, 1, 1, T, T)`, f32: key `j` is visible to query `i`
/// of the same row only when both belong to the same sample (`segments[row·T + i]`), `j ≤ i` and
/// `i − j < window`. Every query sees at least itself, so no softmax row is empty.
pub fn segment_mask(
    segments: &[u32],
    b: usize,
    t: usize,
    window: Option<usize>,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    if segments.len() != b * t {
        candle_core::bail!(
            "segment_mask: {} segment ids for a ({b}, {t}) batch",
            segments.len()
        );
    }
    let w = window.unwrap_or(usize::MAX);
    let mut m = vec![f32::NEG_INFINITY; b * t * t];
    for r in 0..b {
        let seg = &segments[r * t..(r + 1) * t];
        for i in 0..t {
            let row = &mut m[(r * t + i) * t..(r * t + i + 1) * t];
            // Segments are contiguous, so the visible keys of query i are one run ending at i.
            let mut j = i;
            loop {
                row[j] = 0.0;
                if j == 0 || seg[j - 1] != seg[i] || i - (j - 1) >= w {
                    break;
                }
                j -= 1;
            }
        }
    }
    Tensor::from_vec(m, (b, 1, 1, t, t), dev)
}

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
    let (loss, dh, _) = cross_entropy_impl(h, w, None, targets, Some(grad_scale), chunk)?;
    Ok((loss, dh.expect("asked for the gradient")))
}

/// [`chunked_cross_entropy`] with trainable token rows in the (tied) lm_head: the logits' columns
/// `head.ids` come from `head.rows` (`crate::tokens`), and the third value is those rows'
/// gradient `(n, D)` f32, summed over the chunks (`None` without `head`).
pub fn chunked_cross_entropy_with(
    h: &Tensor,
    w: &Tensor,
    head: Option<&HeadRows>,
    targets: &[Option<u32>],
    grad_scale: f64,
    chunk: usize,
) -> Result<(f64, Tensor, Option<Tensor>)> {
    let (loss, dh, drows) = cross_entropy_impl(h, w, head, targets, Some(grad_scale), chunk)?;
    Ok((loss, dh.expect("asked for the gradient"), drows))
}

/// [`chunked_cross_entropy`]'s summed loss alone (evaluation: no gradient is formed).
pub fn chunked_cross_entropy_loss(
    h: &Tensor,
    w: &Tensor,
    targets: &[Option<u32>],
    chunk: usize,
) -> Result<f64> {
    Ok(cross_entropy_impl(h, w, None, targets, None, chunk)?.0)
}

/// [`chunked_cross_entropy_loss`] with trainable token rows in the lm_head.
pub fn chunked_cross_entropy_loss_with(
    h: &Tensor,
    w: &Tensor,
    head: Option<&HeadRows>,
    targets: &[Option<u32>],
    chunk: usize,
) -> Result<f64> {
    Ok(cross_entropy_impl(h, w, head, targets, None, chunk)?.0)
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

#[allow(clippy::type_complexity)]
fn cross_entropy_impl(
    h: &Tensor,
    w: &Tensor,
    head: Option<&HeadRows>,
    targets: &[Option<u32>],
    grad_scale: Option<f64>,
    chunk: usize,
) -> Result<(f64, Option<Tensor>, Option<Tensor>)> {
    check_targets(targets, w.dim(0)?)?;
    let dev = h.device();
    let rows: Vec<u32> = (0..targets.len())
        .filter(|&i| targets[i].is_some())
        .map(|i| i as u32)
        .collect();
    // The summed loss stays on the device (f64, chunk sums added in order): one host read at the
    // end, not one sync per chunk.
    let mut loss: Option<Tensor> = None;
    let mut dparts = Vec::new();
    let mut drows: Option<Tensor> = None;
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
        let stats = crate::fused::ce_fwd(&logits, &tgt)?;
        let sum = stats.narrow(1, 1, 1)?.to_dtype(DType::F64)?.sum_all()?;
        loss = Some(match loss {
            Some(l) => (l + sum)?,
            None => sum,
        });
        let Some(scale) = grad_scale else {
            continue;
        };
        // dlogits = (softmax − onehot) · grad_scale, in h's dtype
        let lse = stats.narrow(1, 0, 1)?.squeeze(1)?;
        let dlogits = crate::fused::ce_bwd(&logits, &tgt, &lse, scale)?;
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
    Ok((loss, dh, drows))
}

/// The cross-entropy of each row of `logits: (n, V)` against `targets: (n)` u32 as candle ops, in
/// f32: `(n, 2)` `[lse, lse − logit[target]]`. The reference for [`crate::fused::ce_fwd`].
pub fn cross_entropy_reference(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let z = logits.broadcast_sub(&max)?;
    let ls = z.exp()?.sum_keepdim(D::Minus1)?.log()?; // (n, 1), relative to max
    let picked = z.gather(&targets.unsqueeze(1)?, D::Minus1)?; // (n, 1)
    Tensor::cat(&[(&max + &ls)?, (ls - picked)?], 1)
}

/// `(softmax(logits) − onehot(targets))·scale` in the logits' dtype as candle ops: the reference
/// for [`crate::fused::ce_bwd`].
pub fn cross_entropy_grad_reference(
    logits: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (n, vocab) = logits.dims2()?;
    let dt = logits.dtype();
    let logits = logits.to_dtype(DType::F32)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let z = logits.broadcast_sub(&max)?;
    let ls = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let p = z.broadcast_sub(&ls)?.exp()?;
    let onehot = Tensor::arange(0u32, vocab as u32, logits.device())?
        .unsqueeze(0)?
        .broadcast_as((n, vocab))?
        .broadcast_eq(&targets.unsqueeze(1)?)?
        .to_dtype(DType::F32)?;
    ((p - onehot)? * scale)?.to_dtype(dt)
}

#[cfg(test)]
mod tests;
