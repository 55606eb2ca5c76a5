//! AdamW on the CUDA device (feature `cuda`): the LoRA optimizer's state — f32 master weights, the
//! moments `exp_avg` and `exp_avg_sq` — lives on the adapter's device as three flat buffers
//! (tensor `k` at `offsets[k]`, the adapter's order A0, B0, A1, B1, ...), and a step is three
//! kernel launches over every tensor at once (`kernels/adamw.cu` through `rtune_ops::adamw`):
//! the gradients' squared norm in chunk partials, the norm and the clipping coefficient, then the
//! update, which reads the coefficient from device memory and writes each tensor's new weights
//! both into the master buffer and into a fresh buffer that becomes the adapter's tensor. The one
//! host sync of a step is the read of the norm (for metrics.jsonl and the skip decision).
//!
//! The arithmetic is `rtune_ops::adamw`'s reference, which `reference_tests.rs` checks against
//! the CPU [`AdamW`](super::AdamW); `rtune_ops::adamw::check` checks the kernels against the
//! reference on a GPU.

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PinnedHostSlice};
use rtune_backend::KernelError;
use rtune_lora::Adapter;
use rtune_model::Grads;
use rtune_ops::adamw::{self, AdamWScalars};
use std::sync::Arc;

use super::{Applied, Hyper};
use crate::TrainError;

// Errors: `TrainError::Kernel` (a run failure, not an input error), naming the device, the
// operation and, for a size mismatch, the tensor and its shape.

fn drv(ordinal: usize, op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> TrainError {
    move |source| TrainError::Kernel {
        ordinal,
        source: KernelError::Driver { op, source },
    }
}

fn kern(ordinal: usize) -> impl Fn(KernelError) -> TrainError {
    move |source| TrainError::Kernel { ordinal, source }
}

fn unsupported(ordinal: usize, message: String) -> TrainError {
    TrainError::Kernel {
        ordinal,
        source: KernelError::Unsupported {
            op: "optimizer step",
            message,
        },
    }
}

/// The optimizer's device state and the buffers a step reuses.
pub(super) struct DeviceAdamW {
    dev: CudaDevice,
    /// The device's CUDA ordinal, for errors.
    ordinal: usize,
    /// candle's stream for `dev`: the gradients were computed on it and the kernels run on it, so
    /// stream order alone orders them.
    stream: Arc<CudaStream>,
    hyper: Hyper,
    /// AdamW's step count (updates made).
    pub step: u64,
    sizes: Vec<usize>,
    offsets: Vec<usize>,
    total: usize,
    n_chunks: usize,
    /// `adamw::chunk_table(sizes)` (one dummy entry when there are no chunks).
    chunks: CudaSlice<u64>,
    /// f32 master weights, `exp_avg`, `exp_avg_sq`: `total` elements each (at least 1).
    master: CudaSlice<f32>,
    m: CudaSlice<f32>,
    v: CudaSlice<f32>,
    /// LoRA+'s parameter groups: per group its chunks (a subset of `chunks`), their count and the
    /// group's learning-rate multiplier; the update is one launch per group. Without LoRA+ none:
    /// one launch over `chunks` at the step's lr.
    groups: Vec<(CudaSlice<u64>, usize, f64)>,
    /// One f64 per chunk: `mt_sq_norm_partial`'s output.
    partials: CudaSlice<f64>,
    /// `[norm, coef]` of the last step.
    norm_coef: CudaSlice<f64>,
    /// The tensor table `(grad ptr, out ptr, offset, numel)` per tensor, written on the host into
    /// page-locked memory (so the copy needs no sync) and copied to `table` each step.
    table_host: PinnedHostSlice<u64>,
    table: CudaSlice<u64>,
}

impl DeviceAdamW {
    /// Zero moments, step 0, master weights `params` (the adapter's, in its order).
    pub fn new(dev: &CudaDevice, params: &[Vec<f32>], hyper: Hyper) -> Result<Self, TrainError> {
        let stream = dev.cuda_stream();
        let ordinal = stream.context().ordinal();
        let drv = |op| drv(ordinal, op);
        let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
        let (offsets, total) = adamw::offsets(&sizes);
        let mut chunks = adamw::chunk_table(&sizes);
        let n_chunks = chunks.len() / 2;
        if chunks.is_empty() {
            chunks = vec![0, 0];
        }
        let mut flat: Vec<f32> = params.concat();
        flat.resize(total.max(1), 0.0);
        // LoRA+: the chunks of the A tensors (even indices) and of the B tensors (odd), each
        // group updated at its own lr by the same kernel.
        let mut groups = Vec::new();
        if hyper.b_lr_ratio != 1.0 {
            let scales = hyper.lr_scales(sizes.len());
            for want in [1.0, hyper.b_lr_ratio] {
                let mut sub: Vec<u64> = chunks
                    .chunks_exact(2)
                    .take(n_chunks)
                    .filter(|c| scales[c[0] as usize] == want)
                    .flatten()
                    .copied()
                    .collect();
                let n = sub.len() / 2;
                if n == 0 {
                    continue;
                }
                sub.shrink_to_fit();
                groups.push((stream.clone_htod(&sub).map_err(drv("upload"))?, n, want));
            }
        }
        let table_len = 4 * sizes.len().max(1);
        // SAFETY: zeroed at once, before any use.
        let mut table_host =
            unsafe { stream.context().alloc_pinned::<u64>(table_len) }.map_err(drv("alloc"))?;
        table_host.as_mut_slice().map_err(drv("alloc"))?.fill(0);
        Ok(Self {
            master: stream.clone_htod(&flat).map_err(drv("upload"))?,
            m: stream.alloc_zeros(total.max(1)).map_err(drv("alloc"))?,
            v: stream.alloc_zeros(total.max(1)).map_err(drv("alloc"))?,
            chunks: stream.clone_htod(&chunks).map_err(drv("upload"))?,
            groups,
            partials: stream.alloc_zeros(n_chunks.max(1)).map_err(drv("alloc"))?,
            norm_coef: stream.alloc_zeros(2).map_err(drv("alloc"))?,
            table_host,
            table: stream.alloc_zeros(table_len).map_err(drv("alloc"))?,
            dev: dev.clone(),
            ordinal,
            stream,
            hyper,
            step: 0,
            sizes,
            offsets,
            total,
            n_chunks,
        })
    }

    /// One step, as [`super::LoraOptimizer::step`]: the norm of the unscaled gradients, then the
    /// clipped update of every tensor unless `loss` or the norm is not finite.
    pub fn step(
        &mut self,
        adapter: &mut Adapter,
        grads: &Grads,
        lr: f64,
        max_norm: f64,
        loss: f64,
        unscale: f64,
    ) -> Result<Applied, TrainError> {
        let (stream, ordinal) = (self.stream.clone(), self.ordinal);
        let drv = |op| drv(ordinal, op);
        let n = self.sizes.len();
        // The gradients as contiguous f32, kept alive until the norm's read synchronizes.
        let mut keep: Vec<Tensor> = Vec::with_capacity(n);
        let mut outs: Vec<Option<CudaSlice<f32>>> = Vec::with_capacity(n);
        let mut entries: Vec<u64> = Vec::with_capacity(4 * n);
        let ordered = grads.ordered(&super::has_magnitude(adapter), adapter.tokens.is_some());
        for (k, g) in ordered.into_iter().enumerate().take(n) {
            let gptr = match g {
                Some(t) => {
                    let t = t
                        .to_dtype(DType::F32)
                        .and_then(|t| t.contiguous())
                        .map_err(TrainError::candle("grad to f32"))?;
                    if t.elem_count() != self.sizes[k] {
                        return Err(unsupported(
                            ordinal,
                            format!(
                                "gradient {k} (A0, B0, A1, ... order) has shape {:?}, its \
                                 parameter {} elements",
                                t.dims(),
                                self.sizes[k]
                            ),
                        ));
                    }
                    let p = grad_ptr(&t, &stream, ordinal)?;
                    keep.push(t);
                    p
                }
                None => 0,
            };
            let mut out = if self.sizes[k] > 0 {
                // SAFETY: the update writes all of it; it is used only when the update ran.
                Some(unsafe { stream.alloc::<f32>(self.sizes[k]) }.map_err(drv("alloc"))?)
            } else {
                None
            };
            // The events cudarc records for these raw pointers (when other streams exist) mark
            // the launch, not the kernels' end; the norm's read below synchronizes the stream
            // before any of these buffers is used or freed, so no other stream can race them.
            let optr = out.as_mut().map_or(0, |o| o.device_ptr_mut(&stream).0);
            entries.extend([gptr, optr, self.offsets[k] as u64, self.sizes[k] as u64]);
            outs.push(out);
        }
        // Waits for the previous step's copy of the table, long done (its norm was read).
        let host = self.table_host.as_mut_slice().map_err(drv("table"))?;
        host[..entries.len()].copy_from_slice(&entries);
        stream
            .memcpy_htod(&self.table_host, &mut self.table)
            .map_err(drv("table upload"))?;
        // SAFETY: (and for the update launches below) the table holds the pointers of `keep` (numel f32 each, alive
        // until the read below synchronizes the stream) and of `outs` (numel each, written by
        // nothing else); offsets are prefix sums of the sizes (≤ total); chunks name tensors < n.
        unsafe {
            adamw::mt_sq_norm(
                &stream,
                &self.table,
                &self.chunks,
                self.n_chunks,
                unscale as f32,
                max_norm,
                &mut self.partials,
                &mut self.norm_coef,
            )
        }
        .map_err(kern(ordinal))?;
        if loss.is_finite() {
            let h = self.hyper;
            let whole = [(&self.chunks, self.n_chunks, 1.0)];
            let groups: Vec<(&CudaSlice<u64>, usize, f64)> = if self.groups.is_empty() {
                whole.to_vec()
            } else {
                self.groups.iter().map(|(c, n, x)| (c, *n, *x)).collect()
            };
            for (chunks, n_chunks, scale) in groups {
                let lr = lr * scale;
                let s =
                    AdamWScalars::new(self.step + 1, lr, h.betas, h.eps, h.weight_decay, unscale);
                // SAFETY: as above; a group's chunks are a subset of `chunks`, so every tensor is
                // written by exactly one launch.
                unsafe {
                    adamw::mt_adamw(
                        &stream,
                        &self.table,
                        chunks,
                        n_chunks,
                        &self.norm_coef,
                        (&mut self.master, &mut self.m, &mut self.v),
                        self.total,
                        &s,
                    )
                }
                .map_err(kern(ordinal))?;
            }
        }
        // The step's one host sync: the norm, for the metrics and the skip decision (the kernel
        // has already skipped itself on the device when it is not finite).
        let nc = stream
            .clone_dtoh(&self.norm_coef)
            .map_err(drv("norm read"))?;
        drop(keep);
        let grad_norm = nc[0];
        if !(loss.is_finite() && grad_norm.is_finite()) {
            // As torch's GradScaler: no update at all, and AdamW's step count does not advance.
            return Ok(Applied {
                grad_norm,
                applied: false,
            });
        }
        self.step += 1;
        let mut outs = outs.into_iter();
        // A0, B0, A1, B1, …, then DoRA's magnitudes: the order the gradients came in.
        for t in adapter.trainable_mut() {
            if let Some(o) = outs.next().flatten() {
                let storage = CudaStorage::wrap_cuda_slice(o, self.dev.clone());
                let shape = t.shape().clone();
                *t = Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false);
            }
        }
        Ok(Applied {
            grad_norm,
            applied: true,
        })
    }

    /// `(m, v)` per tensor, copied to the host.
    #[allow(clippy::type_complexity)]
    pub fn moments(&self) -> Result<(Vec<Vec<f32>>, Vec<Vec<f32>>), TrainError> {
        let ordinal = self.ordinal;
        let drv = |op| drv(ordinal, op);
        let split = |flat: Vec<f32>| -> Vec<Vec<f32>> {
            self.sizes
                .iter()
                .zip(&self.offsets)
                .map(|(&n, &o)| flat[o..o + n].to_vec())
                .collect()
        };
        let m = self.stream.clone_dtoh(&self.m).map_err(drv("moments"))?;
        let v = self.stream.clone_dtoh(&self.v).map_err(drv("moments"))?;
        Ok((split(m), split(v)))
    }

    /// Sets the step count and the moments (sizes checked by the caller).
    pub fn restore(&mut self, step: u64, m: &[Vec<f32>], v: &[Vec<f32>]) -> Result<(), TrainError> {
        let ordinal = self.ordinal;
        let drv = |op| drv(ordinal, op);
        for (src, dst) in [(m, &mut self.m), (v, &mut self.v)] {
            let mut flat: Vec<f32> = src.concat();
            flat.resize(self.total.max(1), 0.0);
            self.stream
                .memcpy_htod(&flat, dst)
                .map_err(drv("restore"))?;
        }
        self.step = step;
        Ok(())
    }
}

/// The device address of `t`'s first element (`t` contiguous f32 on a CUDA device).
fn grad_ptr(t: &Tensor, stream: &Arc<CudaStream>, ordinal: usize) -> Result<u64, TrainError> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        let message = format!(
            "a gradient of shape {:?} is not on the CUDA device",
            t.dims()
        );
        return Err(unsupported(ordinal, message));
    };
    let start = layout.start_offset();
    let slice = s
        .as_cuda_slice::<f32>()
        .map_err(TrainError::candle("grad pointer"))?;
    let view = slice.slice(start..start + t.elem_count());
    // The read event recorded when `_read` drops orders other streams after this point only;
    // the kernels run on candle's stream, after everything that wrote the gradient.
    let (ptr, _read) = view.device_ptr(stream);
    Ok(ptr)
}
