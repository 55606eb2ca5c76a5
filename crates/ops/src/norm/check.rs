//! RMSNorm's CUDA kernels (`cuda.rs`) against the reference (`reference.rs`) on seeded inputs, for
//! `rtune selftest` and `tests/fused_cuda.rs`.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::{cuda, reference};
use rtune_backend::check::{at, down, out, up, CheckGroups, CheckResult, Op, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Result;

/// rms_norm_fwd and rms_norm_bwd on `(rows, dim)`: x with a different scale per row (0.03 to 30),
/// w around 1, eps 1e-5.
pub fn check_rms_norm<T: FusedFloat>(
    s: &Arc<CudaStream>,
    rows: usize,
    dim: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, eps, mut rng) = (T::PRECISION, 1e-5f32, Rng::new(seed));
    let (x, w, dy) = reference::check_inputs(&mut rng, rows, dim, p);
    let (dx_, dw, ddy) = (
        up::<T>(s, &x, offset)?,
        up::<T>(s, &w, offset)?,
        up::<T>(s, &dy, offset)?,
    );
    let (xv, wv, dyv) = (dx_.slice(offset..), dw.slice(offset..), ddy.slice(offset..));
    let mut y = out::<T>(s, rows * dim, offset)?;
    cuda::rms_norm_fwd(s, &xv, &wv, &mut y.slice_mut(offset..), rows, dim, eps)?;
    let mut dx = out::<T>(s, rows * dim, offset)?;
    cuda::rms_norm_bwd(
        s,
        &dyv,
        &xv,
        &wv,
        &mut dx.slice_mut(offset..),
        rows,
        dim,
        eps,
    )?;
    let shape = format!("({rows}, {dim}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::typed("rms_norm_fwd"),
            shape.clone(),
            &down(s, &y, offset)?,
            &reference::rms_norm_fwd(&x, &w, rows, dim, eps, p),
        ),
        CheckResult::new::<T>(
            Op::typed("rms_norm_bwd"),
            shape,
            &down(s, &dx, offset)?,
            &reference::rms_norm_bwd(&dy, &x, &w, rows, dim, eps, p),
        ),
    ])
}

/// This op's groups for `rtune selftest` in type `T` (found by `crates/ops/build.rs`: an op
/// registers its checks by defining this function in its folder's `check.rs`).
pub fn self_test_groups<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> CheckGroups {
    let t = T::SUFFIX;
    vec![
        (
            format!("rms_norm_{t} (64, 4096)"),
            check_rms_norm::<T>(s, 64, 4096, 0, seed),
        ),
        (
            format!("rms_norm_{t} (7, 4097)+1"),
            check_rms_norm::<T>(s, 7, 4097, 1, seed + 1),
        ),
        (
            format!("rms_norm_{t} (3, 97)+3"),
            check_rms_norm::<T>(s, 3, 97, 3, seed + 8),
        ),
    ]
}
