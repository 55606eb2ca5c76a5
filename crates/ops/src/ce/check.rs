//! the cross-entropy of a chunk's CUDA kernels (`cuda.rs`) against the reference (`reference.rs`) on seeded inputs, for
//! `rtune selftest` and `tests/fused_cuda.rs`.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::{cuda, reference};
use rtune_backend::check::{at, down, out, up, CheckGroups, CheckResult, Op, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::{drv, Result};

/// ce_fwd and ce_bwd on `(n, v)`: logits ~ 3·N(0, 1) with one row in four given a dominant
/// logit at its target (loss near 0, softmax near one-hot), scale 1/n. ce_bwd gets the
/// reference's lse, so it is checked on its own.
pub fn check_ce<T: FusedFloat>(
    s: &Arc<CudaStream>,
    n: usize,
    v: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng) = (T::PRECISION, Rng::new(seed));
    let mut logits = rng.normals(n * v, 3.0, p);
    let targets: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
    for (i, &tg) in targets.iter().enumerate().step_by(4) {
        logits[i * v + tg as usize] = p.round(30.0);
    }
    let scale = 1.0 / n.max(1) as f32;
    let want_fwd = reference::ce_fwd(&logits, &targets, n, v);
    let lse: Vec<f32> = want_fwd.iter().step_by(2).copied().collect();
    let want_bwd = reference::ce_bwd(&logits, &targets, &lse, scale, n, v, p);

    let ld = up::<T>(s, &logits, offset)?;
    let lv = ld.slice(offset..);
    let td = s.clone_htod(&targets).map_err(drv("check upload"))?;
    let lse_d = s.clone_htod(&lse).map_err(drv("check upload"))?;
    let mut o = out::<f32>(s, 2 * n, offset)?;
    cuda::ce_fwd(s, &lv, &td.as_view(), &mut o.slice_mut(offset..), n, v)?;
    let mut d = out::<T>(s, n * v, offset)?;
    let ds = &mut d.slice_mut(offset..);
    cuda::ce_bwd(s, &lv, &td.as_view(), &lse_d.as_view(), scale, ds, n, v)?;
    let shape = format!("({n}, {v}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::f32_out("ce_fwd"),
            shape.clone(),
            &down(s, &o, offset)?,
            &want_fwd,
        ),
        CheckResult::new::<T>(Op::typed("ce_bwd"), shape, &down(s, &d, offset)?, &want_bwd),
    ])
}

/// This op's groups for `rtune selftest` in type `T` (found by `crates/ops/build.rs`: an op
/// registers its checks by defining this function in its folder's `check.rs`).
pub fn self_test_groups<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> CheckGroups {
    let t = T::SUFFIX;
    vec![
        (
            format!("ce_{t} (16, 32000)"),
            check_ce::<T>(s, 16, 32000, 0, seed + 4),
        ),
        (
            format!("ce_{t} (4, 128256)"),
            check_ce::<T>(s, 4, 128256, 0, seed + 5),
        ),
        (
            format!("ce_{t} (5, 1001)+3"),
            check_ce::<T>(s, 5, 1001, 3, seed + 11),
        ),
    ]
}
