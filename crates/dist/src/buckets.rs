//! The NCCL gradient all-reduce of a data-parallel CUDA run (issue 16; feature `cuda`), bucketed
//! by layer and overlapped with the backward.
//!
//! On the step's last micro-batch of this rank, the model reports each decoder layer as soon as
//! its backward has added its LoRA gradients (`Model::forward_backward_layers`; layers in reverse
//! order, so every rank reports them in the same order). [`LayerBuckets::launch`] then copies that
//! layer's gradients (A, B and DoRA magnitudes of its modules, f32; a missing gradient as zeros,
//! so every rank's bucket has the same layout) into one flat buffer on the compute stream and
//! launches its NCCL sum all-reduce on the second stream ([`crate::nccl`]): the transfer of
//! layer i runs while the backward of layer i − 1 computes. [`LayerBuckets::finish`] launches
//! whatever no layer reported, waits for the NCCL stream under the watchdog, and cuts the
//! reduced buckets back into gradients. Earlier micro-batches only accumulate (their gradients
//! are not final yet), as in PyTorch DDP's `no_sync`.
//!
//! The sums are the MPI path's: with two ranks `g0 + g1`, the same f32 on either rank.

use std::cell::RefCell;
use std::collections::HashSet;

use candle_core::{DType, Tensor};
use rtune_lora::Adapter;
use rtune_model::Grads;

use crate::nccl::Nccl;
use crate::{DistError, World};
use std::rc::Rc;

/// One trainable tensor: `which` 0 = A, 1 = B, 2 = the DoRA magnitude, of pair `pair`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Slot {
    which: u8,
    pair: usize,
}

impl Slot {
    fn shape(self, adapter: &Adapter) -> (Vec<usize>, DType) {
        let p = &adapter.pairs[self.pair];
        let t = match self.which {
            0 => &p.a,
            1 => &p.b,
            _ => p.m.as_ref().unwrap_or(&p.a),
        };
        (t.dims().to_vec(), t.dtype())
    }

    fn get(self, g: &Grads) -> Option<&Tensor> {
        match self.which {
            0 => g.a[self.pair].as_ref(),
            1 => g.b[self.pair].as_ref(),
            _ => g.m[self.pair].as_ref(),
        }
    }

    fn set(self, g: &mut Grads, t: Tensor) {
        let slot = match self.which {
            0 => &mut g.a[self.pair],
            1 => &mut g.b[self.pair],
            _ => &mut g.m[self.pair],
        };
        *slot = Some(t);
    }
}

/// The trainable tensors of `pairs`, in adapter order: A, B (and m) of each.
fn slots(adapter: &Adapter, pairs: &[usize]) -> Vec<Slot> {
    let mut out = Vec::with_capacity(pairs.len() * 3);
    for &pair in pairs {
        out.push(Slot { which: 0, pair });
        out.push(Slot { which: 1, pair });
        if adapter.pairs[pair].m.is_some() {
            out.push(Slot { which: 2, pair });
        }
    }
    out
}

/// The communicator (shared with a sharded base's gathers, [`crate::nccl::NcclGather`]) and the
/// buckets launched in the current step.
pub(crate) struct LayerBuckets {
    nccl: Rc<Nccl>,
    /// Each bucket's slots and its flat f32 buffer (reduced in place once its all-reduce ran).
    launched: RefCell<Vec<(Vec<Slot>, Tensor)>>,
}

impl LayerBuckets {
    pub(crate) fn new(nccl: Rc<Nccl>) -> Self {
        Self {
            nccl,
            launched: RefCell::new(Vec::new()),
        }
    }

    /// Launches the all-reduce of `pairs`' gradients as one bucket; returns without waiting.
    pub(crate) fn launch(
        &self,
        adapter: &Adapter,
        grads: &Grads,
        pairs: &[usize],
    ) -> candle_core::Result<()> {
        let slots = slots(adapter, pairs);
        let Some(first) = adapter.pairs.first() else {
            return Ok(());
        };
        if slots.is_empty() {
            return Ok(());
        }
        let dev = first.a.device();
        let mut parts = Vec::with_capacity(slots.len());
        for s in &slots {
            parts.push(match s.get(grads) {
                Some(t) => t.to_dtype(DType::F32)?.flatten_all()?,
                None => {
                    let n = s.shape(adapter).0.iter().product::<usize>();
                    Tensor::zeros(n, DType::F32, dev)?
                }
            });
        }
        // A buffer of its own (reduced in place): never a gradient's storage.
        let bucket = match parts.as_slice() {
            [one] => one.copy()?,
            _ => Tensor::cat(&parts, 0)?,
        };
        self.nccl.all_reduce_sum(&bucket)?;
        self.launched.borrow_mut().push((slots, bucket));
        Ok(())
    }

    /// After the step's backward: launches the pairs no layer reported, waits for every bucket
    /// (under the watchdog, as `what`), and returns the summed gradients.
    pub(crate) fn finish(
        &self,
        world: &World,
        what: &str,
        adapter: &Adapter,
        grads: Grads,
    ) -> Result<Grads, DistError> {
        let done: HashSet<Slot> = self
            .launched
            .borrow()
            .iter()
            .flat_map(|(s, _)| s.iter().copied())
            .collect();
        let rest: Vec<usize> = (0..adapter.pairs.len())
            .filter(|&pair| !done.contains(&Slot { which: 0, pair }))
            .collect();
        self.launch(adapter, &grads, &rest)
            .map_err(DistError::candle("NCCL gradient bucket"))?;
        // The trainable token rows (embedding backward and the tied lm_head's, both after the
        // last layer's hook): one f32 bucket of their own.
        let tokens = match &grads.tokens {
            Some(t) => {
                let bucket = t
                    .to_dtype(DType::F32)
                    .and_then(|t| t.copy())
                    .map_err(DistError::candle("NCCL token-rows bucket"))?;
                self.nccl
                    .all_reduce_sum(&bucket)
                    .map_err(DistError::candle("NCCL token-rows bucket"))?;
                Some(bucket)
            }
            None => None,
        };
        drop(grads);
        world.watch(what, || self.nccl.synchronize())?;
        let mut out = Grads::new(adapter.pairs.len());
        out.tokens = tokens;
        for (slots, bucket) in self.launched.take() {
            let mut at = 0;
            for s in slots {
                let (shape, dtype) = s.shape(adapter);
                let n: usize = shape.iter().product();
                let t = bucket
                    .narrow(0, at, n)
                    .and_then(|t| t.reshape(shape.as_slice()))
                    .and_then(|t| t.to_dtype(dtype))
                    .map_err(DistError::candle("reduced gradient from its bucket"))?;
                s.set(&mut out, t);
                at += n;
            }
        }
        Ok(out)
    }
}
