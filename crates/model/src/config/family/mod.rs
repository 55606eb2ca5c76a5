//! The model families as descriptors: one file a family holds everything that is its own — the
//! `architectures` name, how its `config.json` maps onto [`ModelConfig`] (defaults, refusals,
//! windows, biases, the layer flags of [`Variant`]), its checkpoint's layer-norm names, its RoPE
//! rules, and its llama.cpp names — and [`FAMILIES`] lists them. The loader
//! ([`HfConfig::into_config`]), the builder ([`crate::Model`]) and the exports read a family only
//! through its descriptor; none names one.
//!
//! The shared layer ([`crate::layer`]) has one forward and one hand-written backward per flag a
//! descriptor can set (q/k norms per head or over the whole width, pre-norms present or not, the
//! post norms, `1 + w` and f32 norms, GeGLU, fused projections, soft caps); a new family is a new
//! file here plus, only where it needs one, a new flag pair there (torchtune's
//! `models/<family>/_component_builders.py` over its one `TransformerDecoder`).

mod gemma2;
mod gemma3;
mod gpt_oss;
mod llama;
mod mistral;
mod mixtral;
mod olmo2;
mod phi3;
mod qwen2;
mod qwen3;
mod qwen3_moe;

pub use gemma2::GEMMA2;
pub use gemma3::GEMMA3;
pub use gpt_oss::GPT_OSS;
pub use llama::LLAMA;
pub use mistral::MISTRAL;
pub use mixtral::MIXTRAL;
pub use olmo2::OLMO2;
pub use phi3::PHI3;
pub use qwen2::QWEN2;
pub use qwen3::QWEN3;
pub use qwen3_moe::QWEN3_MOE;

use crate::config::{HfConfig, ModelConfig, Variant};

/// Every family rtune builds, looked up by config.json's `architectures`.
pub static FAMILIES: [&Family; 11] = [
    &LLAMA, &MISTRAL, &QWEN2, &QWEN3, &GEMMA2, &GEMMA3, &PHI3, &OLMO2, &QWEN3_MOE, &MIXTRAL,
    &GPT_OSS,
];

/// The family whose `architectures` name is `name`.
pub fn by_name(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.hf_name == name)
}

/// The `architectures` names rtune builds, for errors.
pub fn supported() -> String {
    let names: Vec<&str> = FAMILIES.iter().map(|f| f.hf_name).collect();
    names.join(", ")
}

/// One model family.
#[derive(Debug)]
pub struct Family {
    /// config.json's `architectures` name (`Olmo2ForCausalLM`).
    pub hf_name: &'static str,
    /// The linear modules of a decoder layer by their checkpoint (and PEFT) names, in model order:
    /// what `all-linear` adapts.
    pub linear_modules: &'static [&'static str],
    /// The activation the MLP's gate is: SwiGLU (`hidden_act = silu`) or GeGLU (Gemma's
    /// `hidden_activation = gelu_pytorch_tanh`).
    pub act: Act,
    /// `head_dim` when config.json leaves it out (transformers' config class default), `None`:
    /// `hidden_size / num_attention_heads`.
    pub default_head_dim: Option<usize>,
    /// The layer's norms as the checkpoint names them.
    pub norms: LayerNorms,
    /// How config.json's RoPE keys are read.
    pub rope: RopeRules,
    /// llama.cpp's names for the family.
    pub gguf: Gguf,
    /// The family's part of [`HfConfig::into_config`]: given config.json and the model config
    /// as every family reads it (Llama's: no bias, no window, untied unless said, every
    /// [`Variant`] flag off), sets what the family changes, or refuses with the reason.
    pub map: fn(&HfConfig, &mut ModelConfig) -> Result<(), String>,
}

impl PartialEq for Family {
    fn eq(&self, other: &Self) -> bool {
        self.hf_name == other.hf_name
    }
}

/// The MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// `down(silu(gate)·up)`; config.json's `hidden_act`, if given, must be `silu`.
    SwiGlu,
    /// `down(gelu_tanh(gate)·up)`; `hidden_activation` (or Gemma 1's `hidden_act`) must be
    /// `gelu_pytorch_tanh` or `gelu_tanh`.
    GeGlu,
}

/// The names (under `model.layers.N.`, without `.weight`) of a layer's four possible norms: before
/// attention, after it, before the MLP, after it. Llama has the two pre-norms, Gemma all four,
/// OLMo 2 the two post-norms. The builder loads those a family has and the layer runs those it
/// was given ([`crate::layer::Layer`]).
#[derive(Debug, Clone, Copy)]
pub struct LayerNorms {
    pub pre_attn: Option<&'static str>,
    pub post_attn: Option<&'static str>,
    pub pre_mlp: Option<&'static str>,
    pub post_mlp: Option<&'static str>,
}

impl LayerNorms {
    /// Llama's: `input_layernorm` before attention, `post_attention_layernorm` before the MLP
    /// (transformers' name for it, though it comes before the MLP).
    pub const PRE: LayerNorms = LayerNorms {
        pre_attn: Some("input_layernorm"),
        post_attn: None,
        pre_mlp: Some("post_attention_layernorm"),
        post_mlp: None,
    };

    /// The first norm of a layer: the tensor whose presence in the last layer proves the
    /// checkpoint holds as many layers as config.json says.
    pub fn first(&self) -> &'static str {
        [self.pre_attn, self.post_attn, self.pre_mlp, self.post_mlp]
            .into_iter()
            .flatten()
            .next()
            .expect("a layer has a norm")
    }
}

/// A family's RoPE keys (`config::rope`).
#[derive(Debug, Clone, Copy)]
pub struct RopeRules {
    /// The global base when config.json gives none.
    pub default_theta: f64,
    /// The sliding layers have their own base (`rope_local_base_freq`, or
    /// `rope_parameters.sliding_attention`), this one when config.json gives none (Gemma 3).
    pub local_theta: Option<f64>,
    /// `partial_rotary_factor` below 1 is read (Phi-3); elsewhere it is refused.
    pub partial: bool,
    /// LongRoPE (and Phi3Config's `yarn`, which it reads as LongRoPE) is read, with the top-level
    /// `original_max_position_embeddings` defaulting to 4096 (Phi-3).
    pub longrope: bool,
}

impl RopeRules {
    /// Base 1e4, one base for every layer, the whole head rotated, no LongRoPE.
    pub const PLAIN: RopeRules = RopeRules {
        default_theta: 10_000.0,
        local_theta: None,
        partial: false,
        longrope: false,
    };
}

/// llama.cpp's view of a family: the base GGUF's `general.architecture` (which a LoRA GGUF must
/// match), whether convert_hf_to_gguf.py permutes q/k rows into GGML's interleaved RoPE pairs
/// (`LlamaModel` does; families llama.cpp rotates NeoX-style do not), and its tensor names for the
/// layer's linear modules (`blk.N.<name>.weight`).
#[derive(Debug, Clone, Copy)]
pub struct Gguf {
    pub arch: &'static str,
    pub permute_qk: bool,
    /// (checkpoint path under `model.layers.N.`, llama.cpp name).
    pub linears: &'static [(&'static str, &'static str)],
}

/// llama.cpp's names of the split q/k/v/o and gate/up/down (every family but Phi-3).
pub const GGUF_LINEARS: [(&str, &str); 7] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// Per layer, whether it is a sliding one, from transformers 5's `layer_types`
/// (`sliding_attention` / `full_attention`), checked to have one entry a layer.
pub(crate) fn marked(types: &[String], layers: usize) -> Result<Vec<bool>, String> {
    if types.len() != layers {
        return Err(format!(
            "layer_types has {} entries for {layers} layers",
            types.len()
        ));
    }
    Ok(types.iter().map(|t| t == "sliding_attention").collect())
}

/// Qwen2's and Qwen3's windows: only with `use_sliding_window`, on the layers `layer_types` marks
/// (transformers 5), else from `max_window_layers` (default 28) on.
pub(crate) fn qwen_windows(c: &HfConfig, m: &mut ModelConfig) -> Result<(), String> {
    let (Some(w), Some(true)) = (c.sliding_window, c.use_sliding_window) else {
        return Ok(());
    };
    let layers = m.num_layers;
    m.window_layers = match &c.layer_types {
        Some(types) => marked(types, layers)?,
        None => {
            let from = c.max_window_layers.unwrap_or(28);
            (0..layers).map(|i| i >= from).collect()
        }
    };
    m.sliding_window = Some(w);
    Ok(())
}

/// Mistral's and Phi-3's window: every layer when `sliding_window` is set.
pub(crate) fn every_layer_window(c: &HfConfig, m: &mut ModelConfig) {
    if let Some(w) = c.sliding_window {
        m.sliding_window = Some(w);
        m.window_layers = vec![true; m.num_layers];
    }
}

/// The flags Gemma 2 and Gemma 3 share: `1 + w` norms in f32, four a layer, GeGLU, embeddings
/// scaled by √hidden, scores by `1/√query_pre_attn_scalar`, final logits soft-capped, tied by
/// default; an embedding model (`use_bidirectional_attention`) refused. The window: transformers
/// 5's `layer_types`, else `sliding` per layer index.
pub(crate) fn gemma(
    c: &HfConfig,
    m: &mut ModelConfig,
    sliding: impl Fn(usize) -> bool,
) -> Result<(), String> {
    if c.use_bidirectional_attention == Some(true) {
        return Err(
            "use_bidirectional_attention = true: an embedding model, not a causal LM".into(),
        );
    }
    let positive = |key: &str, v: Option<f64>| -> Result<Option<f64>, String> {
        v.map(|v| crate::config::positive(key, v)).transpose()
    };
    let scalar = positive("query_pre_attn_scalar", c.query_pre_attn_scalar)?;
    let final_cap = positive("final_logit_softcapping", c.final_logit_softcapping)?;
    m.tie_word_embeddings = c.tie_word_embeddings.unwrap_or(true);
    if let Some(w) = c.sliding_window {
        m.sliding_window = Some(w);
        m.window_layers = match &c.layer_types {
            Some(types) => marked(types, m.num_layers)?,
            None => (0..m.num_layers).map(sliding).collect(),
        };
    }
    m.variant = Variant {
        plus_one_norms: true,
        f32_norms: true,
        geglu: true,
        embed_scale: Some((c.hidden_size as f64).sqrt()),
        attn_scale: Some(1.0 / scalar.unwrap_or(256.0).sqrt()),
        final_softcap: final_cap,
        ..std::mem::take(&mut m.variant)
    };
    Ok(())
}

/// Gemma's four norms: `input_layernorm`, `post_attention_layernorm` (after attention),
/// `pre_feedforward_layernorm`, `post_feedforward_layernorm`.
pub(crate) const SANDWICH: LayerNorms = LayerNorms {
    pre_attn: Some("input_layernorm"),
    post_attn: Some("post_attention_layernorm"),
    pre_mlp: Some("pre_feedforward_layernorm"),
    post_mlp: Some("post_feedforward_layernorm"),
};
