//! The tiled attention through cuDNN's fused SDPA on CUDA (issue 48, item 1): which calls cuDNN
//! can take ([`plan`]: the mask as a diagonal band, the dtype, the head dim), the descriptor that
//! maps rtune's layouts onto cuDNN's (B, H, S, D) strides, and the launch on cudarc views
//! ([`sdpa_fwd`], [`sdpa_bwd`], feature `kernels`). `flash_cuda.rs` tries this first and runs
//! `kernels/flash_attn.cu` for everything else; `RTUNE_UNFUSED=cudnn` turns it off
//! (`crate::fused`). The library and the shim's C ABI: `rtune_backend::cudnn`.
//!
//! Same semantics, inputs and outputs as the own kernel (`flash_ref.rs`):
//! `q: (B, H, T, Dh)`, `k, v: (B, Hkv, T, Dh)` contiguous; `o: (B, T, H, Dh)` (the output
//! projection's `(N, H·Dh)`, no transpose); `lse: (B, T, H)` f32, the natural-log log-sum-exp of
//! the scaled scores, which is cuDNN's softmax "Stats" given these strides — so a forward by one
//! engine and a backward by the other agree (`rtune selftest` checks both against the own
//! kernel). GQA/MQA: cuDNN reads kv head `h / (H / Hkv)` in place, as the own kernel does.
//!
//! What falls back to the own kernel, and why:
//! - a mask that is not one causal band a row: packed rows (per-row `starts`) and decoding after a
//!   cache ([`crate::AttnMask::band`] is `None`): cuDNN's band is the same for every row;
//! - f32: cuDNN's fused SDPA has bf16/f16 operands only;
//! - a head dim that is not a multiple of 8 or over 256 (cuDNN's fused kernels);
//! - soft-capped scores never reach the CUDA tiled path (the plain path runs them: no engine
//!   here has the cap; cuDNN could express it only as a score-modifier subgraph, not done);
//! - whatever cuDNN itself answers "not supported" for (its version, the card): the shim
//!   reports it and the own kernel runs, with a one-line notice per reason.

use candle_core::DType;
use rtune_backend::cudnn::{SdpaDesc, SDPA_BF16, SDPA_F16};

use crate::attention::flash_ref::FlashShape;

/// A mask that is one causal diagonal band, the same for every row: query `i` sees keys
/// `i − w < j ≤ i` (`window: Some(w)`) or `j ≤ i` (`None`). What [`crate::AttnMask::band`] gives
/// for one sample a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Band {
    pub window: Option<usize>,
}

/// Why a call runs the own kernel instead of cuDNN ([`plan`]).
#[derive(Debug, Clone, PartialEq)]
pub enum NoCudnn {
    /// Packed rows or keys after a cache: not one band for the batch.
    Mask,
    /// cuDNN's fused SDPA takes bf16 and f16.
    Dtype(DType),
    /// Not a multiple of 8, or over 256.
    HeadDim(usize),
    /// Kv heads that do not divide the heads, or a size over `i32`.
    Shape(String),
}

impl std::fmt::Display for NoCudnn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoCudnn::Mask => write!(f, "packed rows or cached keys (not one causal band)"),
            NoCudnn::Dtype(dt) => write!(f, "{dt:?} (cuDNN's fused attention takes bf16, f16)"),
            NoCudnn::HeadDim(d) => write!(f, "head dim {d} (cuDNN: a multiple of 8, at most 256)"),
            NoCudnn::Shape(m) => write!(f, "{m}"),
        }
    }
}

/// The descriptor of one call on cuDNN, or why the own kernel runs it. `s` and the layouts are the
/// own kernel's (module note); `band` is the mask's ([`crate::AttnMask::band`]).
pub fn plan(
    s: &FlashShape,
    band: Option<Band>,
    dt: DType,
    scale: f64,
) -> Result<SdpaDesc, NoCudnn> {
    let band = band.ok_or(NoCudnn::Mask)?;
    if s.sb != 1 {
        // A band is one row of starts for the whole batch.
        return Err(NoCudnn::Mask);
    }
    let dtype = match dt {
        DType::BF16 => SDPA_BF16,
        DType::F16 => SDPA_F16,
        other => return Err(NoCudnn::Dtype(other)),
    };
    if s.dh == 0 || !s.dh.is_multiple_of(8) || s.dh > 256 {
        return Err(NoCudnn::HeadDim(s.dh));
    }
    if s.hkv == 0 || !s.h.is_multiple_of(s.hkv) {
        return Err(NoCudnn::Shape(format!(
            "{} kv heads do not divide {} heads",
            s.hkv, s.h
        )));
    }
    let total = [s.b, s.h, s.t, s.dh]
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d));
    if s.t > i32::MAX as usize || total.is_none_or(|n| n > i64::MAX as usize) {
        return Err(NoCudnn::Shape(format!(
            "({}, {}, {}, {}) is too large",
            s.b, s.h, s.t, s.dh
        )));
    }
    // A window of at least T keys masks nothing beyond causality; Some(0) is one key, as
    // AttnMask reads it.
    let window = match band.window {
        Some(w) if w < s.t => w.max(1) as i32,
        _ => 0,
    };
    let [b, h, hkv, t, dh] = [s.b, s.h, s.hkv, s.t, s.dh].map(|x| x as i64);
    Ok(SdpaDesc {
        b,
        h,
        hkv,
        s: t,
        d: dh,
        // (B, H, T, Dh) row-major
        q: [h * t * dh, t * dh, dh, 1],
        // (B, Hkv, T, Dh) row-major
        k: [hkv * t * dh, t * dh, dh, 1],
        v: [hkv * t * dh, t * dh, dh, 1],
        // (B, T, H, Dh) row-major, read as (B, H, T, Dh)
        o: [t * h * dh, dh, h * dh, 1],
        // (B, T, H) row-major, read as (B, H, T)
        lse: [t * h, 1, h],
        dtype,
        window,
        scale: scale as f32,
        pad: 0,
    })
}

/// Elements a tensor of `dims` with `strides` spans: one past its last element's offset (0 when
/// empty).
pub fn extent(dims: [i64; 4], strides: [i64; 4]) -> usize {
    if dims.contains(&0) {
        return 0;
    }
    1 + dims
        .iter()
        .zip(strides)
        .map(|(&d, s)| ((d - 1) * s) as usize)
        .sum::<usize>()
}

/// The element counts `q, k, v, o, lse` of `d` span, in that order.
pub fn extents(d: &SdpaDesc) -> [usize; 5] {
    let lse = [d.lse[0], d.lse[1], d.lse[2], 1];
    [
        extent([d.b, d.h, d.s, d.d], d.q),
        extent([d.b, d.hkv, d.s, d.d], d.k),
        extent([d.b, d.hkv, d.s, d.d], d.v),
        extent([d.b, d.h, d.s, d.d], d.o),
        extent([d.b, d.h, d.s, 1], lse),
    ]
}

#[cfg(feature = "kernels")]
mod launch {
    //! The calls on cudarc views.
    use super::{extents, plan, Band, FlashShape, NoCudnn};
    use candle_core::DType;
    use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
    use rtune_backend::cudnn::{notice, Cudnn, Outcome, SdpaDesc};
    use rtune_backend::launch::{need, FusedFloat};
    use rtune_backend::{drv, Result};
    use std::ffi::c_void;
    use std::sync::Arc;

    /// The candle dtype of `T`.
    fn dtype_of<T: FusedFloat>() -> DType {
        match T::INDEX {
            1 => DType::BF16,
            2 => DType::F16,
            _ => DType::F32,
        }
    }

    /// [`plan`] for `T`, or `None` with the reason noticed once (packed rows, decoding and
    /// `RTUNE_UNFUSED=cudnn` give no band: routine, no notice).
    fn planned<T: FusedFloat>(s: &FlashShape, band: Option<Band>, scale: f32) -> Option<SdpaDesc> {
        match plan(s, band, dtype_of::<T>(), scale as f64) {
            Ok(d) => Some(d),
            Err(NoCudnn::Mask) => None,
            Err(why) => {
                notice(&why.to_string());
                None
            }
        }
    }

    /// cuDNN, or `None` with the reason noticed once.
    fn library() -> Option<&'static Cudnn> {
        match rtune_backend::cudnn::get() {
            Ok(lib) => Some(lib),
            Err(why) => {
                notice(&why.to_string());
                None
            }
        }
    }

    /// The forward through cuDNN where it can take the call (`plan`, the library, the graph):
    /// `true` when it ran (`o`, `lse` written), `false` with the reason noticed once (run the own
    /// kernel, which writes every output). `q, k, v, o, lse` as the own kernel's `flash_fwd`.
    pub fn try_fwd<T: FusedFloat>(
        stream: &Arc<CudaStream>,
        s: &FlashShape,
        band: Option<Band>,
        scale: f32,
        x: [&CudaView<'_, T>; 3],
        o: &mut CudaViewMut<'_, T>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> bool {
        let Some(d) = planned::<T>(s, band, scale) else {
            return false;
        };
        let Some(lib) = library() else {
            return false;
        };
        match sdpa_fwd(lib, stream, &d, x, o, lse) {
            Ok(Outcome::Done(())) => true,
            Ok(Outcome::Unsupported(why)) => {
                notice(&format!("forward: {why}"));
                false
            }
            // A graph that failed to build or run (a missing CUDA runtime, say): the own kernel
            // writes every output again, so the step goes on; `rtune selftest` reports the error.
            Err(e) => {
                notice(&format!("forward failed: {e}"));
                false
            }
        }
    }

    /// The backward through cuDNN where it can take the call, as [`try_fwd`]; `lse` may come from
    /// either engine's forward (the same log-sum-exp in the same layout).
    #[allow(clippy::too_many_arguments)]
    pub fn try_bwd<T: FusedFloat>(
        stream: &Arc<CudaStream>,
        s: &FlashShape,
        band: Option<Band>,
        scale: f32,
        x: [&CudaView<'_, T>; 5],
        lse: &CudaView<'_, f32>,
        grads: [&mut CudaViewMut<'_, T>; 3],
    ) -> bool {
        let Some(d) = planned::<T>(s, band, scale) else {
            return false;
        };
        let Some(lib) = library() else {
            return false;
        };
        match sdpa_bwd(lib, stream, &d, x, lse, grads) {
            Ok(Outcome::Done(())) => true,
            Ok(Outcome::Unsupported(why)) => {
                notice(&format!("backward: {why}"));
                false
            }
            // A graph that failed to build or run (a missing CUDA runtime, say): the own kernel
            // writes every output again, so the step goes on; `rtune selftest` reports the error.
            Err(e) => {
                notice(&format!("backward failed: {e}"));
                false
            }
        }
    }

    /// A workspace of `n` bytes on `stream` (none for 0).
    fn workspace(
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<Option<cudarc::driver::CudaSlice<u8>>> {
        if n == 0 {
            return Ok(None);
        }
        // SAFETY: cuDNN's scratch space: written by the graph before it reads it.
        Ok(Some(
            unsafe { stream.alloc::<u8>(n) }.map_err(drv("cudnn workspace"))?,
        ))
    }

    /// cuDNN's forward of `d` on `stream`: `o` and `lse` (laid out as `d` says) from `q, k, v`;
    /// `Unsupported` when cuDNN cannot run the graph (nothing written: run the own kernel).
    #[allow(clippy::too_many_arguments)]
    pub fn sdpa_fwd<T: FusedFloat>(
        lib: &Cudnn,
        stream: &Arc<CudaStream>,
        d: &SdpaDesc,
        [q, k, v]: [&CudaView<'_, T>; 3],
        o: &mut CudaViewMut<'_, T>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<Outcome<()>> {
        const OP: &str = "cudnn_sdpa_fwd";
        let [nq, nk, nv, no, nl] = extents(d);
        need(OP, "q", q.len(), nq)?;
        need(OP, "k", k.len(), nk)?;
        need(OP, "v", v.len(), nv)?;
        need(OP, "o", o.len(), no)?;
        need(OP, "lse", lse.len(), nl)?;
        if nq == 0 {
            return Ok(Outcome::Done(()));
        }
        // The shim reads the device from the runtime: this stream's context is made current.
        stream.context().bind_to_thread().map_err(drv(OP))?;
        let n = match lib.workspace(d, false)? {
            Outcome::Done(n) => n,
            Outcome::Unsupported(why) => return Ok(Outcome::Unsupported(why)),
        };
        let mut ws = workspace(stream, n)?;
        let (pq, _gq) = q.device_ptr(stream);
        let (pk, _gk) = k.device_ptr(stream);
        let (pv, _gv) = v.device_ptr(stream);
        let (po, _go) = o.device_ptr_mut(stream);
        let (pl, _gl) = lse.device_ptr_mut(stream);
        let (pw, _gw) = match ws.as_mut() {
            Some(w) => {
                let (p, g) = w.device_ptr_mut(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        let ptr = |p: u64| p as usize as *const c_void;
        // SAFETY: every buffer is device memory of this context, at least as long as `d` says
        // (checked above; the workspace as the graph asked), kept alive by the guards until the
        // call has been queued on `stream`, which owns their ordering.
        unsafe {
            lib.fwd(
                d,
                stream.cu_stream() as *mut c_void,
                [ptr(pq), ptr(pk), ptr(pv)],
                po as usize as *mut c_void,
                pl as usize as *mut f32,
                pw as usize as *mut c_void,
                n,
            )
        }
    }

    /// cuDNN's backward of `d` on `stream` (deterministic): `dq, dk, dv` (laid out as `q, k, v`)
    /// from the forward's `q, k, v, o, lse` and `d_o` (laid out as `o`).
    #[allow(clippy::too_many_arguments)]
    pub fn sdpa_bwd<T: FusedFloat>(
        lib: &Cudnn,
        stream: &Arc<CudaStream>,
        d: &SdpaDesc,
        [q, k, v, o, d_o]: [&CudaView<'_, T>; 5],
        lse: &CudaView<'_, f32>,
        [dq, dk, dv]: [&mut CudaViewMut<'_, T>; 3],
    ) -> Result<Outcome<()>> {
        const OP: &str = "cudnn_sdpa_bwd";
        let [nq, nk, nv, no, nl] = extents(d);
        for (what, have, want) in [
            ("q", q.len(), nq),
            ("k", k.len(), nk),
            ("v", v.len(), nv),
            ("o", o.len(), no),
            ("d_o", d_o.len(), no),
            ("lse", lse.len(), nl),
            ("dq", dq.len(), nq),
            ("dk", dk.len(), nk),
            ("dv", dv.len(), nv),
        ] {
            need(OP, what, have, want)?;
        }
        if nq == 0 {
            return Ok(Outcome::Done(()));
        }
        stream.context().bind_to_thread().map_err(drv(OP))?;
        let n = match lib.workspace(d, true)? {
            Outcome::Done(n) => n,
            Outcome::Unsupported(why) => return Ok(Outcome::Unsupported(why)),
        };
        let mut ws = workspace(stream, n)?;
        let (pq, _g1) = q.device_ptr(stream);
        let (pk, _g2) = k.device_ptr(stream);
        let (pv, _g3) = v.device_ptr(stream);
        let (po, _g4) = o.device_ptr(stream);
        let (pdo, _g5) = d_o.device_ptr(stream);
        let (pl, _g6) = lse.device_ptr(stream);
        let (pdq, _g7) = dq.device_ptr_mut(stream);
        let (pdk, _g8) = dk.device_ptr_mut(stream);
        let (pdv, _g9) = dv.device_ptr_mut(stream);
        let (pw, _gw) = match ws.as_mut() {
            Some(w) => {
                let (p, g) = w.device_ptr_mut(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        let ptr = |p: u64| p as usize as *const c_void;
        let mptr = |p: u64| p as usize as *mut c_void;
        // SAFETY: as in sdpa_fwd.
        unsafe {
            lib.bwd(
                d,
                stream.cu_stream() as *mut c_void,
                [ptr(pq), ptr(pk), ptr(pv), ptr(po), ptr(pdo)],
                pl as usize as *const f32,
                [mptr(pdq), mptr(pdk), mptr(pdv)],
                mptr(pw),
                n,
            )
        }
    }
}

#[cfg(feature = "kernels")]
pub use launch::{sdpa_bwd, sdpa_fwd, try_bwd, try_fwd};
