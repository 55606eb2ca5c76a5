//! The small random models of the training-step parity checks, one a family: the Llama the
//! checks began with, and one model for each family that adds ops to the Llama layer. Each new
//! family's config is written as transformers writes its `config.json` and read through
//! [`HfConfig::into_config`], so the selftest builds what a checkpoint of that family builds.
//!
//! Sizes: hidden 128, 4 heads over 2 KV heads, 2 layers, vocabulary 512: small enough that a
//! family's steps cost tens of milliseconds on the CPU (f16's, slow there, a few hundred). Every feature is set so that it
//! acts on the selftest's rows of 96 tokens (`step` in `selftest.rs`):
//! - windows of 32 positions, shorter than the rows, on one layer of two (Qwen3, Gemma) or both
//!   (Phi-3);
//! - Gemma 2's soft-caps (attention 0.1, final 0.5) near the size of the random model's scores
//!   and logits, so `tanh` bends them (a unit test checks that removing either, or the window,
//!   changes the step by more than 1%);
//! - `head_dim` 48 for Qwen3 (not hidden / heads = 32), `query_pre_attn_scalar` unlike `head_dim`;
//! - Gemma 3's global layer on its own base (1e6, linear ×4) beside the local one (1e4);
//! - Phi-4-mini's rotary part (0.75 of a head: 24 of 32) and LongRoPE with a pre-training length
//!   of 64 < 96, so the long factors and the attention factor are in use.
//!
//! The seeded weights (`crate::weights`) draw every norm weight jittered: 1 ± 0.1, or for Gemma's
//! `1 + w` norms w = ±0.1 (as its checkpoints store them), so a norm that multiplied by `w` where
//! it should by `1 + w`, or skipped a q/k norm, would change the step.

use std::path::Path;

use rtune_model::{HfConfig, ModelConfig, ModelError};

use crate::DiagError;

/// A model family of the parity checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// GQA, plain RMSNorm, SwiGLU, full RoPE (the checks' first model; also Mistral and Qwen2's
    /// layer without their windows and biases).
    Llama,
    /// q/k RMSNorm per head before RoPE, `head_dim` independent of hidden / heads, tied embeddings.
    Qwen3,
    /// (1 + w) norms in f32, four a layer, GeGLU (tanh), √hidden embedding scale,
    /// `query_pre_attn_scalar`, attention and final soft-caps, a window on alternate layers.
    Gemma2,
    /// Gemma 2's layer with q/k norms, no soft-caps, local and global layers with two RoPE bases.
    Gemma3,
    /// Fused `qkv_proj` and `gate_up_proj`, LoRA on the fused modules, a window on every layer.
    Phi3,
    /// Phi-3's layer with a partial rotary part and LongRoPE, tied embeddings (Phi-4-mini).
    Phi4,
}

impl Family {
    /// Every family, the Llama first.
    pub const ALL: [Family; 6] = [
        Family::Llama,
        Family::Qwen3,
        Family::Gemma2,
        Family::Gemma3,
        Family::Phi3,
        Family::Phi4,
    ];

    /// The family's name in check names (`train step gemma2 bf16: ...`).
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen3 => "qwen3",
            Family::Gemma2 => "gemma2",
            Family::Gemma3 => "gemma3",
            Family::Phi3 => "phi3",
            Family::Phi4 => "phi4",
        }
    }

    /// The family's small model.
    pub fn config(self) -> Result<ModelConfig, DiagError> {
        let json = match self {
            Family::Llama => return Ok(llama()),
            Family::Qwen3 => QWEN3,
            Family::Gemma2 => GEMMA2,
            Family::Gemma3 => GEMMA3,
            Family::Phi3 => PHI3,
            Family::Phi4 => PHI4,
        };
        let path = format!("selftest:{}/config.json", self.name());
        let path = Path::new(&path);
        let hf: HfConfig = serde_json::from_str(json).map_err(|e| ModelError::File {
            path: path.to_path_buf(),
            message: format!("not a model config: {e}"),
        })?;
        Ok(hf.into_config(path)?)
    }
}

/// The small Llama: GQA, two layers, odd-ish sizes (larger than the other families': the checks'
/// first model, kept as it was so its figures compare with earlier runs).
fn llama() -> ModelConfig {
    let o = crate::bench::BenchOptions {
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        intermediate: 704,
        vocab: 1000,
        ..Default::default()
    };
    crate::bench::model_config(&o)
}

const QWEN3: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"],
  "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 48,
  "vocab_size": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
  "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
  "use_sliding_window": true, "sliding_window": 32,
  "layer_types": ["full_attention", "sliding_attention"],
  "tie_word_embeddings": true, "attention_bias": false
}"#;

const GEMMA2: &str = r#"{
  "architectures": ["Gemma2ForCausalLM"],
  "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "vocab_size": 512, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
  "query_pre_attn_scalar": 48,
  "attn_logit_softcapping": 0.1, "final_logit_softcapping": 0.5,
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
  "tie_word_embeddings": true
}"#;

const GEMMA3: &str = r#"{
  "architectures": ["Gemma3ForCausalLM"],
  "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "vocab_size": 512, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
  "query_pre_attn_scalar": 40,
  "attn_logit_softcapping": null, "final_logit_softcapping": null,
  "rope_parameters": {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}
  },
  "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
  "tie_word_embeddings": true, "use_bidirectional_attention": false
}"#;

const PHI3: &str = r#"{
  "architectures": ["Phi3ForCausalLM"],
  "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2,
  "vocab_size": 512, "rms_norm_eps": 1e-5, "hidden_act": "silu",
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "original_max_position_embeddings": 4096, "max_position_embeddings": 4096,
  "sliding_window": 32, "tie_word_embeddings": false,
  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0
}"#;

const PHI4: &str = r#"{
  "architectures": ["Phi3ForCausalLM"],
  "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2,
  "vocab_size": 512, "rms_norm_eps": 1e-5, "hidden_act": "silu",
  "max_position_embeddings": 256, "original_max_position_embeddings": 64,
  "rope_parameters": {
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
    "short_factor": [1.0, 1.0, 1.1, 1.1, 1.2, 1.3, 1.4, 1.6, 1.8, 2.0, 2.2, 2.5],
    "long_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0]
  },
  "sliding_window": null, "tie_word_embeddings": true,
  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0
}"#;
