//! cuDNN's fused attention (`super::cudnn`) against the own kernel's CPU reference
//! ([`crate::flash_ref`], which `flash_check.rs` holds the own kernel to) on fresh random inputs,
//! forward and backward, bf16 and f16: for `rtune selftest` ([`self_test_seeded`], one group per
//! case and type). The cases are `flash_check::CASES` that cuDNN takes (one causal band, no
//! packed rows; element offset 0: cuDNN wants 16-byte aligned tensors): causal GQA 8/2, causal
//! MQA, window 50 over 141 (Dh 96), GQA 8/2 at T 515 (Dh 128). The backward runs on cuDNN's own
//! `O` and log-sum-exp, and the reference backward on the same, so it is compared alone; the
//! log-sum-exp is compared too, since the own backward may read it (`flash_cuda.rs` falls back
//! per call).
//!
//! Tolerances (not yet run on a card: confirm or widen there, with the reason):
//! - `o`, `dq`, `dk`, `dv`: 4 ulps of the type plus two roundings of the largest element
//!   (2·2^-8 bf16, 2·2^-11 f16, times `max |want|`): twice the own kernel's, because cuDNN's tiles
//!   differ from the reference's (the running max of the online softmax, hence the point at which
//!   `P` is rounded to the type before `P·V`, moves) and its tensor cores sum in their own order.
//! - `lse` (f32): `rtol 1e-4`: cuDNN's softmax runs in base 2 on pre-scaled scores (`exp2`, then a
//!   `ln 2` factor), a different rounding chain from the reference's `e^x` and `ln`.
//!
//! A one-key-off mask or a wrong stride gives errors of order 1 (whole rows of `P` move).

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::cudnn::{plan, sdpa_bwd, sdpa_fwd};
use super::flash_check::{down, starts, up, Case, CASES};
use crate::attention::cudnn::Band;
use crate::attention::flash_ref::{self, FlashShape};
use rtune_backend::check::{self as fused_ref, Rng, SelfTestGroup, Tolerance};
use rtune_backend::cudnn::Outcome;
use rtune_backend::launch::FusedFloat;
use rtune_backend::Precision;
use rtune_backend::{drv, KernelError, Result};

fn tolerance(p: Precision) -> Tolerance {
    match p {
        Precision::F32 => Tolerance {
            ulps: 0.0,
            rtol: 1e-4,
            atol: 1e-5,
        },
        Precision::Bf16 => Tolerance {
            ulps: 4.0,
            rtol: 1e-5,
            atol: 2.0 / 256.0,
        },
        Precision::F16 => Tolerance {
            ulps: 4.0,
            rtol: 1e-5,
            atol: 2.0 / 2048.0,
        },
    }
}

/// The cases of `flash_check::CASES` cuDNN takes.
pub fn cases() -> impl Iterator<Item = &'static Case> {
    CASES.iter().filter(|c| c.packed.is_none() && c.offset == 0)
}

fn not_run(why: String) -> KernelError {
    KernelError::Cudnn {
        op: "cudnn attention check",
        message: format!("not run: {why}"),
    }
}

/// Case `c` in `T` (bf16 or f16): `(name, max relative error, pass)` for `o`, `lse`, `dq`, `dk`,
/// `dv`; an error when cuDNN is not loaded or refuses the graph (on a card it should take all).
pub fn check_case<T: FusedFloat>(
    s: &Arc<CudaStream>,
    c: &Case,
    seed: u64,
) -> Result<Vec<(String, f64, bool)>> {
    let lib = rtune_backend::cudnn::get().map_err(|why| not_run(why.to_string()))?;
    let (b, h, hkv, t, dh) = c.dims;
    let p = T::PRECISION;
    let (st, sb) = starts(c);
    let shape = FlashShape {
        b,
        h,
        hkv,
        t,
        dh,
        sb,
    };
    let scale = 1.0 / (dh as f32).sqrt();
    let dt = match p {
        Precision::Bf16 => candle_core::DType::BF16,
        Precision::F16 => candle_core::DType::F16,
        Precision::F32 => candle_core::DType::F32,
    };
    let band = Some(Band { window: c.window });
    let d = plan(&shape, band, dt, scale as f64).map_err(|why| not_run(why.to_string()))?;
    let mut rng = Rng::new(seed);
    let (nq, nk) = (b * h * t * dh, b * hkv * t * dh);
    let q = rng.normals(nq, 1.5, p);
    let k = rng.normals(nk, 1.5, p);
    let v = rng.normals(nk, 1.0, p);
    let d_o = rng.normals(nq, 1.0, p);
    let (o_ref, lse_ref) = flash_ref::forward(&shape, &q, &k, &v, &st, scale, p);

    let (gq, gk, gv, gdo) = (
        up::<T>(s, &q, 0)?,
        up::<T>(s, &k, 0)?,
        up::<T>(s, &v, 0)?,
        up::<T>(s, &d_o, 0)?,
    );
    let alloc = drv("cudnn check alloc");
    let mut go = s.alloc_zeros::<T>(nq).map_err(alloc)?;
    let mut glse = s
        .alloc_zeros::<f32>(b * t * h)
        .map_err(drv("cudnn check alloc"))?;
    let ran = sdpa_fwd::<T>(
        lib,
        s,
        &d,
        [&gq.slice(..), &gk.slice(..), &gv.slice(..)],
        &mut go.slice_mut(..),
        &mut glse.slice_mut(..),
    )?;
    if let Outcome::Unsupported(why) = ran {
        return Err(not_run(format!("forward unsupported: {why}")));
    }
    let o = down(s, &go, 0)?;
    let lse = down(s, &glse, 0)?;
    let (dq_ref, dk_ref, dv_ref) =
        flash_ref::backward(&shape, &q, &k, &v, &o, &d_o, &lse, &st, scale, p);
    let mut grads = Vec::with_capacity(3);
    for n in [nq, nk, nk] {
        grads.push(s.alloc_zeros::<T>(n).map_err(drv("cudnn check alloc"))?);
    }
    let [gdq, gdk, gdv] = &mut grads[..] else {
        unreachable!("three gradients")
    };
    let ran = sdpa_bwd::<T>(
        lib,
        s,
        &d,
        [
            &gq.slice(..),
            &gk.slice(..),
            &gv.slice(..),
            &go.slice(..),
            &gdo.slice(..),
        ],
        &glse.slice(..),
        [
            &mut gdq.slice_mut(..),
            &mut gdk.slice_mut(..),
            &mut gdv.slice_mut(..),
        ],
    )?;
    if let Outcome::Unsupported(why) = ran {
        return Err(not_run(format!("backward unsupported: {why}")));
    }
    let (dq, dk, dv) = (down(s, gdq, 0)?, down(s, gdk, 0)?, down(s, gdv, 0)?);
    let name = |what: &str| {
        format!(
            "cudnn_sdpa_{what}_{} {} (b {b}, h {h}/{hkv}, t {t}, dh {dh})",
            T::SUFFIX,
            c.what
        )
    };
    let mut out = Vec::new();
    for (what, got, want, prec) in [
        ("fwd o", &o, &o_ref, p),
        ("fwd lse", &lse, &lse_ref, Precision::F32),
        ("bwd dq", &dq, &dq_ref, p),
        ("bwd dk", &dk, &dk_ref, p),
        ("bwd dv", &dv, &dv_ref, p),
    ] {
        let cmp = fused_ref::compare(got, want, prec, tolerance(prec));
        out.push((name(what), cmp.max_rel_err, cmp.pass));
    }
    Ok(out)
}

/// One group per case and type (bf16, f16; cuDNN has no f32 attention), labelled
/// `cudnn_sdpa_<type> <case>`.
pub fn self_test_seeded(s: &Arc<CudaStream>, seed: u64) -> Vec<SelfTestGroup> {
    let mut all = Vec::new();
    for (n, c) in cases().enumerate() {
        let seed = seed.wrapping_add(2000 + n as u64);
        all.push((
            format!("cudnn_sdpa_bf16 {}", c.what),
            check_case::<half::bf16>(s, c, seed),
        ));
        all.push((
            format!("cudnn_sdpa_f16 {}", c.what),
            check_case::<half::f16>(s, c, seed),
        ));
    }
    all
}
