//! Llama (`LlamaForCausalLM`: Llama 2, 3, 3.1, 3.2, SmolLM): the shared layer with every flag
//! off. transformers' `modeling_llama.py`; `attention_bias` biases q, k, v and o, `mlp_bias` the
//! MLP.

use super::{Act, Family, Gguf, LayerNorms, RopeRules, GGUF_LINEARS};
use crate::config::{HfConfig, ModelConfig};

pub static LLAMA: Family = Family {
    hf_name: "LlamaForCausalLM",
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::SwiGlu,
    default_head_dim: None,
    norms: LayerNorms::PRE,
    rope: RopeRules::PLAIN,
    // convert_hf_to_gguf.py's LlamaModel permutes q/k rows for GGML's interleaved RoPE.
    gguf: Gguf {
        arch: "llama",
        permute_qk: true,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    let bias = c.attention_bias.unwrap_or(false);
    (m.qkv_bias, m.o_bias) = (bias, bias);
    m.mlp_bias = c.mlp_bias.unwrap_or(false);
    Ok(())
}
