//! A QLoRA group's frozen weights (q/k/v, or gate/up: NF4, which [`super::fuse`] leaves alone)
//! dequantized together (issue 48, item 4): ONE launch of `kernels/nf4.cu`'s grouped kernel
//! (`rtune_ops::nf4::group`) into one of two buffers reused for the whole run, and the predicted
//! next group's dequantization issued into the other buffer — on CUDA on a side stream, so it
//! overlaps the layer's GEMMs. Without it each weight is dequantized by its own launch into its own
//! fresh allocation at each use (`Frozen::dense`).
//!
//! - [`plan`]: which weights group and where each goes in the buffer (offsets 256 bytes apart);
//!   when every weight's size is a multiple of that (every Llama/Qwen/Gemma projection: `in` a
//!   multiple of 128) they are back to back and the buffer is `[W₁; W₂; …]: (Σout, in)`, the
//!   group's block: one GEMM, as for fused dense weights.
//! - [`lease`]: the buffers ([`rtune_backend::ring`] decides which one, and what to prefetch).
//!
//! Taken on CUDA unless `RTUNE_UNFUSED=nf4_group` (the prefetch also unless `nf4_prefetch`); on the
//! CPU only under `rtune_ops::fused::forced`, where the fill is the CPU reference and the prefetch
//! runs at once, so the tests check the whole wiring without a GPU (`tests/fused_layer.rs`).
//!
//! Ordering on CUDA: the buffers are cudarc allocations with their read/write events (cudarc's
//! default; with event tracking off there is no side stream and every fill is on the compute
//! stream). A fill on the side stream waits for the compute stream's last read of its buffer (so
//! layer L+1's dequantization never overwrites layer L's weights before its GEMMs ran); the compute
//! stream's first read of a prefetched buffer waits for that fill and nothing else.
//!
//! A [`Lease`]'s views are valid while it lives: the ring never writes a leased buffer. Groups are
//! keyed by the members' `Arc` addresses; the registry keeps a `Weak` of each, so an address is not
//! reused while it names a group, and a dropped model's groups are simply not prefetched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Result, Tensor};

use crate::linear::{Frozen, Linear};
use rtune_backend::ring::{Ring, Stats};
use rtune_ops::fused::{self, Fused};
use rtune_ops::nf4::{group, Nf4Weight, BLOCKSIZE};

/// Every weight of a group starts at a multiple of this many bytes (the allocator's alignment;
/// the kernel needs 16).
pub const ALIGN_BYTES: usize = 256;

/// Why weights are not dequantized as one group (each then takes the per-weight path).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Ungrouped {
    #[error("{0} weight(s): nothing to group")]
    TooFew(usize),
    #[error("{0} weights: at most {max} a launch", max = group::MAX_ENTRIES)]
    TooMany(usize),
    #[error("weight {index} has shape {shape:?}, not (out, in) of the group's in")]
    Shape { index: usize, shape: Vec<usize> },
    #[error("weight {index} has blocksize {blocksize} (the kernels read 64)")]
    Blocksize { index: usize, blocksize: usize },
}

/// Where each weight of a group lies in the group's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlan {
    /// `[(offset, numel)]` in elements, in the members' order.
    pub slots: Vec<(usize, usize)>,
    /// Elements of the buffer (the last slot's end).
    pub total: usize,
    /// The slots are back to back: the buffer is `[W₁; W₂; …]: (rows, cols) = (Σout, in)`.
    pub tight: bool,
    pub rows: usize,
    pub cols: usize,
}

/// The layout of `weights` in one buffer of `elem_bytes`-byte elements (2 for bf16/f16, 4 for
/// f32), each at the next multiple of `ALIGN_BYTES` (256); or why they do not group (mixed plain and
/// double scales or NF4 and FP4 tables do: both are per entry in the kernel).
pub fn plan(
    weights: &[&Nf4Weight],
    elem_bytes: usize,
) -> std::result::Result<GroupPlan, Ungrouped> {
    if weights.len() < 2 {
        return Err(Ungrouped::TooFew(weights.len()));
    }
    if weights.len() > group::MAX_ENTRIES {
        return Err(Ungrouped::TooMany(weights.len()));
    }
    let shape = |index: usize| Ungrouped::Shape {
        index,
        shape: weights[index].shape.clone(),
    };
    let [_, cols] = weights[0].shape[..] else {
        return Err(shape(0));
    };
    let align = ALIGN_BYTES / elem_bytes;
    let (mut slots, mut at, mut rows, mut tight) = (Vec::new(), 0usize, 0usize, true);
    for (index, w) in weights.iter().enumerate() {
        let [out, c] = w.shape[..] else {
            return Err(shape(index));
        };
        if c != cols {
            return Err(shape(index));
        }
        if w.blocksize != BLOCKSIZE {
            return Err(Ungrouped::Blocksize {
                index,
                blocksize: w.blocksize,
            });
        }
        let start = at.next_multiple_of(align);
        tight &= start == at;
        slots.push((start, w.numel()));
        at = start + w.numel();
        rows += out;
    }
    Ok(GroupPlan {
        slots,
        total: at,
        tight,
        rows,
        cols,
    })
}

/// A group's weights, dequantized, in one of the reused buffers.
pub struct Lease {
    /// Each member's `(out, in)` weight, a view of the buffer.
    pub weights: Vec<Tensor>,
    /// `[W₁; W₂; …]: (Σout, in)` when the plan is tight (the group's one-GEMM weight).
    pub block: Option<Tensor>,
    device: Device,
    dtype: DType,
    slot: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(st) = find(&mut states, &self.device, self.dtype) {
            st.ring.release(self.slot);
        }
    }
}

/// A member's copy on the GPU (`Frozen::Quant`'s `gpu`); none without the `cuda` feature.
#[cfg(feature = "cuda")]
type Gpu = Arc<rtune_ops::nf4::DeviceNf4>;
#[cfg(not(feature = "cuda"))]
type Gpu = std::convert::Infallible;

type Key = Vec<usize>;

/// What a key names: its members (weak) and their layout.
struct Source {
    q: Vec<Weak<Nf4Weight>>,
    #[cfg(feature = "cuda")]
    gpu: Vec<Weak<rtune_ops::nf4::DeviceNf4>>,
    plan: GroupPlan,
}

/// Sources kept before the dead ones are pruned.
const MAX_SOURCES: usize = 4096;

/// The two buffers of one device and dtype, their ring and the groups seen.
struct State {
    device: Device,
    dtype: DType,
    ring: Ring<Key>,
    bufs: [Option<Tensor>; 2],
    /// Elements of the largest group seen (each buffer is made this large).
    largest: usize,
    sources: HashMap<Key, Source>,
    #[cfg(feature = "cuda")]
    side: Option<Arc<candle_core::cuda::cudarc::driver::CudaStream>>,
}

static STATES: Mutex<Vec<State>> = Mutex::new(Vec::new());

fn find<'a>(states: &'a mut [State], device: &Device, dtype: DType) -> Option<&'a mut State> {
    states
        .iter_mut()
        .find(|s| s.dtype == dtype && s.device.same_device(device))
}

/// The members' dequantized weights for this use through the reused buffers, or `None` where
/// each member dequantizes its own: a member not 4-bit, members of different compute dtypes or
/// devices, the grouped path off or not taken on this device, a dtype other than f32/bf16/f16,
/// weights that do not group ([`plan`]), a member without its GPU copy on CUDA, or both
/// buffers leased.
pub(super) fn lease(members: &[&Linear]) -> Result<Option<Lease>> {
    let mut qs: Vec<&Arc<Nf4Weight>> = Vec::with_capacity(members.len());
    let mut gpus: Vec<Option<&Gpu>> = Vec::with_capacity(members.len());
    let mut at: Option<(DType, &Device)> = None;
    for m in members {
        let Frozen::Quant {
            q, dtype, device, ..
        } = &m.w
        else {
            return Ok(None);
        };
        match at {
            Some((d, dev)) if d != *dtype || !dev.same_device(device) => return Ok(None),
            _ => at = Some((*dtype, device)),
        }
        #[cfg(feature = "cuda")]
        gpus.push(match &m.w {
            Frozen::Quant { gpu, .. } => gpu.as_ref(),
            _ => None,
        });
        #[cfg(not(feature = "cuda"))]
        gpus.push(None);
        qs.push(q);
    }
    let Some((dtype, device)) = at else {
        return Ok(None);
    };
    if !fused::on(device, Fused::Nf4Group)?
        || !matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        || (device.is_cuda() && gpus.iter().any(Option::is_none))
    {
        return Ok(None);
    }
    let hosts: Vec<&Nf4Weight> = qs.iter().map(|q| &***q).collect();
    let Ok(plan) = plan(&hosts, dtype.size_in_bytes()) else {
        return Ok(None);
    };
    let prefetch = fused::on(device, Fused::Nf4Prefetch)?;
    let key: Key = qs.iter().map(|q| Arc::as_ptr(q) as usize).collect();
    let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    if find(&mut states, device, dtype).is_none() {
        states.push(State::new(device, dtype));
    }
    let st = find(&mut states, device, dtype).expect("just added");
    st.remember(&key, &qs, &gpus, &plan);
    let Some(step) = st.ring.request(key.clone(), prefetch) else {
        return Ok(None);
    };
    let filled = (|| {
        if step.fill {
            st.fill(step.slot, &key, false)?;
        }
        if let Some((s, k)) = &step.prefetch {
            st.fill(*s, k, true)?;
            fused::ran(Fused::Nf4Prefetch);
        }
        Ok(())
    })();
    if let Err(e) = filled {
        st.ring.forget(step.slot);
        if let Some((s, _)) = step.prefetch {
            st.ring.forget(s);
        }
        st.ring.release(step.slot);
        return Err(e);
    }
    let buf = st.bufs[step.slot]
        .clone()
        .expect("a filled slot has a buffer");
    drop(states);
    fused::ran(Fused::Nf4Group);
    let (weights, block) = views(&buf, &plan, &hosts)?;
    Ok(Some(Lease {
        weights,
        block,
        device: device.clone(),
        dtype,
        slot: step.slot,
    }))
}

/// What the ring did so far on `device` in `dtype` (hits, demand fills, prefetches).
pub fn stats(device: &Device, dtype: DType) -> Option<Stats> {
    let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    find(&mut states, device, dtype).map(|s| s.ring.stats)
}

/// The members' `(out, in)` views of `buf` at `plan`'s offsets, and the `(Σout, in)` block when
/// the offsets are back to back.
fn views(
    buf: &Tensor,
    plan: &GroupPlan,
    qs: &[&Nf4Weight],
) -> Result<(Vec<Tensor>, Option<Tensor>)> {
    if plan.tight {
        let block = buf
            .narrow(0, 0, plan.total)?
            .reshape((plan.rows, plan.cols))?;
        let mut row = 0;
        let mut ws = Vec::with_capacity(qs.len());
        for q in qs {
            ws.push(block.narrow(0, row, q.shape[0])?);
            row += q.shape[0];
        }
        return Ok((ws, Some(block)));
    }
    let ws = plan
        .slots
        .iter()
        .zip(qs)
        .map(|(&(off, n), q)| buf.narrow(0, off, n)?.reshape((q.shape[0], q.shape[1])))
        .collect::<Result<_>>()?;
    Ok((ws, None))
}

impl State {
    fn new(device: &Device, dtype: DType) -> State {
        State {
            device: device.clone(),
            dtype,
            ring: Ring::default(),
            bufs: [None, None],
            largest: 0,
            sources: HashMap::new(),
            #[cfg(feature = "cuda")]
            side: None,
        }
    }

    fn remember(
        &mut self,
        key: &Key,
        qs: &[&Arc<Nf4Weight>],
        gpus: &[Option<&Gpu>],
        plan: &GroupPlan,
    ) {
        if self.sources.contains_key(key) {
            return;
        }
        if self.sources.len() >= MAX_SOURCES {
            self.sources
                .retain(|_, s| s.q.iter().all(|w| w.strong_count() > 0));
        }
        let _ = gpus;
        self.largest = self.largest.max(plan.total);
        self.sources.insert(
            key.clone(),
            Source {
                q: qs.iter().map(|q| Arc::downgrade(q)).collect(),
                #[cfg(feature = "cuda")]
                gpu: gpus.iter().flatten().map(|g| Arc::downgrade(g)).collect(),
                plan: plan.clone(),
            },
        );
    }

    /// Dequantizes the group `key` into buffer `slot` (made first if missing or too small): on
    /// CUDA on the side stream when `ahead` (and one exists), else on the compute stream; on the
    /// CPU at once. A group whose weights were dropped leaves the slot empty.
    fn fill(&mut self, slot: usize, key: &Key, ahead: bool) -> Result<()> {
        let Some(src) = self.sources.get(key) else {
            self.ring.forget(slot);
            return Ok(());
        };
        let Some(q) = src.q.iter().map(Weak::upgrade).collect::<Option<Vec<_>>>() else {
            self.ring.forget(slot);
            return Ok(());
        };
        #[cfg(feature = "cuda")]
        let gpu = match src
            .gpu
            .iter()
            .map(Weak::upgrade)
            .collect::<Option<Vec<_>>>()
        {
            Some(g) if g.len() == q.len() || !self.device.is_cuda() => g,
            _ => {
                self.ring.forget(slot);
                return Ok(());
            }
        };
        let slots = src.plan.slots.clone();
        if self.bufs[slot]
            .as_ref()
            .is_none_or(|b| b.elem_count() < src.plan.total)
        {
            self.bufs[slot] = None;
            self.bufs[slot] = Some(Tensor::zeros(self.largest, self.dtype, &self.device)?);
        }
        #[cfg(feature = "cuda")]
        let stream = if ahead { self.side_stream()? } else { None };
        #[cfg(not(feature = "cuda"))]
        let _ = ahead;
        let op = Fill {
            q,
            slots,
            #[cfg(feature = "cuda")]
            gpu,
            #[cfg(feature = "cuda")]
            stream,
        };
        self.bufs[slot]
            .as_ref()
            .expect("made above")
            .inplace_op1(&op)
    }

    /// The side stream of a CUDA device, made on first use; `None` on the CPU or where cudarc's
    /// event tracking is off (its per-buffer events are what orders the two streams).
    #[cfg(feature = "cuda")]
    fn side_stream(
        &mut self,
    ) -> Result<Option<Arc<candle_core::cuda::cudarc::driver::CudaStream>>> {
        let Device::Cuda(dev) = &self.device else {
            return Ok(None);
        };
        if self.side.is_none() {
            let ctx = dev.cuda_stream().context().clone();
            if !ctx.is_event_tracking() {
                return Ok(None);
            }
            let s = ctx.new_stream().map_err(|e| {
                candle_core::Error::Msg(format!("nf4 grouped dequant: a side stream: {e}"))
            })?;
            self.side = Some(s);
        }
        Ok(self.side.clone())
    }
}

/// Writes a group's dequantized weights into a buffer at the slots' offsets.
struct Fill {
    q: Vec<Arc<Nf4Weight>>,
    slots: Vec<(usize, usize)>,
    #[cfg(feature = "cuda")]
    gpu: Vec<Arc<rtune_ops::nf4::DeviceNf4>>,
    /// Where to launch (the side stream), else the buffer's device's own stream.
    #[cfg(feature = "cuda")]
    stream: Option<Arc<candle_core::cuda::cudarc::driver::CudaStream>>,
}

impl InplaceOp1 for Fill {
    fn name(&self) -> &'static str {
        "nf4_group_fill"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let qs: Vec<&Nf4Weight> = self.q.iter().map(|q| &**q).collect();
        let (a, b) = rtune_backend::storage::contiguous("nf4_group_fill", "buffer", l)?;
        let qerr = |e: rtune_ops::nf4::QuantError| candle_core::Error::Msg(e.to_string());
        match s {
            CpuStorage::BF16(v) => group::dequantize_group_bf16(&qs, &self.slots, &mut v[a..b]),
            CpuStorage::F16(v) => group::dequantize_group_f16(&qs, &self.slots, &mut v[a..b]),
            CpuStorage::F32(v) => group::dequantize_group_f32(&qs, &self.slots, &mut v[a..b]),
            _ => candle_core::bail!("nf4 grouped dequant: only f32, bf16, f16 outputs"),
        }
        .map_err(qerr)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        use candle_core::backend::BackendStorage;
        use half::{bf16, f16};
        use rtune_ops::nf4::{nf4_dequant_group_into, Nf4WeightCuda};
        if l.start_offset() != 0 {
            candle_core::bail!("nf4 grouped dequant: the buffer must start its allocation");
        }
        let dev = s.device.clone();
        let k = rtune_ops::nf4::kernels(&dev)?;
        let stream = self.stream.clone().unwrap_or_else(|| dev.cuda_stream());
        let ws: Vec<&Nf4WeightCuda> = self.gpu.iter().map(|g| g.weight()).collect();
        let hosts: Vec<&Nf4Weight> = self.q.iter().map(|q| &**q).collect();
        let slots = &self.slots[..];
        let kerr = |e: rtune_backend::KernelError| candle_core::Error::Msg(e.to_string());
        match s.dtype() {
            DType::BF16 => {
                let out = s.as_cuda_slice_mut::<bf16>()?;
                nf4_dequant_group_into(&k, &stream, &ws, &hosts, slots, out).map_err(kerr)
            }
            DType::F16 => {
                let out = s.as_cuda_slice_mut::<f16>()?;
                nf4_dequant_group_into(&k, &stream, &ws, &hosts, slots, out).map_err(kerr)
            }
            DType::F32 => {
                let out = s.as_cuda_slice_mut::<f32>()?;
                nf4_dequant_group_into(&k, &stream, &ws, &hosts, slots, out).map_err(kerr)
            }
            other => candle_core::bail!("nf4 grouped dequant: no {other:?} output"),
        }
    }
}

#[cfg(test)]
mod tests;
