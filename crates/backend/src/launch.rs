//! What the launchers of `kernels/fused.cu` ([`crate::fused`]) and `kernels/attn.cu`
//! ([`crate::attn`]) share: the element types ([`FusedFloat`]), the loaded kernels of both files
//! ([`FusedKernels`], cached per CUDA context), the size checks every launcher runs before a launch
//! (`numel`, `need`, `int`) and the launch shapes (`row_cfg`: a block per row; `elementwise_cfg`: a
//! grid-stride loop). A leaf: it imports neither launcher file.

use cudarc::driver::{CudaContext, CudaFunction, DeviceRepr, LaunchConfig, ValidAsZeroBits};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

use crate::precision::Precision;
use crate::{drv, KernelError, Result};

/// An element type of the fused kernels: f32, bf16, f16.
pub trait FusedFloat: DeviceRepr + ValidAsZeroBits + Copy {
    /// Kernel name suffix: `f32`, `bf16`, `f16`.
    const SUFFIX: &'static str;
    /// Index into [`FusedKernels`]' per-type functions.
    const INDEX: usize;
    /// The rounding each op's `reference.rs` applies for this type.
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
const KERNELS: [&str; 13] = [
    "rms_norm_fwd",
    "rms_norm_bwd",
    "swiglu_fwd",
    "swiglu_bwd",
    "geglu_fwd",
    "geglu_bwd",
    "rope_fwd",
    "rope_bwd",
    "ce_fwd",
    "ce_bwd",
    "widen",
    "attn_softmax_fwd",
    "attn_softmax_bwd",
];
/// How many of `KERNELS` are in `fused.ptx` (the rest are in `attn.ptx`).
const IN_FUSED: usize = 11;
const SUFFIXES: [&str; 3] = ["f32", "bf16", "f16"];

#[derive(Clone, Copy)]
pub enum K {
    RmsFwd,
    RmsBwd,
    SwigluFwd,
    SwigluBwd,
    GegluFwd,
    GegluBwd,
    RopeFwd,
    RopeBwd,
    CeFwd,
    CeBwd,
    Widen,
    AttnFwd,
    AttnBwd,
}

/// The kernel set `load` makes for `ctx`, loaded on first use and cached in `cache` for the life of
/// the process, keyed by the raw context (`CUcontext`, shared by every `CudaContext` of a device's
/// primary context; an entry keeps its context alive, so a key is never reused).
pub fn per_context<K>(
    cache: &Mutex<Vec<(usize, Arc<K>)>>,
    ctx: &Arc<CudaContext>,
    load: impl FnOnce(&Arc<CudaContext>) -> Result<K>,
) -> Result<Arc<K>> {
    let key = ctx.cu_ctx() as usize;
    let mut loaded = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, k)) = loaded.iter().find(|(c, _)| *c == key) {
        return Ok(k.clone());
    }
    let k = Arc::new(load(ctx)?);
    loaded.push((key, k.clone()));
    Ok(k)
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
    /// Loads `fused.cu` and `attn.cu` into `ctx`, each as the cubin for the device or else its PTX
    /// ([`crate::image::load`]; the PTX is JIT-compiled by the driver); use [`Self::get`].
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let fused = crate::image::load(ctx, &crate::image::FUSED)?;
        let attn = crate::image::load(ctx, &crate::image::ATTN)?;
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
        crate::launch::per_context(&LOADED, ctx, Self::load)
    }

    pub fn f<T: FusedFloat>(&self, k: K) -> &CudaFunction {
        &self.funcs[k as usize * SUFFIXES.len() + T::INDEX]
    }
}

pub fn bad(op: &'static str, message: String) -> KernelError {
    KernelError::Unsupported { op, message }
}

/// Product of `dims`, or an error on overflow.
pub fn numel(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(op, format!("shape {dims:?} overflows")))
}

/// `have` elements must cover the `want` the shape names.
pub fn need(op: &'static str, what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(bad(
            op,
            format!("{what} has {have} elements, the shape needs {want}"),
        ));
    }
    Ok(())
}

/// `v` as a kernel's `int`, with room for `i + step` (≤ 2^30).
pub fn int(op: &'static str, what: &str, v: usize) -> Result<i32> {
    if v > 1 << 30 {
        return Err(bad(op, format!("{what} = {v} is over 2^30")));
    }
    Ok(v as i32)
}

/// Elements per 16-byte vector.
pub fn vec_width<T>() -> usize {
    16 / std::mem::size_of::<T>()
}

/// One block per row, enough threads for one vector each, in whole warps, at most 1024
/// (`__launch_bounds__(1024)` in fused.cu).
pub fn row_cfg<T>(rows: usize, len: usize) -> LaunchConfig {
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
pub fn elementwise_cfg(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (items.div_ceil(256).clamp(1, 65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
