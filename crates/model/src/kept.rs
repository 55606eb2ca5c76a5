//! The layer inputs kept through the forward pass for the backward (gradient checkpointing): in
//! device memory, or with `offload_checkpoints` on CUDA in host memory, copied out on the model's
//! side stream while the next layers compute and brought back one layer ahead of the backward pass
//! (`offload.rs`).

use candle_core::{Result, Tensor};
#[cfg(feature = "cuda")]
use std::sync::Arc;

enum Kept {
    Device(Tensor),
    #[cfg(feature = "cuda")]
    Host(rtune_backend::offload::Offloaded),
}

pub(crate) struct KeptInputs {
    items: Vec<Kept>,
    #[cfg(feature = "cuda")]
    offloader: Option<Arc<rtune_backend::offload::Offloader>>,
    /// The next input `pop` returns, already on its way back to the device.
    #[cfg(feature = "cuda")]
    prefetched: Option<Tensor>,
}

impl KeptInputs {
    /// Inputs kept where they are (device memory; on the CPU that is host memory).
    pub fn new(layers: usize) -> Self {
        Self {
            items: Vec::with_capacity(layers),
            #[cfg(feature = "cuda")]
            offloader: None,
            #[cfg(feature = "cuda")]
            prefetched: None,
        }
    }

    /// Keeps the inputs in host memory through `offloader` (the model's, one for the run).
    #[cfg(feature = "cuda")]
    pub fn offload_to(&mut self, offloader: Arc<rtune_backend::offload::Offloader>) {
        self.offloader = Some(offloader);
    }

    pub fn push(&mut self, x: Tensor) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(o) = &self.offloader {
            self.items.push(Kept::Host(o.offload(&x)?));
            return Ok(());
        }
        self.items.push(Kept::Device(x));
        Ok(())
    }

    /// The input of the last layer not taken yet (layers are taken last to first); with offloading,
    /// also starts copying back the one before it, so that copy overlaps this layer's backward.
    /// A restored input's pinned buffer goes back to the pool here (its reuse waits for the copy).
    pub fn pop(&mut self) -> Result<Tensor> {
        let kept = self.items.pop();
        #[cfg(feature = "cuda")]
        if let Some(o) = &self.offloader {
            let x = match (self.prefetched.take(), kept) {
                (Some(t), _) => t,
                (None, Some(Kept::Host(h))) => o.restore(&h)?,
                (None, Some(Kept::Device(t))) => t,
                (None, None) => candle_core::bail!("no kept layer input left"),
            };
            if let Some(Kept::Host(h)) = self.items.last() {
                self.prefetched = Some(o.restore(h)?);
            }
            return Ok(x);
        }
        match kept {
            Some(Kept::Device(t)) => Ok(t),
            #[cfg(feature = "cuda")]
            Some(Kept::Host(_)) => candle_core::bail!("offloaded input without an offloader"),
            None => candle_core::bail!("no kept layer input left"),
        }
    }
}
