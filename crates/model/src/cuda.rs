//! CUDA-only parts of the model (feature `cuda`): 4-bit weights resident on the GPU, dequantized by
//! rtune's kernel (`kernels/nf4.cu`) straight into a candle tensor, and the memory pool set-up.
//!
//! A QLoRA base lives on the device as packed NF4 (0.5 byte a weight plus its scales); each use
//! dequantizes one weight into a fresh compute-dtype buffer that is dropped after the matmul, so the
//! full-precision copy of a layer exists only while that layer computes (as on the CPU).

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor};
use cudarc::driver::PinnedHostSlice;
use half::{bf16, f16};
use std::sync::{Arc, Mutex, OnceLock};

use rtune_kernels::{nf4_dequant_cuda_into, Nf4Kernels, Nf4WeightCuda};
use rtune_quant::Nf4Weight;

fn kerr(e: rtune_kernels::KernelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

fn derr(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> candle_core::Error + Copy {
    move |e| candle_core::Error::Msg(format!("{op}: {e}"))
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
    // SAFETY (each alloc): the kernel writes all n elements before anything reads them.
    let storage = match dtype {
        DType::BF16 => {
            let mut out = unsafe { dev.alloc::<bf16>(n)? };
            nf4_dequant_cuda_into(&k, &stream, &q.w, &mut out).map_err(kerr)?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }
        DType::F16 => {
            let mut out = unsafe { dev.alloc::<f16>(n)? };
            nf4_dequant_cuda_into(&k, &stream, &q.w, &mut out).map_err(kerr)?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }
        DType::F32 => {
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

/// A layer input kept in page-locked host memory ([`Offloader`]).
pub struct Offloaded {
    host: HostBuf,
    dims: Vec<usize>,
}

enum HostBuf {
    F32(PinnedHostSlice<f32>),
    Bf16(PinnedHostSlice<bf16>),
    F16(PinnedHostSlice<f16>),
}

/// Moves checkpointed layer inputs to host memory and back on a side stream, so the copies overlap
/// with the layers computing on candle's stream. cudarc orders the two streams by the events it
/// records on every buffer once a second stream exists: the copy out waits for the layer that wrote
/// the input, freeing the device buffer waits for the copy out (stream-ordered, the CPU never
/// blocks), and the first kernel that reads a restored input waits for its copy in.
pub struct Offloader {
    side: Arc<cudarc::driver::CudaStream>,
    dev: CudaDevice,
}

impl Offloader {
    pub fn new(device: &Device) -> Result<Self> {
        let dev = cuda_device(device)?.clone();
        let side = dev.cuda_stream().fork().map_err(derr("offload stream"))?;
        Ok(Self { side, dev })
    }

    /// Starts copying `x` (contiguous, on the device) to host memory; `x` may be dropped at once.
    pub fn offload(&self, x: &Tensor) -> Result<Offloaded> {
        let x = x.contiguous()?;
        let n = x.elem_count();
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            candle_core::bail!("offload: the tensor is not on a CUDA device");
        };
        let from = layout.start_offset();
        let ctx = self.side.context();
        let derr = derr("offload");
        // SAFETY (each alloc_pinned): the copy enqueued next writes all n elements before any read
        // (reads of a pinned slice wait for its event).
        let host = match x.dtype() {
            DType::F32 => {
                let mut h = unsafe { ctx.alloc_pinned::<f32>(n) }.map_err(derr)?;
                let src = s.as_cuda_slice::<f32>()?.slice(from..from + n);
                self.side.memcpy_dtoh(&src, &mut h).map_err(derr)?;
                HostBuf::F32(h)
            }
            DType::BF16 => {
                let mut h = unsafe { ctx.alloc_pinned::<bf16>(n) }.map_err(derr)?;
                let src = s.as_cuda_slice::<bf16>()?.slice(from..from + n);
                self.side.memcpy_dtoh(&src, &mut h).map_err(derr)?;
                HostBuf::Bf16(h)
            }
            DType::F16 => {
                let mut h = unsafe { ctx.alloc_pinned::<f16>(n) }.map_err(derr)?;
                let src = s.as_cuda_slice::<f16>()?.slice(from..from + n);
                self.side.memcpy_dtoh(&src, &mut h).map_err(derr)?;
                HostBuf::F16(h)
            }
            other => candle_core::bail!("offload: no {other:?} layer inputs"),
        };
        Ok(Offloaded {
            host,
            dims: x.dims().to_vec(),
        })
    }

    /// Starts copying an offloaded input back; the tensor can be used at once (its first reader on
    /// candle's stream waits for the copy).
    pub fn restore(&self, o: &Offloaded) -> Result<Tensor> {
        let derr = derr("restore");
        let storage = match &o.host {
            HostBuf::F32(h) => CudaStorage::wrap_cuda_slice(
                self.side.clone_htod(h).map_err(derr)?,
                self.dev.clone(),
            ),
            HostBuf::Bf16(h) => CudaStorage::wrap_cuda_slice(
                self.side.clone_htod(h).map_err(derr)?,
                self.dev.clone(),
            ),
            HostBuf::F16(h) => CudaStorage::wrap_cuda_slice(
                self.side.clone_htod(h).map_err(derr)?,
                self.dev.clone(),
            ),
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            o.dims.as_slice(),
            BackpropOp::none(),
            false,
        ))
    }
}
