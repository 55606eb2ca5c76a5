//! AdamW with exactly `torch.optim.AdamW` semantics (Loshchilov & Hutter 2019; torch's single-tensor
//! path): decoupled weight decay `p ← p·(1 − lr·wd)`, `m ← m + (1−β1)(g − m)`,
//! `v ← β2·v + (1−β2)·g²`, `p ← p − lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε)`; plus the learning-rate
//! schedules of transformers (`get_{constant,linear,cosine}_schedule_with_warmup`) and global-norm
//! clipping as `torch.nn.utils.clip_grad_norm_`.
//!
//! [`LoraOptimizer`] runs it over an adapter in one of two places. On the CPU: [`AdamW`]
//! (`rtune_ops::adamw::cpu`, beside the kernels) on flat host vectors (the reference; every CPU run
//! uses it, bit for bit as before the device path existed). When the adapter lives on a CUDA device (feature `cuda`): `optim/device.rs`, the
//! multi-tensor kernels of `rtune_ops::adamw` over all LoRA tensors at once, with the moments
//! and master weights on the device and one host sync a step (the gradient norm). Their CPU
//! reference, `rtune_ops::adamw`, is tested against [`AdamW`] in `optim/reference_tests.rs`.

use candle_core::Tensor;
use rtune_config::Schedule;
use rtune_lora::Adapter;
use rtune_model::Grads;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

use crate::TrainError;

pub use rtune_ops::adamw::{clip_factor, AdamW};

#[cfg(feature = "cuda")]
mod device;
#[cfg(test)]
mod reference_tests;

/// The multiplier of the base learning rate for optimizer step `step` (0-based), as transformers'
/// schedulers give it (warmup ramps from 0 at step 0).
pub fn lr_factor(schedule: Schedule, step: usize, total: usize, warmup: usize) -> f64 {
    if step < warmup {
        return step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    match schedule {
        Schedule::Constant => 1.0,
        Schedule::Linear => (1.0 - progress).max(0.0),
        Schedule::Cosine => (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0),
    }
}

/// Dynamic loss scaling for f16, as `torch.amp.GradScaler`: gradients are computed for
/// `loss · scale` so small ones survive f16; a step whose gradients overflow is skipped and the scale
/// halved; after `interval` clean steps in a row the scale doubles.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    /// Clean steps since the last overflow or growth.
    pub clean_steps: usize,
    pub interval: usize,
}

impl LossScaler {
    pub fn new(scale: f64, interval: usize) -> Self {
        Self {
            scale,
            clean_steps: 0,
            interval,
        }
    }

    pub fn update(&mut self, overflow: bool) {
        if overflow {
            self.scale *= 0.5;
            self.clean_steps = 0;
        } else {
            self.clean_steps += 1;
            if self.clean_steps >= self.interval {
                self.scale *= 2.0;
                self.clean_steps = 0;
            }
        }
    }
}

/// What [`LoraOptimizer::step`] did.
#[derive(Debug, Clone, Copy)]
pub struct Applied {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// False when the loss or a gradient was not finite: nothing was updated.
    pub applied: bool,
}

/// AdamW's hyperparameters, as `torch.optim.AdamW` takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Hyper {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// LoRA+ (Hayou et al. 2024; PEFT's `create_loraplus_optimizer`): the B matrices' learning
    /// rate is `lr · b_lr_ratio` (1 = plain LoRA, one group).
    pub b_lr_ratio: f64,
    /// How many (A, B) pairs lead the adapter's tensor list; what follows them (DoRA's
    /// magnitude vectors) is one-dimensional.
    pub n_pairs: usize,
    /// The list ends with the trainable token rows (two-dimensional, not `lora_B`: LoRA+'s
    /// groupA, at `lr`).
    pub token_rows: bool,
}

impl Hyper {
    /// The learning-rate multiplier of each tensor in the adapter's order (A0, B0, A1, B1, ...,
    /// then DoRA's magnitudes). PEFT's groups for a LoRA on linear layers: every `lora_A` at `lr`
    /// (groupA), every `lora_B` and every one-dimensional parameter (`param.ndim == 1`: DoRA's
    /// `lora_magnitude_vector`) at `lr · ratio` (groupB); all take the same weight decay (none of
    /// them is a bias or a norm in transformers' decay list), so groupB_no_decay is empty. The
    /// embedding group (`loraplus_lr_embedding`) holds LoRA on embedding layers, which rtune
    /// never creates. The trainable token rows (`…token_adapter.trainable_tokens_delta`, held by
    /// PEFT's TrainableTokensLayer, not a LoRA Embedding, and two-dimensional) are groupA's.
    pub(crate) fn lr_scales(&self, n_tensors: usize) -> Vec<f64> {
        (0..n_tensors)
            .map(|k| {
                if self.token_rows && k + 1 == n_tensors {
                    1.0
                } else if k % 2 == 1 || k >= 2 * self.n_pairs {
                    self.b_lr_ratio
                } else {
                    1.0
                }
            })
            .collect()
    }
}

/// AdamW over an adapter's weights (A0, B0, A1, B1, ..., then the DoRA magnitudes), with its
/// state on the adapter's device.
pub struct LoraOptimizer {
    sizes: Vec<usize>,
    hyper: Hyper,
    store: Store,
}

/// Where the parameters' f32 master copy and the moments live between steps.
enum Store {
    /// Flat f32 vectors on the host, updated by [`AdamW`] (the CPU path).
    Host { params: Vec<Vec<f32>>, adamw: AdamW },
    /// On the adapter's CUDA device, updated by the multi-tensor kernels.
    #[cfg(feature = "cuda")]
    Device(Box<device::DeviceAdamW>),
}

impl LoraOptimizer {
    /// A fresh optimizer (zero moments, step 0) for `adapter`'s current weights: on the device
    /// when the adapter is on a CUDA device (`cuda` builds), else on the host.
    pub fn new(
        adapter: &Adapter,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
    ) -> Result<Self, TrainError> {
        Self::with_loraplus(adapter, betas, eps, weight_decay, 1.0)
    }

    /// [`new`](Self::new) with LoRA+'s groups: the B matrices train at `lr · b_lr_ratio`.
    pub fn with_loraplus(
        adapter: &Adapter,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        b_lr_ratio: f64,
    ) -> Result<Self, TrainError> {
        let hyper = Hyper {
            betas,
            eps,
            weight_decay,
            b_lr_ratio,
            n_pairs: adapter.pairs.len(),
            token_rows: adapter.tokens.is_some(),
        };
        // A0, B0, A1, B1, …, then DoRA's magnitudes (Adapter::trainable's order).
        let mut params = Vec::with_capacity(adapter.pairs.len() * 2);
        for (_, t) in adapter.trainable() {
            params.push(flat(t).map_err(TrainError::candle("adapter to host"))?);
        }
        let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
        #[cfg(feature = "cuda")]
        if let Some(candle_core::Device::Cuda(dev)) = adapter.pairs.first().map(|p| p.a.device()) {
            let d = Box::new(device::DeviceAdamW::new(dev, &params, hyper)?);
            return Ok(Self {
                sizes,
                hyper,
                store: Store::Device(d),
            });
        }
        let adamw = AdamW::new(&sizes, betas, eps, weight_decay);
        Ok(Self {
            sizes,
            hyper,
            store: Store::Host { params, adamw },
        })
    }

    /// Multiplies the gradients by `unscale` (1 / loss scale), clips (`max_norm` 0 = off) and
    /// updates the adapter — unless `loss` or the gradient norm is not finite, in which case nothing
    /// changes.
    pub fn step(
        &mut self,
        adapter: &mut Adapter,
        grads: &Grads,
        lr: f64,
        max_norm: f64,
        loss: f64,
        unscale: f64,
    ) -> Result<Applied, TrainError> {
        let (params, adamw) = match &mut self.store {
            Store::Host { params, adamw } => (params, adamw),
            #[cfg(feature = "cuda")]
            Store::Device(d) => return d.step(adapter, grads, lr, max_norm, loss, unscale),
        };
        let mut gv: Vec<Vec<f32>> = Vec::with_capacity(params.len());
        let ordered = grads.ordered(&has_magnitude(adapter), adapter.tokens.is_some());
        for (size, g) in self.sizes.iter().zip(ordered) {
            gv.push(match g {
                Some(t) => flat(t).map_err(TrainError::candle("grad to host"))?,
                None => vec![0.0; *size],
            });
        }
        if unscale != 1.0 {
            let u = unscale as f32;
            gv.iter_mut()
                .flat_map(|g| g.iter_mut())
                .for_each(|x| *x *= u);
        }
        let (grad_norm, coef) = clip_factor(&gv, max_norm);
        if !(loss.is_finite() && grad_norm.is_finite()) {
            // As torch's GradScaler: no update at all, and AdamW's step count does not advance.
            return Ok(Applied {
                grad_norm,
                applied: false,
            });
        }
        if coef < 1.0 {
            let c = coef as f32;
            gv.iter_mut()
                .flat_map(|g| g.iter_mut())
                .for_each(|x| *x *= c);
        }
        adamw.update_grouped(params, &gv, lr, &self.hyper.lr_scales(gv.len()));
        for (t, v) in adapter.trainable_mut().into_iter().zip(params.iter()) {
            *t = Tensor::from_vec(rtune_backend::storage::par_copy(v), t.shape(), t.device())
                .map_err(TrainError::candle("adapter update"))?;
        }
        Ok(Applied {
            grad_norm,
            applied: true,
        })
    }

    /// AdamW's step count (updates made; skipped steps do not count), for checkpoints.
    pub fn adamw_step(&self) -> u64 {
        match &self.store {
            Store::Host { adamw, .. } => adamw.step,
            #[cfg(feature = "cuda")]
            Store::Device(d) => d.step,
        }
    }

    /// The moments `(m, v)` in the adapter's order (A0, B0, A1, B1, ..., then the DoRA
    /// magnitudes), for checkpoints: borrowed on the host, copied from the device (a checkpoint's
    /// copy, not a step's).
    #[allow(clippy::type_complexity)]
    pub fn moments(&self) -> Result<(Cow<'_, [Vec<f32>]>, Cow<'_, [Vec<f32>]>), TrainError> {
        match &self.store {
            Store::Host { adamw, .. } => Ok((Cow::Borrowed(&adamw.m), Cow::Borrowed(&adamw.v))),
            #[cfg(feature = "cuda")]
            Store::Device(d) => {
                let (m, v) = d.moments()?;
                Ok((Cow::Owned(m), Cow::Owned(v)))
            }
        }
    }

    /// Restores the moments saved by [`moments`](Self::moments); `adapter` must already hold the
    /// checkpoint's weights. Sizes are checked.
    pub fn restore(
        &mut self,
        adapter: &Adapter,
        step: u64,
        m: Vec<Vec<f32>>,
        v: Vec<Vec<f32>>,
    ) -> Result<(), TrainError> {
        let h = self.hyper;
        let mut fresh = Self::with_loraplus(adapter, h.betas, h.eps, h.weight_decay, h.b_lr_ratio)?;
        let same = |x: &[Vec<f32>]| {
            x.len() == fresh.sizes.len() && x.iter().zip(&fresh.sizes).all(|(a, &n)| a.len() == n)
        };
        if !same(&m) || !same(&v) {
            return Err(TrainError::OptimizerState);
        }
        match &mut fresh.store {
            Store::Host { adamw, .. } => {
                adamw.step = step;
                adamw.m = m;
                adamw.v = v;
            }
            #[cfg(feature = "cuda")]
            Store::Device(d) => d.restore(step, &m, &v)?,
        }
        *self = fresh;
        Ok(())
    }
}

/// Which pairs carry a DoRA magnitude (for [`Grads::ordered`]).
pub(crate) fn has_magnitude(adapter: &Adapter) -> Vec<bool> {
    adapter.pairs.iter().map(|p| p.m.is_some()).collect()
}

pub(crate) fn flat(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    rtune_backend::storage::host_f32(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LoRA+'s groups: in the first update every weight moves by lr·sign(g) (Adam's first step),
    /// so A moves by lr and B by lr·ratio; weight decay uses each group's lr. A ratio of 1 is the
    /// plain update, bit for bit.
    #[test]
    fn loraplus_groups_scale_the_b_lr() {
        let init = vec![vec![1.0f32, -1.0], vec![0.5f32, 2.0]];
        let g = vec![vec![0.3f32, -0.2], vec![-1.0f32, 4.0]];
        let (lr, ratio, wd) = (0.01, 16.0, 0.1);
        let mut p = init.clone();
        let mut opt = AdamW::new(&[2, 2], (0.9, 0.999), 1e-8, wd);
        opt.update_grouped(&mut p, &g, lr, &[1.0, ratio]);
        for (k, scale) in [(0, 1.0), (1, ratio)] {
            let lr = lr * scale;
            for i in 0..2 {
                let want = init[k][i] as f64 * (1.0 - lr * wd) - lr * (g[k][i] as f64).signum();
                assert!(
                    (p[k][i] as f64 - want).abs() < 1e-6,
                    "{k},{i}: {} vs {want}",
                    p[k][i]
                );
            }
        }
        let (mut a, mut b) = (init.clone(), init.clone());
        let mut oa = AdamW::new(&[2, 2], (0.9, 0.999), 1e-8, wd);
        let mut ob = oa.clone();
        oa.update(&mut a, &g, lr);
        ob.update_grouped(&mut b, &g, lr, &[1.0, 1.0]);
        assert_eq!(a, b);
        let h = Hyper {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            b_lr_ratio: 4.0,
            n_pairs: 2,
            token_rows: false,
        };
        assert_eq!(h.lr_scales(4), vec![1.0, 4.0, 1.0, 4.0]);
        // DoRA's magnitudes follow the pairs and join B's group (PEFT: `param.ndim == 1`).
        assert_eq!(h.lr_scales(6), vec![1.0, 4.0, 1.0, 4.0, 4.0, 4.0]);
        // Trainable token rows come last, in groupA (PEFT: 2-D and not `lora_B`).
        let h = Hyper {
            token_rows: true,
            ..h
        };
        assert_eq!(h.lr_scales(7), vec![1.0, 4.0, 1.0, 4.0, 4.0, 4.0, 1.0]);
    }

    /// A LoRA+ optimizer restored from a checkpoint's moments keeps its groups: its next step is
    /// bit for bit the step of the optimizer that never stopped.
    #[test]
    fn loraplus_groups_survive_restore() {
        use candle_core::Device;
        use rtune_lora::{LoraPair, LoraSpec};
        let t = |v: Vec<f32>, d: (usize, usize)| Tensor::from_vec(v, d, &Device::Cpu).unwrap();
        let spec = LoraSpec::new(2, 4.0, 0.0, false, &["q_proj".into()]).unwrap();
        let adapter = Adapter {
            spec,
            names: vec!["m".into()],
            pairs: vec![LoraPair {
                a: t(vec![0.1, -0.2, 0.3, 0.4, -0.5, 0.6], (2, 3)),
                b: t(vec![0.05, -0.05, 0.1, 0.2, -0.1, 0.3, 0.0, 0.02], (4, 2)),
                m: None,
            }],
            tokens: None,
        };
        let mut grads = Grads::new(1);
        grads.a[0] = Some(t(vec![0.3, -0.1, 0.2, 0.5, 0.1, -0.4], (2, 3)));
        grads.b[0] = Some(t(vec![-0.2, 0.1, 0.3, -0.3, 0.2, 0.1, -0.1, 0.4], (4, 2)));
        let hyper = ((0.9, 0.999), 1e-8, 0.01, 8.0);
        let new = |a: &Adapter| {
            LoraOptimizer::with_loraplus(a, hyper.0, hyper.1, hyper.2, hyper.3).unwrap()
        };
        let (mut a1, mut o1) = (adapter.clone(), new(&adapter));
        o1.step(&mut a1, &grads, 1e-3, 0.0, 1.0, 1.0).unwrap();
        let (m, v) = o1.moments().unwrap();
        let (m, v) = (m.into_owned(), v.into_owned());
        let mut a2 = a1.clone();
        let mut o2 = new(&a2);
        o2.restore(&a2, o1.adamw_step(), m, v).unwrap();
        o1.step(&mut a1, &grads, 1e-3, 0.0, 1.0, 1.0).unwrap();
        o2.step(&mut a2, &grads, 1e-3, 0.0, 1.0, 1.0).unwrap();
        for (x, y) in [
            (&a1.pairs[0].a, &a2.pairs[0].a),
            (&a1.pairs[0].b, &a2.pairs[0].b),
        ] {
            assert_eq!(flat(x).unwrap(), flat(y).unwrap());
        }
        // And B did move faster than A: the first step moved B by lr·ratio per element.
        let b0 = flat(&adapter.pairs[0].b).unwrap();
        let mut a3 = adapter.clone();
        new(&adapter)
            .step(&mut a3, &grads, 1e-3, 0.0, 1.0, 1.0)
            .unwrap();
        let moved = (flat(&a3.pairs[0].b).unwrap()[0] - b0[0] * (1.0 - 8e-3 * 0.01)).abs();
        assert!((moved - 8e-3).abs() < 1e-6, "{moved}");
    }

    #[test]
    fn schedules_match_transformers() {
        use Schedule::*;
        assert_eq!(lr_factor(Linear, 0, 10, 2), 0.0);
        assert_eq!(lr_factor(Linear, 1, 10, 2), 0.5);
        assert_eq!(lr_factor(Linear, 2, 10, 2), 1.0);
        assert_eq!(lr_factor(Linear, 6, 10, 2), 0.5);
        assert!((lr_factor(Cosine, 6, 10, 2) - 0.5).abs() < 1e-12);
        assert!((lr_factor(Cosine, 10, 10, 2)).abs() < 1e-12);
        assert_eq!(lr_factor(Constant, 7, 10, 2), 1.0);
        assert_eq!(lr_factor(Constant, 0, 10, 0), 1.0);
    }

    #[test]
    fn loss_scaler_backs_off_and_grows_as_grad_scaler() {
        let mut s = LossScaler::new(65536.0, 3);
        s.update(true);
        assert_eq!(s.scale, 32768.0);
        s.update(false);
        s.update(false);
        assert_eq!(s.scale, 32768.0);
        s.update(false);
        assert_eq!((s.scale, s.clean_steps), (65536.0, 0));
        s.update(false);
        s.update(true);
        assert_eq!((s.scale, s.clean_steps), (32768.0, 0));
    }
}
