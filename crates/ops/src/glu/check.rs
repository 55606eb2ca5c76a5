//! A gated unit's CUDA kernels (`cuda.rs`) against its slice reference
//! ([`Activation::reference_fwd`], [`Activation::reference_bwd`]) on seeded inputs, for
//! `rtune selftest` and `tests/fused_cuda.rs`.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::{cuda, Activation};
use rtune_backend::check::{at, down, out, up, CheckGroups, CheckResult, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Result;

/// SwiGLU's kernels, as [`check`].
pub fn check_swiglu<T: FusedFloat>(
    s: &Arc<CudaStream>,
    n: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    check::<crate::swiglu::Silu, T>(s, n, offset, seed)
}

/// GeGLU's kernels, as [`check`].
pub fn check_geglu<T: FusedFloat>(
    s: &Arc<CudaStream>,
    n: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    check::<crate::geglu::GeluTanh, T>(s, n, offset, seed)
}

/// The forward and backward kernels of `A` on `(n)`: g ~ 4·N(0, 1) (both tails of the gate),
/// u, dh ~ N(0, 1).
pub fn check<A: Activation, T: FusedFloat>(
    s: &Arc<CudaStream>,
    n: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng) = (T::PRECISION, Rng::new(seed));
    let (g, u, dh) = (
        rng.normals(n, 4.0, p),
        rng.normals(n, 1.0, p),
        rng.normals(n, 1.0, p),
    );
    let (gd, ud, dhd) = (
        up::<T>(s, &g, offset)?,
        up::<T>(s, &u, offset)?,
        up::<T>(s, &dh, offset)?,
    );
    let (gv, uv, dhv) = (gd.slice(offset..), ud.slice(offset..), dhd.slice(offset..));
    let mut h = out::<T>(s, n, offset)?;
    cuda::fwd(A::KERNELS, s, &gv, &uv, &mut h.slice_mut(offset..), n)?;
    let mut o = out::<T>(s, 2 * n, offset)?;
    cuda::bwd(A::KERNELS, s, &dhv, &gv, &uv, &mut o.slice_mut(offset..), n)?;
    let shape = format!("({n}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            A::KERNELS.check_fwd,
            shape.clone(),
            &down(s, &h, offset)?,
            &A::reference_fwd(&g, &u, p),
        ),
        CheckResult::new::<T>(
            A::KERNELS.check_bwd,
            shape,
            &down(s, &o, offset)?,
            &A::reference_bwd(&dh, &g, &u, p),
        ),
    ])
}

/// The gated units' groups (SwiGLU and GeGLU) for `rtune selftest` in type `T` (found by `crates/ops/build.rs`: an op
/// registers its checks by defining this function in its folder's `check.rs`).
pub fn self_test_groups<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> CheckGroups {
    let t = T::SUFFIX;
    vec![
        (
            format!("swiglu_{t} (2^20+3)"),
            check_swiglu::<T>(s, (1 << 20) + 3, 0, seed + 2),
        ),
        (
            format!("swiglu_{t} (1001)+5"),
            check_swiglu::<T>(s, 1001, 5, seed + 9),
        ),
        (
            format!("geglu_{t} (2^20+3)"),
            check_geglu::<T>(s, (1 << 20) + 3, 0, seed + 21),
        ),
        (
            format!("geglu_{t} (1001)+5"),
            check_geglu::<T>(s, 1001, 5, seed + 22),
        ),
    ]
}
