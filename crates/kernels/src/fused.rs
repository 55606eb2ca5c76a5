//! Host side of `kernels/fused.cu`: RMSNorm, SwiGLU, RoPE and cross-entropy, forward and backward,
//! for f32, bf16 and f16 tensors already on the GPU; and of `kernels/attn.cu`, the attention
//! softmax (its launchers are in `attn.rs`, re-exported here).
//!
//! Every launcher takes the stream to run on and views of row-major contiguous buffers (each view
//! holds at least the elements its shape names; any beyond are ignored), checks the sizes, and
//! launches asynchronously. The PTX is loaded once per CUDA context and cached for the process
//! ([`FusedKernels::get`]). Semantics: those of `crates/model/src/ops.rs` and `rope.rs`, restated in
//! [`crate::fused_ref`]; [`self_test`] and `tests/fused_cuda.rs` compare the two.

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

use crate::fused_ref::Precision;
use crate::{drv, KernelError, Result, ATTN_PTX, FUSED_PTX};

pub use crate::attn::{attn_softmax_bwd, attn_softmax_fwd};
pub use crate::fused_check::{
    check_attn_softmax, check_ce, check_rms_norm, check_rope, check_swiglu, self_test, CheckResult,
};

/// An element type of the fused kernels: f32, bf16, f16.
pub trait FusedFloat: DeviceRepr + ValidAsZeroBits + Copy {
    /// Kernel name suffix: `f32`, `bf16`, `f16`.
    const SUFFIX: &'static str;
    /// Index into [`FusedKernels`]' per-type functions.
    const INDEX: usize;
    /// The rounding [`crate::fused_ref`] applies for this type.
    const PRECISION: Precision;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}
impl FusedFloat for f32 {
    const SUFFIX: &'static str = "f32";
    const INDEX: usize = 0;
    const PRECISION: Precision = Precision::F32;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}
impl FusedFloat for bf16 {
    const SUFFIX: &'static str = "bf16";
    const INDEX: usize = 1;
    const PRECISION: Precision = Precision::Bf16;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
impl FusedFloat for f16 {
    const SUFFIX: &'static str = "f16";
    const INDEX: usize = 2;
    const PRECISION: Precision = Precision::F16;
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// The kernels of `fused.cu`, then those of `attn.cu`, in [`FusedKernels`]' order (that of `K`).
const KERNELS: [&str; 10] = [
    "rms_norm_fwd",
    "rms_norm_bwd",
    "swiglu_fwd",
    "swiglu_bwd",
    "rope_fwd",
    "rope_bwd",
    "ce_fwd",
    "ce_bwd",
    "attn_softmax_fwd",
    "attn_softmax_bwd",
];
/// How many of `KERNELS` are in `fused.ptx` (the rest are in `attn.ptx`).
const IN_FUSED: usize = 8;
const SUFFIXES: [&str; 3] = ["f32", "bf16", "f16"];

#[derive(Clone, Copy)]
pub(crate) enum K {
    RmsFwd,
    RmsBwd,
    SwigluFwd,
    SwigluBwd,
    RopeFwd,
    RopeBwd,
    CeFwd,
    CeBwd,
    AttnFwd,
    AttnBwd,
}

/// Every kernel of `kernels/fused.cu` and `kernels/attn.cu`, loaded into one CUDA context.
pub struct FusedKernels {
    /// `[kernel × 3 + type index]`, kernels as in `KERNELS`, types as [`FusedFloat::INDEX`].
    funcs: Vec<CudaFunction>,
}

/// Loaded modules, by raw context (`CUcontext`, shared by every `CudaContext` of a device's primary
/// context). An entry keeps its context alive, so the key is never reused for another context.
static LOADED: Mutex<Vec<(usize, Arc<FusedKernels>)>> = Mutex::new(Vec::new());

impl FusedKernels {
    /// Loads `fused.ptx` and `attn.ptx` into `ctx` (JIT-compiled by the driver: tens of ms; use
    /// [`Self::get`]).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let fused = ctx
            .load_module(Ptx::from_src(FUSED_PTX))
            .map_err(drv("loading fused.ptx"))?;
        let attn = ctx
            .load_module(Ptx::from_src(ATTN_PTX))
            .map_err(drv("loading attn.ptx"))?;
        let mut funcs = Vec::with_capacity(KERNELS.len() * SUFFIXES.len());
        for (i, k) in KERNELS.into_iter().enumerate() {
            let module = if i < IN_FUSED { &fused } else { &attn };
            for s in SUFFIXES {
                funcs.push(
                    module
                        .load_function(&format!("{k}_{s}"))
                        .map_err(drv("loading a fused kernel"))?,
                );
            }
        }
        Ok(FusedKernels { funcs })
    }

    /// The kernels of `ctx`, loaded on first use and cached for the life of the process.
    pub fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Self>> {
        let key = ctx.cu_ctx() as usize;
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, k)) = loaded.iter().find(|(c, _)| *c == key) {
            return Ok(k.clone());
        }
        let k = Arc::new(Self::load(ctx)?);
        loaded.push((key, k.clone()));
        Ok(k)
    }

    pub(crate) fn f<T: FusedFloat>(&self, k: K) -> &CudaFunction {
        &self.funcs[k as usize * SUFFIXES.len() + T::INDEX]
    }
}

pub(crate) fn bad(op: &'static str, message: String) -> KernelError {
    KernelError::Unsupported { op, message }
}

/// Product of `dims`, or an error on overflow.
pub(crate) fn numel(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(op, format!("shape {dims:?} overflows")))
}

/// `have` elements must cover the `want` the shape names.
pub(crate) fn need(op: &'static str, what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(bad(
            op,
            format!("{what} has {have} elements, the shape needs {want}"),
        ));
    }
    Ok(())
}

/// `v` as a kernel's `int`, with room for `i + step` (≤ 2^30).
pub(crate) fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    if v > 1 << 30 {
        return Err(bad(op, format!("{what} = {v} is over 2^30")));
    }
    Ok(v as i32)
}

/// Elements per 16-byte vector.
pub(crate) fn vec_width<T>() -> usize {
    16 / std::mem::size_of::<T>()
}

/// One block per row, enough threads for one vector each, in whole warps, at most 1024
/// (`__launch_bounds__(1024)` in fused.cu).
pub(crate) fn row_cfg<T>(rows: usize, len: usize) -> LaunchConfig {
    let threads = len
        .div_ceil(vec_width::<T>())
        .next_multiple_of(32)
        .clamp(32, 1024);
    LaunchConfig {
        grid_dim: (rows.min(i32::MAX as usize) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Grid-stride elementwise launch over `items` work items: 256 threads, at most 65535 blocks
/// (~60 per SM on an H100, enough to keep it busy; the loop covers the rest).
fn elementwise_cfg(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(256).clamp(1, 65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

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
