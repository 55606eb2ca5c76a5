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

/// RoPE on q and k in place, one launch for both (`kernels/rope_qk.cuh`): `q: (b, hq, t, dh)`,
/// `k: (b, hk, t, dh)` in `T`; `cos, sin: (bc, 1, t, r)` in `C` = `T` (each product rounded to
/// `T`, as [`rope_fwd`]) or f32 (rotated in f32, rounded once: `rope::apply`'s f32-table mode),
/// `bc` 1 or `b`; the first `r ≤ dh` (even) of each head rotate, the rest stay (partial rotary).
/// `bwd`: the transpose (RoPE's backward on dq, dk).
#[allow(clippy::too_many_arguments)]
pub fn rope_qk<T: FusedFloat, C: FusedFloat>(
    stream: &Arc<CudaStream>,
    q: &mut CudaViewMut<'_, T>,
    k: &mut CudaViewMut<'_, T>,
    cos: &CudaView<'_, C>,
    sin: &CudaView<'_, C>,
    (b, hq, hk, t, dh): (usize, usize, usize, usize, usize),
    (bc, r): (usize, usize),
    bwd: bool,
) -> Result<()> {
    const OP: &str = "rope_qk";
    let stem = match (C::INDEX == T::INDEX, C::INDEX == 0, bwd) {
        (true, _, false) => "rope_qk_fwd",
        (true, _, true) => "rope_qk_bwd",
        (false, true, false) => "rope_qk_f32t_fwd",
        (false, true, true) => "rope_qk_f32t_bwd",
        (false, false, _) => {
            let why = format!("tables in {} for q, k in {}", C::SUFFIX, T::SUFFIX);
            return Err(bad(OP, why));
        }
    };
    if r % 2 != 0 || r > dh || r == 0 {
        return Err(bad(OP, format!("rotary width {r} for head_dim {dh}")));
    }
    if bc != 1 && bc != b {
        return Err(bad(
            OP,
            format!("tables of batch {bc} for q, k of batch {b}"),
        ));
    }
    let (nq, nk) = (numel(OP, &[b, hq, t, dh])?, numel(OP, &[b, hk, t, dh])?);
    let table = numel(OP, &[bc, t, r])?;
    need(OP, "q", q.len(), nq)?;
    need(OP, "k", k.len(), nk)?;
    need(OP, "cos (bc, 1, t, r)", cos.len(), table)?;
    need(OP, "sin (bc, 1, t, r)", sin.len(), table)?;
    if nq + nk == 0 {
        return Ok(());
    }
    let f = GpuKernel::new(&rtune_backend::image::FUSED, stem).get::<T>(stream.context())?;
    let d = [b, hq, hk, t, dh, r, bc].map(|v| v as i64);
    let mut l = stream.launch_builder(&f);
    l.arg(q).arg(k).arg(cos).arg(sin);
    for v in &d {
        l.arg(v);
    }
    // One item: a vector of a head's first rotated half and its partner in the second.
    let items = ((nq + nk) / dh * (r / 2)).div_ceil(vec_width::<T>());
    // SAFETY: argument types and order match rope_qk{,_f32t}_{fwd,bwd}_<T> in fused.cu (tables
    // of C: T, or f32 for the f32t stems); sizes checked above.
    unsafe { l.launch(elementwise_cfg(items)) }.map_err(drv(OP))?;
    Ok(())
}
