//! Launchers of the fused residual add + RMSNorm (`kernels/add_norm.cuh`, compiled into
//! `kernels/fused.cu`'s module) for f32, bf16 and f16 buffers already on the GPU: each takes the
//! stream and views of row-major contiguous buffers, checks the sizes and launches asynchronously.
//! `add_rms_norm_*` take the weight in the input's type (Llama's norm), `add_rms_norm1_*` an f32
//! weight (`rms_norm_plus_one`: Gemma's `1 + w`).

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtrMut, DeviceRepr, PushKernelArg};
use std::sync::Arc;

use rtune_backend::image::FUSED;
use rtune_backend::launch::{bad, int, need, numel, row_cfg, FusedFloat, GpuKernel};
use rtune_backend::{drv, Result};

/// `(rows, dim)` as the kernels' ints, after checking every buffer's length; `None` when empty.
fn dims(
    op: &'static str,
    bufs: &[(&str, usize)],
    w: usize,
    (rows, dim): (usize, usize),
) -> Result<Option<(i32, i32)>> {
    let n = numel(op, &[rows, dim])?;
    for &(name, len) in bufs {
        need(op, name, len, n)?;
    }
    need(op, "w", w, dim)?;
    if n == 0 {
        return Ok(None);
    }
    Ok(Some((int(op, "rows", rows)?, int(op, "dim", dim)?)))
}

#[allow(clippy::too_many_arguments)]
fn fwd<T: FusedFloat, W: DeviceRepr>(
    stem: &'static str,
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    res: &CudaView<'_, T>,
    w: &CudaView<'_, W>,
    h: &mut CudaViewMut<'_, T>,
    y: &mut CudaViewMut<'_, T>,
    shape: (usize, usize),
    eps: f32,
) -> Result<()> {
    let bufs = [
        ("x", x.len()),
        ("res", res.len()),
        ("h", h.len()),
        ("y", y.len()),
    ];
    let op = stem;
    let Some((rows_i, dim_i)) = dims(op, &bufs, w.len(), shape)? else {
        return Ok(());
    };
    let f = GpuKernel::new(&FUSED, stem).get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(x).arg(res).arg(w).arg(h).arg(y);
    b.arg(&rows_i).arg(&dim_i).arg(&eps);
    // SAFETY: argument types and order match add_rms_norm{,1}_fwd_<T> in fused.cu (W is T or
    // f32 as the stem says); sizes checked above.
    unsafe { b.launch(row_cfg::<T>(shape.0, shape.1)) }.map_err(drv(op))?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn bwd<T: FusedFloat, W: DeviceRepr>(
    stem: &'static str,
    stream: &Arc<CudaStream>,
    dy: &CudaView<'_, T>,
    h: &CudaView<'_, T>,
    w: &CudaView<'_, W>,
    dres: Option<&CudaView<'_, T>>,
    dh: &mut CudaViewMut<'_, T>,
    shape: (usize, usize),
    eps: f32,
) -> Result<()> {
    let dres_len = dres.map_or(dh.len(), |d| d.len());
    let bufs = [
        ("dy", dy.len()),
        ("h", h.len()),
        ("dres", dres_len),
        ("dh", dh.len()),
    ];
    let op = stem;
    let Some((rows_i, dim_i)) = dims(op, &bufs, w.len(), shape)? else {
        return Ok(());
    };
    let f = GpuKernel::new(&FUSED, stem).get::<T>(stream.context())?;
    let mut b = stream.launch_builder(&f);
    b.arg(dy).arg(h).arg(w);
    // Without `dres`, dres and dh are one buffer: the residual stream's gradient, accumulated in
    // place (its raw address twice; `_sync` orders the write after the stream's earlier work on
    // it).
    let (dh_ptr, _sync) = dh.device_ptr_mut(stream);
    match dres {
        Some(d) => b.arg(d),
        None => b.arg(&dh_ptr),
    };
    b.arg(&dh_ptr);
    b.arg(&rows_i).arg(&dim_i).arg(&eps);
    // SAFETY: as above, for add_rms_norm{,1}_bwd_<T>; the kernel reads dres with plain loads
    // before writing dh, element by element in one thread, so the two may be one buffer.
    unsafe { b.launch(row_cfg::<T>(shape.0, shape.1)) }.map_err(drv(op))?;
    Ok(())
}

/// `h = T(x + res)`, `y = T(T(h·r)·w)`, `r = 1/sqrt(mean(h²) + eps)` per row. `x, res, h, y:
/// (rows, dim)`, `w: (dim)` in `T`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    res: &CudaView<'_, T>,
    w: &CudaView<'_, T>,
    h: &mut CudaViewMut<'_, T>,
    y: &mut CudaViewMut<'_, T>,
    (rows, dim): (usize, usize),
    eps: f32,
) -> Result<()> {
    fwd(
        "add_rms_norm_fwd",
        stream,
        x,
        res,
        w,
        h,
        y,
        (rows, dim),
        eps,
    )
}

/// [`add_rms_norm_fwd`] with an f32 weight: `y = T(h·r·w)` in f32, one rounding.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm1_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    res: &CudaView<'_, T>,
    w: &CudaView<'_, f32>,
    h: &mut CudaViewMut<'_, T>,
    y: &mut CudaViewMut<'_, T>,
    (rows, dim): (usize, usize),
    eps: f32,
) -> Result<()> {
    fwd(
        "add_rms_norm1_fwd",
        stream,
        x,
        res,
        w,
        h,
        y,
        (rows, dim),
        eps,
    )
}

/// The backward, accumulated into the residual stream's gradient in place:
/// `dh = T(dh + T(g·r − (h·r³)·mean(g·h)))`, `g = T(dy·w)`, `r` from `h`. `dy, h, dh: (rows,
/// dim)`, `w: (dim)` in `T`.
pub fn add_rms_norm_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    dy: &CudaView<'_, T>,
    h: &CudaView<'_, T>,
    w: &CudaView<'_, T>,
    dh: &mut CudaViewMut<'_, T>,
    (rows, dim): (usize, usize),
    eps: f32,
) -> Result<()> {
    bwd(
        "add_rms_norm_bwd",
        stream,
        dy,
        h,
        w,
        None,
        dh,
        (rows, dim),
        eps,
    )
}

/// [`add_rms_norm_bwd`] with an f32 weight: `g = dy·w` in f32.
pub fn add_rms_norm1_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    dy: &CudaView<'_, T>,
    h: &CudaView<'_, T>,
    w: &CudaView<'_, f32>,
    dh: &mut CudaViewMut<'_, T>,
    (rows, dim): (usize, usize),
    eps: f32,
) -> Result<()> {
    bwd(
        "add_rms_norm1_bwd",
        stream,
        dy,
        h,
        w,
        None,
        dh,
        (rows, dim),
        eps,
    )
}

/// The backward out of place: `dh = T(dres + T(g·r − (h·r³)·mean(g·h)))` with `dres` left as it
/// is (the layer's `ops::add(d_out, norm_backward(dy))`, whose `d_out` the caller still owns).
/// `w` in `T` (Llama's norm) or f32 (`W` = f32 for a 16-bit `T`: the f32-weight form; for an
/// f32 `T` both forms are one).
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_bwd_out<T: FusedFloat, W: FusedFloat>(
    stream: &Arc<CudaStream>,
    dy: &CudaView<'_, T>,
    h: &CudaView<'_, T>,
    w: &CudaView<'_, W>,
    dres: &CudaView<'_, T>,
    dh: &mut CudaViewMut<'_, T>,
    (rows, dim): (usize, usize),
    eps: f32,
) -> Result<()> {
    let stem = match (W::INDEX == T::INDEX, W::INDEX == f32::INDEX) {
        (true, _) => "add_rms_norm_bwd",
        (false, true) => "add_rms_norm1_bwd",
        (false, false) => {
            let why = format!("a {} weight for {} inputs", W::SUFFIX, T::SUFFIX);
            return Err(bad("add_rms_norm_bwd", why));
        }
    };
    bwd(stem, stream, dy, h, w, Some(dres), dh, (rows, dim), eps)
}
