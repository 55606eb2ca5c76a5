//! The Llama-family causal LM, written for LoRA training.
//!
//! - [`config`]: `config.json` → [`ModelConfig`]: what every family reads alike, then the
//!   family's own part from its descriptor.
//! - [`family`]: one descriptor a family (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3,
//!   OLMo 2, Qwen3-MoE): config mapping, checkpoint norm names, RoPE rules, llama.cpp names, layer flags.
//! - [`weights`]: memory-mapped safetensors, one file or sharded.
//! - [`Model`]: the network. [`Model::forward`] is the inference path; [`Model::forward_backward`]
//!   trains: a hand-written backward ([`linear`], [`layer`], and each op's in `rtune_ops`) that
//!   forms gradients for LoRA weights only — never for a frozen weight — and can recompute each
//!   decoder layer from its input.
//! - [`moe`]: a sparse layer's router and experts (the grouped op is `rtune_experts::moe`), with
//!   PEFT's `target_parameters` LoRA on the expert stacks and the load-balancing loss's plumbing.
//! - [`rope`]: the rotary tables from the config (the rotation itself is `rtune_ops::rope`).
//! - [`shard`]: the frozen base sharded across ranks (`[distributed] shard_base`), each layer
//!   gathered just before it computes (`gathered`: a layer's gathers planned, filled, finished;
//!   `feed`: a pass's layers in order, kept ones as they are, the next one's gather optionally in
//!   flight on another thread).
//! - [`tokens`]: trainable token rows (PEFT's `trainable_token_indices`) in the embedding and the
//!   tied lm_head.
//!
//! Reference: transformers' `modeling_llama.py` (eager attention) and PEFT's `lora.Linear`; parity
//! with both is tested against golden files in `tests/parity`.

pub mod config;

pub mod device_gather;
mod feed;
mod gathered;

pub mod group;
mod kept;
pub mod layer;
pub mod linear;
mod model;
pub mod moe;
pub mod rope;
pub mod shard;
#[cfg(test)]
mod test_util;
pub mod tokens;
pub mod weights;

pub use config::family::{self, Family};
pub use config::{Arch, HfConfig, ModelConfig, RopeScaling, Variant};
pub use device_gather::{DeviceGather, ThroughHost};
pub use linear::{dora, Frozen, Grads, LoraCtx};
pub use model::decode::{Completion, KvCache};
pub use model::{AuxShare, Forward, HeadLoss, Inputs, Model, PerTokenLoss, Quantize, TemperedLoss};
pub use shard::Gather;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: {what} is not supported; supported architectures: {supported}")]
    Unsupported {
        path: PathBuf,
        what: String,
        supported: String,
    },
    #[error("{path}: checkpoint has no tensor `{name}`")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}` has shape {got:?}, config.json implies {want:?}")]
    TensorShape {
        path: PathBuf,
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("{path}: {source}")]
    Quant {
        path: PathBuf,
        source: rtune_quant::QuantError,
    },
    #[error("model {op}: {source}")]
    Candle {
        op: String,
        source: candle_core::Error,
    },
}

impl ModelError {
    pub fn candle(op: impl Into<String>, source: candle_core::Error) -> Self {
        ModelError::Candle {
            op: op.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
