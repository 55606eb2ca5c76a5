//! A sparse layer's MLP (issue 45): the router `mlp.gate: (E, H)` turns each token's normed
//! hidden state into `E` logits, [`rtune_experts::route`] picks its `k` experts and their weights,
//! and [`rtune_experts::moe`] runs the experts grouped by token (transformers 5's
//! `Qwen3MoeSparseMoeBlock`). gpt-oss's `GptOssMLP` adds biases on the router and the experts
//! and its clamped SwiGLU ([`ExpertAct`]). The router is frozen: its input gradient is
//! `dlogits · W_r`.
//!
//! LoRA on the experts is PEFT's `target_parameters` (`mlp.experts.gate_up_proj`,
//! `mlp.experts.down_proj`): one pair per 3-D parameter, `A: (E·r, in)`, `B: (out, r·E)`, held in
//! the adapter under PEFT's module path for it (`Model::lora_modules`). The load-balancing loss
//! couples every sparse layer's logits: the model computes it after the forward
//! ([`rtune_experts::route::aux_loss`]) and hands each layer its share of the gradient through
//! [`MoeLayerCache::set_aux_grad`] before the layer's backward.

use candle_core::{DType, Result, Tensor};
use std::sync::Arc;

use crate::linear::{Grads, LoraCtx};
use crate::shard::{Gather, Shard};
use crate::weights::TensorSource;
use crate::{ModelError, Result as ModelResult};
use rtune_experts::moe::{
    moe_backward, moe_forward, ExpertAct, ExpertLora, Experts, MoeCache, StackWeights,
};
use rtune_experts::route::{route, route_backward, Routed, Routing};

mod stacks;

/// The expert stacks `spec.target_parameters` adapts on layer `l` of `cfg` (none on a dense
/// layer), as adapter modules with their stack (0 gate_up, 1 down; [`MoeConfig::stacks`]): named
/// as PEFT names the wrapper (`model.layers.N.mlp.experts` with one `.base_layer` per parameter
/// listed after it: PEFT nests its `ParamWrapper`s in the list's order, the first innermost),
/// `in`/`out` PEFT's (`H → 2I` for gate_up, `I → H` for down), `E` experts. The one list the
/// model, the exports and the estimate read.
///
/// [`MoeConfig::stacks`]: crate::config::moe::MoeConfig::stacks
pub fn expert_modules(
    cfg: &crate::ModelConfig,
    l: usize,
    spec: &rtune_lora::LoraSpec,
) -> Vec<(rtune_lora::ModuleShape, usize)> {
    let (Some(moe), true) = (&cfg.moe, cfg.is_sparse(l)) else {
        return Vec::new();
    };
    let params = &spec.target_parameters;
    let mut out = Vec::new();
    for (k, s) in moe.stacks(cfg.hidden_size).iter().enumerate() {
        let Some(at) = params.iter().position(|p| p == s.param) else {
            continue;
        };
        let name = format!(
            "model.layers.{l}.mlp.experts{}",
            ".base_layer".repeat(params.len() - 1 - at)
        );
        let m = rtune_lora::ModuleShape {
            name,
            in_features: s.in_features,
            out_features: s.out_features,
            experts: moe.experts,
        };
        out.push((m, k));
    }
    out
}

/// One sparse layer's router and experts (frozen, compute dtype; the expert stacks in NF4 with
/// `[model] quantize_experts`, [`rtune_experts::moe::stack`]).
#[derive(Debug, Clone)]
pub struct MoeMlp {
    /// `model.layers.N.mlp`.
    pub prefix: String,
    /// `(E, H)`, and gpt-oss's bias `(E)`.
    pub router: Tensor,
    pub router_bias: Option<Tensor>,
    /// `(E, 2I, H)`, rows gate and up as `act` lays them out.
    pub gate_up: StackWeights,
    /// `(E, H, I)`.
    pub down: StackWeights,
    /// gpt-oss's `(E, 2I)` and `(E, H)`.
    pub gate_up_bias: Option<Tensor>,
    pub down_bias: Option<Tensor>,
    pub act: ExpertAct,
    pub top_k: usize,
    pub routing: Routing,
    /// Mixtral: the routing weights scale the experts in f32 ([`MoeConfig::f32_weights`]).
    ///
    /// [`MoeConfig::f32_weights`]: crate::config::moe::MoeConfig::f32_weights
    pub f32_weights: bool,
    /// The adapter's pairs on `experts.gate_up_proj` and `experts.down_proj`, if targeted.
    pub lora_gate_up: Option<usize>,
    pub lora_down: Option<usize>,
    /// In a sharded base (`crate::shard`): this rank's shards of `router`, `gate_up` and `down`,
    /// which are then empty until `crate::gathered` gathers the layer (the biases stay whole).
    pub shards: Option<MoeShards>,
}

/// A sharded base's shards of a sparse layer's router `(E, H)` and expert stacks `(E, 2I, H)`,
/// `(E, H, I)` ([`crate::shard::span`]): the router's flattening split as a dense linear's, the
/// stacks by whole experts (a unit is one expert's `(out, in)`), each in the compute dtype or,
/// with `quantize_experts`, as its NF4 experts' records ([`Shard::nf4_experts`]).
#[derive(Debug, Clone)]
pub struct MoeShards {
    pub router: Arc<Shard>,
    pub gate_up: Arc<Shard>,
    pub down: Arc<Shard>,
}

impl MoeShards {
    /// The three shards with the names they are gathered under (`<prefix>.gate`, ...).
    pub(crate) fn named(&self) -> [(&Arc<Shard>, &'static str); 3] {
        [
            (&self.router, "router"),
            (&self.gate_up, "experts.gate_up_proj"),
            (&self.down, "experts.down_proj"),
        ]
    }

    pub(crate) fn named_mut(&mut self) -> [&mut Arc<Shard>; 3] {
        [&mut self.router, &mut self.gate_up, &mut self.down]
    }
}

/// What [`MoeMlp::backward`] needs, and the router logits the aux loss reads.
#[derive(Debug)]
pub struct MoeLayerCache {
    /// `T × E` f32, holding values of `logits_dtype`.
    pub logits: Vec<f32>,
    /// The dtype the router computed its logits in (the model's, or bf16 under autocast): the
    /// routing path's and the aux loss's gradients round to it.
    pub logits_dtype: DType,
    routed: Routed,
    cache: MoeCache,
    /// `∂(coef · aux)/∂logits` for this layer (`T × E`, rounded to `logits_dtype`), set by the
    /// model before the backward.
    aux_grad: Option<Vec<f32>>,
}

impl MoeLayerCache {
    /// This layer's share of the load-balancing loss's gradient, `T × E`.
    pub fn set_aux_grad(&mut self, g: Vec<f32>) {
        self.aux_grad = Some(g);
    }
}

impl MoeMlp {
    /// Loads layer `layer`'s router and experts (`h`: the hidden width): the stacks read by
    /// `stacks::read` (transformers 5's fused stacks, gpt-oss's transposed or MXFP4 ones, or the
    /// family's released per-expert layout), the router under `<layer>.mlp` or the released
    /// layout's module. The adapter's names are transformers 5's
    /// (`<layer>.mlp.experts.gate_up_proj`) either way, as PEFT's. With `nf4 = Some(double_quant)`
    /// each stack is quantized expert by expert as soon as it is loaded, before the next is read
    /// (one stack in the compute dtype alive at a time), from its values in the compute dtype.
    ///
    /// With `comm` (a sharded base, `crate::shard`) this rank reads and keeps only its shards
    /// ([`MoeShards`]): its experts' bytes of the stacks (the [`span`] of units of one expert)
    /// and its elements of the router; the tensors stay empty until `crate::gathered` gathers
    /// the layer.
    ///
    /// [`span`]: crate::shard::span
    pub fn load(
        w: &dyn TensorSource,
        layer: &str,
        mc: &crate::config::moe::MoeConfig,
        h: usize,
        nf4: Option<bool>,
        comm: Option<&dyn Gather>,
    ) -> ModelResult<MoeMlp> {
        let (e, i, top_k, routing) = (mc.experts, mc.intermediate, mc.top_k, mc.routing);
        let prefix = format!("{layer}.mlp");
        let router_name = format!("{prefix}.{}", mc.router);
        let router_name = match mc.released {
            // The released per-expert layout keeps its router under its own module.
            Some(r) if !w.has(&format!("{router_name}.weight")) => {
                format!("{layer}.{}.gate.weight", r.module)
            }
            _ => format!("{router_name}.weight"),
        };
        let (mine, router) = match comm {
            Some(c) => (
                crate::shard::span(e, 1, c.size(), c.rank()),
                w.piece(
                    &router_name,
                    &[e, h],
                    crate::shard::span(e * h, 1, c.size(), c.rank()),
                )?,
            ),
            None => (0..e, w.tensor(&router_name, &[e, h])?),
        };
        // Each stack quantized (with NF4 experts) as soon as it is read: one dense stack alive.
        let (gate_up, down) = stacks::read(w, layer, mc, h, &router, mine, |which, t| {
            StackWeights::new(t, nf4).map_err(|err| {
                ModelError::candle(
                    format!("{prefix}.experts.{}: NF4 expert by expert", which.param()),
                    err,
                )
            })
        })?;
        let bias = |name: String, n: usize| w.tensor(&name, &[e, n]);
        let (router_bias, gate_up_bias, down_bias) = match mc.bias {
            true => (
                Some(w.tensor(&format!("{prefix}.{}.bias", mc.router), &[e])?),
                Some(bias(format!("{prefix}.experts.gate_up_proj_bias"), 2 * i)?),
                Some(bias(format!("{prefix}.experts.down_proj_bias"), h)?),
            ),
            false => (None, None, None),
        };
        let mut m = MoeMlp {
            prefix,
            router,
            router_bias,
            gate_up,
            down,
            gate_up_bias,
            down_bias,
            act: mc.act,
            top_k,
            routing,
            f32_weights: mc.f32_weights,
            lora_gate_up: None,
            lora_down: None,
            shards: None,
        };
        if comm.is_some() {
            m.keep_shards(e, h, nf4).map_err(|err| {
                ModelError::candle(format!("{}: this rank's shards", m.prefix), err)
            })?;
        }
        Ok(m)
    }

    /// Turns the loaded pieces (this rank's elements of the router `(E, h)`, its experts of the
    /// stacks, NF4 with `nf4 = Some(double_quant)`) into [`MoeShards`], leaving the tensors
    /// empty: a sharded base's sparse layer.
    fn keep_shards(&mut self, e: usize, h: usize, nf4: Option<bool>) -> Result<()> {
        let dtype = self.router.dtype();
        let stack = |w: &StackWeights| -> Result<Arc<Shard>> {
            let (_, out, inp) = w.stack().dims3()?;
            let shape = [e, out, inp];
            Ok(Arc::new(match (w, w.dense(self.router.device())?) {
                (StackWeights::Nf4(s), _) => {
                    Shard::nf4_experts(shape, s, nf4.unwrap_or_default(), dtype)?
                }
                // Dense or panels: the values as loaded, row-major.
                (_, Some(t)) => Shard {
                    unit: out * inp,
                    ..Shard::dense(&shape, &t.flatten_all()?)?
                },
                (_, None) => candle_core::bail!("{}: a stack neither dense nor NF4", self.prefix),
            }))
        };
        self.shards = Some(MoeShards {
            router: Arc::new(Shard::dense(&[e, h], &self.router.flatten_all()?)?),
            gate_up: stack(&self.gate_up)?,
            down: stack(&self.down)?,
        });
        let empty = Tensor::zeros(0, self.router.dtype(), self.router.device())?;
        self.router = empty.clone();
        self.gate_up = StackWeights::Dense(empty.clone());
        self.down = StackWeights::Dense(empty);
        Ok(())
    }

    /// An error naming the layer and `pass` when its weights are still shards (a sharded
    /// base's layer computes only once gathered).
    fn whole(&self, pass: &str) -> Result<()> {
        match self.shards {
            Some(_) => candle_core::bail!("{}: {pass} on shards, not gathered", self.prefix),
            None => Ok(()),
        }
    }

    /// The gathered weights `[router, gate_up, down]` in place of the shards (the router dense,
    /// the stacks dense or NF4 as they were sharded).
    pub(crate) fn set_gathered(
        &mut self,
        [router, gate_up, down]: [StackWeights; 3],
    ) -> Result<()> {
        let StackWeights::Dense(router) = router else {
            candle_core::bail!("{}.gate: a router gathered as NF4 experts", self.prefix);
        };
        (self.router, self.gate_up, self.down) = (router, gate_up, down);
        self.shards = None;
        Ok(())
    }

    /// Bytes this layer holds of its frozen router and experts (NF4 stacks at their packed size;
    /// a sharded base: its shards) and biases.
    pub fn resident_bytes(&self) -> usize {
        let dense = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let biases = [&self.router_bias, &self.gate_up_bias, &self.down_bias];
        let whole: usize = biases.into_iter().flatten().map(dense).sum();
        whole
            + match &self.shards {
                Some(s) => s.named().iter().map(|(s, _)| s.resident_bytes()).sum(),
                None => {
                    dense(&self.router) + self.gate_up.resident_bytes() + self.down.resident_bytes()
                }
            }
    }

    pub fn experts(&self) -> usize {
        match &self.shards {
            Some(s) => s.router.shape[0],
            None => self.router.dim(0).unwrap_or(0),
        }
    }

    /// The LoRA pairs as the op takes them, cast to the compute dtype.
    fn pairs(&self, lora: Option<&LoraCtx>) -> Result<[Option<(Tensor, Tensor, f64)>; 2]> {
        let dt = self.router.dtype();
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
        self.whole("forward")?;
        let e = self.experts();
        // transformers: the logits in the model dtype, the softmax in f32. With a bias (gpt-oss)
        // torch's `F.linear` adds it inside the GEMM, one rounding: summed in f32 here.
        let logits = match &self.router_bias {
            _ if self.logits_dtype(x.dtype()) != x.dtype() => self.autocast_logits(x)?,
            Some(b) if x.dtype() != DType::F32 => {
                let f = |t: &Tensor| t.to_dtype(DType::F32);
                f(x)?
                    .matmul(&f(&self.router)?.t()?)?
                    .broadcast_add(&f(b)?)?
                    .to_dtype(x.dtype())?
            }
            Some(b) => router_product(x, &self.router.t()?)?.broadcast_add(b)?,
            None => router_product(x, &self.router.t()?)?,
        };
        let logits_dtype = self.logits_dtype(x.dtype());
        let logits = logits
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let routed = route(&logits, e, self.top_k, self.routing)?;
        // transformers rounds the weights to the logits' dtype before they scale the experts
        // (Mixtral's stay f32).
        let weights = self.weights(&routed.weights, self.logits_dtype(x.dtype()))?;
        let [gu, dn] = self.pairs(lora)?;
        let ex = self.op_experts(&gu, &dn);
        let (y, cache) = moe_forward(x, &routed.experts, &weights, self.top_k, &ex)?;
        Ok((
            y,
            MoeLayerCache {
                logits,
                logits_dtype,
                routed,
                cache,
                aux_grad: None,
            },
        ))
    }

    /// The router logits' dtype for activations in `dt`: bf16 under autocast (f32 activations),
    /// where torch's autocast runs the router's `F.linear` in bf16 (the routing weights are then
    /// rounded to bf16); else `dt`. The experts stay in `dt`: transformers 5.24's default
    /// `grouped_mm` experts are not on autocast's list and cast their input to the (f32) weight's
    /// dtype, and PEFT folds their LoRA update with autocast disabled
    /// (`tests/parity/make_moe_goldens.py`, `qwen3_moe_autocast`).
    ///
    /// Only for the routers verified so (Qwen3-MoE's: no bias, weights rounded to the logits'
    /// dtype). Mixtral's (f32 weights) and gpt-oss's (biased, top-k of the logits) keep f32
    /// logits: against their autocast goldens (`--only mixtral_autocast,gpt_oss_autocast`, not
    /// committed) bf16 logits measured no better for Mixtral (logits 5.8e-2 vs 7.2e-2 but aux
    /// 8.7e-4 vs 5.5e-5; PEFT's own f32 run is 7.2e-2 away, a routing flip) and mixed for
    /// gpt-oss once ties were broken as torch's `topk` breaks them (logits 1.14e-2 vs 1.16e-2,
    /// steps 3.5e-4 vs 4.5e-4, but loss 1.65e-4 vs 1.12e-4, update 0.223 vs 0.206; with ties to
    /// the lower index, layer 1's input was 2.2e-1 off, a tied top-k choice). Neither family
    /// meets the autocast test's gradient bound either way (1.2e-1 to 1.3e-1 against 5e-2).
    fn logits_dtype(&self, dt: DType) -> DType {
        let verified = self.router_bias.is_none() && !self.f32_weights;
        match verified && dt == DType::F32 && rtune_backend::blas::autocast::on() {
            true => DType::BF16,
            false => dt,
        }
    }

    /// The router's logits under autocast, `x: (T, H)` f32 → `(T, E)` f32 holding bf16 values:
    /// `R(x)·R(W_r)ᵀ` accumulated in f32 ([`rtune_backend::blas::matmul`] in autocast), gpt-oss's
    /// bias (rounded to bf16) added to the f32 sum, and the sum rounded to bf16 once, as torch's
    /// bf16 `F.linear` returns it.
    fn autocast_logits(&self, x: &Tensor) -> Result<Tensor> {
        let bf16 = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let mut y = rtune_backend::blas::matmul(x, &self.router.t()?)?;
        if let Some(b) = &self.router_bias {
            y = y.broadcast_add(&bf16(b)?)?;
        }
        bf16(&y)
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
            gate_up: self.gate_up.stack(),
            down: self.down.stack(),
            gate_up_bias: self.gate_up_bias.as_ref(),
            down_bias: self.down_bias.as_ref(),
            act: self.act,
            lora_gate_up: pair(gu),
            lora_down: pair(dn),
            combine_f32: self.f32_weights,
        }
    }

    /// The routing weights as they scale the experts in `dtype`: rounded to it unless the
    /// family keeps them f32.
    fn weights(&self, w: &[f32], dtype: DType) -> Result<Vec<f32>> {
        match self.f32_weights {
            true => Ok(w.to_vec()),
            false => round_to(w, dtype),
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
        self.whole("backward")?;
        let e = self.experts();
        let weights = self.weights(&c.routed.weights, self.logits_dtype(dy.dtype()))?;
        let [gu, dn] = self.pairs(lora)?;
        let ex = self.op_experts(&gu, &dn);
        let g = moe_backward(dy, &weights, &ex, &c.cache)?;
        for (slot, pair) in [(self.lora_gate_up, g.gate_up), (self.lora_down, g.down)] {
            if let (Some(i), Some((da, db))) = (slot, pair) {
                Grads::add(&mut grads.a[i], da)?;
                Grads::add(&mut grads.b[i], db)?;
            }
        }
        // The logits' two gradients, each rounded to their dtype, summed in it as autograd sums
        // them (`rtune_experts::route`'s module doc).
        let ldt = c.logits_dtype;
        let mut dlogits = route_backward(&c.routed, &g.dweights, e, self.routing, ldt)?;
        if let Some(aux) = &c.aux_grad {
            dlogits.iter_mut().zip(aux).for_each(|(d, a)| *d += a);
            dlogits = round_to(&dlogits, ldt)?;
        }
        let t = dy.dim(0)?;
        let dlogits = Tensor::from_vec(dlogits, (t, e), dy.device())?.to_dtype(dy.dtype())?;
        // The frozen router's input gradient: (T, E)·(E, H); under autocast on bf16-rounded
        // operands, as torch's backward of the bf16 `F.linear`.
        let dx = match self.logits_dtype(dy.dtype()) != dy.dtype() {
            true => rtune_backend::blas::matmul(&dlogits, &self.router)?,
            false => router_product(&dlogits, &self.router)?,
        };
        g.dx + dx
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

/// The router's products in the compute dtype: f32 through the dense path's CBLAS
/// ([`rtune_backend::blas::matmul`]: on candle's CPU matmul this `(T, H)·(H, E)` and its input
/// gradient were ~3% of `benches/moe_vs_peft.sh`'s step in session 31's profile), other dtypes as
/// candle computes them (bf16 would otherwise go to oneDNN, another rounding).
fn router_product(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    match a.dtype() {
        DType::F32 => rtune_backend::blas::matmul(a, b),
        _ => a.matmul(b),
    }
}
