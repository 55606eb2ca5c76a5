//! Launchers of RMSNorm's CUDA kernels (`kernels/norm.cuh`, compiled into `kernels/fused.cu`'s
//! module) for f32, bf16 and f16 buffers already on the GPU: each takes the stream and views of
//! row-major contiguous buffers, checks the sizes and launches asynchronously.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, PushKernelArg};
use std::sync::Arc;

use rtune_backend::image::FUSED;
use rtune_backend::launch::{int, need, numel, row_cfg, FusedFloat, GpuKernel};
use rtune_backend::{drv, Result};

/// RMSNorm forward: `y = T(T(x·r)·w)`, `r = 1/sqrt(mean(x²) + eps)` per row. `x, y: (rows, dim)`,
/// `w: (dim)`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    w: &CudaView<'_, T>,
    y: &mut CudaViewMut<'_, T>,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rms_norm_fwd";
    let n = numel(OP, &[rows, dim])?;
    need(OP, "x", x.len(), n)?;
    need(OP, "w", w.len(), dim)?;
    need(OP, "y", y.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let (rows_i, dim_i) = (int(OP, "rows", rows)?, int(OP, "dim", dim)?);
    let f = GpuKernel::new(&FUSED, "rms_norm_fwd").get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(x).arg(w).arg(y).arg(&rows_i).arg(&dim_i).arg(&eps);
    // SAFETY: argument types and order match rms_norm_fwd_<T> in fused.cu; sizes checked above.
    unsafe { b.launch(row_cfg::<T>(rows, dim)) }.map_err(drv(OP))?;
    Ok(())
}

/// RMSNorm backward: `dx = r·g − x·r³·mean(g·x)`, `g = T(dy·w)`, r recomputed from x.
/// `dy, x, dx: (rows, dim)`, `w: (dim)`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    dy: &CudaView<'_, T>,
    x: &CudaView<'_, T>,
    w: &CudaView<'_, T>,
    dx: &mut CudaViewMut<'_, T>,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<()> {
    const OP: &str = "rms_norm_bwd";
    let n = numel(OP, &[rows, dim])?;
    need(OP, "dy", dy.len(), n)?;
    need(OP, "x", x.len(), n)?;
    need(OP, "w", w.len(), dim)?;
    need(OP, "dx", dx.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let (rows_i, dim_i) = (int(OP, "rows", rows)?, int(OP, "dim", dim)?);
    let f = GpuKernel::new(&FUSED, "rms_norm_bwd").get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(dy)
        .arg(x)
        .arg(w)
        .arg(dx)
        .arg(&rows_i)
        .arg(&dim_i)
        .arg(&eps);
    // SAFETY: as above, for rms_norm_bwd_<T>.
    unsafe { b.launch(row_cfg::<T>(rows, dim)) }.map_err(drv(OP))?;
    Ok(())
}
