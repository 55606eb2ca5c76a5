//! Host side of `kernels/fused.cu`: RMSNorm, SwiGLU, RoPE and cross-entropy, forward and backward,
//! and the widening cast to f32, for f32, bf16 and f16 tensors already on the GPU. (The attention
//! softmax of `kernels/attn.cu` is [`crate::attn`]; what both share — element types, the loaded
//! kernels, size checks — is in `launch.rs`.)
//!
//! Every launcher takes the stream to run on and views of row-major contiguous buffers (each view
//! holds at least the elements its shape names; any beyond are ignored), checks the sizes, and
//! launches asynchronously. The module (cubin or PTX) is loaded once per CUDA context and cached for
//! the process ([`crate::FusedKernels::get`]). Semantics: those of `crates/model/src/ops.rs` and
//! `rope.rs`, restated in [`crate::fused_ref`]; [`crate::fused_check::self_test`] and
//! `tests/fused_cuda.rs` compare the two.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use std::sync::Arc;

use crate::launch::{
    bad, elementwise_cfg, int, need, numel, row_cfg, vec_width, FusedFloat, FusedKernels, K,
};
use crate::{drv, Result};

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
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::RmsFwd));
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
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::RmsBwd));
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

/// SwiGLU forward: `h = T(T(silu(g))·u)`. `g, u, h: (n)`.
pub fn swiglu_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    g: &CudaView<'_, T>,
    u: &CudaView<'_, T>,
    h: &mut CudaViewMut<'_, T>,
    n: usize,
) -> Result<()> {
    const OP: &str = "swiglu_fwd";
    need(OP, "g", g.len(), n)?;
    need(OP, "u", u.len(), n)?;
    need(OP, "h", h.len(), n)?;
    if n == 0 {
        return Ok(());
    }
    let n_i = n as i64;
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::SwigluFwd));
    b.arg(g).arg(u).arg(h).arg(&n_i);
    // SAFETY: as above, for swiglu_fwd_<T>.
    unsafe { b.launch(elementwise_cfg(n.div_ceil(vec_width::<T>()))) }.map_err(drv(OP))?;
    Ok(())
}

/// SwiGLU backward. `dh, g, u: (n)`; `out: (2, n)` = `[dg; du]`: `dg = T(dh·u·silu'(g))` at
/// `[0, n)`, `du = T(dh·silu(g))` at `[n, 2n)`.
pub fn swiglu_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    dh: &CudaView<'_, T>,
    g: &CudaView<'_, T>,
    u: &CudaView<'_, T>,
    out: &mut CudaViewMut<'_, T>,
    n: usize,
) -> Result<()> {
    const OP: &str = "swiglu_bwd";
    need(OP, "dh", dh.len(), n)?;
    need(OP, "g", g.len(), n)?;
    need(OP, "u", u.len(), n)?;
    need(OP, "out (2, n)", out.len(), numel(OP, &[2, n])?)?;
    if n == 0 {
        return Ok(());
    }
    let n_i = n as i64;
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::SwigluBwd));
    b.arg(dh).arg(g).arg(u).arg(out).arg(&n_i);
    // SAFETY: as above, for swiglu_bwd_<T>; out holds 2n elements.
    unsafe { b.launch(elementwise_cfg(n.div_ceil(vec_width::<T>()))) }.map_err(drv(OP))?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn rope<T: FusedFloat>(
    op: &'static str,
    kernel: K,
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
    let k = FusedKernels::get(stream.context())?;
    let mut l = stream.launch_builder(k.f::<T>(kernel));
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
        K::RopeFwd,
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
        K::RopeBwd,
        stream,
        dy,
        cos,
        sin,
        dx,
        (b, h, t, dh),
    )
}

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
    if v == 0 {
        return Err(bad(OP, "vocabulary of 0".into()));
    }
    need(OP, "logits", logits.len(), numel(OP, &[n, v])?)?;
    need(OP, "targets", targets.len(), n)?;
    need(OP, "out (n, 2)", out.len(), numel(OP, &[n, 2])?)?;
    if n == 0 {
        return Ok(());
    }
    let (n_i, v_i) = (int(OP, "n", n)?, int(OP, "v", v)?);
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::CeFwd));
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
    let nv = numel(OP, &[n, v])?;
    need(OP, "logits", logits.len(), nv)?;
    need(OP, "targets", targets.len(), n)?;
    need(OP, "lse", lse.len(), n)?;
    need(OP, "dlogits", dlogits.len(), nv)?;
    if nv == 0 {
        return Ok(());
    }
    let (n_i, v_i) = (int(OP, "n", n)?, int(OP, "v", v)?);
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::CeBwd));
    b.arg(logits)
        .arg(targets)
        .arg(lse)
        .arg(&scale)
        .arg(dlogits)
        .arg(&n_i)
        .arg(&v_i);
    // grid.x spans a row's vectors, grid.y the rows (grid-stride beyond 65535).
    let cfg = LaunchConfig {
        grid_dim: (
            v.div_ceil(vec_width::<T>()).div_ceil(256) as u32,
            n.min(65535) as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: as above, for ce_bwd_<T>.
    unsafe { b.launch(cfg) }.map_err(drv(OP))?;
    Ok(())
}

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
    let k = FusedKernels::get(stream.context())?;
    let mut b = stream.launch_builder(k.f::<T>(K::Widen));
    b.arg(x).arg(y).arg(&n_i);
    // SAFETY: as above, for widen_<T>; sizes checked above.
    unsafe { b.launch(elementwise_cfg(n.div_ceil(vec_width::<T>()))) }.map_err(drv(OP))?;
    Ok(())
}
