//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k norms, `head_dim` default
//! 128) with the MLP of its sparse layers a mixture of experts (`mlp.gate.weight: (E, H)` the
//! router; `mlp.experts.gate_up_proj: (E, 2I, H)`, `mlp.experts.down_proj: (E, H, I)` in
//! transformers 5, or `mlp.experts.N.{gate,up,down}_proj.weight` per expert in the released
//! checkpoints, stacked at load), routed softmax → top-k (→ renormalised with `norm_topk_prob`),
//! the load-balancing loss added with `output_router_logits`. The other layers
//! (`mlp_only_layers`, or off `decoder_sparse_step`) keep Qwen3's dense MLP.
//! transformers' `modeling_qwen3_moe.py`; the keys in [`crate::config::moe::MoeConfig`].

use super::{Act, Family, Gguf, LayerNorms, RopeRules, GGUF_LINEARS};
use crate::config::{HfConfig, ModelConfig};

pub static QWEN3_MOE: Family = Family {
    hf_name: "Qwen3MoeForCausalLM",
    // The dense layers' MLP and the attention; the experts are adapted through
    // `[lora] target_parameters` (PEFT's), not as linear modules.
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::SwiGlu,
    default_head_dim: Some(128),
    norms: LayerNorms::PRE,
    rope: RopeRules::PLAIN,
    gguf: Gguf {
        arch: "qwen3moe",
        permute_qk: false,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    let bias = c.attention_bias.unwrap_or(false);
    (m.qkv_bias, m.o_bias) = (bias, bias);
    m.variant.qk_norm = true;
    m.moe = Some(crate::config::moe::qwen3_moe(c, m.num_layers)?);
    super::qwen_windows(c, m)
}
