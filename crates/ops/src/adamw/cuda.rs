//! Host side of `kernels/adamw.cu`: loads its three kernels ([`AdamWKernels`], cached per CUDA
//! context) and launches them on a stream — [`mt_sq_norm`] (chunk partials, then the norm and the
//! clipping coefficient into a 2-element device buffer) and [`mt_adamw`] (the update, reading that
//! buffer, so the host need not see the norm before launching it). The tables are those of
//! [`super::chunk_table`] and the tensor table `(grad ptr, out ptr, offset, numel)` per tensor; the
//! arithmetic is [`super`]'s reference.

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use std::sync::{Arc, Mutex};

use super::{AdamWScalars, THREADS};
use rtune_backend::{drv, KernelError, Result};

/// The kernels of `adamw.cu`, loaded into one CUDA context.
pub struct AdamWKernels {
    sq_norm_partial: CudaFunction,
    norm_finalize: CudaFunction,
    adamw: CudaFunction,
}

/// Loaded modules by raw context, as `GpuKernel` keeps its own.
static LOADED: Mutex<Vec<(usize, Arc<AdamWKernels>)>> = Mutex::new(Vec::new());

impl AdamWKernels {
    /// Loads `adamw.cu`'s cubin or PTX into `ctx` ([`rtune_backend::image::load`]; use [`Self::get`]).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let module = rtune_backend::image::load(ctx, &rtune_backend::image::ADAMW)?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(drv("loading an adamw kernel"))
        };
        Ok(Self {
            sq_norm_partial: f("mt_sq_norm_partial")?,
            norm_finalize: f("mt_norm_finalize")?,
            adamw: f("mt_adamw")?,
        })
    }

    /// The kernels of `ctx`, loaded on first use and cached for the life of the process.
    pub fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Self>> {
        rtune_backend::launch::per_context(&LOADED, ctx, Self::load)
    }
}

fn check(op: &'static str, what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(KernelError::Unsupported {
            op,
            message: format!("{what} has {have} elements, {want} needed"),
        });
    }
    Ok(())
}

/// One block of THREADS per chunk, grid-stride beyond 65535 chunks (the result does not depend on
/// the grid: each chunk is summed by one block in a fixed order).
fn chunk_cfg(n_chunks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n_chunks.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `mt_sq_norm_partial` over the `n_chunks` chunks of `chunks` (`2·n_chunks` entries)
/// into `partials`, then `mt_norm_finalize`: `norm_coef = [norm, coef]` of `(g·unscale)` over
/// every tensor of `tensors` (`4` entries per tensor), `coef` for `max_norm` (≤ 0: 1).
///
/// # Safety
/// Every chunk names a tensor of `tensors`, and every non-zero grad pointer there points to at
/// least `numel` f32 of device memory of this context that stays allocated, and is not written,
/// until the kernels have run on `stream`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn mt_sq_norm(
    stream: &Arc<CudaStream>,
    tensors: &CudaSlice<u64>,
    chunks: &CudaSlice<u64>,
    n_chunks: usize,
    unscale: f32,
    max_norm: f64,
    partials: &mut CudaSlice<f64>,
    norm_coef: &mut CudaSlice<f64>,
) -> Result<()> {
    const OP: &str = "mt_sq_norm";
    check(OP, "chunks", chunks.len(), 2 * n_chunks)?;
    check(OP, "partials", partials.len(), n_chunks)?;
    check(OP, "norm_coef", norm_coef.len(), 2)?;
    let k = AdamWKernels::get(stream.context())?;
    let n = n_chunks as u64;
    if n_chunks > 0 {
        let mut b = stream.launch_builder(&k.sq_norm_partial);
        b.arg(tensors)
            .arg(chunks)
            .arg(&n)
            .arg(&unscale)
            .arg(&mut *partials);
        // SAFETY: argument types and order match mt_sq_norm_partial (two const u64 tables, u64,
        // float, double*); table sizes checked above, grad pointers by the caller.
        unsafe { b.launch(chunk_cfg(n_chunks)) }.map_err(drv(OP))?;
    }
    let mut b = stream.launch_builder(&k.norm_finalize);
    b.arg(&*partials).arg(&n).arg(&max_norm).arg(norm_coef);
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and order match mt_norm_finalize (const double*, u64, double,
    // double*); partials holds n_chunks and norm_coef 2 elements (checked above).
    unsafe { b.launch(one) }.map_err(drv(OP))?;
    Ok(())
}

/// Launches `mt_adamw`: the update of the flat `(master, m, v)` (`total` elements each) by the
/// gradients of `tensors`, clipped by `norm_coef[1]`; each tensor's new weights also go to its out
/// pointer when that is non-zero. Does nothing on the device when `norm_coef[0]` is not finite.
///
/// # Safety
/// As [`mt_sq_norm`] for the grad pointers; moreover every tensor's `offset + numel ≤ total`, and
/// every non-zero out pointer points to `numel` f32 of device memory of this context, written by
/// nothing else until the kernel has run on `stream`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn mt_adamw(
    stream: &Arc<CudaStream>,
    tensors: &CudaSlice<u64>,
    chunks: &CudaSlice<u64>,
    n_chunks: usize,
    norm_coef: &CudaSlice<f64>,
    (master, m, v): (
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
    ),
    total: usize,
    s: &AdamWScalars,
) -> Result<()> {
    const OP: &str = "mt_adamw";
    check(OP, "chunks", chunks.len(), 2 * n_chunks)?;
    check(OP, "norm_coef", norm_coef.len(), 2)?;
    for (what, have) in [("master", master.len()), ("m", m.len()), ("v", v.len())] {
        check(OP, what, have, total)?;
    }
    if n_chunks == 0 {
        return Ok(());
    }
    let k = AdamWKernels::get(stream.context())?;
    let n = n_chunks as u64;
    let mut b = stream.launch_builder(&k.adamw);
    b.arg(tensors)
        .arg(chunks)
        .arg(&n)
        .arg(norm_coef)
        .arg(master)
        .arg(m)
        .arg(v)
        .arg(&s.unscale)
        .arg(&s.w1)
        .arg(&s.b2)
        .arg(&s.w2)
        .arg(&s.eps)
        .arg(&s.bc2_sqrt)
        .arg(&s.step_size)
        .arg(&s.decay);
    // SAFETY: argument types and order match mt_adamw (two const u64 tables, u64, const double*,
    // three float*, eight floats); sizes checked above, table contents by the caller.
    unsafe { b.launch(chunk_cfg(n_chunks)) }.map_err(drv(OP))?;
    Ok(())
}
