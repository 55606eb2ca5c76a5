//! The layers and tables a pass of a sharded base uses, gathered from every rank's shards
//! ([`crate::shard`]): [`Sharded`], the model's sharded state, and [`Planned`], a layer's gathers
//! in three steps — planned (every buffer allocated, by the pass's thread), filled (the gathers
//! themselves, on whichever thread gathers: `crate::feed`'s prefetching one allocates nothing),
//! finished (the buffers made into ordinary dense or NF4 weights without a copy, the dense q/k/v
//! and gate/up as the one block each the unsharded model fuses, a sparse layer's router and
//! expert stacks as its tensors, or NF4 stacks from their experts' records).

use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;

use crate::layer::Layer;
use crate::linear::{Frozen, Linear};
use crate::shard::{fill, Buf, DeviceGather, Gather, Job, Part, Shard};
use rtune_experts::moe::StackWeights;

/// The sharded base's own state: the transport, and the embedding table's and an untied
/// lm_head's shards (the layers' are in their [`Frozen::Sharded`] weights).
pub struct Sharded {
    pub comm: Rc<dyn Gather>,
    /// The transport a [`Feed`](crate::feed::Feed) prefetches through
    /// ([`Gather::background`]); `None`: no prefetch (turned off, or the transport gathers on
    /// its own thread only).
    pub background: Option<Arc<dyn Gather + Send + Sync>>,
    /// The device transport, once the shards are on the device
    /// ([`Model::set_device_gather`](crate::Model::set_device_gather)); every gather then
    /// goes through it.
    pub device: Option<Rc<dyn DeviceGather>>,
    /// With the device transport and `prefetch`: the next layer's gathers are launched on the
    /// pass's thread as soon as this one is made (`crate::feed`).
    pub launch_ahead: bool,
    /// `(V, D)`
    pub embed: Arc<Shard>,
    /// `(V, D)`: an untied lm_head, or under autocast a bf16 copy of a tied one.
    pub lm_head: Option<Arc<Shard>>,
    /// How many of the last layers a training pass's forward gathers stay gathered for its
    /// backward (`[distributed] keep_gathered_layers`; [`Model::set_keep_gathered`]).
    ///
    /// [`Model::set_keep_gathered`]: crate::Model::set_keep_gathered
    pub keep: usize,
}

impl Sharded {
    /// `layer` with its weights gathered: ordinary dense or NF4 weights, and the dense q/k/v and
    /// gate/up members gathered straight into one block each, as the unsharded model fuses
    /// them (`Layer::fuse`): the gathered layer costs its weights' bytes once.
    pub fn gather_layer(&self, layer: &Layer, device: &Device) -> candle_core::Result<Layer> {
        self.launch_layer(layer)?.finish(device)
    }

    /// `layer`'s gathers planned and run (with the device transport: launched, the layer made
    /// later by [`Planned::finish`]).
    pub(crate) fn launch_layer(&self, layer: &Layer) -> candle_core::Result<Planned> {
        let mut planned = Planned::new(layer, self.comm.size())?;
        planned.fill(&*self.comm, self.device.as_deref())?;
        Ok(planned)
    }

    /// The embedding table `(V, D)`, gathered.
    pub fn embed(&self, device: &Device) -> candle_core::Result<Tensor> {
        self.table(&self.embed, "model.embed_tokens", device)
    }

    /// The lm_head `(V, D)`, gathered (the embedding table when tied).
    pub fn lm_head(&self, device: &Device) -> candle_core::Result<Tensor> {
        match &self.lm_head {
            Some(s) => self.table(s, "lm_head", device),
            None => self.embed(device),
        }
    }

    /// A table `(V, D)` gathered (on the calling thread).
    fn table(&self, s: &Arc<Shard>, name: &str, device: &Device) -> candle_core::Result<Tensor> {
        let mut bufs = vec![s.buffer(Part::Values, self.comm.size())?];
        let jobs = [job(s, Part::Values, name, 0, 0)];
        fill(&*self.comm, self.device.as_deref(), &jobs, &mut bufs)?;
        let [buf] = <[Buf; 1]>::try_from(bufs)
            .map_err(|_| candle_core::Error::Msg(format!("{name}: one buffer gathered")))?;
        buf.tensor(&s.shape, device)
    }

    /// Moves every shard of the embedding table and lm_head, and of `layers`' weights, onto
    /// `device`, and gathers through `transport` from then on (no background thread: a device
    /// gather is launched, not waited for).
    pub(crate) fn use_device(
        &mut self,
        layers: &mut [Layer],
        transport: Rc<dyn DeviceGather>,
        device: &Device,
    ) -> candle_core::Result<()> {
        self.embed = Arc::new(self.embed.upload(device)?);
        if let Some(h) = &mut self.lm_head {
            *h = Arc::new(h.upload(device)?);
        }
        for l in layers {
            for lin in l.linears_mut() {
                if let Frozen::Sharded { shard, .. } = &mut lin.w {
                    *shard = Arc::new(shard.upload(device)?);
                }
            }
            if let Some(s) = l.moe.as_mut().and_then(|m| m.shards.as_mut()) {
                for shard in s.named_mut() {
                    *shard = Arc::new(shard.upload(device)?);
                }
            }
        }
        self.launch_ahead = self.launch_ahead || self.background.is_some();
        self.background = None;
        self.device = Some(transport);
        Ok(())
    }

    /// Bytes of the embedding's and lm_head's shards.
    pub fn resident_bytes(&self) -> usize {
        self.embed.resident_bytes() + self.lm_head.as_ref().map_or(0, |s| s.resident_bytes())
    }
}

/// A clone of `layer` whose DoRA row-norm caches are `layer`'s own (a plain clone starts empty):
/// the norms stay cached across the gathers of a step.
pub(crate) fn sharing_norms(layer: &Layer) -> Layer {
    let mut l = layer.clone();
    for (lin, own) in l.linears_mut().into_iter().zip(layer.linears()) {
        lin.dora_norm = own.dora_norm.share();
    }
    l
}

/// A layer's gathers: its clone, whose weights are still shards until [`Planned::finish`], the
/// gathers and the buffers they fill.
pub(crate) struct Planned {
    layer: Layer,
    jobs: Vec<Job>,
    bufs: Vec<Buf>,
    /// How q/k/v (or Phi-3's qkv), gate/up, o and down are made from `bufs`, in that order.
    plans: [GroupPlan; 4],
    /// A sparse layer's router and expert stacks: their buffers, in `MoeShards::named` order.
    moe: Option<[usize; 3]>,
}

/// How a group of linears (or one) is made from the gathered buffers.
struct GroupPlan {
    /// The buffer of the members' one dense block, rows in member order.
    block: Option<usize>,
    /// Otherwise each member's first buffer (its [`Shard::parts`] in order from there; `None`:
    /// not sharded, whole already).
    members: Vec<Option<usize>>,
}

impl Planned {
    /// Plans `layer`'s gathers in a world of `size` (on the pass's thread: every buffer the
    /// gathers fill is allocated here, at its whole size).
    pub(crate) fn new(layer: &Layer, size: usize) -> candle_core::Result<Self> {
        let mut l = sharing_norms(layer);
        let (mut jobs, mut bufs) = (Vec::new(), Vec::new());
        let mut plan = |members: &[Linear]| plan_group(members, size, &mut jobs, &mut bufs);
        let plans = [
            plan(&l.attn_in)?,
            plan(&l.mlp_in)?,
            plan(std::slice::from_ref(&l.o))?,
            plan(l.down.as_slice())?,
        ];
        // A sparse layer's router and experts, after the linears (every rank in this order).
        let moe = match l
            .moe
            .as_ref()
            .and_then(|m| Some((&m.prefix, m.shards.as_ref()?)))
        {
            Some((prefix, shards)) => {
                let mut at = [0; 3];
                for (i, (shard, name)) in shards.named().into_iter().enumerate() {
                    // One part each: a dense tensor's values, or NF4 experts' records.
                    let &[part] = shard.parts() else {
                        candle_core::bail!("{prefix}.{name}: a shard gathered in several parts");
                    };
                    bufs.push(shard.buffer(part, size)?);
                    at[i] = bufs.len() - 1;
                    jobs.push(job(shard, part, &format!("{prefix}.{name}"), at[i], 0));
                }
                Some(at)
            }
            None => None,
        };
        // The blocks are remade from the gathered buffers.
        (l.qkv, l.gate_up) = (None, None);
        Ok(Self {
            layer: l,
            jobs,
            bufs,
            plans,
            moe,
        })
    }

    /// Runs the gathers through `comm` (device buffers through `device`), on any thread;
    /// allocates nothing.
    pub(crate) fn fill(
        &mut self,
        comm: &dyn Gather,
        device: Option<&dyn DeviceGather>,
    ) -> candle_core::Result<()> {
        fill(comm, device, &self.jobs, &mut self.bufs)
    }

    /// The layer with its gathered weights on `device` (on the pass's thread).
    pub(crate) fn finish(self, device: &Device) -> candle_core::Result<Layer> {
        let Self {
            mut layer,
            bufs,
            plans: [qkv, gate_up, o, down],
            moe,
            ..
        } = self;
        let mut bufs: Vec<Option<Buf>> = bufs.into_iter().map(Some).collect();
        layer.qkv = finish_group(&mut layer.attn_in, qkv, &mut bufs, device)?;
        layer.gate_up = finish_group(&mut layer.mlp_in, gate_up, &mut bufs, device)?;
        finish_group(std::slice::from_mut(&mut layer.o), o, &mut bufs, device)?;
        finish_group(layer.down.as_mut_slice(), down, &mut bufs, device)?;
        if let (Some(at), Some(m)) = (moe, layer.moe.as_mut()) {
            let Some(shards) = m.shards.take() else {
                candle_core::bail!("{}: gathers planned for experts not sharded", m.prefix);
            };
            let mut gathered = Vec::with_capacity(3);
            for (k, (i, (shard, name))) in at.into_iter().zip(shards.named()).enumerate() {
                let buf = bufs[i].take().ok_or_else(|| {
                    candle_core::Error::Msg(format!("{}.{name}: buffer {i} used twice", m.prefix))
                })?;
                gathered.push(match shard.dense_dtype() {
                    Some(_) if k == 0 => StackWeights::Dense(buf.tensor(&shard.shape, device)?),
                    // A stack in panels where the CPU path reads them so (`StackWeights::new`).
                    Some(_) => StackWeights::new(buf.tensor(&shard.shape, device)?, None)?,
                    None => StackWeights::Nf4(
                        shard.join_nf4_experts(&format!("{}.{name}", m.prefix), buf)?,
                    ),
                });
            }
            let gathered: [StackWeights; 3] = gathered
                .try_into()
                .map_err(|_| candle_core::Error::Msg("three expert tensors".into()))?;
            m.set_gathered(gathered)?;
        }
        Ok(layer)
    }
}

/// A group's gathers (q, k, v or gate, up; or one linear alone): dense members of one dtype
/// and input size into one `(Σ out, in)` block, as `group::fuse` makes it; otherwise each into
/// its own buffers.
fn plan_group(
    members: &[Linear],
    size: usize,
    jobs: &mut Vec<Job>,
    bufs: &mut Vec<Buf>,
) -> candle_core::Result<GroupPlan> {
    let shards: Vec<&Arc<Shard>> = members
        .iter()
        .filter_map(|m| match &m.w {
            Frozen::Sharded { shard, .. } => Some(shard),
            _ => None,
        })
        .collect();
    let dtype = shards.first().and_then(|s| s.dense_dtype());
    let blockable = members.len() >= 2
        && shards.len() == members.len()
        && shards
            .iter()
            .all(|s| s.dense_dtype() == dtype && s.shape[1] == shards[0].shape[1]);
    if let Some(dtype) = dtype.filter(|_| blockable) {
        let rows: usize = shards.iter().map(|s| s.shape[0]).sum();
        let n = rows * shards[0].shape[1];
        bufs.push(match shards[0].device.first() {
            Some(t) => Buf::on_device(dtype, n, t.device())?,
            None => Buf::zeroed(dtype, n)?,
        });
        let mut at = 0;
        for (m, s) in members.iter().zip(shards) {
            jobs.push(job(s, Part::Values, &m.name, bufs.len() - 1, at));
            at += s.numel() * dtype.size_in_bytes();
        }
        return Ok(GroupPlan {
            block: Some(bufs.len() - 1),
            members: Vec::new(),
        });
    }
    let mut firsts = Vec::with_capacity(members.len());
    for m in members {
        let Frozen::Sharded { shard, .. } = &m.w else {
            firsts.push(None);
            continue;
        };
        firsts.push(Some(bufs.len()));
        for &part in shard.parts() {
            bufs.push(shard.buffer(part, size)?);
            jobs.push(job(shard, part, &m.name, bufs.len() - 1, 0));
        }
    }
    Ok(GroupPlan {
        block: None,
        members: firsts,
    })
}

fn job(shard: &Arc<Shard>, part: Part, name: &str, buf: usize, at: usize) -> Job {
    Job {
        shard: shard.clone(),
        part,
        name: name.to_string(),
        buf,
        at,
    }
}

/// The group's members made from their gathered buffers; the block, if they share one.
fn finish_group(
    members: &mut [Linear],
    plan: GroupPlan,
    bufs: &mut [Option<Buf>],
    device: &Device,
) -> candle_core::Result<Option<Tensor>> {
    let mut take = |i: usize| {
        bufs[i]
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("gathered buffer {i} used twice")))
    };
    let dims = |m: &Linear| m.w.dims();
    if let Some(b) = plan.block {
        let rows: Vec<usize> = members.iter().map(|m| dims(m)[0]).collect();
        let shape = [rows.iter().sum(), dims(&members[0])[1]];
        let block = take(b)?.tensor(&shape, device)?;
        let mut row = 0;
        for (m, r) in members.iter_mut().zip(rows) {
            m.w = Frozen::Dense(block.narrow(0, row, r)?);
            row += r;
        }
        return Ok(Some(block));
    }
    for (m, first) in members.iter_mut().zip(plan.members) {
        let (Frozen::Sharded { shard, dtype }, Some(first)) = (&m.w, first) else {
            continue;
        };
        m.w = match shard.dense_dtype() {
            Some(_) => Frozen::Dense(take(first)?.tensor(&shard.shape, device)?),
            None => {
                let n = shard.parts().len();
                let parts: Vec<Buf> = (first..first + n)
                    .map(&mut take)
                    .collect::<Result<_, _>>()?;
                if device.is_cuda() && parts.iter().all(Buf::is_device) {
                    quant_on_device(shard, &m.name, parts, *dtype, device)?
                } else {
                    Frozen::quant(shard.join_nf4(&m.name, parts)?, *dtype, device)?
                }
            }
        };
    }
    Ok(None)
}

/// A GPU NF4 weight from its parts gathered on the device ([`Shard::parts`] order): the codes
/// and scales copied device to device into the dequantize kernels' buffers; the host side keeps
/// the layout only ([`Shard::nf4_layout`]: shape, tables, block sizes), which is all a GPU weight
/// reads of it.
#[cfg(feature = "cuda")]
fn quant_on_device(
    shard: &Shard,
    name: &str,
    parts: Vec<Buf>,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Frozen> {
    let layout = shard.nf4_layout(name)?;
    let parts: Vec<Tensor> = parts
        .into_iter()
        .map(Buf::into_device)
        .collect::<Result<_, _>>()?;
    let gpu = rtune_ops::nf4::from_device_parts(&layout, &parts, device)
        .map_err(|e| candle_core::Error::Msg(format!("gathering {name}: {e}")))?;
    Ok(Frozen::Quant {
        q: Arc::new(layout),
        dtype,
        device: device.clone(),
        gpu: Some(gpu),
    })
}

/// Without the `cuda` feature no device is CUDA: never called.
#[cfg(not(feature = "cuda"))]
fn quant_on_device(
    _: &Shard,
    name: &str,
    _: Vec<Buf>,
    _: DType,
    _: &Device,
) -> candle_core::Result<Frozen> {
    candle_core::bail!("{name}: a CUDA device in a build without the cuda feature")
}

/// A layer as the pass uses it: the model's own, or gathered.
pub(crate) type LayerRef<'a> = Cow<'a, Layer>;

/// `Arc` for [`Frozen::Sharded`].
pub(crate) fn sharded(shard: Shard, dtype: DType) -> Frozen {
    Frozen::Sharded {
        shard: Arc::new(shard),
        dtype,
    }
}
