//! Launchers of GeGLU's CUDA kernels (`kernels/geglu.cuh`, compiled into `kernels/fused.cu`'s
//! module) for f32, bf16 and f16 buffers already on the GPU: each takes the stream and views of
//! row-major contiguous buffers, checks the sizes and launches asynchronously.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, PushKernelArg};
use std::sync::Arc;

use rtune_backend::launch::{elementwise_cfg, need, numel, vec_width, FusedFloat, FusedKernels, K};
use rtune_backend::{drv, Result};

/// GeGLU forward: `h = T(T(gelu_tanh(g))·u)`. `g, u, h: (n)`.
pub fn geglu_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    g: &CudaView<'_, T>,
    u: &CudaView<'_, T>,
    h: &mut CudaViewMut<'_, T>,
    n: usize,
) -> Result<()> {
    const OP: &str = "geglu_fwd";
    need(OP, "g", g.len(), n)?;
    need(OP, "u", u.len(), n)?;
    need(OP, "h", h.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let n_i = n as i64;
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::GegluFwd));
    b.arg(g).arg(u).arg(h).arg(&n_i);
    // SAFETY: as above, for geglu_fwd_<T>.
    unsafe { b.launch(elementwise_cfg(n.div_ceil(vec_width::<T>()))) }.map_err(drv(OP))?;
    Ok(())
}

/// GeGLU backward. `dh, g, u: (n)`; `out: (2, n)` = `[dg; du]`: `dg = T(dh·u·gelu_tanh'(g))` at
/// `[0, n)`, `du = T(dh·T(gelu_tanh(g)))` at `[n, 2n)`.
pub fn geglu_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    dh: &CudaView<'_, T>,
    g: &CudaView<'_, T>,
    u: &CudaView<'_, T>,
    out: &mut CudaViewMut<'_, T>,
    n: usize,
) -> Result<()> {
    const OP: &str = "geglu_bwd";
    need(OP, "dh", dh.len(), n)?;
    need(OP, "g", g.len(), n)?;
    need(OP, "u", u.len(), n)?;
    need(OP, "out (2, n)", out.len(), numel(OP, &[2, n])?)?;
    if n == 0 {
        return Ok(());
    }
    let n_i = n as i64;
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::GegluBwd));
    b.arg(dh).arg(g).arg(u).arg(out).arg(&n_i);
    // SAFETY: as above, for geglu_bwd_<T>; out holds 2n elements.
    unsafe { b.launch(elementwise_cfg(n.div_ceil(vec_width::<T>()))) }.map_err(drv(OP))?;
    Ok(())
}
