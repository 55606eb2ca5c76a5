//! Mistral (`MistralForCausalLM`): Llama's layer with a sliding window on every layer.
//! `attention_bias` biases q, k and v only (as rtune has always read it for this family).

use super::{Act, Family, Gguf, LayerNorms, RopeRules, GGUF_LINEARS};
use crate::config::{HfConfig, ModelConfig};

pub static MISTRAL: Family = Family {
    hf_name: "MistralForCausalLM",
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::SwiGlu,
    default_head_dim: None,
    norms: LayerNorms::PRE,
    rope: RopeRules::PLAIN,
    // llama.cpp reads Mistral as a `llama` (q/k rows permuted).
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
    Ok(())
}
