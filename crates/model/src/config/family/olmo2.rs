//! OLMo 2 (`Olmo2ForCausalLM`): Llama's attention and MLP with the norms moved after them —
//! `h = x + post_attention_layernorm(attn(x))`, `out = h + post_feedforward_layernorm(mlp(h))`,
//! no norm before either — and an RMSNorm on q and on k over the whole projection width
//! (`self_attn.q_norm: (H·Dh)`, `self_attn.k_norm: (Hkv·Dh)`, not per head as Qwen3's) before
//! RoPE. Its RMSNorm multiplies the weight in f32 and rounds once (`(w·x).to(dtype)`, Gemma's
//! form without the `1 +`). `attention_bias` biases q, k, v and o. transformers'
//! `modeling_olmo2.py`. Its rotary tables stay f32 and q/k rotate in f32 with one rounding
//! (`f32_rope`).

use super::{Act, Family, Gguf, LayerNorms, RopeRules, GGUF_LINEARS};
use crate::config::{HfConfig, ModelConfig};

pub static OLMO2: Family = Family {
    hf_name: "Olmo2ForCausalLM",
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::SwiGlu,
    default_head_dim: None,
    norms: LayerNorms {
        pre_attn: None,
        post_attn: Some("post_attention_layernorm"),
        pre_mlp: None,
        post_mlp: Some("post_feedforward_layernorm"),
    },
    rope: RopeRules::PLAIN,
    // convert_hf_to_gguf.py's Olmo2Model is no LlamaModel and llama.cpp's olmo2 graph rotates
    // NeoX-style: no permutation.
    gguf: Gguf {
        arch: "olmo2",
        permute_qk: false,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    let bias = c.attention_bias.unwrap_or(false);
    (m.qkv_bias, m.o_bias) = (bias, bias);
    m.variant.qk_norm = true;
    m.variant.qk_norm_whole = true;
    m.variant.f32_norms = true;
    m.variant.f32_rope = true;
    Ok(())
}
