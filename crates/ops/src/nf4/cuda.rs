//! Host side of `kernels/nf4.cu`: upload an [`Nf4Weight`], launch the dequantize kernels.

use super::group::{Addresses, GroupTable, Slots};
use super::{Absmax, Nf4Weight, BLOCKSIZE};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg, SyncOnDrop, ValidAsZeroBits,
};
use half::{bf16, f16};
use std::sync::Arc;

use rtune_backend::{drv, KernelError, Result};

/// Outputs written by one thread (8 packed bytes); see the work split in `kernels/nf4.cu`.
const PER_THREAD: usize = 16;
const THREADS: u32 = 256;

/// An output element type of the dequantize kernels.
pub trait DequantOut: DeviceRepr + ValidAsZeroBits + Copy {
    /// Kernel name suffix: `f32`, `f16`, `bf16`.
    const SUFFIX: &'static str;
    /// Index into [`Nf4Kernels`]' function arrays.
    const INDEX: usize;
}
impl DequantOut for f32 {
    const SUFFIX: &'static str = "f32";
    const INDEX: usize = 0;
}
impl DequantOut for f16 {
    const SUFFIX: &'static str = "f16";
    const INDEX: usize = 1;
}
impl DequantOut for bf16 {
    const SUFFIX: &'static str = "bf16";
    const INDEX: usize = 2;
}

/// The dequantize kernels of `kernels/nf4.cu` (per tensor, plain and double quant; grouped),
/// loaded into one CUDA context.
pub struct Nf4Kernels {
    /// `[f32, f16, bf16]`
    plain: [CudaFunction; 3],
    double: [CudaFunction; 3],
    group: [CudaFunction; 3],
}

impl Nf4Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let module = rtune_backend::image::load(ctx, &rtune_backend::image::NF4)?;
        let get = |kind: &str, sfx: &str| {
            module
                .load_function(&format!("nf4_dequant_{kind}_{sfx}"))
                .map_err(drv("loading an nf4 kernel"))
        };
        Ok(Nf4Kernels {
            plain: [
                get("plain", "f32")?,
                get("plain", "f16")?,
                get("plain", "bf16")?,
            ],
            double: [
                get("double", "f32")?,
                get("double", "f16")?,
                get("double", "bf16")?,
            ],
            group: [
                get("group", "f32")?,
                get("group", "f16")?,
                get("group", "bf16")?,
            ],
        })
    }
}

/// The scales of an [`Nf4WeightCuda`], as in [`Absmax`].
pub enum DeviceAbsmax {
    /// `[n_blocks]` f32
    Plain(CudaSlice<f32>),
    Double {
        /// `[n_blocks]` u8
        codes: CudaSlice<u8>,
        /// `[ceil(n_blocks / nested_blocksize)]` f32
        nested_absmax: CudaSlice<f32>,
        /// `[256]` f32
        nested_quant_map: CudaSlice<f32>,
        offset: f32,
        nested_blocksize: usize,
    },
}

/// An [`Nf4Weight`] in GPU memory (resident: ~0.5 byte per element plus scales).
pub struct Nf4WeightCuda {
    pub shape: Vec<usize>,
    /// `[ceil(numel / 2)]`
    pub packed: CudaSlice<u8>,
    pub absmax: DeviceAbsmax,
    /// `[16]`
    pub quant_map: CudaSlice<f32>,
}

impl Nf4WeightCuda {
    /// Copies `w` to the GPU on `stream` (blocksize must be 64, as every weight rtune makes or
    /// reads).
    pub fn upload(stream: &Arc<CudaStream>, w: &Nf4Weight) -> Result<Self> {
        if w.blocksize != BLOCKSIZE {
            return Err(KernelError::Unsupported {
                op: "nf4 upload",
                message: format!("blocksize {} (the kernels handle 64)", w.blocksize),
            });
        }
        let up8 = |v: &[u8]| stream.clone_htod(v).map_err(drv("nf4 upload"));
        let up32 = |v: &[f32]| stream.clone_htod(v).map_err(drv("nf4 upload"));
        let absmax = match &w.absmax {
            Absmax::Plain(a) => DeviceAbsmax::Plain(up32(a)?),
            Absmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                offset,
                nested_blocksize,
            } => DeviceAbsmax::Double {
                codes: up8(codes)?,
                nested_absmax: up32(nested_absmax)?,
                nested_quant_map: up32(nested_quant_map)?,
                offset: *offset,
                nested_blocksize: *nested_blocksize,
            },
        };
        Ok(Nf4WeightCuda {
            shape: w.shape.clone(),
            packed: up8(&w.packed)?,
            absmax,
            quant_map: up32(&w.quant_map)?,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Dequantizes `w` into a new `[numel]` buffer of `T` (f32, f16 or bf16) on `stream`; asynchronous
/// like any launch.
pub fn nf4_dequant_cuda<T: DequantOut>(
    kernels: &Nf4Kernels,
    stream: &Arc<CudaStream>,
    w: &Nf4WeightCuda,
) -> Result<CudaSlice<T>> {
    // SAFETY: the kernel writes every one of the numel elements before anything reads them.
    let mut out = unsafe { stream.alloc::<T>(w.numel()) }.map_err(drv("nf4 output alloc"))?;
    nf4_dequant_cuda_into(kernels, stream, w, &mut out)?;
    Ok(out)
}

/// Dequantizes `w` into `out` (`[numel]`, a whole allocation so 16-byte stores are aligned).
pub fn nf4_dequant_cuda_into<T: DequantOut>(
    kernels: &Nf4Kernels,
    stream: &Arc<CudaStream>,
    w: &Nf4WeightCuda,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    let n = w.numel();
    if out.len() != n {
        return Err(KernelError::Unsupported {
            op: "nf4 dequant",
            message: format!("output has {} elements, the weight {n}", out.len()),
        });
    }
    if n == 0 {
        return Ok(());
    }
    let threads = n.div_ceil(PER_THREAD);
    let grid = u32::try_from(threads.div_ceil(THREADS as usize)).map_err(|_| {
        KernelError::Unsupported {
            op: "nf4 dequant",
            message: format!("{n} elements is too many for one launch"),
        }
    })?;
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let n = n as i64;
    match &w.absmax {
        DeviceAbsmax::Plain(absmax) => {
            let mut b = stream.launch_builder(&kernels.plain[T::INDEX]);
            b.arg(&w.packed)
                .arg(absmax)
                .arg(&w.quant_map)
                .arg(out)
                .arg(&n);
            // SAFETY: argument types and order match nf4_dequant_plain_<T> in kernels/nf4.cu;
            // the buffer sizes were checked on upload and above.
            unsafe { b.launch(cfg) }.map_err(drv("nf4_dequant_plain"))?;
        }
        DeviceAbsmax::Double {
            codes,
            nested_absmax,
            nested_quant_map,
            offset,
            nested_blocksize,
        } => {
            let nbs = *nested_blocksize as i32;
            let mut b = stream.launch_builder(&kernels.double[T::INDEX]);
            b.arg(&w.packed)
                .arg(codes)
                .arg(nested_absmax)
                .arg(nested_quant_map)
                .arg(offset)
                .arg(&nbs)
                .arg(&w.quant_map)
                .arg(out)
                .arg(&n);
            // SAFETY: as above, for nf4_dequant_double_<T>.
            unsafe { b.launch(cfg) }.map_err(drv("nf4_dequant_double"))?;
        }
    }
    Ok(())
}

// SAFETY: `#[repr(C)]` plain data (addresses as u64, integers, floats) laid out as the kernel's
// `Nf4GroupTable` (sizes asserted in `group.rs` and the .cu); passed by value as the parameter.
unsafe impl DeviceRepr for GroupTable {}

/// Dequantizes the weights `ws` (with their host copies `hosts`, for the scale kinds) into `out`
/// at `slots`' offsets in one launch on `stream` (each offset a multiple of 16 bytes into `out`,
/// the start of its allocation, for the kernel's vector stores). cudarc's per-buffer events order
/// it after the last work touching `out` on any stream and the weights' uploads, and the next
/// reader of `out` after it.
pub fn nf4_dequant_group_into<T: DequantOut>(
    kernels: &Nf4Kernels,
    stream: &Arc<CudaStream>,
    ws: &[&Nf4WeightCuda],
    hosts: &[&Nf4Weight],
    slots: &Slots,
    out: &mut CudaSlice<T>,
) -> Result<()> {
    let bad = |message: String| KernelError::Unsupported {
        op: "nf4 grouped dequant",
        message,
    };
    let end = slots.iter().map(|&(o, n)| o + n).max().unwrap_or(0);
    let align = 16 / std::mem::size_of::<T>();
    if out.len() < end || slots.iter().any(|&(o, _)| o % align != 0) {
        return Err(bad(format!(
            "slots {slots:?} in an output of {} elements (offsets a multiple of {align})",
            out.len()
        )));
    }
    if let Some((i, (w, h))) = ws.iter().zip(hosts).enumerate().find(|(_, (w, h))| {
        w.shape != h.shape
            || matches!(w.absmax, DeviceAbsmax::Double { .. }) != h.absmax.is_double()
    }) {
        return Err(bad(format!(
            "weight {i}: device copy {:?} is not its host weight {:?}",
            w.shape, h.shape
        )));
    }
    // The device addresses, each with the guard that records this launch as a use of the buffer
    // (dropped after the launch).
    let mut guards: Vec<SyncOnDrop<'_>> = Vec::new();
    let mut addrs = Vec::with_capacity(ws.len());
    for w in ws {
        let (packed, pg) = w.packed.device_ptr(stream);
        let (quant_map, qg) = w.quant_map.device_ptr(stream);
        guards.extend([pg, qg]);
        let mut a = Addresses {
            packed,
            quant_map,
            ..Default::default()
        };
        match &w.absmax {
            DeviceAbsmax::Plain(v) => {
                let (p, g) = v.device_ptr(stream);
                a.absmax = p;
                guards.push(g);
            }
            DeviceAbsmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                ..
            } => {
                let (c, g1) = codes.device_ptr(stream);
                let (n, g2) = nested_absmax.device_ptr(stream);
                let (m, g3) = nested_quant_map.device_ptr(stream);
                (a.codes, a.nested_absmax, a.nested_map) = (c, n, m);
                guards.extend([g1, g2, g3]);
            }
        }
        addrs.push(a);
    }
    let table = super::group::table(hosts, &addrs, slots, THREADS as usize).map_err(bad)?;
    if table.total_blocks == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (table.total_blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (dst, out_guard) = out.device_ptr_mut(stream);
    let mut b = stream.launch_builder(&kernels.group[T::INDEX]);
    b.arg(&table).arg(&dst);
    // SAFETY: argument types and order match nf4_dequant_group_<T> (the table by value, the
    // output's address); every address in the table is a live buffer of a weight in `ws` whose
    // sizes were checked on upload, and `out` holds every slot.
    unsafe { b.launch(cfg) }.map_err(drv("nf4_dequant_group"))?;
    drop(out_guard);
    drop(guards);
    Ok(())
}
