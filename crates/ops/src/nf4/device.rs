//! A QLoRA base weight resident on the GPU (feature `cuda`): packed NF4 (0.5 byte a weight plus its
//! scales), dequantized by `kernels/nf4.cu` straight into a fresh compute-dtype candle tensor at
//! each use and dropped after the matmul, so the full-precision copy of a layer exists only while
//! that layer computes (as on the CPU).

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor};
use half::{bf16, f16};
use std::sync::{Arc, Mutex, OnceLock};

use super::Nf4Weight;
use rtune_backend::cuda::cuda_device;

use super::cuda::{nf4_dequant_cuda_into, Nf4Kernels, Nf4WeightCuda};

fn kerr(e: rtune_backend::KernelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// An NF4/FP4 weight on the GPU.
pub struct DeviceNf4 {
    w: Nf4WeightCuda,
}

impl DeviceNf4 {
    /// The weight's device buffers (a grouped launch's entries: `rtune-model`'s `group/nf4.rs`).
    pub fn weight(&self) -> &Nf4WeightCuda {
        &self.w
    }
}

impl std::fmt::Debug for DeviceNf4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceNf4({:?})", self.w.shape)
    }
}

/// Kernels loaded so far, one entry per device.
type Loaded = Mutex<Vec<(candle_core::cuda::DeviceId, Arc<Nf4Kernels>)>>;

/// The dequantize kernels, loaded once per device.
pub fn kernels(dev: &CudaDevice) -> Result<Arc<Nf4Kernels>> {
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

/// A weight whose codes and scales are already on the device (a sharded base's gather,
/// `rtune-model`'s `gathered.rs`): `layout` gives its shape, blocks and code tables (its own
/// codes and scales unused, empty there), `parts` its 1-D tensors in the gather's order — the
/// packed codes (u8), then the scales (f32), or with double quantization the scales' codes (u8)
/// and the second-level scales (f32). Each part is copied device to device on the compute
/// stream (which first waits for the gather's write); only the code tables come from the host.
pub fn from_device_parts(
    layout: &Nf4Weight,
    parts: &[Tensor],
    device: &Device,
) -> Result<Arc<DeviceNf4>> {
    use super::cuda::DeviceAbsmax;
    use super::Absmax;
    let dev = cuda_device(device)?;
    let stream = dev.cuda_stream();
    if layout.blocksize != super::BLOCKSIZE {
        candle_core::bail!(
            "nf4 from device parts: blocksize {} (the kernels handle 64)",
            layout.blocksize
        );
    }
    let numel = layout.numel();
    let blocks = numel.div_ceil(layout.blocksize);
    // A part's elements `[n]` of `T` copied into a buffer of the weight's own.
    fn copy<
        T: candle_core::WithDType + candle_core::cuda::CudaDType + cudarc::driver::DeviceRepr,
    >(
        stream: &Arc<cudarc::driver::CudaStream>,
        t: &Tensor,
        n: usize,
        what: &str,
    ) -> Result<cudarc::driver::CudaSlice<T>> {
        if t.dims() != [n] || t.dtype() != T::DTYPE {
            candle_core::bail!(
                "nf4 from device parts: {what} {:?} {:?}, expected [{n}] {:?}",
                t.shape(),
                t.dtype(),
                T::DTYPE
            );
        }
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            candle_core::bail!("nf4 from device parts: {what} is not on a CUDA device");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("nf4 from device parts: {what} is not contiguous");
        };
        let src = cs.as_cuda_slice::<T>()?.slice(start..end);
        Ok(stream
            .clone_dtod(&src)
            .map_err(candle_core::cuda::CudaError::from)?)
    }
    let part = |i: usize| {
        parts.get(i).ok_or_else(|| {
            candle_core::Error::Msg(format!("nf4 from device parts: part {i} missing"))
        })
    };
    let packed = copy::<u8>(&stream, part(0)?, numel.div_ceil(2), "the codes")?;
    let up32 = |v: &[f32]| {
        stream
            .clone_htod(v)
            .map_err(candle_core::cuda::CudaError::from)
    };
    let absmax = match &layout.absmax {
        Absmax::Plain(_) => {
            DeviceAbsmax::Plain(copy::<f32>(&stream, part(1)?, blocks, "the scales")?)
        }
        Absmax::Double {
            nested_quant_map,
            offset,
            nested_blocksize,
            ..
        } => DeviceAbsmax::Double {
            codes: copy::<u8>(&stream, part(1)?, blocks, "the scale codes")?,
            nested_absmax: copy::<f32>(
                &stream,
                part(2)?,
                blocks.div_ceil(*nested_blocksize),
                "the second-level scales",
            )?,
            nested_quant_map: up32(nested_quant_map)?,
            offset: *offset,
            nested_blocksize: *nested_blocksize,
        },
    };
    let w = Nf4WeightCuda {
        shape: layout.shape.clone(),
        packed,
        absmax,
        quant_map: up32(&layout.quant_map)?,
    };
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
