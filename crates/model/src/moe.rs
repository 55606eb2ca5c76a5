//! A sparse layer's MLP (issue 45): the router `mlp.gate: (E, H)` turns each token's normed
//! hidden state into `E` logits, [`rtune_ops::route`] picks its `k` experts and their weights,
//! and [`rtune_ops::moe`] runs the experts grouped by token (transformers 5's
//! `Qwen3MoeSparseMoeBlock`). The router is frozen: its input gradient is `dlogits · W_r`.
//!
//! LoRA on the experts is PEFT's `target_parameters` (`mlp.experts.gate_up_proj`,
//! `mlp.experts.down_proj`): one pair per 3-D parameter, `A: (E·r, in)`, `B: (out, r·E)`, held in
//! the adapter under PEFT's module path for it (`Model::lora_modules`). The load-balancing loss
//! couples every sparse layer's logits: the model computes it after the forward
//! ([`rtune_ops::route::aux_loss`]) and hands each layer its share of the gradient through
//! [`MoeLayerCache::set_aux_grad`] before the layer's backward.

use candle_core::{DType, Result, Tensor};

use crate::linear::{Grads, LoraCtx};
use crate::weights::TensorSource;
use crate::{ModelError, Result as ModelResult};
use rtune_ops::moe::{moe_backward, moe_forward, ExpertLora, Experts, MoeCache};
use rtune_ops::route::{route, route_backward, Routed, Routing};

/// One sparse layer's router and experts (frozen, compute dtype).
#[derive(Debug, Clone)]
pub struct MoeMlp {
    /// `model.layers.N.mlp`.
    pub prefix: String,
    /// `(E, H)`.
    pub router: Tensor,
    /// `(E, 2I, H)`, rows gate then up.
    pub gate_up: Tensor,
    /// `(E, H, I)`.
    pub down: Tensor,
    pub top_k: usize,
    pub routing: Routing,
    /// The adapter's pairs on `experts.gate_up_proj` and `experts.down_proj`, if targeted.
    pub lora_gate_up: Option<usize>,
    pub lora_down: Option<usize>,
}

/// What [`MoeMlp::backward`] needs, and the router logits the aux loss reads.
#[derive(Debug)]
pub struct MoeLayerCache {
    /// `T × E` f32.
    pub logits: Vec<f32>,
    routed: Routed,
    cache: MoeCache,
    /// `∂(coef · aux)/∂logits` for this layer (`T × E`), set by the model before the backward.
    aux_grad: Option<Vec<f32>>,
}

impl MoeLayerCache {
    /// This layer's share of the load-balancing loss's gradient, `T × E`.
    pub fn set_aux_grad(&mut self, g: Vec<f32>) {
        self.aux_grad = Some(g);
    }
}

impl MoeMlp {
    /// Loads layer `layer`'s router and experts (`h`: the hidden width): transformers 5's fused
    /// stacks under `<layer>.mlp`, else the family's released per-expert layout
    /// ([`crate::config::moe::Released`]: Qwen3-MoE's `mlp.experts.N.{gate,up,down}_proj`,
    /// Mixtral's `block_sparse_moe.experts.N.{w1,w3,w2}`), stacked. The adapter's names are
    /// transformers 5's (`<layer>.mlp.experts.gate_up_proj`) either way, as PEFT's.
    pub fn load(
        w: &dyn TensorSource,
        layer: &str,
        mc: &crate::config::moe::MoeConfig,
        h: usize,
    ) -> ModelResult<MoeMlp> {
        let (e, i, top_k, routing) = (mc.experts, mc.intermediate, mc.top_k, mc.routing);
        let prefix = format!("{layer}.mlp");
        let fused = format!("{prefix}.experts.gate_up_proj");
        let (router, gate_up, down) = match w.tensor(&fused, &[e, 2 * i, h]) {
            Ok(gu) => (
                w.tensor(&format!("{prefix}.gate.weight"), &[e, h])?,
                gu,
                w.tensor(&format!("{prefix}.experts.down_proj"), &[e, h, i])?,
            ),
            Err(ModelError::MissingTensor { .. }) => {
                let module = format!("{layer}.{}", mc.released.module);
                let [gate, up, down] = mc.released.names;
                let per = |n: usize, p: &str, shape: &[usize]| {
                    w.tensor(&format!("{module}.experts.{n}.{p}.weight"), shape)
                };
                let router = w.tensor(&format!("{module}.gate.weight"), &[e, h])?;
                let mut gu = Vec::with_capacity(e);
                let mut dn = Vec::with_capacity(e);
                for n in 0..e {
                    let g = per(n, gate, &[i, h])?;
                    let u = per(n, up, &[i, h])?;
                    gu.push(
                        Tensor::cat(&[g, u], 0)
                            .map_err(|err| ModelError::candle(format!("{prefix}: stack"), err))?,
                    );
                    dn.push(per(n, down, &[h, i])?);
                }
                let stack = |v: Vec<Tensor>| {
                    Tensor::stack(&v, 0).map_err(|err| {
                        ModelError::candle(format!("{prefix}: stacking {e} experts"), err)
                    })
                };
                (router, stack(gu)?, stack(dn)?)
            }
            Err(other) => return Err(other),
        };
        Ok(MoeMlp {
            prefix,
            router,
            gate_up,
            down,
            top_k,
            routing,
            lora_gate_up: None,
            lora_down: None,
        })
    }

    /// The expert stacks' names under the checkpoint (`<prefix>.experts.gate_up_proj`,
    /// `...down_proj`) with `(in, out)` as PEFT's `ParamWrapper` reads them: gate_up `H → 2I`,
    /// down `I → H`.
    pub fn param_names(&self) -> [(String, usize, usize); 2] {
        let (_, i2, h) = self.gate_up.dims3().unwrap_or((0, 0, 0));
        [
            (format!("{}.experts.gate_up_proj", self.prefix), h, i2),
            (format!("{}.experts.down_proj", self.prefix), i2 / 2, h),
        ]
    }

    pub fn experts(&self) -> usize {
        self.router.dim(0).unwrap_or(0)
    }

    /// The LoRA pairs as the op takes them, cast to the compute dtype.
    fn pairs(&self, lora: Option<&LoraCtx>) -> Result<[Option<(Tensor, Tensor, f64)>; 2]> {
        let dt = self.gate_up.dtype();
        let get = |slot: Option<usize>| -> Result<Option<(Tensor, Tensor, f64)>> {
            let (Some(ctx), Some(i)) = (lora, slot) else {
                return Ok(None);
            };
            let p = &ctx.adapter.pairs[i];
            Ok(Some((p.a.to_dtype(dt)?, p.b.to_dtype(dt)?, ctx.scaling)))
        };
        Ok([get(self.lora_gate_up)?, get(self.lora_down)?])
    }

    /// `x: (T, H)` (the normed hidden state) → `(T, H)` and the cache.
    pub fn forward(&self, x: &Tensor, lora: Option<&LoraCtx>) -> Result<(Tensor, MoeLayerCache)> {
        let e = self.experts();
        // transformers: the logits in the model dtype, the softmax in f32.
        let logits = x
            .matmul(&self.router.t()?)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let routed = route(&logits, e, self.top_k, self.routing)?;
        // transformers rounds the weights to the model dtype before they scale the experts.
        let weights = round_to(&routed.weights, x.dtype())?;
        let [gu, dn] = self.pairs(lora)?;
        let ex = self.op_experts(&gu, &dn);
        let (y, cache) = moe_forward(x, &routed.experts, &weights, self.top_k, &ex)?;
        Ok((
            y,
            MoeLayerCache {
                logits,
                routed,
                cache,
                aux_grad: None,
            },
        ))
    }

    fn op_experts<'a>(
        &'a self,
        gu: &'a Option<(Tensor, Tensor, f64)>,
        dn: &'a Option<(Tensor, Tensor, f64)>,
    ) -> Experts<'a> {
        let pair = |p: &'a Option<(Tensor, Tensor, f64)>| {
            p.as_ref().map(|(a, b, s)| ExpertLora { a, b, scale: *s })
        };
        Experts {
            gate_up: &self.gate_up,
            down: &self.down,
            gate_up_bias: None,
            down_bias: None,
            act: rtune_ops::moe::ExpertAct::SwiGlu,
            lora_gate_up: pair(gu),
            lora_down: pair(dn),
        }
    }

    /// `dy: (T, H)` → `dx: (T, H)` through the experts and the router; the experts' LoRA
    /// gradients added into `grads`.
    pub fn backward(
        &self,
        dy: &Tensor,
        c: &MoeLayerCache,
        lora: Option<&LoraCtx>,
        grads: &mut Grads,
    ) -> Result<Tensor> {
        let e = self.experts();
        let weights = round_to(&c.routed.weights, dy.dtype())?;
        let [gu, dn] = self.pairs(lora)?;
        let ex = self.op_experts(&gu, &dn);
        let g = moe_backward(dy, &weights, &ex, &c.cache)?;
        for (slot, pair) in [(self.lora_gate_up, g.gate_up), (self.lora_down, g.down)] {
            if let (Some(i), Some((da, db))) = (slot, pair) {
                Grads::add(&mut grads.a[i], da)?;
                Grads::add(&mut grads.b[i], db)?;
            }
        }
        let mut dlogits = route_backward(&c.routed, &g.dweights, e, self.routing)?;
        if let Some(aux) = &c.aux_grad {
            dlogits.iter_mut().zip(aux).for_each(|(d, a)| *d += a);
        }
        let t = dy.dim(0)?;
        let dlogits = Tensor::from_vec(dlogits, (t, e), dy.device())?.to_dtype(dy.dtype())?;
        // The frozen router's input gradient: (T, E)·(E, H).
        g.dx + dlogits.matmul(&self.router)?
    }
}

/// `v` rounded to `dtype` and back (f32: as is).
fn round_to(v: &[f32], dtype: DType) -> Result<Vec<f32>> {
    if dtype == DType::F32 {
        return Ok(v.to_vec());
    }
    Tensor::new(v, &candle_core::Device::Cpu)?
        .to_dtype(dtype)?
        .to_dtype(DType::F32)?
        .to_vec1()
}
