//! Mixtral (`MixtralForCausalLM`): Mistral's attention (a sliding window when config.json gives
//! one) with every layer's MLP a mixture of experts: the router `mlp.gate.weight: (E, H)`, the
//! experts as transformers 5's fused stacks (`mlp.experts.gate_up_proj: (E, 2I, H)`,
//! `mlp.experts.down_proj: (E, H, I)`) or the released per-expert layout
//! (`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.N.w1/w3/w2.weight`), routed softmax
//! → top-k → renormalised; the load-balancing loss added with `output_router_logits`.
//! transformers' `modeling_mixtral.py`; the keys in [`crate::config::moe::mixtral`].

use super::{Act, Family, Gguf, LayerNorms, RopeRules, GGUF_LINEARS};
use crate::config::{HfConfig, ModelConfig};

pub static MIXTRAL: Family = Family {
    hf_name: "MixtralForCausalLM",
    // The attention; the experts are adapted through `[lora] target_parameters` (PEFT's).
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::SwiGlu,
    default_head_dim: None,
    norms: LayerNorms::PRE,
    rope: RopeRules::PLAIN,
    // llama.cpp reads Mixtral as a `llama` with experts (q/k rows permuted).
    gguf: Gguf {
        arch: "llama",
        permute_qk: true,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    m.qkv_bias = c.attention_bias.unwrap_or(false);
    super::every_layer_window(c, m);
    m.moe = Some(crate::config::moe::mixtral(c, m.num_layers)?);
    Ok(())
}
