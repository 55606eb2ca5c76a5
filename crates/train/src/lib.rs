//! Training and inference on top of the model:
//! - [`optim`]: AdamW, learning-rate schedules, gradient clipping (torch semantics);
//! - [`trainer`]: `rtune train` — config in, run directory with a PEFT adapter out;
//! - [`dataset`]: the run's data through the tokenized cache, weighted, with a validation split;
//! - [`estimate`]: `rtune estimate` — peak memory predicted from config.json and the settings;
//! - [`check`]: `rtune check` — the pre-flight checks before a long run;
//! - [`checkpoint`]: atomic, verified checkpoints and exact resume; [`record`]: run.json;
//! - [`scan`]: `rtune data scan` — likely secrets and personal data in training files;
//! - [`evaluate`]: validation loss and sample completions during a run;
//! - [`inspect`]: `rtune data inspect` — formatted samples with their loss masks;
//! - [`generate`]: `rtune generate` — greedy or nucleus sampling with an optional adapter;
//! - [`bench`]: `rtune bench` — training throughput and peak memory on a random model;
//! - [`memory`]: peak memory (host RSS; device memory on CUDA);
//! - [`selftest`]: `rtune selftest` — the CUDA path checked against the CPU.

pub mod bench;
pub mod check;
pub mod checkpoint;
pub mod dataset;
pub mod disk;
pub mod estimate;
pub mod evaluate;
pub mod generate;
pub mod inspect;
pub mod memory;
pub mod optim;
pub mod record;
pub mod scan;
pub mod selftest;
#[cfg(feature = "cuda")]
mod selftest_cuda;
mod setup;
pub mod trainer;

pub use setup::resolve_model;
pub use trainer::{train, Event, Outcome, RunOptions, StepMetrics, Summary};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    // Boxed: the library errors carry paths and shapes, and a large Err slows every Result.
    #[error(transparent)]
    Config(Box<rtune_config::ConfigError>),
    #[error(transparent)]
    Model(Box<rtune_model::ModelError>),
    #[error(transparent)]
    Lora(Box<rtune_lora::LoraError>),
    #[error(transparent)]
    Data(Box<rtune_data::DataError>),
    /// `[model] path` could not be resolved to a model directory (hub, GGUF conversion).
    #[error(transparent)]
    Source(Box<rtune_hub::HubError>),
    /// Writing the run's files failed while it ran.
    #[error("{path}: {message}")]
    Output { path: PathBuf, message: String },
    /// The output directory cannot be used as asked (before anything is written).
    #[error("{path}: {message}")]
    OutputDir { path: PathBuf, message: String },
    #[error("{0}")]
    Device(String),
    #[error("{0}")]
    Resume(String),
    #[error(
        "step {step}: loss {loss} / gradient norm {grad_norm} not finite for {in_a_row} steps in a row; \
         stopped without writing an adapter (the last checkpoint is intact; try a lower [train] lr)"
    )]
    NonFinite {
        step: usize,
        loss: f64,
        grad_norm: f64,
        in_a_row: usize,
    },
    #[error("{op}: {source}")]
    Candle {
        op: &'static str,
        source: candle_core::Error,
    },
}

macro_rules! boxed_from {
    ($($variant:ident: $ty:ty),*) => {$(
        impl From<$ty> for TrainError {
            fn from(e: $ty) -> Self {
                TrainError::$variant(Box::new(e))
            }
        }
    )*};
}
boxed_from!(Config: rtune_config::ConfigError, Model: rtune_model::ModelError, Lora: rtune_lora::LoraError, Data: rtune_data::DataError, Source: rtune_hub::HubError);

impl From<rtune_fsio::IoError> for TrainError {
    fn from(e: rtune_fsio::IoError) -> Self {
        TrainError::Output {
            path: e.path,
            message: format!("{}: {}", e.op, e.source),
        }
    }
}

impl TrainError {
    pub(crate) fn candle(op: &'static str) -> impl Fn(candle_core::Error) -> TrainError {
        move |source| TrainError::Candle { op, source }
    }
}
