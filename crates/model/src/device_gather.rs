//! A sharded base's gathers between device buffers (issue 48 item 5): on a CUDA rank every
//! shard lives on the GPU ([`Model::set_device_gather`](crate::Model::set_device_gather) uploads
//! them once, emptying their host copies) and each layer's weights are gathered by a
//! [`DeviceGather`] — `rtune_dist`'s NCCL communicator, the one the gradient buckets use — into
//! device buffers that become the layer's tensors as they are (dense) or its GPU NF4 weight (the
//! codes and scales copied device to device; nothing crosses to the host).
//!
//! What moves where is `crate::shard`'s and `crate::gathered`'s plain Rust, shared with the host
//! path: the same jobs (`Job`: which part of which shard, into which buffer, from which byte), the
//! same counts (`Shard::counts`), the same buffers, now typed tensors (`Buf::Device`). The
//! transport only moves elements: [`ThroughHost`] does it over any host [`Gather`] for tensors
//! on the CPU, which is how the tests run the whole device path for worlds of 1 to 4 ranks
//! (`tests/shard.rs`), and the NCCL one is a few lines over `Nccl::all_gather_into`.
//!
//! Order: a device gather is launched, not waited for (NCCL's stream; the compute stream's first
//! read of a gathered buffer waits for it on the device). With `prefetch`, the next layer's
//! gathers are launched as soon as this one's weights are made, on the pass's own thread
//! (`crate::feed`), so they run on the side stream while this layer computes.

use candle_core::Tensor;
use std::rc::Rc;

pub use crate::shard::DeviceGather;
use crate::shard::Gather;

/// A host transport as a [`DeviceGather`] for tensors on the CPU: `mine`'s bytes through
/// [`Gather::all_gather_into`], then copied into `out` at `at`. What a CPU rank would use; the
/// tests run the device path through it.
pub struct ThroughHost(pub Rc<dyn Gather>);

impl DeviceGather for ThroughHost {
    fn all_gather(
        &self,
        what: &str,
        mine: &Tensor,
        counts: &[usize],
        out: &Tensor,
        at: usize,
    ) -> candle_core::Result<()> {
        let elem = mine.dtype().size_in_bytes();
        if mine.dims().len() != 1 || out.dims().len() != 1 || mine.dtype() != out.dtype() {
            candle_core::bail!(
                "{what}: a 1-D shard {:?} {:?} into a 1-D buffer {:?} {:?}",
                mine.shape(),
                mine.dtype(),
                out.shape(),
                out.dtype()
            );
        }
        let bytes: Vec<usize> = counts.iter().map(|&n| n * elem).collect();
        let n: usize = counts.iter().sum();
        let mut gathered = vec![0u8; n * elem];
        let mine = mine.contiguous()?;
        let (storage, layout) = mine.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("{what}: a host transport gathers CPU tensors");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("{what}: a contiguous shard");
        };
        let raw = cpu_bytes(cpu, start, end)?;
        self.0.all_gather_into(what, raw, &bytes, &mut gathered);
        drop(storage);
        let t = Tensor::from_raw_buffer(&gathered, out.dtype(), &[n], out.device())?;
        out.slice_set(&t, 0, at)
    }
}

/// Elements `start..end` of a CPU storage as bytes (native order, as the host shards are kept).
fn cpu_bytes(s: &candle_core::CpuStorage, start: usize, end: usize) -> candle_core::Result<&[u8]> {
    use candle_core::CpuStorage as C;
    Ok(match s {
        C::U8(v) => &v[start..end],
        C::F32(v) => bytemuck::cast_slice(&v[start..end]),
        C::BF16(v) => bytemuck::cast_slice(&v[start..end]),
        C::F16(v) => bytemuck::cast_slice(&v[start..end]),
        _ => candle_core::bail!("a shard of a dtype other than u8, f32, bf16 or f16"),
    })
}
