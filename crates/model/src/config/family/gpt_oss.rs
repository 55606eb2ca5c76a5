//! gpt-oss (`GptOssForCausalLM`): biases on q/k/v/o, a learned sink logit per query head in every
//! attention's softmax (`self_attn.sinks: (H,)`), sliding and full layers by `layer_types`
//! (default: even layers sliding) with `sliding_window` (128), YaRN RoPE (base 150000), and every
//! MLP a mixture of experts: the router `mlp.router` with a bias, top-k of its logits then softmax
//! over the k; the experts `mlp.experts.gate_up_proj: (E, H, 2I)` (gate/up interleaved) and
//! `down_proj: (E, I, H)` with biases, the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`);
//! in MXFP4 in the release (`*_blocks`, `*_scales`), dequantized at load. The load-balancing loss
//! with `output_router_logits`. transformers' `modeling_gpt_oss.py`; the keys in
//! [`crate::config::moe::gpt_oss`].

use super::{Act, Family, Gguf, LayerNorms, RopeRules, GGUF_LINEARS};
use crate::config::{HfConfig, ModelConfig};

pub static GPT_OSS: Family = Family {
    hf_name: "GptOssForCausalLM",
    // The attention; the experts are adapted through `[lora] target_parameters` (PEFT's).
    linear_modules: &rtune_lora::ALL_LINEAR,
    act: Act::SwiGlu,
    default_head_dim: Some(64),
    norms: LayerNorms::PRE,
    rope: RopeRules {
        default_theta: 150_000.0,
        ..RopeRules::PLAIN
    },
    gguf: Gguf {
        arch: "gpt-oss",
        permute_qk: false,
        linears: &GGUF_LINEARS,
    },
    map,
};

fn map(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    let bias = c.attention_bias.unwrap_or(true);
    (m.qkv_bias, m.o_bias) = (bias, bias);
    let layers = m.num_layers;
    if let Some(w) = c.sliding_window.or(Some(128)) {
        m.sliding_window = Some(w);
        m.window_layers = match &c.layer_types {
            Some(types) => super::marked(types, layers)?,
            None => (0..layers).map(|i| (i + 1) % 2 == 1).collect(),
        };
    }
    m.variant.attn_sinks = true;
    // `GptOssRMSNorm`: `(w · x_f32).to(dtype)`, its weights kept in f32 (`_keep_in_fp32_modules`).
    m.variant.f32_norms = true;
    m.moe = Some(crate::config::moe::gpt_oss(c, layers)?);
    Ok(())
}
