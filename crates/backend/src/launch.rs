//! What the launchers of the embedded kernels share: the element types ([`FusedFloat`]), an entry
//! point by its file and name ([`GpuKernel`], loaded once per CUDA context), the size checks every launcher runs before a launch
//! (`numel`, `need`, `int`) and the launch shapes (`row_cfg`: a block per row; `elementwise_cfg`: a
//! grid-stride loop). A leaf: it imports neither launcher file.

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

use crate::image::KernelImage;
use crate::precision::Precision;
use crate::{drv, KernelError, Result};

/// An element type of the fused kernels: f32, bf16, f16.
pub trait FusedFloat: DeviceRepr + ValidAsZeroBits + Copy {
    /// Kernel name suffix: `f32`, `bf16`, `f16`.
    const SUFFIX: &'static str;
    /// Index of the type in per-type tables (f32 0, bf16 1, f16 2).
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

/// One entry point of an embedded kernel file, in each element type: `stem` followed by
/// `_f32`, `_bf16` or `_f16` ([`FusedFloat::SUFFIX`]) in `image`'s module. A launcher names its
/// own (`GpuKernel::new(&image::FUSED, "rope_fwd")`): no list of the kernels exists to edit when one
/// is added.
#[derive(Clone, Copy)]
pub struct GpuKernel {
    pub image: &'static KernelImage,
    pub stem: &'static str,
}

impl GpuKernel {
    pub const fn new(image: &'static KernelImage, stem: &'static str) -> GpuKernel {
        GpuKernel { image, stem }
    }

    /// The entry point for `T` in `ctx`: the image's module loaded on first use (the cubin for the
    /// device, else its PTX: [`crate::image::load`]) and each function once, both cached for the
    /// life of the process by raw context (`CUcontext`, shared by every `CudaContext` of a
    /// device's primary context; an entry keeps its context alive, so a key is never reused).
    pub fn get<T: FusedFloat>(self, ctx: &Arc<CudaContext>) -> Result<CudaFunction> {
        // (raw context, image name[, function name])
        type ModuleKey = (usize, &'static str);
        type Key = (usize, &'static str, String);
        static MODULES: Mutex<Vec<(ModuleKey, Arc<CudaModule>)>> = Mutex::new(Vec::new());
        static FUNCTIONS: Mutex<Vec<(Key, CudaFunction)>> = Mutex::new(Vec::new());
        let raw = ctx.cu_ctx() as usize;
        let name = format!("{}_{}", self.stem, T::SUFFIX);
        let key = (raw, self.image.name, name);
        let mut funcs = FUNCTIONS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, f)) = funcs.iter().find(|(k, _)| *k == key) {
            return Ok(f.clone());
        }
        let module = {
            let mut modules = MODULES.lock().unwrap_or_else(|e| e.into_inner());
            match modules.iter().find(|(k, _)| *k == (raw, self.image.name)) {
                Some((_, m)) => m.clone(),
                None => {
                    let m = crate::image::load(ctx, self.image)?;
                    modules.push(((raw, self.image.name), m.clone()));
                    m
                }
            }
        };
        let f = module
            .load_function(&key.2)
            .map_err(drv("loading a kernel function"))?;
        funcs.push((key, f.clone()));
        Ok(f)
    }
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
