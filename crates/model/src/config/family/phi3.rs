//! Phi-3 and Phi-4 dense (`Phi3ForCausalLM`): Mistral's layer with q/k/v and gate/up fused into
//! one weight each (`self_attn.qkv_proj`, rows q, k, v; `mlp.gate_up_proj`, rows gate, up), each
//! adapted as one LoRA module as PEFT does; RoPE on part of each head
//! (`partial_rotary_factor`) and LongRoPE. transformers' `modeling_phi3.py`.

use super::{Act, Family, Gguf, LayerNorms, RopeRules};
use crate::config::{HfConfig, ModelConfig};

pub static PHI3: Family = Family {
    hf_name: "Phi3ForCausalLM",
    linear_modules: &rtune_lora::FUSED_LINEAR,
    act: Act::SwiGlu,
    default_head_dim: None,
    norms: LayerNorms::PRE,
    rope: RopeRules {
        partial: true,
        longrope: true,
        ..RopeRules::PLAIN
    },
    // NeoX RoPE in llama.cpp's phi3 graph: the fused rows stay as transformers has them.
    // convert_hf_to_gguf.py's Phi3MiniModel keeps them fused: `attn_qkv`, and gate/up as
    // `ffn_up` (llama.cpp splits its rows gate, up).
    gguf: Gguf {
        arch: "phi3",
        permute_qk: false,
        linears: &[
            ("self_attn.qkv_proj", "attn_qkv"),
            ("self_attn.o_proj", "attn_output"),
            ("mlp.gate_up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ],
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    m.qkv_bias = c.attention_bias.unwrap_or(false);
    m.variant.fused_proj = true;
    super::every_layer_window(c, m);
    Ok(())
}
