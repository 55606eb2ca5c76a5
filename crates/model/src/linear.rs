//! A frozen linear layer with an optional LoRA branch (Hu et al. 2021, "LoRA"):
//!
//! `y = x·Wᵀ + b + scaling · (dropout(x)·Aᵀ)·Bᵀ`, `W: (out, in)` frozen, `A: (r, in)`, `B: (out, r)`.
//!
//! The backward returns `dx` and accumulates `dA`, `dB`; it never forms a gradient for `W` or `b`.
//! The LoRA product is taken as `(x·Aᵀ)·Bᵀ` so the intermediate is `(N, r)`, never `(N, out)·(out, in)`.

use candle_core::{DType, Device, Result, Tensor};
use rand::{Rng, SeedableRng};
use std::borrow::Cow;
use std::sync::Arc;

use rtune_quant::Nf4Weight;

use rtune_lora::Adapter;

/// The adapter as the forward pass sees it.
#[derive(Debug, Clone, Copy)]
pub struct LoraCtx<'a> {
    pub adapter: &'a Adapter,
    pub scaling: f64,
    /// Dropout probability on the LoRA input; 0 in evaluation.
    pub dropout: f64,
    /// Seed of this micro-batch's dropout masks; a recomputed forward gets the same masks.
    pub seed: u64,
}

/// LoRA gradients, f32, in the adapter's module order.
#[derive(Debug, Clone)]
pub struct Grads {
    pub a: Vec<Option<Tensor>>,
    pub b: Vec<Option<Tensor>>,
}

impl Grads {
    pub fn new(modules: usize) -> Self {
        Self {
            a: vec![None; modules],
            b: vec![None; modules],
        }
    }

    fn add(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
        let g = g.to_dtype(DType::F32)?;
        *slot = Some(match slot.take() {
            Some(prev) => (prev + g)?,
            None => g,
        });
        Ok(())
    }
}

/// A frozen weight `(out, in)`: dense in the compute dtype, or 4-bit (QLoRA).
#[derive(Debug, Clone)]
pub enum Frozen {
    Dense(Tensor),
    /// bitsandbytes NF4 (or FP4). Dequantized into the compute dtype for each use and dropped
    /// after it, so the full-precision copy of a layer lives only while that layer computes.
    Quant {
        q: Arc<Nf4Weight>,
        dtype: DType,
        device: Device,
    },
}

impl Frozen {
    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Frozen::Dense(t) => [t.dims()[0], t.dims()[1]],
            Frozen::Quant { q, .. } => [q.shape[0], q.shape[1]],
        }
    }

    pub fn elem_count(&self) -> usize {
        let [o, i] = self.dims();
        o * i
    }

    /// Bytes held for this weight.
    pub fn resident_bytes(&self) -> usize {
        match self {
            Frozen::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Frozen::Quant { q, .. } => q.resident_bytes(),
        }
    }

    /// The weight in the compute dtype (dequantized when 4-bit).
    pub fn dense(&self) -> Result<Cow<'_, Tensor>> {
        match self {
            Frozen::Dense(t) => Ok(Cow::Borrowed(t)),
            Frozen::Quant { q, dtype, device } => q
                .to_tensor(*dtype, device)
                .map(Cow::Owned)
                .map_err(|e| candle_core::Error::Msg(e.to_string())),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Linear {
    /// Checkpoint name without `.weight`, e.g. `model.layers.0.self_attn.q_proj`.
    pub name: String,
    pub w: Frozen,
    pub bias: Option<Tensor>,
    /// Index of this module's LoRA pair in the attached adapter.
    pub lora: Option<usize>,
}

/// What the backward needs besides the input.
#[derive(Debug, Clone, Default)]
pub struct LinearCache {
    /// `x·Aᵀ` (after dropout): `(N, r)`, f32.
    xa: Option<Tensor>,
    /// Dropout keep-mask scaled by `1/(1−p)`: `(N, in)`, f32.
    mask: Option<Tensor>,
}

impl Linear {
    pub fn in_features(&self) -> usize {
        self.w.dims()[1]
    }
    pub fn out_features(&self) -> usize {
        self.w.dims()[0]
    }

    /// `x: (N, in)` → `(N, out)`.
    pub fn forward(
        &self,
        x: &Tensor,
        lora: Option<&LoraCtx>,
        salt: u64,
    ) -> Result<(Tensor, LinearCache)> {
        let mut y = x.matmul(&self.w.dense()?.t()?)?;
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        let mut cache = LinearCache::default();
        if let (Some(slot), Some(ctx)) = (self.lora, lora) {
            let pair = &ctx.adapter.pairs[slot];
            // The LoRA branch runs in f32, the adapter's dtype, whatever the compute dtype: PEFT
            // casts the input to the adapter weights' dtype (kept f32) and adds in f32.
            let dt = x.dtype();
            let xf = x.to_dtype(DType::F32)?;
            let mask = if ctx.dropout > 0.0 {
                Some(dropout_mask(&xf, ctx.dropout, ctx.seed ^ salt)?)
            } else {
                None
            };
            let xd = match &mask {
                Some(m) => (&xf * m)?,
                None => xf,
            };
            let xa = xd.matmul(&pair.a.t()?)?; // (N, r) f32
            let yl = (xa.matmul(&pair.b.t()?)? * ctx.scaling)?;
            y = (y.to_dtype(DType::F32)? + yl)?.to_dtype(dt)?;
            cache = LinearCache { xa: Some(xa), mask };
        }
        Ok((y, cache))
    }

    /// Accumulates `dA, dB` into `grads`; returns `dx: (N, in)` when `need_dx`.
    pub fn backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        cache: &LinearCache,
        lora: Option<&LoraCtx>,
        grads: &mut Grads,
        need_dx: bool,
    ) -> Result<Option<Tensor>> {
        let mut dx = if need_dx {
            Some(dy.matmul(&*self.w.dense()?)?)
        } else {
            None
        };
        if let (Some(slot), Some(ctx), Some(xa)) = (self.lora, lora, &cache.xa) {
            let pair = &ctx.adapter.pairs[slot];
            let s = ctx.scaling;
            // In f32, as the forward's LoRA branch.
            let dyf = dy.to_dtype(DType::F32)?;
            // dB: (out, r) = s · dyᵀ·xa
            Grads::add(&mut grads.b[slot], (dyf.t()?.matmul(xa)? * s)?)?;
            // dxa: (N, r) = s · dy·B
            let dxa = (dyf.matmul(&pair.b)? * s)?;
            let xf = x.to_dtype(DType::F32)?;
            let xd = match &cache.mask {
                Some(m) => (&xf * m)?,
                None => xf,
            };
            // dA: (r, in) = dxaᵀ·xd
            Grads::add(&mut grads.a[slot], dxa.t()?.matmul(&xd)?)?;
            if let Some(d) = dx.as_mut() {
                let mut dl = dxa.matmul(&pair.a)?;
                if let Some(m) = &cache.mask {
                    dl = (dl * m)?;
                }
                *d = (&*d + dl.to_dtype(d.dtype())?)?;
            }
        }
        Ok(dx)
    }
}

/// Inverted-dropout mask shaped like `x` (f32): `1/(1−p)` with probability `1−p`, else 0.
fn dropout_mask(x: &Tensor, p: f64, seed: u64) -> Result<Tensor> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let keep = (1.0 / (1.0 - p)) as f32;
    let v: Vec<f32> = (0..x.elem_count())
        .map(|_| if rng.random::<f64>() < p { 0.0 } else { keep })
        .collect();
    Tensor::from_vec(v, x.shape(), x.device())
}
