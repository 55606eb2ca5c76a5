//! Launchers of RoPE's CUDA kernels (`kernels/rope.cuh`, compiled into `kernels/fused.cu`'s
//! module) for f32, bf16 and f16 buffers already on the GPU: each takes the stream and views of
//! row-major contiguous buffers, checks the sizes and launches asynchronously.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, PushKernelArg};
use std::sync::Arc;

use rtune_backend::launch::{bad, elementwise_cfg, need, numel, vec_width, FusedFloat, GpuKernel};
use rtune_backend::{drv, Result};

#[allow(clippy::too_many_arguments)]
fn rope<T: FusedFloat>(
    op: &'static str,
    kernel: GpuKernel,
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    cos: &CudaView<'_, T>,
    sin: &CudaView<'_, T>,
    y: &mut CudaViewMut<'_, T>,
    (b, h, t, dh): (usize, usize, usize, usize),
) -> Result<()> {
    if dh % 2 != 0 {
        return Err(bad(op, format!("head_dim {dh} is odd")));
    }
    let n = numel(op, &[b, h, t, dh])?;
    let table = numel(op, &[b, t, dh])?;
    need(op, "x", x.len(), n)?;
    need(op, "cos (b, 1, t, dh)", cos.len(), table)?;
    need(op, "sin (b, 1, t, dh)", sin.len(), table)?;
    need(op, "y", y.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let dims = [b as i64, h as i64, t as i64, dh as i64];
    let f = kernel.get::<T>(stream.context())?;
    let mut l = stream.launch_builder(&f);
    l.arg(x)
        .arg(cos)
        .arg(sin)
        .arg(y)
        .arg(&dims[0])
        .arg(&dims[1])
        .arg(&dims[2])
        .arg(&dims[3]);
    // One item: a vector of the first half and its partner in the second.
    let items = (n / 2).div_ceil(vec_width::<T>());
    // SAFETY: as above, for rope_{fwd,bwd}_<T>.
    unsafe { l.launch(elementwise_cfg(items)) }.map_err(drv(op))?;
    Ok(())
}

/// RoPE forward, rotate-half layout: `y = x·cos + rotate_half(x)·sin`, `rotate_half([x1, x2]) =
/// [−x2, x1]`. `x, y: (b, h, t, dh)`; `cos, sin: (b, 1, t, dh)`.
#[allow(clippy::too_many_arguments)]
pub fn rope_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    cos: &CudaView<'_, T>,
    sin: &CudaView<'_, T>,
    y: &mut CudaViewMut<'_, T>,
    b: usize,
    h: usize,
    t: usize,
    dh: usize,
) -> Result<()> {
    rope(
        "rope_fwd",
        GpuKernel::new(&rtune_backend::image::FUSED, "rope_fwd"),
        stream,
        x,
        cos,
        sin,
        y,
        (b, h, t, dh),
    )
}

/// RoPE backward: `dx = dy·cos + rotate_halfᵀ(dy·sin)`, `rotate_halfᵀ([z1, z2]) = [z2, −z1]`.
/// Shapes as [`rope_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn rope_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    dy: &CudaView<'_, T>,
    cos: &CudaView<'_, T>,
    sin: &CudaView<'_, T>,
    dx: &mut CudaViewMut<'_, T>,
    b: usize,
    h: usize,
    t: usize,
    dh: usize,
) -> Result<()> {
    rope(
        "rope_bwd",
        GpuKernel::new(&rtune_backend::image::FUSED, "rope_bwd"),
        stream,
        dy,
        cos,
        sin,
        dx,
        (b, h, t, dh),
    )
}
