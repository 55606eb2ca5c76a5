//! Inference with a model and an optional adapter, which training calls for its sample
//! completions and `rtune generate` and `rtune check` call directly:
//! - [`generate`]: greedy or temperature + top-p sampling with a key/value cache
//!   ([`generate::complete`] on a loaded model; [`generate::generate`] and [`generate::chat`]
//!   load one from a directory);
//! - [`warp`]: the next-token distribution shaped as transformers' `generate` shapes it when
//!   sampling (repetition penalty, temperature, top-k, top-p, min-p), for GRPO's rollouts.
//!
//! [`InferError`] is the one error type; [`InferError::is_input_error`] decides the CLI's exit
//! status.

pub mod generate;
pub mod warp;

use rtune_lora::LoraError;
use rtune_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum InferError {
    // Boxed: the library errors carry paths and shapes, and a large Err slows every Result.
    #[error(transparent)]
    Model(Box<ModelError>),
    #[error(transparent)]
    Lora(Box<LoraError>),
    #[error(transparent)]
    Data(Box<rtune_data::DataError>),
    /// A tensor operation failed (`op` names it).
    #[error("{op}: {source}")]
    Candle {
        op: &'static str,
        source: candle_core::Error,
    },
    /// `rtune generate`: the prompt (or chat conversation) plus the new tokens asked for do not
    /// fit the model's context; found before any forward pass.
    #[error(
        "{what} is {prompt_tokens} tokens + {max_new_tokens} new (--max-new-tokens) = {} > the \
         model's context of {limit} tokens (max_position_embeddings); shorten the prompt or lower \
         --max-new-tokens",
        prompt_tokens.saturating_add(*max_new_tokens)
    )]
    ContextTooLong {
        what: &'static str,
        prompt_tokens: usize,
        max_new_tokens: usize,
        limit: usize,
    },
}

impl InferError {
    /// Bad input (exit 2) rather than a failure of the computation (exit 1).
    pub fn is_input_error(&self) -> bool {
        match self {
            InferError::Data(_) | InferError::ContextTooLong { .. } => true,
            InferError::Model(m) => !matches!(**m, ModelError::Candle { .. }),
            InferError::Lora(l) => !matches!(**l, LoraError::Candle { .. }),
            InferError::Candle { .. } => false,
        }
    }

    pub(crate) fn candle(op: &'static str) -> impl Fn(candle_core::Error) -> InferError {
        move |source| InferError::Candle { op, source }
    }
}

impl From<ModelError> for InferError {
    fn from(e: ModelError) -> Self {
        InferError::Model(Box::new(e))
    }
}

impl From<LoraError> for InferError {
    fn from(e: LoraError) -> Self {
        InferError::Lora(Box::new(e))
    }
}

impl From<rtune_data::DataError> for InferError {
    fn from(e: rtune_data::DataError) -> Self {
        InferError::Data(Box::new(e))
    }
}
