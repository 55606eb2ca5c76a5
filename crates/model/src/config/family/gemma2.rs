//! Gemma 2 (`Gemma2ForCausalLM`): `1 + w` norms in f32, four a layer, GeGLU, scaled embeddings,
//! soft-capped attention scores (`attn_logit_softcapping`) and final logits, a window on the
//! even layers (or as `layer_types` marks them). transformers' `modeling_gemma2.py`.

use super::{Act, Family, Gguf, RopeRules, GGUF_LINEARS, SANDWICH};
use crate::config::{positive, HfConfig, ModelConfig};

pub static GEMMA2: Family = Family {
    hf_name: "Gemma2ForCausalLM",
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::GeGlu,
    default_head_dim: Some(256),
    norms: SANDWICH,
    rope: RopeRules::PLAIN,
    // llama.cpp's Gemma graphs rotate NeoX-style: the rows stay as transformers has them.
    gguf: Gguf {
        arch: "gemma2",
        permute_qk: false,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    m.qkv_bias = c.attention_bias.unwrap_or(false);
    super::gemma(c, m, |i| i % 2 == 0)?;
    m.variant.attn_softcap = c
        .attn_logit_softcapping
        .map(|v| positive("attn_logit_softcapping", v))
        .transpose()?;
    Ok(())
}
