//! A frozen linear layer with an optional LoRA branch (Hu et al. 2021, "LoRA"):
//!
//! `y = x·Wᵀ + b + scaling · (dropout(x)·Aᵀ)·Bᵀ`, `W: (out, in)` frozen, `A: (r, in)`, `B: (out, r)`.
//!
//! The backward returns `dx` and accumulates `dA`, `dB`; it never forms a gradient for `W` or `b`.
//! The LoRA product is taken as `(x·Aᵀ)·Bᵀ` so the intermediate is `(N, r)`, never `(N, out)·(out, in)`.
//! Dropout masks come from [`rtune_backend::dropout`]: the cache keeps the mask's key, and the backward
//! regenerates the mask from it.
//!
//! A pair with a magnitude (`LoraPair::m`) is DoRA: [`crate::dora`] holds that math; the hooks here
//! scale the output and the incoming gradient.

pub mod dora;

use candle_core::{DType, Device, Result, Tensor};
use std::borrow::Cow;
use std::sync::Arc;

use rtune_quant::Nf4Weight;

use rtune_lora::Adapter;

use dora::{DoraCache, NormCache};
use rtune_backend::blas::matmul as mm;
use rtune_backend::cast::cast;
use rtune_backend::dropout::{self, DropoutKey};
use rtune_ops::lora::acc;
use rtune_ops::{add, lora_up};

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
    /// DoRA magnitudes' gradients `(out,)` (stay `None` for plain LoRA).
    pub m: Vec<Option<Tensor>>,
    /// The trainable token rows' gradient `(n, hidden)` (`None` without trainable tokens).
    pub tokens: Option<Tensor>,
}

impl Grads {
    pub fn new(modules: usize) -> Self {
        Self {
            a: vec![None; modules],
            b: vec![None; modules],
            m: vec![None; modules],
            tokens: None,
        }
    }

    /// The gradients in [`Adapter::trainable`]'s order: `A0, B0, A1, B1, …`, then the DoRA
    /// magnitudes' of the pairs that have one (`has_m[i]`), then the token rows' when the adapter
    /// trains some (`has_tokens`).
    pub fn ordered(&self, has_m: &[bool], has_tokens: bool) -> Vec<&Option<Tensor>> {
        let mut out: Vec<&Option<Tensor>> = Vec::with_capacity(self.a.len() * 3);
        for (a, b) in self.a.iter().zip(&self.b) {
            out.push(a);
            out.push(b);
        }
        out.extend(
            self.m
                .iter()
                .zip(has_m)
                .filter(|(_, h)| **h)
                .map(|(m, _)| m),
        );
        if has_tokens {
            out.push(&self.tokens);
        }
        out
    }

    pub(crate) fn add(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
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
        /// The same weight resident on the GPU when `device` is CUDA (dequantized there by
        /// rtune's kernel; `q` stays for its shape and for exports).
        #[cfg(feature = "cuda")]
        gpu: Option<Arc<rtune_ops::nf4::DeviceNf4>>,
    },
    /// This rank's shard of the weight in a sharded base ([`crate::shard`]): gathered into a
    /// `Dense` or `Quant` weight before its layer computes, never used as it is. `dtype`: what
    /// an NF4 weight dequantizes into.
    Sharded {
        shard: Arc<crate::shard::Shard>,
        dtype: DType,
    },
}

impl Frozen {
    /// A 4-bit weight computing in `dtype` on `device` (on a GPU, uploaded there).
    pub fn quant(q: Nf4Weight, dtype: DType, device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let gpu = match device {
            Device::Cuda(_) => Some(rtune_ops::nf4::upload(&q, device)?),
            _ => None,
        };
        Ok(Frozen::Quant {
            q: Arc::new(q),
            dtype,
            device: device.clone(),
            #[cfg(feature = "cuda")]
            gpu,
        })
    }

    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Frozen::Dense(t) => [t.dims()[0], t.dims()[1]],
            Frozen::Quant { q, .. } => [q.shape[0], q.shape[1]],
            Frozen::Sharded { shard, .. } => [shard.shape[0], shard.shape[1]],
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
            Frozen::Sharded { shard, .. } => shard.resident_bytes(),
        }
    }

    /// The weight in the compute dtype (dequantized when 4-bit).
    pub fn dense(&self) -> Result<Cow<'_, Tensor>> {
        match self {
            Frozen::Dense(t) => Ok(Cow::Borrowed(t)),
            #[cfg(feature = "cuda")]
            Frozen::Quant {
                gpu: Some(g),
                dtype,
                device,
                ..
            } => rtune_ops::nf4::dequantize(g, *dtype, device).map(Cow::Owned),
            Frozen::Quant {
                q, dtype, device, ..
            } => q
                .to_tensor(*dtype, device)
                .map(Cow::Owned)
                .map_err(|e| candle_core::Error::Msg(e.to_string())),
            Frozen::Sharded { shard, .. } => candle_core::bail!(
                "a shard ({:?}) of a sharded base's weight used without gathering it",
                shard.shape
            ),
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
    /// DoRA's row norms `‖W + s·B·A‖`, computed once per optimizer step.
    pub dora_norm: NormCache,
}

/// What the backward needs besides the input.
#[derive(Debug, Clone, Default)]
pub struct LinearCache {
    /// `x·Aᵀ` (after dropout): `(N, r)`, f32, contiguous.
    xa: Option<Tensor>,
    /// What regenerates the dropout mask of the LoRA input, when dropout is on.
    pub(crate) dropout: Option<DropoutKey>,
    /// DoRA's scale and pre-scale output, for a pair with a magnitude.
    dora: Option<DoraCache>,
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
        let y = product(x, &self.w.dense()?.t()?, self.bias.as_ref())?;
        self.finish(x, y, lora, salt)
    }

    /// The rest of [`Linear::forward`] once `y = x·Wᵀ` is known: bias, then the LoRA branch.
    pub(crate) fn finish(
        &self,
        x: &Tensor,
        y: Tensor,
        lora: Option<&LoraCtx>,
        salt: u64,
    ) -> Result<(Tensor, LinearCache)> {
        let (Some(slot), Some(ctx)) = (self.lora, lora) else {
            return Ok((self.add_bias(y)?, LinearCache::default()));
        };
        let pair = &ctx.adapter.pairs[slot];
        if half_branch(x, ctx, pair.m.is_some())? {
            return self.finish_lora(y, half_xa(x, &pair.a)?, None, ctx);
        }
        let key = dropout_key(ctx, salt);
        let xd = lora_input(x, key.as_ref())?; // (N, in) f32
        let xa = mm(&xd, &pair.a.t()?)?; // (N, r) f32
                                         // DoRA with dropout recomputes the base product on the dropped input (PEFT), f32.
        let base_d = match (&pair.m, &key) {
            (Some(_), Some(_)) => Some(mm(&xd, &self.w.dense()?.to_dtype(DType::F32)?.t()?)?),
            _ => None,
        };
        drop(xd);
        let (y, mut cache) = self.finish_lora(y, xa, base_d, ctx)?;
        cache.dropout = key;
        Ok((y, cache))
    }

    /// The cache [`Linear::forward`] returns, without its output: all that a recomputed forward
    /// (gradient checkpointing) needs of a layer whose output it does not use. A plain LoRA pair
    /// forms only `xa = dropout(x)·Aᵀ` (the same bits as the forward's), so the frozen product is
    /// skipped; a DoRA pair's cache holds its pre-scale output, so it runs the whole forward.
    pub fn forward_cache(
        &self,
        x: &Tensor,
        lora: Option<&LoraCtx>,
        salt: u64,
    ) -> Result<LinearCache> {
        let (Some(slot), Some(ctx)) = (self.lora, lora) else {
            return Ok(LinearCache::default());
        };
        let pair = &ctx.adapter.pairs[slot];
        if pair.m.is_some() {
            return Ok(self.forward(x, lora, salt)?.1);
        }
        if half_branch(x, ctx, false)? {
            return Ok(LinearCache {
                xa: Some(half_xa(x, &pair.a)?),
                dropout: None,
                dora: None,
            });
        }
        let key = dropout_key(ctx, salt);
        let xd = lora_input(x, key.as_ref())?; // (N, in) f32
        Ok(LinearCache {
            xa: Some(mm(&xd, &pair.a.t()?)?),
            dropout: key,
            dora: None,
        })
    }

    /// `y + b` in the bias's dtype. `y` f32 with a 16-bit bias is [`product`]'s unrounded
    /// accumulator: the sum is formed in f32 and rounded once, as torch's `F.linear` (`addmm`,
    /// the bias inside the GEMM) rounds it.
    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(b) if y.dtype() == DType::F32 && b.dtype() != DType::F32 => y
                .broadcast_add(&b.to_dtype(DType::F32)?)?
                .to_dtype(b.dtype()),
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// Bias and `y += scaling · xa·Bᵀ` for a given `xa = dropout(x)·Aᵀ: (N, r)` f32 (the cache
    /// says no dropout; [`Linear::finish`] sets its key).
    pub(crate) fn finish_with_xa(
        &self,
        y: Tensor,
        xa: Tensor,
        ctx: &LoraCtx,
    ) -> Result<(Tensor, LinearCache)> {
        self.finish_lora(y, xa, None, ctx)
    }

    /// [`Linear::finish_with_xa`]; a DoRA pair with dropout also takes `base_d = d(x)·Wᵀ` f32.
    fn finish_lora(
        &self,
        y: Tensor,
        xa: Tensor,
        base_d: Option<Tensor>,
        ctx: &LoraCtx,
    ) -> Result<(Tensor, LinearCache)> {
        let pair = &ctx.adapter.pairs[self.lora.expect("adapted layer")];
        if pair.m.is_some() {
            // DoRA scales `x·Wᵀ` before the bias, in the compute dtype: [`product`]'s f32
            // accumulator is rounded first.
            let y = match &self.bias {
                Some(b) if y.dtype() != b.dtype() => y.to_dtype(b.dtype())?,
                _ => y,
            };
            let yl = (mm(&xa, &pair.b.t()?)? * ctx.scaling)?;
            let (y, d) = dora::output(self, y, yl, base_d, ctx)?;
            return Ok((
                y,
                LinearCache {
                    xa: Some(xa),
                    dropout: None,
                    dora: Some(d),
                },
            ));
        }
        let cache = LinearCache {
            xa: Some(xa),
            dropout: None,
            dora: None,
        };
        let xa = cache.xa.as_ref().expect("just set");
        if xa.dtype() != DType::F32 {
            // The half branch: y += s·xa·Bᵀ by cuBLAS with beta = 1, in y's own rows (a member's
            // column view of a fused product too): no (N, out) product of its own.
            let y = self.add_bias(y)?;
            let bt = pair.b.to_dtype(xa.dtype())?; // (out, r): the adapter's, see `half_xa`
            acc::gemm_acc(&y, xa, &bt.t()?, ctx.scaling)?;
            return Ok((y, cache));
        }
        // y + s·xa·Bᵀ in f32, rounded once (the GEMM, its scale and the add as one pass).
        let y = lora_up(
            &self.add_bias(y)?,
            xa,
            &pair.b.t()?,
            Some(ctx.scaling),
            false,
        )?;
        Ok((y, cache))
    }

    /// DoRA's first step of the backward (accumulates `dm`); the gradient the rest of the
    /// layer's backward takes (see [`DoraCache::prepare`]). `dy` itself for plain LoRA.
    pub(crate) fn dora_dy(
        &self,
        dy: &Tensor,
        cache: &LinearCache,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        match (&cache.dora, self.lora) {
            (Some(d), Some(slot)) => d.prepare(dy, slot, grads),
            _ => Ok(dy.clone()),
        }
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
        let dy = &self.dora_dy(dy, cache, grads)?;
        let dx = if need_dx {
            Some(mm(dy, &*self.w.dense()?)?)
        } else {
            None
        };
        self.lora_backward(dy, x, cache, lora, grads, dx)
    }

    /// Accumulates `dB` and returns `dxa = scaling · dy·B: (N, r)` f32.
    pub(crate) fn lora_dxa(
        &self,
        dy: &Tensor,
        cache: &LinearCache,
        ctx: &LoraCtx,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        let slot = self.lora.expect("adapted layer");
        let pair = &ctx.adapter.pairs[slot];
        let xa = cache.xa.as_ref().expect("forward ran with LoRA");
        let s = ctx.scaling;
        if xa.dtype() != DType::F32 {
            // The half branch (its forward kept xa in the compute dtype): dB = s·dyᵀ·xa straight
            // into f32, dxa = s·dy·B in the compute dtype, each one GEMM with the scale in alpha.
            let dy = dy.contiguous()?;
            let b = pair.b.to_dtype(xa.dtype())?; // (out, r)
            Grads::add(&mut grads.b[slot], acc::gemm(&dy.t()?, xa, s, DType::F32)?)?;
            return acc::gemm(&dy, &b, s, xa.dtype());
        }
        // In f32, as the forward's LoRA branch.
        let dyf = cast(dy, DType::F32)?;
        let dyf = match &cache.dora {
            Some(d) => d.lora_dy(dyf)?,
            None => dyf,
        };
        // dB: (out, r) = s · dyᵀ·xa
        Grads::add(&mut grads.b[slot], (mm(&dyf.t()?, xa)? * s)?)?;
        mm(&dyf, &pair.b)? * s
    }

    /// The LoRA half of the backward: accumulates `dA, dB`; returns `dx` (the frozen path's
    /// input gradient, `Some` when the caller needs one) plus the LoRA branch's, `dx` itself
    /// when the layer has no LoRA branch.
    pub(crate) fn lora_backward(
        &self,
        dy: &Tensor,
        x: &Tensor,
        cache: &LinearCache,
        lora: Option<&LoraCtx>,
        grads: &mut Grads,
        dx: Option<Tensor>,
    ) -> Result<Option<Tensor>> {
        let (Some(slot), Some(ctx), Some(_)) = (self.lora, lora, &cache.xa) else {
            return Ok(dx);
        };
        let dxa = self.lora_dxa(dy, cache, ctx, grads)?;
        let pair = &ctx.adapter.pairs[slot];
        if dxa.dtype() != DType::F32 {
            // The half branch: dA = dxaᵀ·x into f32, dx += dxa·A in place (beta = 1).
            Grads::add(
                &mut grads.a[slot],
                acc::gemm(&dxa.t()?, &x.contiguous()?, 1.0, DType::F32)?,
            )?;
            let Some(dx) = dx else {
                return Ok(None);
            };
            acc::gemm_acc(&dx, &dxa, &pair.a.to_dtype(dxa.dtype())?, 1.0)?;
            return Ok(Some(dx));
        }
        // dA: (r, in) = dxaᵀ·dropout(x), the mask regenerated from its key.
        let xd = lora_input(x, cache.dropout.as_ref())?;
        Grads::add(&mut grads.a[slot], mm(&dxa.t()?, &xd)?)?;
        drop(xd);
        let Some(dx) = dx else {
            return Ok(None);
        };
        if cache.dora.is_none() && cache.dropout.is_none() {
            // dx + T(dxa·A): the rank-r product and the add as one pass.
            return Ok(Some(lora_up(&dx, &dxa, &pair.a, None, true)?));
        }
        // dx of the LoRA branch: (dxa·A) masked as the input was; DoRA with dropout adds the
        // recomputed base product's (dy⊙(k−1))·W before the mask.
        let dl = mm(&dxa, &pair.a)?;
        let extra = match &cache.dora {
            Some(d) => d.extra_dx(dy, &*self.w.dense()?)?,
            None => None,
        };
        let dl = match extra {
            Some(e) => (dl + e)?,
            None => dl,
        };
        let dl = match &cache.dropout {
            Some(k) => dropout::apply(&dl, k)?,
            None => dl,
        };
        Ok(Some(add(&dx, &dl)?))
    }
}

/// Whether the LoRA branch of input `x` runs in `x`'s 16-bit type on cuBLAS (issue 48, item 2;
/// [`rtune_ops::lora::acc`]): on CUDA unless `RTUNE_UNFUSED=lora_bf16`, for bf16/f16 without
/// dropout or DoRA; on the CPU for bf16 when `RTUNE_ONEDNN_LORA=on` and oneDNN is in use
/// (issue 47: its bf16 kernels, `rtune_backend::onednn::acc`; off by default, the f32 branch is
/// PEFT's for a bf16 model and the bf16 parity goldens hold it). Its numerics are PEFT's under bf16
/// autocast, where `lora_A(x)` and `lora_B(·)` are bf16 GEMMs of the f32 weights cast to bf16
/// (bf16 operands, f32 sums, bf16 out): `xa = T(x·T(A)ᵀ)` kept in `T`,
/// `y = T(y + s·xa·T(B)ᵀ)` rounded once (PEFT rounds the product, the scale and the add); the
/// adapters' gradients are summed in f32 from the `T` operands and never rounded to `T` (PEFT's
/// autocast rounds them to bf16 before `.grad` takes them in f32). The f32 masters stay f32.
/// The adapter's weights are cast to `T` at each use (`(r, in)` and `(out, r)`: small; a `T`
/// copy kept per optimizer step would remove those casts too).
pub(crate) fn half_branch(x: &Tensor, ctx: &LoraCtx, dora: bool) -> Result<bool> {
    // f16 on the CPU has no oneDNN path here (candle's gemm and a plain loop): the f32 branch.
    let half = x.dtype() == DType::BF16 || (x.dtype() == DType::F16 && !x.device().is_cpu());
    Ok(half
        && ctx.dropout == 0.0
        && !dora
        && rtune_ops::fused::on(x.device(), rtune_ops::fused::Fused::LoraBf16)?)
}

/// The half branch's `xa = x·T(A)ᵀ: (N, r)` in `x`'s type `T` (the stacked `[A₁; A₂; …]` of a
/// group too).
pub(crate) fn half_xa(x: &Tensor, a: &Tensor) -> Result<Tensor> {
    mm(x, &a.to_dtype(x.dtype())?.t()?)
}

/// The LoRA branch's input `dropout(x)` in f32, the adapter's dtype, whatever the compute dtype:
/// PEFT casts the input to the adapter weights' dtype (kept f32) and adds in f32. With dropout,
/// cast and mask are one pass ([`dropout::apply`]).
/// The key of a LoRA input's dropout mask (`None` when dropout is off).
fn dropout_key(ctx: &LoraCtx, salt: u64) -> Option<DropoutKey> {
    (ctx.dropout > 0.0).then_some(DropoutKey {
        p: ctx.dropout,
        seed: ctx.seed,
        salt,
    })
}

fn lora_input(x: &Tensor, key: Option<&DropoutKey>) -> Result<Tensor> {
    match key {
        Some(k) => dropout::apply(x, k),
        None => cast(x, DType::F32),
    }
}

/// The frozen product `x·Wᵀ` of a layer with bias `bias` (`wt = Wᵀ: (in, out)`): in a 16-bit
/// dtype with a bias, the f32 accumulator unrounded (oneDNN's where it takes the operands, else
/// an f32 GEMM of the upcast operands), for [`Linear::add_bias`] to round once with the bias in,
/// as torch's CPU `addmm` does (measured: `F.linear` equals `R(x·Wᵀ + b)` in f32 bit for bit,
/// and differs from `R(R(x·Wᵀ) + b)`); otherwise `mm`'s product in the compute dtype.
pub(crate) fn product(x: &Tensor, wt: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let half = |t: &Tensor| matches!(t.dtype(), DType::BF16 | DType::F16);
    match bias {
        Some(b) if half(b) && x.dtype() == b.dtype() && wt.dtype() == b.dtype() => {
            if let Some(y) = rtune_backend::onednn::matmul(x, wt, DType::F32) {
                return y;
            }
            mm(&x.to_dtype(DType::F32)?, &wt.to_dtype(DType::F32)?)
        }
        _ => mm(x, wt),
    }
}
