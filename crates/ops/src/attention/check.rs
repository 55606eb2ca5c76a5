//! The attention softmax's CUDA kernels (`softmax_cuda.rs`) against the reference, for
//! `rtune selftest` and `tests/fused_cuda.rs` (the tiled kernels' check is `flash_check.rs`).

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::{reference, softmax_cuda};
use rtune_backend::check::{at, down, out, up, CheckGroups, CheckResult, Op, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Result;

/// attn_softmax_fwd and attn_softmax_bwd on scores `(heads·tq, tk)` (`heads` = Hkv·G stacked
/// blocks of `tq` query rows) and a `(tq, tk)` mask: causal, query i at position `tk − tq + i`,
/// plus row `tq / 2` fully masked when `tq >= 3` (NaN probabilities, as the CPU op). Raw scores
/// ~ 16·N(0, 1) at scale 1/8 (scaled std 2), dp ~ N(0, 1). attn_softmax_bwd gets the reference's
/// probabilities, so it is checked on its own.
pub fn check_attn_softmax<T: FusedFloat>(
    s: &Arc<CudaStream>,
    (heads, tq, tk): (usize, usize, usize),
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng, scale) = (T::PRECISION, Rng::new(seed), 0.125f32);
    let rows = heads * tq;
    let mask = reference::check_mask(tq, tk);
    let raw = rng.normals(rows * tk, 16.0, p);
    let dp = rng.normals(rows * tk, 1.0, p);
    let want_fwd = reference::attn_softmax_fwd(&raw, &mask, tk, scale, p);
    let want_bwd = reference::attn_softmax_bwd(&want_fwd, &dp, tk, scale, p);

    let (rd, dpd) = (up::<T>(s, &raw, offset)?, up::<T>(s, &dp, offset)?);
    let (md, pd) = (
        up::<f32>(s, &mask, offset)?,
        up::<f32>(s, &want_fwd, offset)?,
    );
    let mut o = out::<f32>(s, rows * tk, offset)?;
    let (rv, mv) = (rd.slice(offset..), md.slice(offset..));
    let os = &mut o.slice_mut(offset..);
    softmax_cuda::attn_softmax_fwd(s, &rv, &mv, os, rows, tk, tq, scale)?;
    let mut d = out::<T>(s, rows * tk, offset)?;
    let ds = &mut d.slice_mut(offset..);
    softmax_cuda::attn_softmax_bwd(
        s,
        &pd.slice(offset..),
        &dpd.slice(offset..),
        ds,
        rows,
        tk,
        scale,
    )?;
    let shape = format!("({heads}·{tq}, {tk}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::f32_out("attn_softmax_fwd"),
            shape.clone(),
            &down(s, &o, offset)?,
            &want_fwd,
        ),
        CheckResult::new::<T>(
            Op::typed("attn_softmax_bwd"),
            shape,
            &down(s, &d, offset)?,
            &want_bwd,
        ),
    ])
}

/// The attention softmax's groups (the tiled kernels have theirs in `flash_check.rs`) for `rtune selftest` in type `T` (found by `crates/ops/build.rs`: an op
/// registers its checks by defining this function in its folder's `check.rs`).
pub fn self_test_groups<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> CheckGroups {
    let t = T::SUFFIX;
    vec![
        (
            format!("attn_softmax_{t} (32·128, 128)"),
            check_attn_softmax::<T>(s, (32, 128, 128), 0, seed + 6),
        ),
        (
            format!("attn_softmax_{t} (2·3, 16384)"),
            check_attn_softmax::<T>(s, (2, 3, 16384), 0, seed + 7),
        ),
        (
            format!("attn_softmax_{t} (3·7, 333)+1"),
            check_attn_softmax::<T>(s, (3, 7, 333), 1, seed + 12),
        ),
    ]
}
