//! CUDA-only parts of the model (feature `cuda`): 4-bit weights resident on the GPU, dequantized by
//! rtune's kernel (`kernels/nf4.cu`) straight into a candle tensor, the memory pool set-up, and the
//! read-out of the driver errors cudarc records where it cannot return them ([`deferred_error`]).
//!
//! A QLoRA base lives on the device as packed NF4 (0.5 byte a weight plus its scales); each use
//! dequantizes one weight into a fresh compute-dtype buffer that is dropped after the matmul, so the
//! full-precision copy of a layer exists only while that layer computes (as on the CPU).

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor};
use half::{bf16, f16};
use std::sync::{Arc, Mutex, OnceLock};

use rtune_kernels::{nf4_dequant_cuda_into, Nf4Kernels, Nf4WeightCuda};
use rtune_quant::Nf4Weight;

fn kerr(e: rtune_kernels::KernelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The CUDA device behind a candle device.
pub fn cuda_device(d: &Device) -> Result<&CudaDevice> {
    match d {
        Device::Cuda(c) => Ok(c),
        other => candle_core::bail!("expected a CUDA device, got {other:?}"),
    }
}

/// An NF4/FP4 weight on the GPU.
pub struct DeviceNf4 {
    w: Nf4WeightCuda,
}

impl std::fmt::Debug for DeviceNf4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceNf4({:?})", self.w.shape)
    }
}

/// Kernels loaded so far, one entry per device.
type Loaded = Mutex<Vec<(candle_core::cuda::DeviceId, Arc<Nf4Kernels>)>>;

/// The dequantize kernels, loaded once per device.
fn kernels(dev: &CudaDevice) -> Result<Arc<Nf4Kernels>> {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    let mut l = LOADED
        .get_or_init(Default::default)
        .lock()
        .expect("poisoned");
    if let Some((_, k)) = l.iter().find(|(id, _)| *id == dev.id()) {
        return Ok(k.clone());
    }
    let k = Arc::new(Nf4Kernels::load(dev.cuda_stream().context()).map_err(kerr)?);
    l.push((dev.id(), k.clone()));
    Ok(k)
}

/// Copies a quantized weight to the device.
pub fn upload(q: &Nf4Weight, device: &Device) -> Result<Arc<DeviceNf4>> {
    let dev = cuda_device(device)?;
    let w = Nf4WeightCuda::upload(&dev.cuda_stream(), q).map_err(kerr)?;
    Ok(Arc::new(DeviceNf4 { w }))
}

/// The weight dequantized into a new `(out, in)` tensor of `dtype` on `device`.
pub fn dequantize(q: &DeviceNf4, dtype: DType, device: &Device) -> Result<Tensor> {
    let dev = cuda_device(device)?;
    let k = kernels(dev)?;
    let stream = dev.cuda_stream();
    let n = q.w.numel();
    // Each alloc below: the kernel writes all n elements before anything reads them.
    let storage = match dtype {
        DType::BF16 => {
            // SAFETY: written in full by the kernel before any read.
            let mut out = unsafe { dev.alloc::<bf16>(n)? };
            nf4_dequant_cuda_into(&k, &stream, &q.w, &mut out).map_err(kerr)?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }
        DType::F16 => {
            // SAFETY: written in full by the kernel before any read.
            let mut out = unsafe { dev.alloc::<f16>(n)? };
            nf4_dequant_cuda_into(&k, &stream, &q.w, &mut out).map_err(kerr)?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }
        DType::F32 => {
            // SAFETY: written in full by the kernel before any read.
            let mut out = unsafe { dev.alloc::<f32>(n)? };
            nf4_dequant_cuda_into(&k, &stream, &q.w, &mut out).map_err(kerr)?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }
        other => candle_core::bail!("nf4 dequantize: no {other:?} output"),
    };
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        q.w.shape.as_slice(),
        BackpropOp::none(),
        false,
    ))
}

/// Opens `cuda:N` for training: candle's device, with the stream-ordered memory pool told to keep
/// what it has allocated (by default it returns memory to the driver at every synchronisation,
/// so each step would allocate its activations from the driver again).
pub fn open(ordinal: usize) -> Result<Device> {
    let d = Device::new_cuda(ordinal)?;
    rtune_kernels::memory::keep_pool(ordinal).map_err(kerr)?;
    Ok(d)
}

/// `cuda:N`'s card in words for `rtune check` and `rtune bench`: name, compute capability and
/// memory, e.g. `cuda:0, NVIDIA H200 (sm_90), 149.4 GB of which 148.9 GB free`.
pub fn describe(device: &Device) -> Result<String> {
    let d = cuda_device(device)?;
    let ctx = d.cuda_stream().context().clone();
    let e = |what: &str, err: cudarc::driver::DriverError| {
        candle_core::Error::Msg(format!("describing cuda:{}: {what}: {err}", ctx.ordinal()))
    };
    let name = ctx.name().map_err(|err| e("cuDeviceGetName", err))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|err| e("compute capability", err))?;
    ctx.bind_to_thread()
        .map_err(|err| e("cuCtxSetCurrent", err))?;
    let (free, total) = rtune_kernels::memory::free_and_total().map_err(kerr)?;
    Ok(format!(
        "cuda:{}, {name} (sm_{major}{minor}), {:.1} GB of which {:.1} GB free",
        ctx.ordinal(),
        total as f64 / 1e9,
        free as f64 / 1e9
    ))
}

/// The driver error cudarc recorded, if any, since the last call (then clears it). cudarc cannot
/// return errors from `Drop` (freeing a device or pinned buffer, destroying an event or stream,
/// the stream waits it inserts for event tracking): it stores the last one in the context's error
/// slot (`CudaContext::record_err`), where nothing reads it unless asked. The trainer asks at every
/// step boundary and at the end of the run. `Ok` on a non-CUDA device.
pub fn deferred_error(device: &Device) -> std::result::Result<(), cudarc::driver::DriverError> {
    match device {
        Device::Cuda(d) => d.cuda_stream().context().check_err(),
        _ => Ok(()),
    }
}
