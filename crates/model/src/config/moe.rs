//! The mixture-of-experts part of a model config (issue 45): how many experts, how many a token
//! goes to, how the router's logits become weights, which layers are sparse, and the
//! load-balancing loss. A family's descriptor fills it from its own config.json keys
//! ([`qwen3_moe`](super::family) reads Qwen3-MoE's).

use super::HfConfig;
use rtune_experts::moe::ExpertAct;
use rtune_experts::route::Routing;

/// The sparse layers' MLP.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// `E`: experts per sparse layer.
    pub experts: usize,
    /// `k`: experts per token.
    pub top_k: usize,
    /// `I`: each expert's intermediate width (`moe_intermediate_size`).
    pub intermediate: usize,
    pub routing: Routing,
    /// Per layer, whether its MLP is the experts (else the dense MLP of `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    /// `router_aux_loss_coef` when `output_router_logits` is set: the load-balancing loss
    /// ([`rtune_experts::route::aux_loss`]) times this is added to the loss, as transformers adds
    /// it; `None`: no aux loss.
    pub aux_coef: Option<f64>,
    /// Where the family's released checkpoints keep a sparse layer's router and experts when
    /// they are not transformers 5's fused stacks under `mlp` (`None`: gpt-oss, whose release
    /// keeps the fused stacks, in MXFP4).
    pub released: Option<Released>,
    /// The router's name under `mlp` (`gate`; gpt-oss: `router`).
    pub router: &'static str,
    /// Biases on the router (`mlp.router.bias`) and on the experts (`experts.gate_up_proj_bias`,
    /// `experts.down_proj_bias`): gpt-oss.
    pub bias: bool,
    /// The experts' gate, and the layout of `gate_up`'s columns it implies.
    pub act: ExpertAct,
    /// The stacks are stored `(E, in, out)` (gpt-oss: `gate_up_proj: (E, H, 2I)`,
    /// `down_proj: (E, I, H)`), transposed at load to the op's `(E, out, in)`.
    pub transposed: bool,
    /// The stacks may be stored in MXFP4 (`<name>_blocks`, `<name>_scales`: gpt-oss's release).
    pub mxfp4: bool,
    /// The router's weights stay f32 (Mixtral's `MixtralTopKRouter`, no cast back to the model
    /// dtype): in bf16 the experts' outputs are scaled and summed in f32, rounded once
    /// ([`rtune_experts::moe::Experts::combine_f32`]); else the weights are rounded to the model
    /// dtype first (Qwen3-MoE, gpt-oss).
    pub f32_weights: bool,
}

/// One of a sparse layer's two expert stacks as PEFT's `ParamWrapper` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertStack {
    /// Under `model.layers.N.` (PEFT's `target_parameters` spelling).
    pub param: &'static str,
    /// `in → out` of each expert's linear map: gate_up `H → 2I`, down `I → H`.
    pub in_features: usize,
    pub out_features: usize,
}

impl MoeConfig {
    /// The expert stacks of a sparse layer of hidden width `h`: gate_up then down.
    pub fn stacks(&self, h: usize) -> [ExpertStack; 2] {
        let i = self.intermediate;
        [
            ExpertStack {
                param: rtune_lora::KNOWN_PARAMETERS[0],
                in_features: h,
                out_features: 2 * i,
            },
            ExpertStack {
                param: rtune_lora::KNOWN_PARAMETERS[1],
                in_features: i,
                out_features: h,
            },
        ]
    }
}

/// A released checkpoint's per-expert layout: `<layer>.<module>.gate.weight` (the router) and
/// `<layer>.<module>.experts.N.<name>.weight` for gate, up and down, stacked at load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Released {
    pub module: &'static str,
    /// `[gate, up, down]`.
    pub names: [&'static str; 3],
}

/// Qwen3-MoE's keys (transformers' `Qwen3MoeConfig` defaults): `num_experts` (128),
/// `num_experts_per_tok` (8), `norm_topk_prob` (false), `moe_intermediate_size` (768),
/// `decoder_sparse_step` (1), `mlp_only_layers` ([]), `router_aux_loss_coef` (0.001),
/// `output_router_logits` (false). Layer `l` is sparse when not in `mlp_only_layers` and
/// `(l + 1) % decoder_sparse_step == 0`.
pub(crate) fn qwen3_moe(c: &HfConfig, layers: usize) -> Result<MoeConfig, String> {
    let (experts, top_k) = experts_and_k(c, "num_experts", (128, 8))?;
    let step = c.decoder_sparse_step.unwrap_or(1);
    if step == 0 {
        return Err("decoder_sparse_step = 0: give 1 for every layer sparse".into());
    }
    let intermediate = c.moe_intermediate_size.unwrap_or(768);
    if intermediate == 0 {
        return Err("moe_intermediate_size = 0: an expert needs a width".into());
    }
    let only = c.mlp_only_layers.clone().unwrap_or_default();
    let sparse_layers = (0..layers)
        .map(|l| !only.contains(&l) && (l + 1) % step == 0)
        .collect();
    Ok(MoeConfig {
        experts,
        top_k,
        intermediate,
        routing: Routing::SoftmaxTopK {
            normalize: c.norm_topk_prob.unwrap_or(false),
        },
        sparse_layers,
        aux_coef: aux_coef(c),
        released: Some(Released {
            module: "mlp",
            names: ["gate_proj", "up_proj", "down_proj"],
        }),
        ..MoeConfig::plain()
    })
}

/// Mixtral's keys (transformers' `MixtralConfig` defaults): `num_local_experts` (8),
/// `num_experts_per_tok` (2), `intermediate_size` (each expert's width, 14336),
/// `router_aux_loss_coef` (0.001), `output_router_logits` (false); every layer sparse; the top-k of
/// the softmax always renormalised. `router_jitter_noise` > 0 (random noise on the router's input
/// in training) is refused: no run with it is reproducible. Released checkpoints keep the experts
/// as `block_sparse_moe.experts.N.w1` (gate), `w3` (up), `w2` (down).
pub(crate) fn mixtral(c: &HfConfig, layers: usize) -> Result<MoeConfig, String> {
    let (experts, top_k) = experts_and_k(c, "num_local_experts", (8, 2))?;
    if let Some(j) = c.router_jitter_noise.filter(|&j| j != 0.0) {
        return Err(format!(
            "router_jitter_noise = {j}: random noise on the router's input in training is not \
             supported (set it to 0.0 in config.json)"
        ));
    }
    Ok(MoeConfig {
        experts,
        top_k,
        intermediate: c.intermediate_size,
        routing: Routing::SoftmaxTopK { normalize: true },
        sparse_layers: vec![true; layers],
        aux_coef: aux_coef(c),
        released: Some(Released {
            module: "block_sparse_moe",
            names: ["w1", "w3", "w2"],
        }),
        f32_weights: true,
        ..MoeConfig::plain()
    })
}

/// gpt-oss's keys (transformers' `GptOssConfig` defaults): `num_local_experts` (128),
/// `num_experts_per_tok` (4), `intermediate_size` (each expert's width, 2880), `swiglu_limit`
/// (7.0), `swiglu_alpha` (1.702), `router_aux_loss_coef` (0.001), `output_router_logits` (false);
/// every layer sparse, routed top-k of the logits then softmax over the k, biases on the router
/// and the experts, the stacks stored `(E, in, out)` with gate/up interleaved, and in MXFP4 in the
/// release.
pub(crate) fn gpt_oss(c: &HfConfig, layers: usize) -> Result<MoeConfig, String> {
    let (experts, top_k) = experts_and_k(c, "num_local_experts", (128, 4))?;
    let limit = super::positive("swiglu_limit", c.swiglu_limit.unwrap_or(7.0))?;
    let alpha = super::positive("swiglu_alpha", c.swiglu_alpha.unwrap_or(1.702))?;
    Ok(MoeConfig {
        experts,
        top_k,
        intermediate: c.intermediate_size,
        routing: Routing::TopKSoftmax,
        sparse_layers: vec![true; layers],
        aux_coef: aux_coef(c),
        released: None,
        router: "router",
        bias: true,
        act: ExpertAct::Clamped { alpha, limit },
        transposed: true,
        mxfp4: true,
        f32_weights: false,
    })
}

/// `(E, k)` from config.json's `num_experts` (named `key` in the family's config:
/// `num_experts` or `num_local_experts`) and `num_experts_per_tok`, with the family's defaults:
/// a token needs 1 to `E` experts.
fn experts_and_k(
    c: &HfConfig,
    key: &str,
    (experts, top_k): (usize, usize),
) -> Result<(usize, usize), String> {
    let experts = c.num_experts.unwrap_or(experts);
    let top_k = c.num_experts_per_tok.unwrap_or(top_k);
    if experts == 0 || top_k == 0 || top_k > experts {
        return Err(format!(
            "num_experts_per_tok = {top_k} of {key} = {experts}: a token needs 1 to {key} experts"
        ));
    }
    Ok((experts, top_k))
}

/// The load-balancing loss's coefficient, `router_aux_loss_coef` (transformers' default 0.001),
/// when `output_router_logits` is set.
fn aux_coef(c: &HfConfig) -> Option<f64> {
    let coef = c.router_aux_loss_coef.unwrap_or(0.001);
    c.output_router_logits.unwrap_or(false).then_some(coef)
}

impl MoeConfig {
    /// The defaults of the Qwen3-MoE / Mixtral kind (no biases, SwiGLU on halves, `(E, out, in)`
    /// stacks, router `mlp.gate`) that their readers complete.
    fn plain() -> MoeConfig {
        MoeConfig {
            experts: 0,
            top_k: 0,
            intermediate: 0,
            routing: Routing::TopKSoftmax,
            sparse_layers: Vec::new(),
            aux_coef: None,
            released: None,
            router: "gate",
            bias: false,
            act: ExpertAct::SwiGlu,
            transposed: false,
            mxfp4: false,
            f32_weights: false,
        }
    }
}
