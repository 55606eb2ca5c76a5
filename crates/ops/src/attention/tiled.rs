//! Tiled attention with an online softmax (FlashAttention-2's algorithm) on the CPU, forward and
//! backward, memory O(T) per head: the `T × T` scores and probabilities never exist.
//!
//! Forward, per (batch row, query head, tile of [`BR`] queries): stream the key/value tiles of
//! [`BC`] keys that the tile can see, keep per query the running max `m`, sum `l` and the
//! unnormalised output `acc` (f32), rescaling both by `e^(m_old − m_new)` when the max grows;
//! store `O = acc / l` (the inputs' dtype) and the log-sum-exp `L = m + ln l` (f32). `O` comes out
//! as `(B, T, H, Dh)` — the `(N, H·Dh)` the output projection reads, no transpose — and `L` as
//! `(B, T, H)`; the backward reads `O` and `dO` in that layout too, so the model's attention cache
//! holds `O` as the same tensor the layer keeps for the output projection (no extra memory).
//! Backward (FA-2): `D = rowsum(dO ∘ O)`; per key tile recompute `P = e^(S·scale − L)` and
//! `dP = dO·Vᵀ`, then `dS = P ∘ (dP − D)·scale`, `dQ += dS·K`, `dK += dSᵀ·Q`, `dV += Pᵀ·dO`.
//!
//! Soft-capped scores (Gemma 2's `attn_logit_softcapping`, `cap`): the scaled score `s = S·scale`
//! becomes `z = cap·tanh(s/cap)` before the online softmax (the log-sum-exp is of `z`); the
//! backward recomputes `t = tanh(s/cap)` with `P = e^(z − L)` and takes
//! `dS = P ∘ (dP − D) ∘ (1 − t²)·scale`. On f32 inputs in f32 throughout ([`crate::softcap::Cap`]).
//! On bf16/f16 inputs the kernels compute what transformers' eager attention computes (soft-capped
//! attention has no other implementation there; the plain path, [`super::capped`], does the
//! same): each step of the chain (`S`, `S·scale`, `/cap`, `tanh`, `cap·t`) rounded to the inputs'
//! dtype ([`crate::softcap::Cap::eager`]), and `P` the whole row's softmax rounded to that dtype
//! before `P·V` — so the forward takes two passes over the keys, the first finding each row's max
//! and sum (the score products twice); the backward rounds `P` and `dS` likewise. One pass in f32
//! (an unnormalised f32 `P`) left tiny-gemma2's bf16 logits 1.21e-2 from transformers' (the
//! goldens' bound 1e-2); the two passes give them bit for bit (`parity.rs`,
//! `gemma2_bf16_on_the_tiled_attention_matches_peft_bf16`). Memory stays O(T): Gemma 2 at 2048
//! tokens no longer needs the `T × T` scores of the plain path.
//!
//! Visibility is one run of keys per query, given as `starts: (B or 1, T)` u32: query `i` of row
//! `r` sees keys `starts[r, i] ..= i` — causal, with Mistral's sliding window (`start ≥ i + 1 − w`)
//! and packed rows (`start ≥` the first position of the query's sample) folded in by
//! [`crate::attention::AttnMask`]. Key tiles wholly outside a query tile's runs are never visited
//! (causal tile skipping), and no mask tensor is read. GQA/MQA: query head `h` reads kv head
//! `h / (H / Hkv)` in place, K and V are never repeated.
//!
//! Parallel over (batch row, query tile) with rayon in the forward (every head of the tile in one
//! task: its output rows are one contiguous block); in the backward over
//! (batch row, head, chunk of query tiles), each task summing its dK/dV into its own buffer of the
//! keys it sees, the buffers then reduced per kv head (a fixed order: the result does not depend on
//! the thread count). The tile products (`S = Q·Kᵀ`, `P·V`; in the backward `dO·Vᵀ`, `dS·K`, `dSᵀ·Q`,
//! `Pᵀ·dO`) are GEMMs on one thread through the `gemm` crate (`mm`: candle's own CPU GEMM, packed
//! FMA micro-kernels), over the `BR × Dh` query and `BC × Dh` key/value tiles (read in place when
//! the inputs are f32, as f32 copies otherwise), which stay in L1/L2 — but for bf16 inputs with
//! oneDNN in use, where the score products (`S = Q·Kᵀ`, `dP = dO·Vᵀ`: both operands bf16 inputs)
//! run on oneDNN's bf16 kernels reading the rows in place (`scores`,
//! `rtune_backend::onednn::tile`; `RTUNE_UNFUSED=onednn_attn` turns it off; 1.05–1.39× forward +
//! backward at seq 512/2048, README's Speed). The other four keep f32 `P` and `dS` as operands on
//! the gemm crate (bf16 ones would round them; soft-capped scores do round them, above). `P·V`
//! and `Pᵀ·dO` on oneDNN too (`P` rounded to bf16 as torch's CPU flash kernel rounds it, copied
//! to a packed bf16 tile, summed into the f32 accumulators by a sum post-op) were measured slower
//! (2026-12-06, AMD EPYC AVX-512 BF16, load 7–10, `onednn_attention_timing`: oneDNN vs gemm crate
//! 0.72–1.03× against 1.13–1.43× with the score products alone) and not kept; the softmax
//! between them is one vectorized pass over the `BR × BC` scores (the loop nest compiled for AVX-512F or AVX2 when the CPU has it). Like the model's matmuls, the bits
//! depend on the CPU's instruction set (FMA or not), never on the thread count.
//!
//! Under bf16 autocast ([`rtune_backend::blas::autocast`], f32 inputs) the operands of every tile product
//! are rounded to bf16 once, as the plain path's products round theirs: the inputs `Q`, `K`, `V` and
//! `dO` once per call (not per tile read: a key tile is read once per query tile), `P` (after its
//! row sum is taken) before `P·V` and `Pᵀ·dO`, and `dS`
//! before `dS·K` and `dSᵀ·Q`; the sums stay f32 and so do the outputs. Without it the tiled path
//! computed attention in f32 while every other product of the step was rounded: f32 summation noise
//! in `q, k, v` or `dO` (oneDNN vs the fallback, say) then went through instead of vanishing in
//! the rounding, and the tiled and plain paths differed by a bf16-sized amount (8e-3 of the
//! logits on golden_tiny).
//!
//! On CUDA both functions run `kernels/flash_attn.cu` instead (`flash_cuda.rs`, feature `cuda`);
//! that kernel does not round f32 inputs under autocast. Given the mask's causal band
//! ([`flash_attn_with`]), bf16/f16 calls go through cuDNN's fused attention first (`cudnn.rs`).
//!
//! The plain path ([`crate::attention::attention_keeping`] with [`crate::attention::softmax::attn_softmax`]) stays the
//! reference; `tests.rs` compares the two.
//!
//! Measured side by side (2-core dev box, loaded by other builds, no BLAS; `rtune bench` dev
//! profile, bench-small with 2 layers, seq 2048, batch 1, `RTUNE_ATTN=plain` vs `tiled`):
//! 67.2 vs 100.5 tokens/s, peak RSS 819 vs 418 MB; with gradient checkpointing 72.9 vs 88.5
//! tokens/s, 820 vs 384 MB. Full bench-small at seq 512 (batch 4, 8 layers, before the four-row
//! tile products): 46.0 vs 51.7 tokens/s, 1149 vs 856 MB; after them, on a less loaded box,
//! 105.7 vs 102.8 tokens/s, 1135 vs 850 MB, and with checkpointing 62.0 vs 53.3 tokens/s, 509 vs
//! 462 MB. Hence the default on the CPU from [`crate::attention::TILED_MIN_T`] tokens on
//! ([`crate::attention::AttnPath::for_device`]). With the tile products as GEMMs (2026-12-02, 2-core Xeon,
//! OpenBLAS, release build, full bench-small batch 4): plain vs tiled 500.9 vs 659.5 tokens/s at
//! seq 512, 302.1 vs 602.3 at seq 2048 (benches/README.md).

use candle_core::{bail, DType, Layout, Result, Storage, Tensor, WithDType};
use rayon::prelude::*;

use crate::attention::cudnn::Band;
use crate::softcap::Cap;
use rtune_backend::cpu::{exp, max, sum1, Elem, LANES};
use rtune_backend::storage::{by_dtype, contiguous, float_dtype};

/// Queries per tile.
pub const BR: usize = 64;
/// Keys per tile.
pub const BC: usize = 64;
/// Backward tasks to aim for (twice the cores of a 16-core machine): (batch row, head) pairs are
/// split into chunks of query tiles until there are this many.
const BWD_TASKS: usize = 32;

/// The sizes of one call: `q: (b, h, t, dh)`, `k, v: (b, hkv, t, dh)`, `starts: (sb, t)`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    h: usize,
    hkv: usize,
    t: usize,
    dh: usize,
    /// Rows of `starts`: 1 (shared by the batch) or `b`.
    sb: usize,
}

impl Dims {
    fn g(&self) -> usize {
        self.h / self.hkv
    }
    /// Offset of row `i` of head `h` of batch row `b` in a `(b, heads, t, dh)` tensor.
    fn at(&self, heads: usize, b: usize, h: usize, i: usize) -> usize {
        ((b * heads + h) * self.t + i) * self.dh
    }
    /// Offset of row `i` of head `h` of batch row `b` in a `(b, t, h, dh)` tensor.
    fn at_bthd(&self, b: usize, h: usize, i: usize) -> usize {
        ((b * self.t + i) * self.h + h) * self.dh
    }
    /// The same sizes for the CUDA kernels.
    #[cfg(feature = "cuda")]
    fn kernel_shape(&self) -> crate::attention::flash_kernel::FlashShape {
        crate::attention::flash_kernel::FlashShape {
            b: self.b,
            h: self.h,
            hkv: self.hkv,
            t: self.t,
            dh: self.dh,
            sb: self.sb,
        }
    }
    /// The visible-key starts of batch row `b`.
    fn starts<'a>(&self, starts: &'a [u32], b: usize) -> &'a [u32] {
        let r = if self.sb == 1 { 0 } else { b };
        &starts[r * self.t..(r + 1) * self.t]
    }
}

/// Tallies `products` tile-product passes of `(T, Dh)·(Dh, T)` per head for `rtune bench`
/// ([`rtune_backend::served`]; counted whole, as the bench's FLOPs are), the first `dnn` of them
/// on oneDNN: 2 forward (`S = Q·Kᵀ`, `P·V`), 5 backward (`S` again, `dP`, `dQ`, `dK`, `dV`).
fn served(products: usize, dnn: usize, d: &Dims) {
    for n in 0..products {
        rtune_backend::served::record(
            || {
                if n < dnn {
                    "rtune tiled attention (oneDNN bf16 tiles, per-thread streams)".into()
                } else {
                    "rtune tiled attention (gemm crate, f32 tiles)".into()
                }
            },
            d.b * d.h,
            d.t,
            d.dh,
            d.t,
        );
    }
}

/// Whether the score products of this call run on oneDNN: bf16 CPU inputs, oneDNN in use and
/// not turned off (`RTUNE_UNFUSED=onednn_attn`; [`crate::fused::Fused::OnednnAttn`]).
fn onednn_scores(q: &Tensor, dt: DType) -> Result<bool> {
    Ok(dt == DType::BF16
        && q.device().is_cpu()
        && crate::fused::on(q.device(), crate::fused::Fused::OnednnAttn)?)
}

/// `s (nr × nc, row stride BC) = X·Yᵀ`, the score products: `X` the `nr` rows of `x` from
/// offset `xo`, `xs` apart, `Y` the `nc` rows of `y` from `yo`, `ys` apart, each `dh` long. With
/// f32 tiles of both (`f32s`) through the gemm crate ([`mm`]); without, `T` is bf16 and oneDNN
/// reads the rows in place (`rtune_backend::onednn::tile`: bf16 products summed in f32, as the
/// gemm crate sums the same values converted; only the order of the f32 sums differs). Should
/// oneDNN fail, the f32 tiles are made and the gemm crate runs (`gemm_nt` warns once).
#[inline(always)]
fn scores<T: Elem>(
    s: &mut [f32],
    [(x, xo, xs), (y, yo, ys)]: [(&[T], usize, usize); 2],
    f32s: Option<(Mat<'_>, Mat<'_>)>,
    (nr, nc, dh): (usize, usize, usize),
) {
    if let Some((xm, ym)) = f32s {
        return mm(s, BC, false, xm, ym.t(), (nr, nc, dh));
    }
    if let (Some(xb), Some(yb)) = (T::bf16s(&x[xo..]), T::bf16s(&y[yo..])) {
        // `None`: oneDNN not in use; an error has been reported once by `gemm_nt`.
        if let Some(Ok(())) =
            rtune_backend::onednn::tile::gemm_nt((xb, xs), (yb, ys), (s, BC), (nr, nc, dh))
        {
            return;
        }
    }
    let (mut xbuf, mut ybuf) = (Vec::new(), Vec::new());
    let xm = tile(&mut xbuf, x, xo, (nr, dh, xs));
    let ym = tile(&mut ybuf, y, yo, (nc, dh, ys));
    mm(s, BC, false, xm, ym.t(), (nr, nc, dh));
}

/// The shapes of `q, k, v, starts` checked against each other; errors name the op and the tensor.
fn dims(op: &str, q: &Tensor, k: &Tensor, v: &Tensor, starts: &Tensor) -> Result<Dims> {
    let (b, h, t, dh) = q.dims4()?;
    let (kb, hkv, kt, kd) = k.dims4()?;
    if (kb, kt, kd) != (b, t, dh) || hkv == 0 || h % hkv != 0 {
        bail!(
            "{op}: `k` {:?} does not fit `q` {:?} (want (B, Hkv, T, Dh) with Hkv dividing H)",
            k.dims(),
            q.dims()
        );
    }
    if v.dims() != k.dims() {
        bail!("{op}: `v` {:?} but `k` {:?}", v.dims(), k.dims());
    }
    let (sb, st) = starts.dims2()?;
    if st != t || !(sb == 1 || sb == b) || starts.dtype() != DType::U32 {
        bail!(
            "{op}: `starts` is {:?} {:?}, want u32 (1 or {b}, {t})",
            starts.dtype(),
            starts.dims()
        );
    }
    Ok(Dims {
        b,
        h,
        hkv,
        t,
        dh,
        sb,
    })
}

/// The contiguous elements of a CPU tensor's storage.
fn host<'a, T: WithDType>(op: &str, what: &str, s: &'a Storage, l: &Layout) -> Result<&'a [T]> {
    let Storage::Cpu(cs) = s else {
        bail!("{op}: `{what}` is on {:?}; the tiled attention runs on the CPU only (use RTUNE_ATTN=plain)", s.device().location())
    };
    let (a, b) = contiguous(op, what, l)?;
    Ok(&cs.as_slice::<T>()?[a..b])
}

/// The checked starts: `starts[i] ≤ i` (every query sees at least itself, so no softmax is empty).
fn check_starts(op: &str, st: &[u32], t: usize) -> Result<()> {
    if let Some(n) = st.iter().enumerate().position(|(n, &s)| s as usize > n % t) {
        bail!(
            "{op}: `starts` row {} query {} starts at key {} (after itself)",
            n / t,
            n % t,
            st[n]
        );
    }
    Ok(())
}

/// Tiled attention forward. `q: (B, H, T, Dh)`, `k, v: (B, Hkv, T, Dh)` (contiguous, one float
/// dtype), `starts: (B or 1, T)` u32. Returns `o: (B, T, H, Dh)` in the inputs' dtype and the
/// log-sum-exp of each query's scaled scores, `lse: (B, T, H)` f32. Under autocast (f32 inputs)
/// the tile products take bf16-rounded operands (see the module note).
pub fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    starts: &Tensor,
    scale: f64,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    flash_attn_with(q, k, v, starts, None, scale, softcap)
}

/// [`flash_attn`] given also the mask as one causal band when it is one
/// ([`crate::AttnMask::band`], matching `starts`): on CUDA, cuDNN's fused attention then runs it
/// where it can (`cudnn.rs`), with the same outputs; the CPU reads `starts` alone.
pub fn flash_attn_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    starts: &Tensor,
    band: Option<Band>,
    scale: f64,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    let op = "flash_attn";
    let cap = Cap::new(op, softcap)?;
    rtune_backend::blas::layout_audit::call(op, q.dims(), k.dims());
    let d = dims(op, q, k, v, starts)?;
    let dt = float_dtype(op, &[("q", q.dtype()), ("k", k.dtype()), ("v", v.dtype())])?;
    let dnn = onednn_scores(q, dt)?;
    served(2, usize::from(dnn), &d);
    let (q, k, v, starts) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        starts.contiguous()?,
    );
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        no_cuda_cap(op, cap)?;
        return super::flash_cuda::fwd(&d.kernel_shape(), band, [&q, &k, &v, &starts], scale, dt);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = band;
    let round = autocast_rounds(dt);
    let (q, k, v) = (rounded(q, round)?, rounded(k, round)?, rounded(v, round)?);
    let (sq, lq) = q.storage_and_layout();
    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    let (ss, ls) = starts.storage_and_layout();
    let st = host::<u32>(op, "starts", &ss, ls)?;
    check_starts(op, st, d.t)?;
    let dev = q.device();
    let shape = (d.b, d.t, d.h, d.dh);
    let o = by_dtype!(dt, T => {
        let (o, lse) = forward::<T>(
            &d,
            host(op, "q", &sq, lq)?,
            host(op, "k", &sk, lk)?,
            host(op, "v", &sv, lv)?,
            st,
            (scale as f32, cap, round, dnn),
        );
        (Tensor::from_vec(o, shape, dev)?, lse)
    });
    let lse = Tensor::from_vec(o.1, (d.b, d.t, d.h), dev)?;
    Ok((o.0, lse))
}

/// Tiled attention backward. `q, k, v, starts` as given to [`flash_attn`], `o, lse` what it
/// returned (`o: (B, T, H, Dh)`, `lse: (B, T, H)`), `d_o: (B, T, H, Dh)` in the inputs' dtype.
/// Returns `(dq, dk, dv)` shaped and typed like `q, k, v`. Under autocast (f32 inputs) the tile
/// products take bf16-rounded operands, as in [`flash_attn`].
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    starts: &Tensor,
    scale: f64,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor, Tensor)> {
    flash_attn_bwd_with([q, k, v], o, lse, d_o, (starts, None), scale, softcap)
}

/// [`flash_attn_bwd`] given also the mask's band, as [`flash_attn_with`].
pub fn flash_attn_bwd_with(
    [q, k, v]: [&Tensor; 3],
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    (starts, band): (&Tensor, Option<Band>),
    scale: f64,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "flash_attn_bwd";
    let cap = Cap::new(op, softcap)?;
    let d = dims(op, q, k, v, starts)?;
    let dt = float_dtype(
        op,
        &[
            ("q", q.dtype()),
            ("k", k.dtype()),
            ("v", v.dtype()),
            ("o", o.dtype()),
            ("d_o", d_o.dtype()),
        ],
    )?;
    let dnn = onednn_scores(q, dt)?;
    served(5, 2 * usize::from(dnn), &d);
    let bthd = [d.b, d.t, d.h, d.dh];
    if o.dims() != bthd || d_o.dims() != bthd {
        bail!(
            "{op}: `o` {:?} and `d_o` {:?} must be (B, T, H, Dh) = {bthd:?}",
            o.dims(),
            d_o.dims(),
        );
    }
    if lse.dims() != [d.b, d.t, d.h] || lse.dtype() != DType::F32 {
        bail!(
            "{op}: `lse` is {:?} {:?}, want f32 ({}, {}, {})",
            lse.dtype(),
            lse.dims(),
            d.b,
            d.t,
            d.h
        );
    }
    let c = |x: &Tensor| x.contiguous();
    let (q, k, v, o, lse, d_o, starts) = (c(q)?, c(k)?, c(v)?, c(o)?, c(lse)?, c(d_o)?, c(starts)?);
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        no_cuda_cap(op, cap)?;
        let x = [&q, &k, &v, &o, &d_o];
        return super::flash_cuda::bwd(&d.kernel_shape(), band, x, &lse, &starts, scale, dt);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = band;
    // O is no product's operand (it enters D only): never rounded.
    let round = autocast_rounds(dt);
    let r = |x: Tensor| rounded(x, round);
    let (q, k, v, d_o) = (r(q)?, r(k)?, r(v)?, r(d_o)?);
    let (sq, lq) = q.storage_and_layout();
    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    let (so, lo) = o.storage_and_layout();
    let (sl, ll) = lse.storage_and_layout();
    let (sd, ld) = d_o.storage_and_layout();
    let (ss, ls) = starts.storage_and_layout();
    let st = host::<u32>(op, "starts", &ss, ls)?;
    check_starts(op, st, d.t)?;
    let lse_h = host::<f32>(op, "lse", &sl, ll)?;
    let dev = q.device();
    let kv_shape = (d.b, d.hkv, d.t, d.dh);
    by_dtype!(dt, T => {
        let (dq, dk, dv) = backward::<T>(
            &d,
            [
                host(op, "q", &sq, lq)?,
                host(op, "k", &sk, lk)?,
                host(op, "v", &sv, lv)?,
                host(op, "o", &so, lo)?,
                host(op, "d_o", &sd, ld)?,
            ],
            lse_h,
            st,
            (scale as f32, cap, round, dnn),
        );
        Ok((
            Tensor::from_vec(dq, (d.b, d.h, d.t, d.dh), dev)?,
            Tensor::from_vec(dk, kv_shape, dev)?,
            Tensor::from_vec(dv, kv_shape, dev)?,
        ))
    })
}

/// The CUDA flash kernel has no soft cap: the model runs capped scores on the plain path there.
#[cfg(feature = "cuda")]
fn no_cuda_cap(op: &str, cap: Option<Cap>) -> Result<()> {
    if let Some(c) = cap {
        bail!(
            "{op}: soft-capped scores (cap {}) are not in the CUDA flash kernel; use the plain path",
            c.value()
        );
    }
    Ok(())
}

/// `Σ a[i]·b[i]` over [`LANES`] partial sums.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, ra) = a.as_chunks::<LANES>();
    let (cb, rb) = b.as_chunks::<LANES>();
    for (xa, xb) in ca.iter().zip(cb) {
        for i in 0..LANES {
            acc[i] += xa[i] * xb[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    acc.iter().sum::<f32>() + tail
}

/// Whether the tile products round their operands to bf16: f32 inputs under autocast (this
/// thread's mode, as [`rtune_backend::blas::matmul`] reads it; bf16 inputs are bf16 already).
fn autocast_rounds(dt: DType) -> bool {
    dt == DType::F32 && rtune_backend::blas::autocast::on()
}

/// `x` rounded to bf16 (nearest even) when `round`, kept as f32: an input that every tile product
/// takes as an operand, rounded once per call rather than once per tile read.
fn rounded(x: Tensor, round: bool) -> Result<Tensor> {
    if round {
        rtune_backend::cast::round_bf16(&x)
    } else {
        Ok(x)
    }
}

/// Whether soft-capped scores are computed as torch's eager attention computes them: on bf16/f16
/// inputs, each step rounded to `T` ([`Cap::eager`], as the plain path's
/// [`crate::softcap::softcap`]), `P` normalised and rounded (the forward's two passes), `dS`
/// rounded (see the module note).
#[inline(always)]
fn eager<T: Elem>() -> bool {
    T::DTYPE != DType::F32
}

/// `x` rounded to `T` and back.
#[inline(always)]
fn round_to<T: Elem>(x: f32) -> f32 {
    T::of(x).f()
}

/// `x` rounded to bf16 in place (nearest even), kept as f32: an autocast GEMM operand.
#[inline(always)]
fn round_bf16(x: &mut [f32]) {
    x.iter_mut()
        .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
}

/// A tile operand: `x(i, k) = data[i·rs + k·cs]` (`rs`, `cs`: row and column strides).
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// Row-major with `ld` elements a row.
    fn rows(data: &'a [f32], ld: usize) -> Self {
        Mat {
            data,
            rs: ld,
            cs: 1,
        }
    }
    /// The transpose.
    fn t(self) -> Self {
        Mat {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
    /// The first `n` elements of row `r` (of a view with unit column stride).
    fn row(&self, r: usize, n: usize) -> &'a [f32] {
        debug_assert_eq!(self.cs, 1);
        &self.data[r * self.rs..r * self.rs + n]
    }
    /// Whether every element of an `m × n` view lies inside `data`.
    fn covers(&self, m: usize, n: usize) -> bool {
        m == 0 || n == 0 || (m - 1) * self.rs + (n - 1) * self.cs < self.data.len()
    }
}

/// The tile product `c (m × n, row stride ldc) = [c +] a (m × k) · b (k × n)` on one thread, through
/// the `gemm` crate (candle's CPU GEMM: packed AVX-512 or AVX2/FMA micro-kernels, chosen at run
/// time; the AVX-512 ones need the crate's `x86-v4` feature, which rtune-model enables).
/// `accumulate`: add to `c`, else overwrite it.
#[inline(always)]
fn mm(
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    a: Mat<'_>,
    b: Mat<'_>,
    (m, n, k): (usize, usize, usize),
) {
    // The bounds the raw pointers below are read and written within (a real check, not a debug
    // one: the call is unsafe and a wrong tile size must not become an out-of-bounds write).
    assert!(
        a.covers(m, k) && b.covers(k, n) && Mat::rows(c, ldc).covers(m, n) && n <= ldc,
        "flash: tile product {m}×{k}·{k}×{n} out of its buffers"
    );
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: every element of the three views is in bounds (checked above), `c` is borrowed
    // mutably and does not alias `a` or `b` (shared borrows), and `gemm` reads/writes only the
    // `m × n`, `m × k`, `k × n` elements the strides describe.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            ldc as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// `rows` rows of `dh` elements, `stride` apart, from offset `base` of `src`, as an f32 tile:
/// read in place when `T` is f32, else converted into `buf` (packed, row stride `dh`).
#[inline(always)]
fn tile<'a, T: Elem>(
    buf: &'a mut Vec<f32>,
    src: &'a [T],
    base: usize,
    (rows, dh, stride): (usize, usize, usize),
) -> Mat<'a> {
    let end = base + rows.saturating_sub(1) * stride + dh;
    if let Some(x) = T::f32s(&src[base..end]) {
        return Mat::rows(x, stride);
    }
    buf.clear();
    for r in 0..rows {
        let a = base + r * stride;
        buf.extend(src[a..a + dh].iter().map(|x| x.f()));
    }
    Mat::rows(buf, dh)
}

/// The query tiles of each (batch row, head) and the key range `lo..hi` a tile of queries
/// `i0..i1` can see.
fn key_range(st: &[u32], i0: usize, i1: usize) -> (usize, usize) {
    let lo = st[i0..i1].iter().copied().min().unwrap_or(0) as usize;
    (lo, i1)
}

/// The visible keys of query `i` in the key tile `j0..j0 + nc`, as tile columns `c0..c1`:
/// `(st[i] ..= i) ∩ (j0..j0 + nc)`, empty (`c0 == c1`) when the two do not meet.
#[inline(always)]
fn visible(st: &[u32], i: usize, j0: usize, nc: usize) -> (usize, usize) {
    let c0 = ((st[i] as usize).max(j0) - j0).min(nc);
    let c1 = (i + 1).min(j0 + nc).saturating_sub(j0).max(c0);
    (c0, c1)
}

/// Runs `f` compiled for AVX-512F or AVX2 when the CPU has it, else for the baseline.
#[inline(always)]
fn dispatch<K: Task>(k: &K, job: K::Job<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        let cpu = rtune_backend::cpu_features::get();
        if cpu.avx512f {
            // SAFETY: the CPU has AVX-512F, checked on the line above.
            return unsafe { run_avx512(k, job) };
        }
        if cpu.avx2 {
            // SAFETY: the CPU has AVX2, checked on the line above.
            return unsafe { run_avx2(k, job) };
        }
    }
    k.run(job)
}

/// One parallel task; `run` is `#[inline(always)]` so [`dispatch`]'s copies compile the whole loop
/// nest for their instruction set.
trait Task: Sync {
    type Job<'j>;
    fn run(&self, job: Self::Job<'_>);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_avx512<K: Task>(k: &K, job: K::Job<'_>) {
    k.run(job)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_avx2<K: Task>(k: &K, job: K::Job<'_>) {
    k.run(job)
}

struct Fwd<'a, T> {
    d: Dims,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    st: &'a [u32],
    scale: f32,
    /// The soft cap of the scaled scores.
    cap: Option<Cap>,
    /// Autocast: `P` (and `dS`) rounded to bf16 before their products; the inputs come rounded.
    round: bool,
    /// `S = Q·Kᵀ` of bf16 inputs through oneDNN ([`scores`]).
    dnn: bool,
}

/// One forward job: (batch row, first query) and the tile's output rows `(nr, H, Dh)` and lse
/// `(nr, H)`.
type FwdJob<'j, T> = ((usize, usize), &'j mut [T], &'j mut [f32]);

impl<T: Elem> Task for Fwd<'_, T> {
    type Job<'j> = FwdJob<'j, T>;

    #[inline(always)]
    fn run(&self, ((b, i0), o, lse): Self::Job<'_>) {
        let d = &self.d;
        let (dh, nh) = (d.dh, d.h);
        let nr = lse.len() / nh;
        let i1 = i0 + nr;
        let st = d.starts(self.st, b);
        let (lo, hi) = key_range(st, i0, i1);
        let (mut qbuf, mut kbuf, mut vbuf) = (Vec::new(), Vec::new(), Vec::new());
        let mut m = vec![0f32; nr];
        let mut l = vec![0f32; nr];
        let mut acc = vec![0f32; nr * dh];
        let mut sq = vec![0f32; BR * BC];
        // Soft-capped scores on bf16/f16 inputs: P normalised and rounded as eager's softmax
        // output, a first pass over the keys finding each row's max and sum ([`eager`]).
        let two_pass = self.cap.is_some() && eager::<T>();
        for h in 0..nh {
            let hk = h / d.g();
            // Q and K enter S = Q·Kᵀ only: no f32 tiles of them when oneDNN reads them in place.
            let q_at = d.at(d.h, b, h, i0);
            let qm = (!self.dnn).then(|| tile(&mut qbuf, self.q, q_at, (nr, dh, dh)));
            m.fill(f32::NEG_INFINITY);
            l.fill(0.0);
            acc.fill(0.0);
            // `pv`: the pass that sums P·V (the only one without `two_pass`; the first of two
            // finds the rows' max and sum only).
            let passes: &[bool] = if two_pass { &[false, true] } else { &[true] };
            for &pv in passes {
                let mut j0 = lo;
                while j0 < hi {
                    let j1 = (j0 + BC).min(hi);
                    let nc = j1 - j0;
                    let kv = d.at(d.hkv, b, hk, j0);
                    let km = (!self.dnn).then(|| tile(&mut kbuf, self.k, kv, (nc, dh, dh)));
                    // S = Q·Kᵀ of the whole tile (masked pairs too: only on the tiles the runs'
                    // ends cut), (nr, nc) with row stride BC.
                    let rows = [(self.q, q_at, dh), (self.k, kv, dh)];
                    scores(&mut sq, rows, qm.zip(km), (nr, nc, dh));
                    // S → P = e^(S·scale − m_new) in place, masked pairs 0; rescale acc and l.
                    for r in 0..nr {
                        let i = i0 + r;
                        let (c0, c1) = visible(st, i, j0, nc);
                        let row = &mut sq[r * BC..r * BC + nc];
                        row[..c0].fill(0.0);
                        row[c1..].fill(0.0);
                        if c0 == c1 {
                            continue;
                        }
                        let vis = &mut row[c0..c1];
                        match self.cap {
                            // Rounded as torch's eager steps in T (bf16/f16 inputs).
                            Some(cap) if eager::<T>() => vis
                                .iter_mut()
                                .for_each(|x| *x = cap.eager(*x, self.scale, round_to::<T>).1),
                            Some(cap) => {
                                vis.iter_mut().for_each(|x| *x *= self.scale);
                                cap.apply(vis)
                            }
                            None => vis.iter_mut().for_each(|x| *x *= self.scale),
                        }
                        if two_pass && pv {
                            // softmax(z) of the whole row, rounded to T: eager's P.
                            let (mr, lr) = (m[r], l[r]);
                            vis.iter_mut()
                                .for_each(|x| *x = round_to::<T>(exp(*x - mr) / lr));
                            continue;
                        }
                        let mt = max(vis);
                        let mn = if mt > m[r] { mt } else { m[r] };
                        // m[r] = −∞ before the first visible key: alpha = 0 (acc and l are 0).
                        let alpha = exp(m[r] - mn);
                        if alpha != 1.0 && pv {
                            acc[r * dh..(r + 1) * dh]
                                .iter_mut()
                                .for_each(|x| *x *= alpha);
                        }
                        vis.iter_mut().for_each(|x| *x = exp(*x - mn));
                        l[r] = l[r] * alpha + sum1(vis, |x| x);
                        m[r] = mn;
                        // The sum takes P as computed; P·V its bf16 values (torch's CPU flash
                        // attention in bf16 rounds the same unnormalised P).
                        if self.round {
                            round_bf16(vis);
                        }
                    }
                    if pv {
                        // acc += P·V: (nr, nc)·(nc, dh).
                        let vm = tile(&mut vbuf, self.v, kv, (nc, dh, dh));
                        mm(&mut acc, dh, true, Mat::rows(&sq, BC), vm, (nr, dh, nc));
                    }
                    j0 = j1;
                }
            }
            for r in 0..nr {
                // With two passes P was normalised already.
                let inv = if two_pass { 1.0 } else { 1.0 / l[r] };
                let orow = &mut o[(r * nh + h) * dh..(r * nh + h + 1) * dh];
                for (y, &x) in orow.iter_mut().zip(&acc[r * dh..(r + 1) * dh]) {
                    *y = T::of(x * inv);
                }
                lse[r * nh + h] = m[r] + l[r].ln();
            }
        }
    }
}

/// The forward loops: `(o, lse)`, `(B, T, H, Dh)` and `(B, T, H)`.
/// `(scale, cap, round, dnn)`: the score scale, the soft cap, whether `P` (and `dS`) are
/// rounded to bf16 before their products (autocast; the inputs arrive rounded), and whether
/// the score products of bf16 inputs run on oneDNN ([`scores`]).
fn forward<T: Elem>(
    d: &Dims,
    q: &[T],
    k: &[T],
    v: &[T],
    st: &[u32],
    (scale, cap, round, dnn): (f32, Option<Cap>, bool, bool),
) -> (Vec<T>, Vec<f32>) {
    let (t, hd) = (d.t, d.h * d.dh);
    let mut o = vec![T::of(0.0); d.b * t * hd];
    let mut lse = vec![0f32; d.b * t * d.h];
    let mut jobs = Vec::new();
    for ((b, o_b), l_b) in o
        .chunks_mut(t * hd)
        .enumerate()
        .zip(lse.chunks_mut(t * d.h))
    {
        for ((n, ot), lt) in o_b
            .chunks_mut(BR * hd)
            .enumerate()
            .zip(l_b.chunks_mut(BR * d.h))
        {
            jobs.push(((b, n * BR), ot, lt));
        }
    }
    let f = Fwd {
        d: *d,
        q,
        k,
        v,
        st,
        scale,
        cap,
        round,
        dnn: dnn && T::bf16s(q).is_some(),
    };
    // Latest query tiles first: under the causal mask they see the most keys.
    jobs.reverse();
    jobs.into_par_iter().for_each(|job| dispatch(&f, job));
    (o, lse)
}

struct Bwd<'a, T> {
    d: Dims,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    o: &'a [T],
    d_o: &'a [T],
    lse: &'a [f32],
    st: &'a [u32],
    scale: f32,
    /// The soft cap of the scaled scores.
    cap: Option<Cap>,
    /// Autocast: `P` (and `dS`) rounded to bf16 before their products; the inputs come rounded.
    round: bool,
    /// `S = Q·Kᵀ` and `dP = dO·Vᵀ` of bf16 inputs through oneDNN ([`scores`]).
    dnn: bool,
    /// Query tiles per task.
    tiles: usize,
}

/// One backward job: (batch row, head, first query tile), the task's dQ rows, and its partial
/// dK/dV over keys `lo..` (the buffer's first key).
type BwdJob<'j, T> = (
    (usize, usize, usize),
    &'j mut [T],
    &'j mut (usize, Vec<f32>, Vec<f32>),
);

impl<T: Elem> Task for Bwd<'_, T> {
    type Job<'j> = BwdJob<'j, T>;

    #[inline(always)]
    fn run(&self, ((b, h, n0), dq_out, part): Self::Job<'_>) {
        let d = &self.d;
        let dh = d.dh;
        let hk = h / d.g();
        let st = d.starts(self.st, b);
        let q_end = ((n0 + self.tiles) * BR).min(d.t);
        let (lo_all, _) = key_range(st, n0 * BR, q_end);
        // Partial dK/dV of keys lo_all..q_end, f32.
        let (plo, pk, pv) = part;
        *plo = lo_all;
        *pk = vec![0f32; (q_end - lo_all) * dh];
        *pv = vec![0f32; (q_end - lo_all) * dh];
        let (mut qbuf, mut dobuf, mut obuf) = (Vec::new(), Vec::new(), Vec::new());
        let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
        let (mut sq, mut sdp) = (vec![0f32; BR * BC], vec![0f32; BR * BC]);
        for n in n0..n0 + self.tiles {
            let i0 = n * BR;
            if i0 >= d.t {
                break;
            }
            let i1 = (i0 + BR).min(d.t);
            let nr = i1 - i0;
            let qm = tile(&mut qbuf, self.q, d.at(d.h, b, h, i0), (nr, dh, dh));
            let (base, hd) = (d.at_bthd(b, h, i0), d.h * dh);
            let dom = tile(&mut dobuf, self.d_o, base, (nr, dh, hd));
            let om = tile(&mut obuf, self.o, base, (nr, dh, hd));
            let lse: Vec<f32> = (0..nr)
                .map(|r| self.lse[(b * d.t + i0 + r) * d.h + h])
                .collect();
            // D = rowsum(dO ∘ O)
            let dd: Vec<f32> = (0..nr)
                .map(|r| dot(dom.row(r, dh), om.row(r, dh)))
                .collect();
            let mut dqt = vec![0f32; nr * dh];
            let (lo, hi) = key_range(st, i0, i1);
            let mut j0 = lo;
            while j0 < hi {
                let j1 = (j0 + BC).min(hi);
                let nc = j1 - j0;
                let kv = d.at(d.hkv, b, hk, j0);
                let km = tile(&mut kbuf, self.k, kv, (nc, dh, dh));
                // V enters dP = dO·Vᵀ only: no f32 tile of it when oneDNN reads it in place.
                let vm = (!self.dnn).then(|| tile(&mut vbuf, self.v, kv, (nc, dh, dh)));
                let poff = (j0 - lo_all) * dh;
                let pk = &mut pk[poff..poff + nc * dh];
                let pv = &mut pv[poff..poff + nc * dh];
                // S = Q·Kᵀ and dP = dO·Vᵀ of the whole tile, (nr, nc) with row stride BC.
                let f32 = !self.dnn;
                let q_at = d.at(d.h, b, h, i0);
                let rows = [(self.q, q_at, dh), (self.k, kv, dh)];
                scores(&mut sq, rows, f32.then_some((qm, km)), (nr, nc, dh));
                let rows = [(self.d_o, base, hd), (self.v, kv, dh)];
                scores(&mut sdp, rows, f32.then_some(dom).zip(vm), (nr, nc, dh));
                // In place: S → P = e^(S·scale − L), dP → dS = P ∘ (dP − D)·scale; masked pairs 0.
                for r in 0..nr {
                    let i = i0 + r;
                    let (c0, c1) = visible(st, i, j0, nc);
                    let (pr, dsr) = (&mut sq[r * BC..r * BC + nc], &mut sdp[r * BC..r * BC + nc]);
                    pr[..c0].fill(0.0);
                    pr[c1..].fill(0.0);
                    dsr[..c0].fill(0.0);
                    dsr[c1..].fill(0.0);
                    if let Some(cap) = self.cap {
                        // z = cap·t, t = tanh(s/cap): dz/ds = 1 − t².
                        // The forward's z (rounded as it rounded them on bf16/f16 inputs).
                        let eager = eager::<T>();
                        for (p, ds) in pr[c0..c1].iter_mut().zip(&mut dsr[c0..c1]) {
                            let (t, z) = if eager {
                                cap.eager(*p, self.scale, round_to::<T>)
                            } else {
                                let t = cap.tanh(*p * self.scale);
                                (t, cap.of_tanh(t))
                            };
                            *p = exp(z - lse[r]);
                            *ds = *p * (*ds - dd[r]) * Cap::slope(t) * self.scale;
                        }
                    } else {
                        for (p, ds) in pr[c0..c1].iter_mut().zip(&mut dsr[c0..c1]) {
                            *p = exp(*p * self.scale - lse[r]);
                            *ds = *p * (*ds - dd[r]) * self.scale;
                        }
                    }
                    // dS from P as computed; the products take their bf16 values.
                    if self.round {
                        round_bf16(&mut pr[c0..c1]);
                        round_bf16(&mut dsr[c0..c1]);
                    } else if self.cap.is_some() && eager::<T>() {
                        // Eager's P and dS are tensors of T (the forward's two passes).
                        for x in pr[c0..c1].iter_mut().chain(&mut dsr[c0..c1]) {
                            *x = round_to::<T>(*x);
                        }
                    }
                }
                // dQ += dS·K, dK += dSᵀ·Q, dV += Pᵀ·dO: (nr, nc)·(nc, dh) and (nc, nr)·(nr, dh).
                let (pm, dsm) = (Mat::rows(&sq, BC), Mat::rows(&sdp, BC));
                mm(&mut dqt, dh, true, dsm, km, (nr, dh, nc));
                mm(pk, dh, true, dsm.t(), qm, (nc, dh, nr));
                mm(pv, dh, true, pm.t(), dom, (nc, dh, nr));
                j0 = j1;
            }
            let off = (i0 - n0 * BR) * dh;
            for (y, &x) in dq_out[off..off + nr * dh].iter_mut().zip(&dqt) {
                *y = T::of(x);
            }
        }
    }
}

/// The backward loops: `(dq, dk, dv)`. `x = [q, k, v, o, d_o]`; `(scale, cap, round, dnn)` as
/// [`forward`].
fn backward<T: Elem>(
    d: &Dims,
    x: [&[T]; 5],
    lse: &[f32],
    st: &[u32],
    (scale, cap, round, dnn): (f32, Option<Cap>, bool, bool),
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let [q, k, v, o, d_o] = x;
    let (t, dh) = (d.t, d.dh);
    let ntiles = t.div_ceil(BR);
    // At least BWD_TASKS tasks, no more than needed: each holds a dK/dV buffer. Fixed by the shape
    // alone, so the summation order (and the bits) do not depend on the thread count.
    let heads = d.b * d.h;
    let want = BWD_TASKS.div_ceil(heads.max(1));
    let tiles = ntiles.div_ceil(want.clamp(1, ntiles.max(1))).max(1);
    let chunks = ntiles.div_ceil(tiles);
    let mut dq = vec![T::of(0.0); heads * t * dh];
    let mut parts: Vec<(usize, Vec<f32>, Vec<f32>)> = (0..heads * chunks)
        .map(|_| (0, Vec::new(), Vec::new()))
        .collect();
    let mut jobs = Vec::new();
    for ((bh, dq_bh), parts_bh) in dq
        .chunks_mut(t * dh)
        .enumerate()
        .zip(parts.chunks_mut(chunks))
    {
        for ((c, dqc), part) in dq_bh
            .chunks_mut(tiles * BR * dh)
            .enumerate()
            .zip(parts_bh.iter_mut())
        {
            jobs.push(((bh / d.h, bh % d.h, c * tiles), dqc, part));
        }
    }
    let f = Bwd {
        d: *d,
        q,
        k,
        v,
        o,
        d_o,
        lse,
        st,
        scale,
        cap,
        round,
        dnn: dnn && T::bf16s(q).is_some(),
        tiles,
    };
    jobs.reverse();
    jobs.into_par_iter().for_each(|job| dispatch(&f, job));
    // dK, dV of kv head hk of row b: the parts of its G query heads and their chunks, in order.
    let g = d.g();
    let mut dk = vec![T::of(0.0); d.b * d.hkv * t * dh];
    let mut dv = vec![T::of(0.0); d.b * d.hkv * t * dh];
    dk.par_chunks_mut(t * dh)
        .zip(dv.par_chunks_mut(t * dh))
        .enumerate()
        .for_each(|(bk, (dk, dv))| {
            let (b, hk) = (bk / d.hkv, bk % d.hkv);
            let mut ak = vec![0f32; t * dh];
            let mut av = vec![0f32; t * dh];
            for h in hk * g..(hk + 1) * g {
                for (lo, pk, pv) in &parts[(b * d.h + h) * chunks..(b * d.h + h + 1) * chunks] {
                    let off = lo * dh;
                    for (y, x) in ak[off..off + pk.len()].iter_mut().zip(pk) {
                        *y += x;
                    }
                    for (y, x) in av[off..off + pv.len()].iter_mut().zip(pv) {
                        *y += x;
                    }
                }
            }
            for (y, x) in dk.iter_mut().zip(&ak) {
                *y = T::of(*x);
            }
            for (y, x) in dv.iter_mut().zip(&av) {
                *y = T::of(*x);
            }
        });
    (dq, dk, dv)
}
