//! What the model crate's integration tests share: a tiny random model, the fixtures' configs.
//! Each test binary uses some of it.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use rtune_model::config::{ModelConfig, RopeScaling};
use rtune_model::weights::TensorSource;
use rtune_model::ModelError;

/// N(0, 0.02²) weights, norm weights 1 (transformers' Llama init).
pub struct RandomWeights {
    pub dtype: DType,
}

impl TensorSource for RandomWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let t = if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
            Tensor::ones(shape, self.dtype, &Device::Cpu)
        } else {
            Tensor::randn(0f32, 0.02, shape, &Device::Cpu).and_then(|t| t.to_dtype(self.dtype))
        };
        t.map_err(|e| ModelError::candle(format!("random {name}"), e))
    }
}

/// GQA (4 query heads on 2 kv heads), q/k/v biases (Qwen2-style), untied lm_head.
pub fn config() -> ModelConfig {
    ModelConfig {
        arch: &rtune_model::family::LLAMA,
        hidden_size: 64,
        intermediate_size: 96,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 80,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        tie_word_embeddings: false,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        sliding_window: None,
        window_layers: vec![false; 2],
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        pad_token_id: None,
        variant: Default::default(),
        moe: None,
    }
}

/// `tests/fixtures/<name>` and its `config.json` read as rtune's config.
pub fn fixture_config(name: &str) -> (std::path::PathBuf, ModelConfig) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    let path = dir.join("config.json");
    let cfg = rtune_model::HfConfig::from_file(&path)
        .unwrap()
        .into_config(&path)
        .unwrap();
    (dir, cfg)
}
