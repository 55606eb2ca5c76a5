//! Host side of `kernels/dropout.cu`: the LoRA dropout `y = f32(x)·m(i)` for f32, bf16 and f16
//! inputs already on the GPU, with the mask drawn from Philox4x32-10 keyed by `(seed, salt, i)`.
//! The definition (key and counter layout, keep threshold, scale) and the CPU implementation are
//! in `crates/backend/src/dropout.rs`; both devices draw the same masks, bit for bit.

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use std::sync::{Arc, Mutex};

use crate::{drv, FusedFloat, KernelError, Result};

/// The dropout kernels, one per input type (index [`FusedFloat::INDEX`]: f32, bf16, f16), loaded
/// into one CUDA context.
pub struct DropoutKernels {
    funcs: Vec<CudaFunction>,
}

/// Loaded modules by raw context, as `GpuKernel` keeps its own.
static LOADED: Mutex<Vec<(usize, Arc<DropoutKernels>)>> = Mutex::new(Vec::new());

impl DropoutKernels {
    /// Loads `dropout.cu`'s cubin or PTX into `ctx` ([`crate::image::load`]; use [`Self::get`]).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let module = crate::image::load(ctx, &crate::image::DROPOUT)?;
        let funcs = ["f32", "bf16", "f16"]
            .into_iter()
            .map(|s| {
                module
                    .load_function(&format!("lora_dropout_{s}"))
                    .map_err(drv("loading a dropout kernel"))
            })
            .collect::<Result<_>>()?;
        Ok(Self { funcs })
    }

    /// The kernels of `ctx`, loaded on first use and cached for the life of the process.
    pub fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Self>> {
        crate::launch::per_context(&LOADED, ctx, Self::load)
    }
}

/// `y[i] = f32(x[i]) · (word(i) >> 8 ≥ threshold ? scale : 0)` for `i < n`, `word(i)` word `i % 4`
/// of `philox4x32_10((i/4 low, i/4 high, salt low, salt high), (seed low, seed high))`.
/// `threshold = ⌈p·2²⁴⌉`, `scale = f32(1/(1−p))`, as the CPU computes them. `x, y` hold at least
/// `n` elements (contiguous).
#[allow(clippy::too_many_arguments)]
pub fn lora_dropout<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, T>,
    y: &mut CudaViewMut<'_, f32>,
    n: usize,
    seed: u64,
    salt: u64,
    threshold: u32,
    scale: f32,
) -> Result<()> {
    const OP: &str = "lora_dropout";
    for (what, have) in [("x", x.len()), ("y", y.len())] {
        if have < n {
            return Err(KernelError::Unsupported {
                op: OP,
                message: format!("{what} has {have} elements, {n} asked for"),
            });
        }
    }
    if n == 0 {
        return Ok(());
    }
    let k = DropoutKernels::get(stream.context())?;
    let n64 = n as u64;
    let (seed_lo, seed_hi, salt_lo, salt_hi) = (
        seed as u32,
        (seed >> 32) as u32,
        salt as u32,
        (salt >> 32) as u32,
    );
    // One thread per 4 elements, grid-stride beyond 65535 blocks of 256.
    let blocks = n.div_ceil(4).div_ceil(256).clamp(1, 65_535) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&k.funcs[T::INDEX]);
    b.arg(x)
        .arg(y)
        .arg(&n64)
        .arg(&seed_lo)
        .arg(&seed_hi)
        .arg(&salt_lo)
        .arg(&salt_hi)
        .arg(&threshold)
        .arg(&scale);
    // SAFETY: argument types and order match lora_dropout_<T> in dropout.cu (const T*, float*,
    // unsigned long long, six uint32/float scalars); x and y hold n elements (checked above).
    unsafe { b.launch(cfg) }.map_err(drv(OP))?;
    Ok(())
}
