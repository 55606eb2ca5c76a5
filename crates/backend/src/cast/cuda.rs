//! Launcher of the widening cast to f32 (`widen_<T>` in `kernels/cast.cuh`): bf16/f16 → f32 of a
//! contiguous buffer, exact.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, PushKernelArg};
use std::sync::Arc;

use crate::launch::{elementwise_cfg, need, vec_width, FusedFloat, GpuKernel};
use crate::{drv, Result};

/// Widening to f32: `y = f32(x)`, exact (every bf16 and f16 value is an f32; a NaN keeps its
/// payload, as candle's CUDA cast keeps it). `x, y: (n)`. For `T = f32` a copy.
pub fn widen<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    y: &mut CudaViewMut<'_, f32>,
    n: usize,
) -> Result<()> {
    const OP: &str = "widen";
    need(OP, "x", x.len(), n)?;
    need(OP, "y", y.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let n_i = n as i64;
    let f = GpuKernel::new(&crate::image::FUSED, "widen").get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(x).arg(y).arg(&n_i);
    // SAFETY: as above, for widen_<T>; sizes checked above.
    unsafe { b.launch(elementwise_cfg(n.div_ceil(vec_width::<T>()))) }.map_err(drv(OP))?;
    Ok(())
}
