//! Checkpoint offload on CUDA (feature `cuda`): the layer inputs gradient checkpointing keeps are
//! copied to page-locked host memory during the forward pass and back one layer ahead of the
//! backward (`kept.rs`), on ONE side stream created with the model's first offloading step and
//! used for the rest of the run, into pinned buffers taken from a pool (`host_pool.rs`) and given
//! back once restored, so the steady state allocates neither streams nor pinned memory.
//!
//! Ordering: cudarc records an event on every device buffer and every pinned buffer it copies
//! (candle runs the context in multi-stream mode, so event tracking is on): the copy out waits for
//! the layer that wrote the input; freeing the device buffer waits for the copy out
//! (stream-ordered, the CPU never blocks); the first kernel that reads a restored input waits for
//! its copy in; a pooled buffer's next copy out waits for its last copy in (the buffer's event).
//! A pinned buffer may be larger than the input it holds (best fit): only the input's bytes move.

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Result, Storage, Tensor};
use cudarc::driver::{
    result, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice,
    HostSlice, PinnedHostSlice,
};
use half::{bf16, f16};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::cuda::cuda_device;
use crate::host_pool::{HostPool, PoolBuffer, PoolStats};

fn derr(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> candle_core::Error + Copy {
    move |e| candle_core::Error::Msg(format!("{op}: {e}"))
}

impl PoolBuffer for PinnedHostSlice<u8> {
    fn capacity_bytes(&self) -> usize {
        self.num_bytes()
    }
}

type Pool = Arc<Mutex<HostPool<PinnedHostSlice<u8>>>>;

fn lock(pool: &Pool) -> MutexGuard<'_, HostPool<PinnedHostSlice<u8>>> {
    // The pool's state is a list of free buffers: still valid after a panic elsewhere.
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

/// A layer input kept in page-locked host memory; its buffer goes back to the pool on drop.
pub struct Offloaded {
    /// `Some` until dropped.
    host: Option<PinnedHostSlice<u8>>,
    pool: Pool,
    dtype: DType,
    dims: Vec<usize>,
}

impl Drop for Offloaded {
    fn drop(&mut self) {
        if let Some(h) = self.host.take() {
            lock(&self.pool).give(h);
        }
    }
}

/// The side stream and the pinned-buffer pool of one model (see the file's overview).
pub struct Offloader {
    side: Arc<CudaStream>,
    dev: CudaDevice,
    pool: Pool,
}

impl Offloader {
    /// Creates the side stream (ordered after the work already queued on candle's stream).
    pub fn new(device: &Device) -> Result<Self> {
        let dev = cuda_device(device)?.clone();
        let side = dev.cuda_stream().fork().map_err(derr("offload stream"))?;
        Ok(Self {
            side,
            dev,
            pool: Arc::new(Mutex::new(HostPool::new())),
        })
    }

    /// What the pinned-buffer pool has done so far.
    pub fn pool_stats(&self) -> PoolStats {
        lock(&self.pool).stats()
    }

    /// Starts copying `x` (on the device) to host memory; `x` may be dropped at once.
    pub fn offload(&self, x: &Tensor) -> Result<Offloaded> {
        let x = x.contiguous()?;
        let (n, dtype) = (x.elem_count(), x.dtype());
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            candle_core::bail!("offload: no {dtype:?} layer inputs");
        }
        let bytes = n * dtype.size_in_bytes();
        let ctx = self.side.context().clone();
        // SAFETY: the buffer's bytes are written by the copy below before anything reads them
        // (restore copies only the first `bytes`, after this copy: same stream and the buffer's
        // event).
        let mut host = lock(&self.pool)
            .take(bytes.max(1), |b| unsafe { ctx.alloc_pinned::<u8>(b) })
            .map_err(derr("offload: pinned host allocation"))?;
        let copied = (|| {
            let (storage, layout) = x.storage_and_layout();
            let Storage::Cuda(s) = &*storage else {
                candle_core::bail!("offload: the tensor is not on a CUDA device");
            };
            let r = layout.start_offset()..layout.start_offset() + n;
            match dtype {
                DType::F32 => self.copy_out(&s.as_cuda_slice::<f32>()?.slice(r), &mut host),
                DType::BF16 => self.copy_out(&s.as_cuda_slice::<bf16>()?.slice(r), &mut host),
                _ => self.copy_out(&s.as_cuda_slice::<f16>()?.slice(r), &mut host),
            }
        })();
        if let Err(e) = copied {
            lock(&self.pool).give(host);
            return Err(e);
        }
        Ok(Offloaded {
            host: Some(host),
            pool: self.pool.clone(),
            dtype,
            dims: x.dims().to_vec(),
        })
    }

    /// Starts copying an offloaded input back; the tensor can be used at once (its first reader on
    /// candle's stream waits for the copy).
    pub fn restore(&self, o: &Offloaded) -> Result<Tensor> {
        let Some(host) = &o.host else {
            candle_core::bail!("restore: the offloaded input was already released");
        };
        let n: usize = o.dims.iter().product();
        let storage = match o.dtype {
            DType::F32 => self.wrap(self.copy_in::<f32>(host, n)?),
            DType::BF16 => self.wrap(self.copy_in::<bf16>(host, n)?),
            DType::F16 => self.wrap(self.copy_in::<f16>(host, n)?),
            other => candle_core::bail!("restore: no {other:?} layer inputs"),
        };
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            o.dims.as_slice(),
            BackpropOp::none(),
            false,
        ))
    }

    fn wrap<T: candle_core::cuda::CudaDType>(&self, s: CudaSlice<T>) -> CudaStorage {
        CudaStorage::wrap_cuda_slice(s, self.dev.clone())
    }

    /// Enqueues on the side stream the copy of `src` into the first bytes of `host`.
    fn copy_out<T: DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        host: &mut PinnedHostSlice<u8>,
    ) -> Result<()> {
        let side = &self.side;
        let bytes = src.num_bytes();
        if bytes == 0 {
            return Ok(());
        }
        side.context()
            .bind_to_thread()
            .map_err(derr("offload copy"))?;
        // The guards record, when dropped after the copy, the read of `src` and the write of `host`
        // on the side stream: freeing `src` and reusing `host` wait for this copy.
        let (src_ptr, _read) = src.device_ptr(side);
        // SAFETY: the slice is used only by the copy enqueued on `side` below (which first waits
        // for the buffer's previous use, its event).
        let (dst, _write) = unsafe { host.stream_synced_mut_slice(side) };
        if dst.len() < bytes {
            candle_core::bail!(
                "offload copy: pinned buffer of {} < {bytes} bytes",
                dst.len()
            );
        }
        // SAFETY: `dst[..bytes]` is pinned host memory that stays allocated (the pool or the
        // `Offloaded` holds it; dropping it waits for its event); `src_ptr` addresses `bytes` bytes
        // of device memory kept alive until the copy ends (the read event recorded above).
        unsafe { result::memcpy_dtoh_async(&mut dst[..bytes], src_ptr, side.cu_stream()) }
            .map_err(derr("offload copy"))
    }

    /// A new device buffer of `n` elements, filled on the side stream from the first bytes of
    /// `host`.
    fn copy_in<T: DeviceRepr>(&self, host: &PinnedHostSlice<u8>, n: usize) -> Result<CudaSlice<T>> {
        let side = &self.side;
        let bytes = n * std::mem::size_of::<T>();
        if host.len() < bytes {
            candle_core::bail!("restore: pinned buffer of {} < {bytes} bytes", host.len());
        }
        // SAFETY: every element is written by the copy below before any reader (readers on other
        // streams wait for the write event recorded after it).
        let mut dst = unsafe { side.alloc::<T>(n) }.map_err(derr("restore: device allocation"))?;
        if bytes == 0 {
            return Ok(dst);
        }
        {
            let (dst_ptr, _write) = dst.device_ptr_mut(side);
            // SAFETY: the slice is read only by the copy enqueued on `side` below, which waits for
            // the copy out that filled it (the buffer's event).
            let (src, _read) = unsafe { host.stream_synced_slice(side) };
            // SAFETY: `src[..bytes]` is pinned host memory that outlives the copy (giving the
            // buffer back to the pool does not free it; its next use waits for the event recorded
            // after this copy); `dst_ptr` addresses `n` elements = `bytes` bytes just allocated.
            unsafe { result::memcpy_htod_async(dst_ptr, &src[..bytes], side.cu_stream()) }
                .map_err(derr("restore copy"))?;
        }
        Ok(dst)
    }
}
