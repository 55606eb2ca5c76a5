//! The grouped NF4 dequantization as a QLoRA layer takes it (issue 48, item 4): [`lease`] hands
//! out a group's weights (q/k/v, or gate/up) dequantized by one launch ([`super::group`]) into one
//! of two buffers reused for the whole run ([`super::ring`]), and issues the predicted next
//! group's dequantization into the other buffer — on CUDA on a side stream, so it overlaps the
//! layer's GEMMs. Without it each weight is dequantized by its own launch into its own fresh
//! allocation at each use (`device.rs`, `Frozen::dense` in `rtune-model`).
//!
//! Taken on CUDA unless `RTUNE_UNFUSED=nf4_group` (the prefetch also unless `nf4_prefetch`); on the
//! CPU only under [`crate::fused::forced`], where the fill is the CPU reference
//! ([`super::group::dequantize_group_bf16`]) and the prefetch runs at once — which lets
//! `rtune-model`'s tests check the whole wiring (views, the one-GEMM block, hits) without a GPU.
//!
//! Ordering on CUDA: the buffers are cudarc allocations with their read/write events (the
//! default; with event tracking off there is no side stream and every fill is on the compute
//! stream). A fill on the side stream waits for the compute stream's last read of its buffer
//! (so layer L+1's dequantization never overwrites layer L's weights before its GEMMs ran); the
//! compute stream's first read of a prefetched buffer waits for that fill and nothing else.
//!
//! The views a [`Lease`] holds are valid while it lives: the ring never writes a leased buffer.
//! Keys are the members' `Arc` addresses; the registry keeps a `Weak` of each, so an address is
//! not reused while it names a group, and a dropped model's groups are simply not prefetched.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Result, Tensor};

use super::group::{self, GroupPlan};
use super::ring::{Ring, Stats};
use super::Nf4Weight;
use crate::fused::{self, Fused};

/// A member's copy on the GPU (`Frozen::Quant`'s `gpu`).
#[cfg(feature = "cuda")]
pub type GpuWeight = Arc<super::DeviceNf4>;
/// No GPU copies without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub type GpuWeight = std::convert::Infallible;

/// One weight of a group: the host copy (shape, scale kind, the CPU fill) and, on CUDA, the
/// device one.
#[derive(Clone, Copy)]
pub struct Member<'a> {
    pub q: &'a Arc<Nf4Weight>,
    pub gpu: Option<&'a GpuWeight>,
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

type Key = Vec<usize>;

/// What a key names: its members (weak) and their layout.
struct Source {
    q: Vec<Weak<Nf4Weight>>,
    #[cfg(feature = "cuda")]
    gpu: Vec<Weak<super::DeviceNf4>>,
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
    /// Elements of the largest group seen (each buffer is made this large, once).
    largest: usize,
    sources: HashMap<Key, Source>,
    #[cfg(feature = "cuda")]
    side: Option<Arc<cudarc::driver::CudaStream>>,
}

static STATES: Mutex<Vec<State>> = Mutex::new(Vec::new());

fn find<'a>(states: &'a mut [State], device: &Device, dtype: DType) -> Option<&'a mut State> {
    states
        .iter_mut()
        .find(|s| s.dtype == dtype && s.device.same_device(device))
}

/// The group `members` dequantized into `dtype` on `device` through the reused buffers, or `None`
/// where the per-weight path applies: the grouped path off or not taken on this device (the
/// CPU), a dtype other than f32/bf16/f16, weights that do not group ([`group::plan`]), a member
/// without its GPU copy on CUDA, or both buffers leased.
pub fn lease(members: &[Member], dtype: DType, device: &Device) -> Result<Option<Lease>> {
    if !fused::on(device, Fused::Nf4Group)?
        || !matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        || (device.is_cuda() && members.iter().any(|m| m.gpu.is_none()))
    {
        return Ok(None);
    }
    let qs: Vec<&Nf4Weight> = members.iter().map(|m| &**m.q).collect();
    let Ok(plan) = group::plan(&qs, dtype.size_in_bytes()) else {
        return Ok(None);
    };
    let prefetch = fused::on(device, Fused::Nf4Prefetch)?;
    let key: Key = members.iter().map(|m| Arc::as_ptr(m.q) as usize).collect();
    let mut states = STATES.lock().unwrap_or_else(|e| e.into_inner());
    if find(&mut states, device, dtype).is_none() {
        states.push(State::new(device, dtype));
    }
    let st = find(&mut states, device, dtype).expect("just added");
    st.remember(&key, members, &plan);
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
    let (weights, block) = views(&buf, &plan, &qs)?;
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

/// The members' `(out, in)` views of `buf` at `plan`'s offsets, and the `(Σout, in)` block when the
/// offsets are back to back.
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

    fn remember(&mut self, key: &Key, members: &[Member], plan: &GroupPlan) {
        if self.sources.contains_key(key) {
            return;
        }
        if self.sources.len() >= MAX_SOURCES {
            self.sources
                .retain(|_, s| s.q.iter().all(|w| w.strong_count() > 0));
        }
        self.largest = self.largest.max(plan.total);
        self.sources.insert(
            key.clone(),
            Source {
                q: members.iter().map(|m| Arc::downgrade(m.q)).collect(),
                #[cfg(feature = "cuda")]
                gpu: members
                    .iter()
                    .filter_map(|m| m.gpu.map(Arc::downgrade))
                    .collect(),
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
        let plan = src.plan.clone();
        if self.bufs[slot]
            .as_ref()
            .is_none_or(|b| b.elem_count() < plan.total)
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
            plan,
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
    fn side_stream(&mut self) -> Result<Option<Arc<cudarc::driver::CudaStream>>> {
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

/// Writes a group's dequantized weights into a buffer at the plan's offsets.
struct Fill {
    q: Vec<Arc<Nf4Weight>>,
    plan: GroupPlan,
    #[cfg(feature = "cuda")]
    gpu: Vec<Arc<super::DeviceNf4>>,
    /// Where to launch (the side stream), else the buffer's device's own stream.
    #[cfg(feature = "cuda")]
    stream: Option<Arc<cudarc::driver::CudaStream>>,
}

impl InplaceOp1 for Fill {
    fn name(&self) -> &'static str {
        "nf4_group_fill"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let qs: Vec<&Nf4Weight> = self.q.iter().map(|q| &**q).collect();
        let (a, b) = rtune_backend::storage::contiguous("nf4_group_fill", "buffer", l)?;
        let at = a..a + self.plan.total;
        if b - a < self.plan.total {
            candle_core::bail!(
                "nf4 grouped dequant: buffer of {} for {}",
                b - a,
                self.plan.total
            );
        }
        let qerr = |e: super::QuantError| candle_core::Error::Msg(e.to_string());
        match s {
            CpuStorage::BF16(v) => group::dequantize_group_bf16(&qs, &self.plan, &mut v[at]),
            CpuStorage::F16(v) => group::dequantize_group_f16(&qs, &self.plan, &mut v[at]),
            CpuStorage::F32(v) => group::dequantize_group_f32(&qs, &self.plan, &mut v[at]),
            _ => candle_core::bail!("nf4 grouped dequant: only f32, bf16, f16 outputs"),
        }
        .map_err(qerr)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        use candle_core::backend::BackendStorage;
        use half::{bf16, f16};
        if l.start_offset() != 0 {
            candle_core::bail!("nf4 grouped dequant: the buffer must start its allocation");
        }
        let dev = s.device.clone();
        let k = super::device::kernels(&dev)?;
        let stream = self.stream.clone().unwrap_or_else(|| dev.cuda_stream());
        let ws: Vec<&super::Nf4WeightCuda> = self.gpu.iter().map(|g| g.weight()).collect();
        let hosts: Vec<&Nf4Weight> = self.q.iter().map(|q| &**q).collect();
        let kerr = |e: rtune_backend::KernelError| candle_core::Error::Msg(e.to_string());
        let run = |r: rtune_backend::Result<()>| r.map_err(kerr);
        match s.dtype() {
            DType::BF16 => run(super::nf4_dequant_group_into(
                &k,
                &stream,
                &ws,
                &hosts,
                &self.plan,
                s.as_cuda_slice_mut::<bf16>()?,
            )),
            DType::F16 => run(super::nf4_dequant_group_into(
                &k,
                &stream,
                &ws,
                &hosts,
                &self.plan,
                s.as_cuda_slice_mut::<f16>()?,
            )),
            DType::F32 => run(super::nf4_dequant_group_into(
                &k,
                &stream,
                &ws,
                &hosts,
                &self.plan,
                s.as_cuda_slice_mut::<f32>()?,
            )),
            other => candle_core::bail!("nf4 grouped dequant: no {other:?} output"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nf4::quantize_nf4;

    fn weight(out: usize, inp: usize, seed: usize) -> Arc<Nf4Weight> {
        let x: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 13 + seed) as f32 * 0.29).cos() * 0.04)
            .collect();
        Arc::new(quantize_nf4(&x, &[out, inp], seed.is_multiple_of(2)).unwrap())
    }

    fn members(ws: &[Arc<Nf4Weight>]) -> Vec<Member<'_>> {
        ws.iter().map(|q| Member { q, gpu: None }).collect()
    }

    /// The leased views are each weight's own dequantization; the tight plan's block is their
    /// row concatenation; unforced (the CPU), nothing is leased.
    #[test]
    fn leased_views_are_each_weights_dequantization() {
        let cpu = Device::Cpu;
        for inp in [128, 37] {
            let ws = [weight(8, inp, 1), weight(3, inp, 2), weight(5, inp, 3)];
            let m = members(&ws);
            assert!(lease(&m, DType::BF16, &cpu).unwrap().is_none());
            let (l, ran) = fused::forced(&[Fused::Nf4Group], || {
                lease(&m, DType::BF16, &cpu).unwrap().expect("forced")
            });
            assert_eq!(ran, vec![1]);
            for (v, q) in l.weights.iter().zip(&ws) {
                let want = q.to_tensor(DType::BF16, &cpu).unwrap();
                assert_eq!(v.dims(), want.dims());
                let eq = v.eq(&want).unwrap().flatten_all().unwrap();
                assert_eq!(eq.min(0).unwrap().to_scalar::<u8>().unwrap(), 1);
            }
            assert_eq!(l.block.is_some(), inp == 128);
            if let Some(b) = &l.block {
                let cat = Tensor::cat(&l.weights, 0).unwrap();
                let eq = b.eq(&cat).unwrap().flatten_all().unwrap();
                assert_eq!(eq.min(0).unwrap().to_scalar::<u8>().unwrap(), 1);
            }
        }
    }
}
