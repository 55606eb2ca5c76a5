//! The fused residual add + RMSNorm kernels (`cuda.rs`) against the reference (`reference.rs`) on
//! seeded inputs, for `rtune selftest`.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::cuda;
use super::reference::{self, Weight};
use rtune_backend::check::{at, down, out, up, CheckGroups, CheckResult, Op, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Result;

/// The forward (`h` and `y`) and the backward accumulated into `dres` in place, on `(rows, dim)`
/// with a weight of `T` or f32, eps 1e-6.
pub fn check_add_rms_norm<T: FusedFloat>(
    s: &Arc<CudaStream>,
    (rows, dim): (usize, usize),
    weight: Weight,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, eps, mut rng) = (T::PRECISION, 1e-6f32, Rng::new(seed));
    let (x, res, w, dy, dres) = reference::check_inputs(&mut rng, (rows, dim), p, weight);
    let (want_h, want_y) = reference::add_rms_norm_fwd(&x, &res, &w, (rows, dim), eps, p, weight);
    let want_dh = reference::add_rms_norm_bwd(&dy, &want_h, &w, &dres, (rows, dim), eps, p, weight);
    let n = rows * dim;
    let (xd, rd, dyd) = (
        up::<T>(s, &x, offset)?,
        up::<T>(s, &res, offset)?,
        up::<T>(s, &dy, offset)?,
    );
    let (mut h, mut y, mut dh) = (
        out::<T>(s, n, offset)?,
        out::<T>(s, n, offset)?,
        up::<T>(s, &dres, offset)?,
    );
    let (xv, rv, dyv) = (xd.slice(offset..), rd.slice(offset..), dyd.slice(offset..));
    let (hs, ys) = (&mut h.slice_mut(offset..), &mut y.slice_mut(offset..));
    let shape = (rows, dim);
    match weight {
        Weight::Typed => {
            let wd = up::<T>(s, &w, offset)?;
            let wv = wd.slice(offset..);
            cuda::add_rms_norm_fwd(s, &xv, &rv, &wv, hs, ys, shape, eps)?;
            let hv = h.slice(offset..);
            cuda::add_rms_norm_bwd(s, &dyv, &hv, &wv, &mut dh.slice_mut(offset..), shape, eps)?;
        }
        Weight::F32 => {
            let wd = up::<f32>(s, &w, offset)?;
            let wv = wd.slice(offset..);
            cuda::add_rms_norm1_fwd(s, &xv, &rv, &wv, hs, ys, shape, eps)?;
            let hv = h.slice(offset..);
            cuda::add_rms_norm1_bwd(s, &dyv, &hv, &wv, &mut dh.slice_mut(offset..), shape, eps)?;
        }
    }
    let label = format!("({rows}, {dim}){}", at(offset));
    let op = |fwd| match (weight, fwd) {
        (Weight::Typed, true) => Op::typed("add_rms_norm_fwd"),
        (Weight::Typed, false) => Op::typed("add_rms_norm_bwd"),
        (Weight::F32, true) => Op::typed("add_rms_norm1_fwd"),
        (Weight::F32, false) => Op::typed("add_rms_norm1_bwd"),
    };
    Ok(vec![
        CheckResult::new::<T>(
            op(true),
            format!("{label} h"),
            &down(s, &h, offset)?,
            &want_h,
        ),
        CheckResult::new::<T>(op(true), label.clone(), &down(s, &y, offset)?, &want_y),
        CheckResult::new::<T>(op(false), label, &down(s, &dh, offset)?, &want_dh),
    ])
}

/// This op's groups for `rtune selftest` in type `T` (found by `crates/ops/build.rs`).
pub fn self_test_groups<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> CheckGroups {
    let t = T::SUFFIX;
    vec![
        (
            format!("add_rms_norm_{t} (64, 4096)"),
            check_add_rms_norm::<T>(s, (64, 4096), Weight::Typed, 0, seed + 20),
        ),
        (
            format!("add_rms_norm1_{t} (64, 3072)"),
            check_add_rms_norm::<T>(s, (64, 3072), Weight::F32, 0, seed + 21),
        ),
        (
            format!("add_rms_norm_{t} (7, 4097)+1"),
            check_add_rms_norm::<T>(s, (7, 4097), Weight::Typed, 1, seed + 22),
        ),
        (
            format!("add_rms_norm1_{t} (3, 97)+3"),
            check_add_rms_norm::<T>(s, (3, 97), Weight::F32, 3, seed + 23),
        ),
    ]
}
