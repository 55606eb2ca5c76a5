//! Attention sinks (gpt-oss, transformers 5.24's `eager_attention_forward` in
//! `modeling_gpt_oss.py`): each query head `h` has a learned logit `sink_h` that joins the softmax
//! denominator and is then dropped, `p_j = e^{s_j} / (Σ_k e^{s_k} + e^{sink_h})`, so a row's
//! probabilities sum to `1 − p_sink` and `o = Σ_j p_j v_j`.
//!
//! Applied after either path's attention, from the row's log-sum-exp `L` over the real keys:
//! `L' = logaddexp(L, sink_h)`, each row's output and probabilities scaled by `e^{L − L'}` and the
//! tiled path's `L` replaced by `L'`. The backward is then the path's own, unchanged: with `p'`
//! the softmax backward `ds = p'∘(dp − Σ_row dp∘p')` is exact for the sinked softmax (the sink
//! has no value row, so its `dp` is 0), and FA-2's `P = e^{S − L'}`, `D = rowsum(dO∘O')` are the
//! same quantities. The plain path recomputes `p` in its backward and rescales it by the kept
//! `e^{L − L'}` (`(B, H, T)` f32, O(T)).
//!
//! On the plain path the layer takes [`attend_sinked`] instead, which joins the sinks to the
//! softmax where transformers does, rounding where its eager attention in a 16-bit dtype rounds
//! (`joint_probs`): the scores scaled and rounded, the sink logit concatenated as one more
//! column, the row's max subtracted and rounded, the softmax in f32 rounded, the column dropped,
//! then `p·v`. Its backward is the plain path's with these probabilities (kept or recomputed).
//!
//! The sink's own gradient, `∂L/∂sink_h = −Σ_{b,t} p_sink · D`, `D = dO·O'` per row (the sink's
//! column of the softmax backward, its `dp` being 0): [`sink_grad`].

use candle_core::{bail, DType, Result, Tensor, D};

use super::{row_scores, AttnCache, AttnMask, AttnPath, AttnSaved, AttnShape};

/// What the backward keeps of the sinks: per row `(B, H, T)` f32, the real keys' share of the
/// mass `e^{L − L'}` ([`apply_sinks`]; `None` after [`attend_sinked`]'s plain path, whose
/// probabilities have the sinks in) and the sink's `p_sink = e^{sink − L'}`.
#[derive(Debug, Clone)]
pub struct SinkCache {
    pub scale: Option<Tensor>,
    pub p_sink: Tensor,
    /// The sink logits `(H,)` when the probabilities were formed with them (`joint_probs`): what
    /// the backward recomputes them with.
    pub joined: Option<Tensor>,
}

/// Attention with sinks `sinks: (H,)` on `path` ([`super::attend`]'s arguments): on the plain
/// path the sinks joined to the softmax as transformers joins them (`joint_probs`); on the
/// tiled path [`apply_sinks`] after the attention.
#[allow(clippy::too_many_arguments)]
pub fn attend_sinked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &AttnMask,
    path: AttnPath,
    sinks: &Tensor,
) -> Result<(Tensor, AttnCache)> {
    if sinks.dims() != [s.heads] {
        bail!(
            "attention sinks: `sinks` is {:?}, want one logit a query head ({},)",
            sinks.dims(),
            s.heads
        );
    }
    match path {
        AttnPath::Plain => {
            if s.softcap.is_some() {
                bail!("attention sinks: soft-capped scores with sinks are not supported");
            }
            let keep = super::keep_probs(s);
            super::plain(
                q,
                k,
                v,
                s,
                cos,
                sin,
                &mask.dense()?,
                keep,
                None,
                Some(sinks),
            )
        }
        AttnPath::Tiled => {
            let (o, c) = super::attention_tiled(q, k, v, s, cos, sin, mask)?;
            apply_sinks(&o, c, s, sinks)
        }
    }
}

/// Batch row `i`'s probabilities with the sinks joined, as transformers 5.24's gpt-oss
/// `eager_attention_forward` forms them in the compute dtype `dt` (each step rounded to `dt`
/// where torch's bf16 tensors round): `z = R(R(q·kᵀ)·scale) + mask` (the mask 0 or −∞: exact),
/// the sink `R(sink_h)` concatenated as column `Tk`, `z − max_row(z)` rounded (the max is one of
/// the row's entries: exact in any dtype, the difference not), `p = R(softmax(·))` in f32 (torch's
/// CPU softmax of a bf16 tensor: `e^x · (1/Σ)` in f32, rounded), the column dropped. Returns the
/// real keys' `p: (1, Hkv, G·T, Tk)` and the sink's `(1, H, T)`, f32 holding `dt`'s values.
pub(super) fn joint_probs(
    q: &Tensor,
    k: &Tensor,
    mask: &Tensor,
    s: &AttnShape,
    i: usize,
    sinks: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (t, h, hkv) = (s.t, s.heads, s.kv_heads);
    let g = h / hkv;
    let tk = k.dim(2)?;
    let mask_i = if mask.dim(0)? == s.b && s.b > 1 {
        mask.narrow(0, i, 1)?
    } else {
        mask.clone()
    };
    let raw = row_scores(q, k, i)?; // (1, Hkv, G·T, Tk), the compute dtype
    let dt = raw.dtype();
    let round = |x: Tensor| -> Result<Tensor> {
        match dt {
            DType::F32 => Ok(x),
            _ => x.to_dtype(dt)?.to_dtype(DType::F32),
        }
    };
    // (1, Hkv, G, T, Tk) f32
    let x = (raw * s.scale)?
        .to_dtype(DType::F32)?
        .reshape((1, hkv, g, t, tk))?
        .broadcast_add(&mask_i.reshape((1, 1, 1, t, tk))?)?;
    let sink = round(sinks.to_dtype(DType::F32)?)?
        .reshape((1, hkv, g, 1, 1))?
        .broadcast_as((1, hkv, g, t, 1))?
        .contiguous()?;
    let z = Tensor::cat(&[&x, &sink], 4)?; // (1, Hkv, G, T, Tk + 1)
    let z = round(z.broadcast_sub(&z.max_keepdim(4)?)?)?;
    let e = z.exp()?;
    let p = round(e.broadcast_mul(&e.sum_keepdim(4)?.recip()?)?)?;
    Ok((
        p.narrow(4, 0, tk)?.reshape((1, hkv, g * t, tk))?,
        p.narrow(4, tk, 1)?.reshape((1, h, t))?,
    ))
}

/// Adds the sinks `sinks: (H,)` (any float dtype) to an attention's output `o: (N, H·Dh)` and
/// cache `c` (either path, from [`super::attend`], [`super::attend_after`] or
/// [`super::attention_tiled_kept`] run fresh). Soft-capped scores are refused (no family has both).
pub fn apply_sinks(
    o: &Tensor,
    mut c: AttnCache,
    s: &AttnShape,
    sinks: &Tensor,
) -> Result<(Tensor, AttnCache)> {
    let (b, t, h, dh) = (s.b, s.t, s.heads, s.head_dim);
    if sinks.dims() != [h] {
        bail!(
            "attention sinks: `sinks` is {:?}, want one logit a query head ({h},)",
            sinks.dims()
        );
    }
    if s.softcap.is_some() {
        bail!("attention sinks: soft-capped scores with sinks are not supported");
    }
    if c.sink.is_some() {
        bail!("attention sinks: this cache has its sinks already");
    }
    // L: (B, H, T) f32.
    let lse = match &c.saved {
        AttnSaved::Tiled { lse, .. } => lse.transpose(1, 2)?.contiguous()?,
        AttnSaved::Plain { mask } => plain_lse(&c, mask, s)?,
    };
    let sink = sinks.to_dtype(DType::F32)?.reshape((1, h, 1))?;
    // L' = logaddexp(L, sink), stable.
    let m = lse.broadcast_maximum(&sink)?;
    let sum = (lse.broadcast_sub(&m)?.exp()? + sink.broadcast_sub(&m)?.exp()?)?;
    let lse2 = (m + sum.log()?)?;
    let scale = (&lse - &lse2)?.exp()?; // (B, H, T)
    let p_sink = sink.broadcast_sub(&lse2)?.exp()?;
    // o: (N, H·Dh) = (B, T, H, Dh), scaled per (row, head).
    let per_row = scale.transpose(1, 2)?.unsqueeze(3)?.to_dtype(o.dtype())?;
    let o2 = o
        .reshape((b, t, h, dh))?
        .broadcast_mul(&per_row)?
        .reshape((b * t, h * dh))?;
    let scale = Some(scale);
    match &mut c.saved {
        AttnSaved::Tiled { o: so, lse: sl, .. } => {
            *so = o2.clone();
            *sl = lse2.transpose(1, 2)?.contiguous()?;
        }
        AttnSaved::Plain { .. } => {
            if let Some(ps) = &mut c.p {
                let sc = scale.as_ref().expect("just set");
                for (i, p) in ps.iter_mut().enumerate() {
                    *p = p.broadcast_mul(&row_scale(sc, s, i)?)?;
                }
            }
        }
    }
    c.sink = Some(SinkCache {
        scale,
        p_sink,
        joined: None,
    });
    Ok((o2, c))
}

/// Row `i`'s `scale` as the plain path's probabilities are laid out: `(1, Hkv, G·T, 1)` (query
/// head `h = kv·G + g`).
pub(super) fn row_scale(scale: &Tensor, s: &AttnShape, i: usize) -> Result<Tensor> {
    let g = s.heads / s.kv_heads;
    scale.narrow(0, i, 1)?.reshape((1, s.kv_heads, g * s.t, 1))
}

/// The plain path's log-sum-exp of the masked scaled scores (as `attn_softmax` forms them: the
/// scaling rounded to the scores' dtype, the mask added in f32), `(B, H, T)` f32.
fn plain_lse(c: &AttnCache, mask: &Tensor, s: &AttnShape) -> Result<Tensor> {
    let (b, t, h) = (s.b, s.t, s.heads);
    let g = h / s.kv_heads;
    let tk = c.k.dim(2)?;
    let mut rows = Vec::with_capacity(b);
    for i in 0..b {
        let m = if mask.dim(0)? == b && b > 1 {
            mask.narrow(0, i, 1)?
        } else {
            mask.clone()
        };
        let m = m.reshape((1, 1, 1, t, tk))?;
        let raw = row_scores(&c.q, &c.k, i)?; // (1, Hkv, G·T, Tk)
        let x = (raw * s.scale)?
            .to_dtype(DType::F32)?
            .reshape((1, s.kv_heads, g, t, tk))?
            .broadcast_add(&m)?;
        let max = x.max_keepdim(D::Minus1)?;
        let l = (x
            .broadcast_sub(&max)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?
            + max)?;
        rows.push(l.reshape((1, h, t))?);
    }
    Tensor::cat(&rows, 0)
}

/// `∂L/∂sinks: (H,)` f32 from the output's gradient `d_out` and the sinked output `o`
/// (`(N, H·Dh)` each, as [`apply_sinks`] returned it) and its cache.
pub fn sink_grad(d_out: &Tensor, o: &Tensor, c: &AttnCache, s: &AttnShape) -> Result<Tensor> {
    let Some(sk) = &c.sink else {
        bail!("sink_grad: the cache has no sinks (apply_sinks was not run)");
    };
    let (b, t, h, dh) = (s.b, s.t, s.heads, s.head_dim);
    // D = dO·O' per (row, head): (B, T, H) -> (B, H, T).
    let d = (d_out.to_dtype(DType::F32)? * o.to_dtype(DType::F32)?)?
        .reshape((b, t, h, dh))?
        .sum(3)?
        .transpose(1, 2)?;
    (sk.p_sink.mul(&d)?.sum(2)?.sum(0)?).neg()
}
