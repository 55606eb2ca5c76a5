//! Launchers of the gated units' CUDA kernels (`kernels/glu.cuh`, instantiated per activation in
//! `kernels/fused.cu`'s module) for f32, bf16 and f16 buffers already on the GPU: each takes the
//! stream and views of row-major contiguous buffers, checks the sizes and launches asynchronously.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, PushKernelArg};
use std::sync::Arc;

use rtune_backend::check::Op;
use rtune_backend::launch::{elementwise_cfg, need, numel, vec_width, FusedFloat, GpuKernel};
use rtune_backend::{drv, Result};

/// One activation's kernels and the names its checks report under (`Op`).
#[derive(Clone, Copy)]
pub struct Kernels {
    pub fwd: GpuKernel,
    pub bwd: GpuKernel,
    pub check_fwd: Op,
    pub check_bwd: Op,
}

/// Forward: `h = T(T(act(g))·u)`. `g, u, h: (n)`.
pub fn fwd<T: FusedFloat>(
    k: Kernels,
    stream: &Arc<CudaStream>,
    g: &CudaView<'_, T>,
    u: &CudaView<'_, T>,
    h: &mut CudaViewMut<'_, T>,
    n: usize,
) -> Result<()> {
    let op = k.check_fwd.name();
    need(op, "g", g.len(), n)?;
    need(op, "u", u.len(), n)?;
    need(op, "h", h.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let n_i = n as i64;
    let f = k.fwd.get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(g).arg(u).arg(h).arg(&n_i);
    // SAFETY: the kernel reads g, u and writes h, n elements each (checked above), with the
    // argument list of fused.cu's `<glu>_fwd_<T>`.
    unsafe { b.launch(elementwise_cfg(n.div_ceil(vec_width::<T>()))) }.map_err(drv(op))?;
    Ok(())
}

/// Backward. `dh, g, u: (n)`; `out: (2, n)` = `[dg; du]` (see `super`).
pub fn bwd<T: FusedFloat>(
    k: Kernels,
    stream: &Arc<CudaStream>,
    dh: &CudaView<'_, T>,
    g: &CudaView<'_, T>,
    u: &CudaView<'_, T>,
    out: &mut CudaViewMut<'_, T>,
    n: usize,
) -> Result<()> {
    let op = k.check_bwd.name();
    need(op, "dh", dh.len(), n)?;
    need(op, "g", g.len(), n)?;
    need(op, "u", u.len(), n)?;
    need(op, "out (2, n)", out.len(), numel(op, &[2, n])?)?;
    if n == 0 {
        return Ok(());
    }
    let n_i = n as i64;
    let f = k.bwd.get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(dh).arg(g).arg(u).arg(out).arg(&n_i);
    // SAFETY: the kernel reads dh, g, u (n elements each) and writes out (2n), checked above,
    // with the argument list of fused.cu's `<glu>_bwd_<T>`.
    unsafe { b.launch(elementwise_cfg(n.div_ceil(vec_width::<T>()))) }.map_err(drv(op))?;
    Ok(())
}
