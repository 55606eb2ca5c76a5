//! Qwen2 (`Qwen2ForCausalLM`): Llama's layer with a bias on q, k and v, and a window on some
//! layers when `use_sliding_window` is set.

use super::{Act, Family, Gguf, LayerNorms, RopeRules, GGUF_LINEARS};
use crate::config::{HfConfig, ModelConfig};

pub static QWEN2: Family = Family {
    hf_name: "Qwen2ForCausalLM",
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::SwiGlu,
    default_head_dim: None,
    norms: LayerNorms::PRE,
    rope: RopeRules::PLAIN,
    // NeoX RoPE in llama.cpp's qwen2 graph: no permutation.
    gguf: Gguf {
        arch: "qwen2",
        permute_qk: false,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    m.qkv_bias = true;
    super::qwen_windows(c, m)
}
