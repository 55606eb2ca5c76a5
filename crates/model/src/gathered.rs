//! The layers and tables a pass of a sharded base uses, gathered from every rank's shards
//! ([`crate::shard`]): [`Sharded`], the model's sharded state, and how a layer's weights become
//! ordinary dense or NF4 weights again, the dense q/k/v and gate/up straight into their fused
//! blocks.

use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;

use crate::layer::Layer;
use crate::linear::{Frozen, Linear};
use crate::shard::{dense_tensor, Gather, Shard};

/// The sharded base's own state: the transport, and the embedding table's and an untied
/// lm_head's shards (the layers' are in their [`Frozen::Sharded`] weights).
pub struct Sharded {
    pub comm: Rc<dyn Gather>,
    /// `(V, D)`
    pub embed: Shard,
    /// `(V, D)`: an untied lm_head, or under autocast a bf16 copy of a tied one.
    pub lm_head: Option<Shard>,
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
        let comm = &*self.comm;
        let mut l = layer.clone();
        for (lin, own) in l.linears_mut().into_iter().zip(layer.linears()) {
            // DoRA's per-step row norms stay cached across the gathers of a step.
            lin.dora_norm = own.dora_norm.share();
        }
        l.qkv = gather_group(comm, &mut l.attn_in, device)?;
        l.gate_up = gather_group(comm, &mut l.mlp_in, device)?;
        gather_one(comm, &mut l.o, device)?;
        gather_one(comm, &mut l.down, device)?;
        Ok(l)
    }

    /// The embedding table `(V, D)`, gathered.
    pub fn embed(&self, device: &Device) -> candle_core::Result<Tensor> {
        gather_table(&*self.comm, &self.embed, "model.embed_tokens", device)
    }

    /// The lm_head `(V, D)`, gathered (the embedding table when tied).
    pub fn lm_head(&self, device: &Device) -> candle_core::Result<Tensor> {
        match &self.lm_head {
            Some(s) => gather_table(&*self.comm, s, "lm_head", device),
            None => self.embed(device),
        }
    }

    /// Bytes of the embedding's and lm_head's shards.
    pub fn resident_bytes(&self) -> usize {
        self.embed.resident_bytes() + self.lm_head.as_ref().map_or(0, Shard::resident_bytes)
    }
}

fn gather_table(
    comm: &dyn Gather,
    s: &Shard,
    name: &str,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let dtype = s.dense_dtype().unwrap_or(DType::F32);
    dense_tensor(dtype, &s.shape, device, |out| {
        s.gather_dense_into(comm, name, out)
    })
}

/// One linear's weight gathered in place (a member of no block).
fn gather_one(comm: &dyn Gather, lin: &mut Linear, device: &Device) -> candle_core::Result<()> {
    let Frozen::Sharded { shard, dtype } = &lin.w else {
        return Ok(());
    };
    lin.w = match shard.dense_dtype() {
        Some(d) => Frozen::Dense(dense_tensor(d, &shard.shape, device, |out| {
            shard.gather_dense_into(comm, &lin.name, out)
        })?),
        None => Frozen::quant(shard.gather_nf4(comm, &lin.name)?, *dtype, device)?,
    };
    Ok(())
}

/// A group's members (q, k, v or gate, up) gathered: dense members of one dtype and input size
/// into one `(Σ out, in)` block whose row views they become (the block returned), as
/// `group::fuse` makes it; otherwise each on its own (`None`).
fn gather_group(
    comm: &dyn Gather,
    members: &mut [Linear],
    device: &Device,
) -> candle_core::Result<Option<Tensor>> {
    let shards: Vec<Arc<Shard>> = members
        .iter()
        .filter_map(|m| match &m.w {
            Frozen::Sharded { shard, .. } => Some(shard.clone()),
            _ => None,
        })
        .collect();
    let dtype = shards.first().and_then(|s| s.dense_dtype());
    let blockable = members.len() >= 2
        && shards.len() == members.len()
        && shards
            .iter()
            .all(|s| s.dense_dtype() == dtype && s.shape[1] == shards[0].shape[1]);
    let Some(dtype) = dtype.filter(|_| blockable) else {
        for m in members.iter_mut() {
            gather_one(comm, m, device)?;
        }
        return Ok(None);
    };
    let rows: Vec<usize> = shards.iter().map(|s| s.shape[0]).collect();
    let shape = [rows.iter().sum(), shards[0].shape[1]];
    let row_bytes = dtype.size_in_bytes() * shape[1];
    let block = dense_tensor(dtype, &shape, device, |out| {
        let mut at = 0;
        for (m, s) in members.iter().zip(&shards) {
            let n = s.shape[0] * row_bytes;
            s.gather_dense_into(comm, &m.name, &mut out[at..at + n])?;
            at += n;
        }
        Ok(())
    })?;
    let mut row = 0;
    for (m, r) in members.iter_mut().zip(rows) {
        m.w = Frozen::Dense(block.narrow(0, row, r)?);
        row += r;
    }
    Ok(Some(block))
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
