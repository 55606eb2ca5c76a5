//! The layer inputs kept through the forward pass for the backward (gradient checkpointing): in
//! device memory, or with `offload_checkpoints` on CUDA in host memory, copied out on a side
//! stream while the next layers compute and brought back one layer ahead of the backward pass.

use candle_core::{Device, Result, Tensor};

enum Kept {
    Device(Tensor),
    #[cfg(feature = "cuda")]
    Host(crate::cuda::Offloaded),
}

pub(crate) struct KeptInputs {
    items: Vec<Kept>,
    #[cfg(feature = "cuda")]
    offloader: Option<crate::cuda::Offloader>,
    /// The next input `pop` returns, already on its way back to the device.
    #[cfg(feature = "cuda")]
    prefetched: Option<Tensor>,
}

impl KeptInputs {
    /// `offload` applies on CUDA devices only (elsewhere the inputs already are in host memory).
    pub fn new(device: &Device, offload: bool, layers: usize) -> Result<Self> {
        #[cfg(not(feature = "cuda"))]
        let _ = (device, offload);
        Ok(Self {
            items: Vec::with_capacity(layers),
            #[cfg(feature = "cuda")]
            offloader: if offload && device.is_cuda() {
                Some(crate::cuda::Offloader::new(device)?)
            } else {
                None
            },
            #[cfg(feature = "cuda")]
            prefetched: None,
        })
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
