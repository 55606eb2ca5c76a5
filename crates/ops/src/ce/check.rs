//! the cross-entropy of a chunk's CUDA kernels (`cuda.rs`) against the reference (`reference.rs`) on seeded inputs, for
//! `rtune selftest` and `tests/fused_cuda.rs`.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::{cuda, reference};
use rtune_backend::check::{at, down, out, up, CheckGroups, CheckResult, Op, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::{drv, Precision, Result};

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

/// ce_capped_fwd and ce_capped_bwd on `(n, v)` with soft cap `cap`: logits ~ 10·N(0, 1) (a
/// quarter of them past tanh's knee at cap 30), one row in four with a dominant logit at its
/// target (60: capped near the cap), scale 1/n; the backward gets the reference's lse.
///
/// Tolerance: f32, the default (`rtol 1e-5`: CUDA's `tanhf` is within 2 f32 ulps of the host's,
/// carried through `exp`). bf16/f16: the capped logit is rounded to the type after `tanhf`, so a
/// device `tanhf` one f32 ulp from the host's lands a whole ulp of the type away for the few
/// values next to a rounding boundary (about one in 2^15 elements per f32 ulp of difference) — as
/// the unfused GPU chain would from the CPU's; that moves `exp(z − lse)` by up to
/// `e^(cap·2^−(mantissa bits)) − 1` (bf16 at cap 30: 0.26), which is the 16-bit types' rtol
/// and atol here. The emulated test (the host's `tanhf` on both sides) holds them to the default.
pub fn check_ce_capped<T: FusedFloat>(
    s: &Arc<CudaStream>,
    (n, v): (usize, usize),
    cap: f64,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng) = (T::PRECISION, Rng::new(seed));
    let (logits, targets) = reference::check_inputs(&mut rng, (n, v), (10.0, 60.0), p);
    let scale = 1.0 / n.max(1) as f32;
    let want_fwd = reference::ce_capped_fwd(&logits, &targets, (n, v), cap, p);
    let lse: Vec<f32> = want_fwd.iter().step_by(2).copied().collect();
    let want_bwd = reference::ce_capped_bwd(&logits, &targets, &lse, scale, (n, v), cap, p);

    let ld = up::<T>(s, &logits, offset)?;
    let lv = ld.slice(offset..);
    let td = s.clone_htod(&targets).map_err(drv("check upload"))?;
    let lse_d = s.clone_htod(&lse).map_err(drv("check upload"))?;
    let mut o = out::<f32>(s, 2 * n, offset)?;
    cuda::ce_capped_fwd(
        s,
        &lv,
        &td.as_view(),
        &mut o.slice_mut(offset..),
        (n, v),
        cap,
    )?;
    let mut d = out::<T>(s, n * v, offset)?;
    let ds = &mut d.slice_mut(offset..);
    cuda::ce_capped_bwd(
        s,
        &lv,
        &td.as_view(),
        &lse_d.as_view(),
        scale,
        ds,
        (n, v),
        cap,
    )?;
    let tol = match p {
        Precision::F32 => 1e-5,
        Precision::Bf16 => ((cap / 128.0).exp() - 1.0) as f32,
        Precision::F16 => ((cap / 1024.0).exp() - 1.0) as f32,
    };
    let shape = format!("({n}, {v}) cap {cap}{}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::f32_out("ce_capped_fwd").with_tol(tol, tol),
            shape.clone(),
            &down(s, &o, offset)?,
            &want_fwd,
        ),
        CheckResult::new::<T>(
            Op::typed("ce_capped_bwd").with_tol(tol, tol),
            shape,
            &down(s, &d, offset)?,
            &want_bwd,
        ),
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
        (
            format!("ce_capped_{t} (16, 256000) cap 30"),
            check_ce_capped::<T>(s, (16, 256000), 30.0, 0, seed + 40),
        ),
        (
            format!("ce_capped_{t} (5, 1001) cap 30+3"),
            check_ce_capped::<T>(s, (5, 1001), 30.0, 3, seed + 41),
        ),
    ]
}
