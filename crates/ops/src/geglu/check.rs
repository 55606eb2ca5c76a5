//! GeGLU's CUDA kernels (`cuda.rs`) against the reference (`reference.rs`) on seeded inputs, for
//! `rtune selftest` and `tests/fused_cuda.rs`.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::{cuda, reference};
use rtune_backend::check::{at, down, out, up, CheckResult, Op, Rng};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Result;

/// geglu_fwd and geglu_bwd on `(n)`: g ~ 4·N(0, 1) (the tanh saturates on both sides), u, dh ~ N(0, 1).
pub fn check_geglu<T: FusedFloat>(
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
    cuda::geglu_fwd(s, &gv, &uv, &mut h.slice_mut(offset..), n)?;
    let mut o = out::<T>(s, 2 * n, offset)?;
    cuda::geglu_bwd(s, &dhv, &gv, &uv, &mut o.slice_mut(offset..), n)?;
    let shape = format!("({n}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::GegluFwd,
            shape.clone(),
            &down(s, &h, offset)?,
            &reference::geglu_fwd(&g, &u, p),
        ),
        CheckResult::new::<T>(
            Op::GegluBwd,
            shape,
            &down(s, &o, offset)?,
            &reference::geglu_bwd(&dh, &g, &u, p),
        ),
    ])
}
