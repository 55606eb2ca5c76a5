//! RoPE's CUDA kernels (`cuda.rs`) against the reference (`reference.rs`) on seeded inputs, for
//! `rtune selftest` and `tests/fused_cuda.rs`.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::{cuda, reference};
use rtune_backend::check::{at, down, out, up, CheckGroups, CheckResult, Op, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Result;

/// rope_fwd and rope_bwd on `(b, h, t, dh)`: real cos/sin tables (random positions per batch row,
/// Llama's frequencies, rounded to T as rope.rs's tables are), x, dy ~ N(0, 1).
pub fn check_rope<T: FusedFloat>(
    s: &Arc<CudaStream>,
    (b, h, t, dh): (usize, usize, usize, usize),
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng) = (T::PRECISION, Rng::new(seed));
    let (cos, sin) = reference::check_tables(&mut rng, (b, t, dh), p);
    let n = b * h * t * dh;
    let (x, dy) = (rng.normals(n, 1.0, p), rng.normals(n, 1.0, p));
    let (xd, dyd) = (up::<T>(s, &x, offset)?, up::<T>(s, &dy, offset)?);
    let (cd, sd) = (up::<T>(s, &cos, offset)?, up::<T>(s, &sin, offset)?);
    let (cv, sv) = (cd.slice(offset..), sd.slice(offset..));
    let mut y = out::<T>(s, n, offset)?;
    let mut dx = out::<T>(s, n, offset)?;
    let ys = &mut y.slice_mut(offset..);
    cuda::rope_fwd(s, &xd.slice(offset..), &cv, &sv, ys, b, h, t, dh)?;
    let dxs = &mut dx.slice_mut(offset..);
    cuda::rope_bwd(s, &dyd.slice(offset..), &cv, &sv, dxs, b, h, t, dh)?;
    let shape4 = (b, h, t, dh);
    let shape = format!("({b}, {h}, {t}, {dh}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::typed("rope_fwd").with_tol(1e-6, 1e-6),
            shape.clone(),
            &down(s, &y, offset)?,
            &reference::rope_fwd(&x, &cos, &sin, shape4, p),
        ),
        CheckResult::new::<T>(
            Op::typed("rope_bwd").with_tol(1e-6, 1e-6),
            shape,
            &down(s, &dx, offset)?,
            &reference::rope_bwd(&dy, &cos, &sin, shape4, p),
        ),
    ])
}

/// This op's groups for `rtune selftest` in type `T` (found by `crates/ops/build.rs`: an op
/// registers its checks by defining this function in its folder's `check.rs`).
pub fn self_test_groups<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> CheckGroups {
    let t = T::SUFFIX;
    vec![
        (
            format!("rope_{t} (2, 8, 65, 128)"),
            check_rope::<T>(s, (2, 8, 65, 128), 0, seed + 3),
        ),
        (
            format!("rope_{t} (1, 3, 33, 64)+1"),
            check_rope::<T>(s, (1, 3, 33, 64), 1, seed + 10),
        ),
    ]
}
