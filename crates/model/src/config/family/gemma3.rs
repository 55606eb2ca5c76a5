//! Gemma 3 text (`Gemma3ForCausalLM`): Gemma 2's layer with q/k norms (per head) and no
//! attention soft cap; local (sliding) layers and global ones with their own RoPE base (global
//! default 1e6, local 1e4), every `sliding_window_pattern`-th layer (default 6) global unless
//! `layer_types` says. transformers' `modeling_gemma3.py`.

use super::{Act, Family, Gguf, RopeRules, GGUF_LINEARS, SANDWICH};
use crate::config::{HfConfig, ModelConfig};

pub static GEMMA3: Family = Family {
    hf_name: "Gemma3ForCausalLM",
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::GeGlu,
    default_head_dim: Some(256),
    norms: SANDWICH,
    rope: RopeRules {
        default_theta: 1e6,
        local_theta: Some(10_000.0),
        ..RopeRules::PLAIN
    },
    gguf: Gguf {
        arch: "gemma3",
        permute_qk: false,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    m.qkv_bias = c.attention_bias.unwrap_or(false);
    let pattern = c.sliding_window_pattern.unwrap_or(6).max(1);
    super::gemma(c, m, |i| (i + 1) % pattern != 0)?;
    m.variant.qk_norm = true;
    Ok(())
}
