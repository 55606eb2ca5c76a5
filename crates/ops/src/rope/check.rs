//! RoPE's CUDA kernels (`cuda.rs`) against the reference (`reference.rs`) on seeded inputs, for
//! `rtune selftest` and `tests/fused_cuda.rs`.

use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

use super::{cuda, reference};
use rtune_backend::check::{at, down, out, up, CheckGroups, CheckResult, Op, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::{Precision, Result};

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

/// rope_qk forward then backward on q `(b, hq, t, dh)` and k `(b, hk, t, dh)` in place, tables
/// `(bc, 1, t, r)` of `C` (T, or f32: the f32-table mode), the backward run on the forward's
/// output (each checked against the reference on the same input).
#[allow(clippy::too_many_arguments)]
pub fn check_rope_qk<T: FusedFloat, C: FusedFloat>(
    s: &Arc<CudaStream>,
    (b, hq, hk, t, dh): (usize, usize, usize, usize, usize),
    (bc, r): (usize, usize),
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, pc, mut rng) = (T::PRECISION, C::PRECISION, Rng::new(seed));
    let (cos, sin) = reference::check_tables(&mut rng, (bc, t, r), pc);
    let (q, k) = (
        rng.normals(b * hq * t * dh, 1.0, p),
        rng.normals(b * hk * t * dh, 1.0, p),
    );
    let shape5 = (b, hq, hk, t, dh);
    let (mut wq, mut wk) = (q.clone(), k.clone());
    reference::rope_qk(
        &mut wq,
        &mut wk,
        &cos,
        &sin,
        shape5,
        (bc, r),
        (pc, p),
        false,
    );
    let (mut bq, mut bk) = (wq.clone(), wk.clone());
    reference::rope_qk(&mut bq, &mut bk, &cos, &sin, shape5, (bc, r), (pc, p), true);
    let (mut qd, mut kd) = (up::<T>(s, &q, offset)?, up::<T>(s, &k, offset)?);
    let (cd, sd) = (up::<C>(s, &cos, offset)?, up::<C>(s, &sin, offset)?);
    let (cv, sv) = (cd.slice(offset..), sd.slice(offset..));
    let pass = |qd: &mut CudaSlice<T>, kd: &mut CudaSlice<T>, bwd| {
        let (qs, ks) = (&mut qd.slice_mut(offset..), &mut kd.slice_mut(offset..));
        cuda::rope_qk(s, qs, ks, &cv, &sv, shape5, (bc, r), bwd)
    };
    pass(&mut qd, &mut kd, false)?;
    let (fq, fk) = (down(s, &qd, offset)?, down(s, &kd, offset)?);
    pass(&mut qd, &mut kd, true)?;
    let (gq, gk) = (down(s, &qd, offset)?, down(s, &kd, offset)?);
    let tables = if pc == Precision::F32 && p != pc {
        " f32 tables"
    } else {
        ""
    };
    let label = format!(
        "({b}, {hq}/{hk}, {t}, {dh}) r {r} bc {bc}{tables}{}",
        at(offset)
    );
    let (f, g) = (
        Op::typed("rope_qk_fwd").with_tol(1e-6, 1e-6),
        Op::typed("rope_qk_bwd").with_tol(1e-6, 1e-6),
    );
    Ok(vec![
        CheckResult::new::<T>(f, format!("{label} q"), &fq, &wq),
        CheckResult::new::<T>(f, format!("{label} k"), &fk, &wk),
        CheckResult::new::<T>(g, format!("{label} q"), &gq, &bq),
        CheckResult::new::<T>(g, format!("{label} k"), &gk, &bk),
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
        (
            format!("rope_qk_{t} (2, 32/8, 65, 128)"),
            check_rope_qk::<T, T>(s, (2, 32, 8, 65, 128), (2, 128), 0, seed + 30),
        ),
        (
            format!("rope_qk_{t} (1, 24/8, 33, 128) r 96 bc 1 f32 tables+1"),
            check_rope_qk::<T, f32>(s, (1, 24, 8, 33, 128), (1, 96), 1, seed + 31),
        ),
    ]
}
