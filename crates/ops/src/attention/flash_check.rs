//! The tiled attention kernels ([`crate::flash`], `kernels/flash_attn.cu`) against their CPU
//! reference [`crate::flash_ref`] (same tiling and roundings) on fresh random inputs, forward and
//! backward: for `rtune selftest` ([`self_test_seeded`], one group per case and type).
//!
//! Cases ([`CASES`]): causal GQA 8/2, causal MQA, sliding window 5 over 12 tokens, window 50 over
//! 141, packed rows of 3 samples (per-row starts), packed with a window and MQA, a longer row
//! (515, H 8/2, Dh 128); every T odd (not a multiple of the 32-row tiles), head dims 64, 96 and
//! 128, and one case at an odd element offset (the kernels' scalar, unaligned load path).
//!
//! Tolerances (per output, [`fused_ref::compare`] (`rtune_backend::check`)), and why:
//! - f32 (and `lse` for every type): `rtol 1e-5` plus `1e-5 · max |want|`. The f32 kernels run the
//!   reference's fused multiply-add chains in the same order; what differs is CUDA's `expf` (2 ulps)
//!   and the order of the row sums `l` and `D` (warp shuffles): a few f32 ulps, carried into the
//!   gradients, which are differences of such terms (hence the absolute floor).
//! - bf16/f16 outputs: 2 ulps of the type plus one rounding of the largest element (2^-8 bf16,
//!   2^-11 f16, times `max |want|`): the tensor cores sum the (exact) products of a tile in their
//!   own order, so an f32 `p` or `dS` can land on the other side of a bf16/f16 rounding boundary
//!   than the reference's and move its term by one ulp of the type.

use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

use super::flash_kernel::{flash_bwd, flash_fwd};
use crate::attention::flash_ref::{self, FlashShape};
use rtune_backend::check::{self as fused_ref, Rng, Tolerance};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Precision;
use rtune_backend::{drv, Result};

/// One case: `(b, h, hkv, t, dh)`, a sliding window, packed rows (sample lengths per batch row),
/// the element offset of every buffer.
pub struct Case {
    pub dims: (usize, usize, usize, usize, usize),
    pub window: Option<usize>,
    pub packed: Option<&'static [&'static [usize]]>,
    pub offset: usize,
    pub what: &'static str,
}

pub const CASES: [Case; 7] = [
    Case {
        dims: (2, 8, 2, 77, 64),
        window: None,
        packed: None,
        offset: 0,
        what: "causal GQA 8/2",
    },
    Case {
        dims: (1, 4, 1, 130, 128),
        window: None,
        packed: None,
        offset: 0,
        what: "causal MQA",
    },
    Case {
        dims: (2, 4, 2, 12, 64),
        window: Some(5),
        packed: None,
        offset: 1,
        what: "window 5 over 12, offset 1",
    },
    Case {
        dims: (2, 4, 2, 141, 96),
        window: Some(50),
        packed: None,
        offset: 0,
        what: "window 50 over 141",
    },
    Case {
        dims: (2, 4, 2, 99, 128),
        window: None,
        packed: Some(&[&[30, 50, 19], &[1, 70, 28]]),
        offset: 0,
        what: "packed rows of 3 samples",
    },
    Case {
        dims: (2, 4, 1, 99, 64),
        window: Some(20),
        packed: Some(&[&[10, 60, 29], &[65, 33, 1]]),
        offset: 0,
        what: "packed, window 20, MQA",
    },
    Case {
        dims: (1, 8, 2, 515, 128),
        window: None,
        packed: None,
        offset: 0,
        what: "causal GQA 8/2, T 515",
    },
];

/// The visible-key starts of a case, `(starts, rows)`: as `crate::AttnMask::new` builds them (one
/// shared row unless packed; a sample starts at its first position; the window keeps the last
/// `w` keys).
pub fn starts(c: &Case) -> (Vec<u32>, usize) {
    let (b, _, _, t, _) = c.dims;
    let w = c.window.unwrap_or(usize::MAX).max(1);
    match c.packed {
        None => ((0..t).map(|i| i.saturating_sub(w - 1) as u32).collect(), 1),
        Some(rows) => {
            let mut v = Vec::with_capacity(b * t);
            for lens in rows.iter().take(b) {
                let mut first = 0;
                for &len in lens.iter() {
                    for i in first..first + len {
                        v.push(first.max(i.saturating_sub(w - 1)) as u32);
                    }
                    first += len;
                }
            }
            (v, b)
        }
    }
}

/// `v` as `T` on the GPU after `offset` zeros.
pub(crate) fn up<T: FusedFloat>(
    s: &Arc<CudaStream>,
    v: &[f32],
    offset: usize,
) -> Result<CudaSlice<T>> {
    let host: Vec<T> = std::iter::repeat_n(0.0, offset)
        .chain(v.iter().copied())
        .map(T::from_f32)
        .collect();
    s.clone_htod(&host).map_err(drv("flash check upload"))
}

/// Elements `offset..` of `buf` as f32.
pub(crate) fn down<T: FusedFloat>(
    s: &Arc<CudaStream>,
    buf: &CudaSlice<T>,
    offset: usize,
) -> Result<Vec<f32>> {
    let v = s
        .clone_dtoh(&buf.slice(offset..))
        .map_err(drv("flash check download"))?;
    Ok(v.into_iter().map(T::to_f32).collect())
}

fn tolerance(p: Precision) -> Tolerance {
    match p {
        Precision::F32 => Tolerance {
            ulps: 0.0,
            rtol: 1e-5,
            atol: 1e-5,
        },
        Precision::Bf16 => Tolerance {
            ulps: 2.0,
            rtol: 1e-5,
            atol: 1.0 / 256.0,
        },
        Precision::F16 => Tolerance {
            ulps: 2.0,
            rtol: 1e-5,
            atol: 1.0 / 2048.0,
        },
    }
}

/// Case `c` in `T`: `(name, max relative error, pass)` for `o`, `lse`, `dq`, `dk`, `dv`.
pub fn check_case<T: FusedFloat>(
    s: &Arc<CudaStream>,
    c: &Case,
    seed: u64,
) -> Result<Vec<(String, f64, bool)>> {
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
    let mut rng = Rng::new(seed);
    let (nq, nk) = (b * h * t * dh, b * hkv * t * dh);
    let q = rng.normals(nq, 1.5, p);
    let k = rng.normals(nk, 1.5, p);
    let v = rng.normals(nk, 1.0, p);
    let d_o = rng.normals(nq, 1.0, p);
    let scale = 1.0 / (dh as f32).sqrt();
    let (o_ref, lse_ref) = flash_ref::forward(&shape, &q, &k, &v, &st, scale, p);

    let off = c.offset;
    let (gq, gk, gv, gdo) = (
        up::<T>(s, &q, off)?,
        up::<T>(s, &k, off)?,
        up::<T>(s, &v, off)?,
        up::<T>(s, &d_o, off)?,
    );
    let gst = s.clone_htod(&st).map_err(drv("flash check upload"))?;
    let mut go = s
        .alloc_zeros::<T>(off + nq)
        .map_err(drv("flash check alloc"))?;
    let mut glse = s
        .alloc_zeros::<f32>(off + b * t * h)
        .map_err(drv("flash check alloc"))?;
    flash_fwd::<T>(
        s,
        &shape,
        &gq.slice(off..),
        &gk.slice(off..),
        &gv.slice(off..),
        &gst.slice(..),
        &mut go.slice_mut(off..),
        &mut glse.slice_mut(off..),
        scale,
    )?;
    let o = down(s, &go, off)?;
    let lse = down(s, &glse, off)?;
    // Both backwards run on the kernel's O and lse (as in training), so the comparison is of the
    // backward alone.
    let (dq_ref, dk_ref, dv_ref) =
        flash_ref::backward(&shape, &q, &k, &v, &o, &d_o, &lse, &st, scale, p);
    let mut gdq = s
        .alloc_zeros::<T>(off + nq)
        .map_err(drv("flash check alloc"))?;
    let mut gdk = s
        .alloc_zeros::<T>(off + nk)
        .map_err(drv("flash check alloc"))?;
    let mut gdv = s
        .alloc_zeros::<T>(off + nk)
        .map_err(drv("flash check alloc"))?;
    flash_bwd::<T>(
        s,
        &shape,
        [
            &gq.slice(off..),
            &gk.slice(off..),
            &gv.slice(off..),
            &go.slice(off..),
            &gdo.slice(off..),
        ],
        &glse.slice(off..),
        &gst.slice(..),
        &mut gdq.slice_mut(off..),
        &mut gdk.slice_mut(off..),
        &mut gdv.slice_mut(off..),
        scale,
    )?;
    let dq = down(s, &gdq, off)?;
    let dk = down(s, &gdk, off)?;
    let dv = down(s, &gdv, off)?;
    let name = |what: &str| {
        format!(
            "flash_{what}_{} {} (b {b}, h {h}/{hkv}, t {t}, dh {dh})",
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

/// One group per case and type (f32, bf16, f16): `(label, results)`, so a failing launch loses
/// only its own group.
pub fn self_test_seeded(
    s: &Arc<CudaStream>,
    seed: u64,
) -> Vec<rtune_backend::check::SelfTestGroup> {
    let mut all = Vec::new();
    for (n, c) in CASES.iter().enumerate() {
        let seed = seed.wrapping_add(1000 + n as u64);
        all.push((
            format!("flash_attn_f32 {}", c.what),
            check_case::<f32>(s, c, seed),
        ));
        all.push((
            format!("flash_attn_bf16 {}", c.what),
            check_case::<half::bf16>(s, c, seed),
        ));
        all.push((
            format!("flash_attn_f16 {}", c.what),
            check_case::<half::f16>(s, c, seed),
        ));
    }
    all
}
