//! Host side of `kernels/attn.cu`: the attention softmax, forward and backward, for f32, bf16 and
//! f16 scores already on the GPU (the kernels are loaded and cached with `fused.cu`'s by
//! [`GpuKernel`], in `launch.rs`). Semantics: those of `crates/ops/src/attention/softmax.rs`'s
//! CPU op, restated in [`super::reference::attn_softmax_fwd`] / [`super::reference::attn_softmax_bwd`].

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use std::sync::Arc;

use rtune_backend::drv;
use rtune_backend::image::ATTN;
use rtune_backend::launch::{bad, int, need, numel, row_cfg, FusedFloat, GpuKernel};
use rtune_backend::Result;

/// The longest row whose scores the forward keeps in shared memory (`t·4` bytes within the 48 KiB a
/// block gets without opting in, beside its 256 bytes of reduction scratch); longer rows are
/// recomputed from global memory in each pass, with the same results.
pub(crate) const CACHED_MAX: usize = 12 * 1024 - 256;

/// Attention softmax forward: `p = softmax(f32(T(scores·scale)) + mask)` per row, f32.
/// `scores: (rows, t)` raw (unscaled) in `T`; `mask: (mrows, t)` additive f32, row `r` of the
/// scores taking mask row `r % mrows` (`rows` a multiple of `mrows`); `p: (rows, t)` f32. A fully
/// masked row (all `−inf`) gives NaN, as the CPU op.
#[allow(clippy::too_many_arguments)]
pub fn attn_softmax_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    scores: &CudaView<'_, T>,
    mask: &CudaView<'_, f32>,
    p: &mut CudaViewMut<'_, f32>,
    rows: usize,
    t: usize,
    mrows: usize,
    scale: f32,
) -> Result<()> {
    const OP: &str = "attn_softmax_fwd";
    let n = numel(OP, &[rows, t])?;
    if mrows == 0 || !rows.is_multiple_of(mrows) {
        return Err(bad(
            OP,
            format!("{rows} score rows are not a multiple of the mask's {mrows}"),
        ));
    }
    need(OP, "scores", scores.len(), n)?;
    need(OP, "mask", mask.len(), numel(OP, &[mrows, t])?)?;
    need(OP, "p", p.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let (rows_i, t_i, mrows_i) = (
        int(OP, "rows", rows)?,
        int(OP, "t", t)?,
        int(OP, "mask rows", mrows)?,
    );
    let cached = t <= CACHED_MAX;
    let cached_i = cached as i32;
    let f = GpuKernel::new(&ATTN, "attn_softmax_fwd").get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(scores)
        .arg(mask)
        .arg(p)
        .arg(&rows_i)
        .arg(&t_i)
        .arg(&mrows_i)
        .arg(&scale)
        .arg(&cached_i);
    let cfg = LaunchConfig {
        shared_mem_bytes: if cached { (t * 4) as u32 } else { 0 },
        ..row_cfg::<T>(rows, t)
    };
    // SAFETY: argument types and order match attn_softmax_fwd_<T> in attn.cu; sizes checked above;
    // the dynamic shared memory holds t floats when `cached`.
    unsafe { b.launch(cfg) }.map_err(drv(OP))?;
    Ok(())
}

/// Attention softmax backward: `ds = T((p·(dp − Σ_row dp·p))·scale)`. `p: (rows, t)` f32 (the
/// forward's output), `dp, ds: (rows, t)` in `T`.
#[allow(clippy::too_many_arguments)]
pub fn attn_softmax_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    p: &CudaView<'_, f32>,
    dp: &CudaView<'_, T>,
    ds: &mut CudaViewMut<'_, T>,
    rows: usize,
    t: usize,
    scale: f32,
) -> Result<()> {
    const OP: &str = "attn_softmax_bwd";
    let n = numel(OP, &[rows, t])?;
    need(OP, "p", p.len(), n)?;
    need(OP, "dp", dp.len(), n)?;
    need(OP, "ds", ds.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let (rows_i, t_i) = (int(OP, "rows", rows)?, int(OP, "t", t)?);
    let f = GpuKernel::new(&ATTN, "attn_softmax_bwd").get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(p).arg(dp).arg(ds).arg(&rows_i).arg(&t_i).arg(&scale);
    // SAFETY: as above, for attn_softmax_bwd_<T>.
    unsafe { b.launch(row_cfg::<T>(rows, t)) }.map_err(drv(OP))?;
    Ok(())
}
