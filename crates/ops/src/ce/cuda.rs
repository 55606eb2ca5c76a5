//! Launchers of the cross-entropy of a chunk's CUDA kernels (`kernels/ce.cuh`, compiled into `kernels/fused.cu`'s
//! module) for f32, bf16 and f16 buffers already on the GPU: each takes the stream and views of
//! row-major contiguous buffers, checks the sizes and launches asynchronously.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use std::sync::Arc;

use rtune_backend::launch::{bad, int, need, numel, row_cfg, vec_width, FusedFloat, GpuKernel};
use rtune_backend::{drv, Result};

/// Cross-entropy forward over a chunk of logits. `logits: (n, v)`, `targets: (n)`; `out: (n, 2)`
/// f32 = `[lse, lse − logit[target]]` per row (NaN loss for a target `>= v`).
pub fn ce_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    logits: &CudaView<'_, T>,
    targets: &CudaView<'_, u32>,
    out: &mut CudaViewMut<'_, f32>,
    n: usize,
    v: usize,
) -> Result<()> {
    const OP: &str = "ce_fwd";
    let sizes = [logits.len(), targets.len(), out.len()];
    let Some((n_i, v_i)) = fwd_dims(OP, sizes, (n, v))? else {
        return Ok(());
    };
    let f = GpuKernel::new(&rtune_backend::image::FUSED, "ce_fwd").get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(logits).arg(targets).arg(out).arg(&n_i).arg(&v_i);
    // SAFETY: as above, for ce_fwd_<T>.
    unsafe { b.launch(row_cfg::<T>(n, v)) }.map_err(drv(OP))?;
    Ok(())
}

/// Cross-entropy backward: `dlogits = T((exp(logit − lse) − onehot(target))·scale)`.
/// `logits, dlogits: (n, v)`; `targets: (n)`; `lse: (n)` f32 (column 0 of [`ce_fwd`]'s output).
#[allow(clippy::too_many_arguments)]
pub fn ce_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    logits: &CudaView<'_, T>,
    targets: &CudaView<'_, u32>,
    lse: &CudaView<'_, f32>,
    scale: f32,
    dlogits: &mut CudaViewMut<'_, T>,
    n: usize,
    v: usize,
) -> Result<()> {
    const OP: &str = "ce_bwd";
    let sizes = [logits.len(), targets.len(), lse.len(), dlogits.len()];
    let Some((n_i, v_i)) = bwd_dims(OP, sizes, (n, v))? else {
        return Ok(());
    };
    let f = GpuKernel::new(&rtune_backend::image::FUSED, "ce_bwd").get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(logits)
        .arg(targets)
        .arg(lse)
        .arg(&scale)
        .arg(dlogits)
        .arg(&n_i)
        .arg(&v_i);
    // SAFETY: as above, for ce_bwd_<T>.
    unsafe { b.launch(bwd_cfg::<T>(n, v)) }.map_err(drv(OP))?;
    Ok(())
}

/// The backward's launch: grid.x spans a row's vectors, grid.y the rows (grid-stride beyond
/// 65535).
fn bwd_cfg<T>(n: usize, v: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            v.div_ceil(vec_width::<T>()).div_ceil(256) as u32,
            n.min(65535) as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The soft-capped cross-entropy's forward (Gemma 2's `final_logit_softcapping` fused in): as
/// [`ce_fwd`] over `z = T(T(tanh(T(logit·(1/cap))))·cap)`, formed on the fly (never stored).
/// `cap` finite and positive.
pub fn ce_capped_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    logits: &CudaView<'_, T>,
    targets: &CudaView<'_, u32>,
    out: &mut CudaViewMut<'_, f32>,
    (n, v): (usize, usize),
    cap: f64,
) -> Result<()> {
    const OP: &str = "ce_capped_fwd";
    let (cap, inv) = cap_args(OP, cap)?;
    let sizes = [logits.len(), targets.len(), out.len()];
    let Some((n_i, v_i)) = fwd_dims(OP, sizes, (n, v))? else {
        return Ok(());
    };
    let f = GpuKernel::new(&rtune_backend::image::FUSED, OP).get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(logits).arg(targets).arg(out).arg(&n_i).arg(&v_i);
    b.arg(&cap).arg(&inv);
    // SAFETY: as above, for ce_capped_fwd_<T>.
    unsafe { b.launch(row_cfg::<T>(n, v)) }.map_err(drv(OP))?;
    Ok(())
}

/// The soft-capped cross-entropy's backward: `dz = T((exp(z − lse) − onehot)·scale)`, then
/// `dlogits = T(dz·(1 − t²))`, `t = z·(1/cap)`, with `z` recomputed from the logits as
/// [`ce_capped_fwd`] forms it; `lse` is that forward's first column.
#[allow(clippy::too_many_arguments)]
pub fn ce_capped_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    logits: &CudaView<'_, T>,
    targets: &CudaView<'_, u32>,
    lse: &CudaView<'_, f32>,
    scale: f32,
    dlogits: &mut CudaViewMut<'_, T>,
    (n, v): (usize, usize),
    cap: f64,
) -> Result<()> {
    const OP: &str = "ce_capped_bwd";
    let (cap, inv) = cap_args(OP, cap)?;
    let sizes = [logits.len(), targets.len(), lse.len(), dlogits.len()];
    let Some((n_i, v_i)) = bwd_dims(OP, sizes, (n, v))? else {
        return Ok(());
    };
    let f = GpuKernel::new(&rtune_backend::image::FUSED, OP).get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(logits).arg(targets).arg(lse).arg(&scale).arg(dlogits);
    b.arg(&n_i).arg(&v_i).arg(&cap).arg(&inv);
    // SAFETY: as above, for ce_capped_bwd_<T>; the launch shape of ce_bwd.
    unsafe { b.launch(bwd_cfg::<T>(n, v)) }.map_err(drv(OP))?;
    Ok(())
}

/// A forward's size checks (`[logits, targets, out]` lengths against `(n, v)`, `(n)`, `(n, 2)`;
/// a vocabulary of 0 refused): `(n, v)` as the kernels take them, or `None` for no rows.
fn fwd_dims(
    op: &'static str,
    [logits, targets, out]: [usize; 3],
    (n, v): (usize, usize),
) -> Result<Option<(i32, i32)>> {
    if v == 0 {
        return Err(bad(op, "vocabulary of 0".into()));
    }
    need(op, "logits", logits, numel(op, &[n, v])?)?;
    need(op, "targets", targets, n)?;
    need(op, "out (n, 2)", out, numel(op, &[n, 2])?)?;
    if n == 0 {
        return Ok(None);
    }
    Ok(Some((int(op, "n", n)?, int(op, "v", v)?)))
}

/// A backward's size checks (`[logits, targets, lse, dlogits]` lengths against `(n, v)`, `(n)`,
/// `(n)`, `(n, v)`): `(n, v)` as the kernels take them, or `None` for nothing to do.
fn bwd_dims(
    op: &'static str,
    [logits, targets, lse, dlogits]: [usize; 4],
    (n, v): (usize, usize),
) -> Result<Option<(i32, i32)>> {
    let nv = numel(op, &[n, v])?;
    need(op, "logits", logits, nv)?;
    need(op, "targets", targets, n)?;
    need(op, "lse", lse, n)?;
    need(op, "dlogits", dlogits, nv)?;
    if nv == 0 {
        return Ok(None);
    }
    Ok(Some((int(op, "n", n)?, int(op, "v", v)?)))
}

/// `(cap, f32(1/cap))` as the kernels take them (the reciprocal in f64 then rounded, as candle's
/// `x / cap` multiplies by it); an error for a cap that is not finite and positive.
fn cap_args(op: &'static str, cap: f64) -> Result<(f32, f32)> {
    if !(cap.is_finite() && cap > 0.0) {
        return Err(bad(
            op,
            format!("soft cap {cap} must be finite and positive"),
        ));
    }
    Ok((cap as f32, (1.0 / cap) as f32))
}
