//! The mixture-of-experts part of a model config (issue 45): how many experts, how many a token
//! goes to, how the router's logits become weights, which layers are sparse, and the
//! load-balancing loss. A family's descriptor fills it from its own config.json keys
//! ([`qwen3_moe`](super::family) reads Qwen3-MoE's).

use super::HfConfig;
use rtune_ops::route::Routing;

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
    /// ([`rtune_ops::route::aux_loss`]) times this is added to the loss, as transformers adds
    /// it; `None`: no aux loss.
    pub aux_coef: Option<f64>,
}

/// Qwen3-MoE's keys (transformers' `Qwen3MoeConfig` defaults): `num_experts` (128),
/// `num_experts_per_tok` (8), `norm_topk_prob` (false), `moe_intermediate_size` (768),
/// `decoder_sparse_step` (1), `mlp_only_layers` ([]), `router_aux_loss_coef` (0.001),
/// `output_router_logits` (false). Layer `l` is sparse when not in `mlp_only_layers` and
/// `(l + 1) % decoder_sparse_step == 0`.
pub(crate) fn qwen3_moe(c: &HfConfig, layers: usize) -> Result<MoeConfig, String> {
    let experts = c.num_experts.unwrap_or(128);
    let top_k = c.num_experts_per_tok.unwrap_or(8);
    if experts == 0 || top_k == 0 || top_k > experts {
        return Err(format!(
            "num_experts_per_tok = {top_k} of num_experts = {experts}: a token needs 1 to \
             num_experts experts"
        ));
    }
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
    let coef = c.router_aux_loss_coef.unwrap_or(0.001);
    Ok(MoeConfig {
        experts,
        top_k,
        intermediate,
        routing: Routing::SoftmaxTopK {
            normalize: c.norm_topk_prob.unwrap_or(false),
        },
        sparse_layers,
        aux_coef: c.output_router_logits.unwrap_or(false).then_some(coef),
    })
}
