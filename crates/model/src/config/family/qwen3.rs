//! Qwen3 (`Qwen3ForCausalLM`): Qwen2's layer without the q/k/v bias (unless `attention_bias`,
//! which also biases o_proj), with a per-head RMSNorm on q and k before RoPE
//! (`self_attn.q_norm`, `self_attn.k_norm`, `(head_dim)` each); `head_dim` defaults to 128.

use super::{Act, Family, Gguf, LayerNorms, RopeRules, GGUF_LINEARS};
use crate::config::{HfConfig, ModelConfig};

pub static QWEN3: Family = Family {
    hf_name: "Qwen3ForCausalLM",
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::SwiGlu,
    // transformers' Qwen3Config: 128 whatever hidden / heads is.
    default_head_dim: Some(128),
    norms: LayerNorms::PRE,
    rope: RopeRules::PLAIN,
    gguf: Gguf {
        arch: "qwen3",
        permute_qk: false,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    let bias = c.attention_bias.unwrap_or(false);
    (m.qkv_bias, m.o_bias) = (bias, bias);
    m.variant.qk_norm = true;
    super::qwen_windows(c, m)
}
