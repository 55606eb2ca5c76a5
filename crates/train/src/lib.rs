//! Training on top of the model (inference is `rtune-infer`'s):
//! - [`trainer`]: `rtune train` — config in, run directory with a PEFT adapter out;
//! - [`optim`]: AdamW, learning-rate schedules, gradient clipping (torch semantics);
//! - [`dataset`]: the run's data through the tokenized cache, weighted, with a validation split;
//! - exact resume from a checkpoint (the checkpoint's files and run.json are `rtune_run`'s);
//! - [`objective`]: the objectives as recipes the loop is generic over (SFT, the preference
//!   objectives), one folder each;
//! - [`evaluate`]: validation metrics and sample completions during a run;
//! - [`memory`]: measured memory (host RSS and RAM from /proc; device memory on CUDA);
//! - [`variants`]: `[lora] init` at setup (PiSSA / OLoRA: the residual base, the adapter saved
//!   against the original one); LoRA+'s groups are in [`optim`].
//!
//! Below it, `rtune-estimate` predicts a run's memory; above it, `rtune-diag` holds the
//! diagnostics that drive training (`rtune check`, `bench`, `selftest`). [`TrainError`] is the
//! one error type; [`TrainError::is_input_error`] decides the CLI's exit status.

mod compute;
pub mod dataset;
pub mod evaluate;
pub mod memory;
pub mod objective;
pub mod optim;
pub mod sample;
mod setup;
pub mod tokens;
pub mod trainer;
pub mod variants;

pub use compute::device;
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
    /// `cuda:N` asked of a build without the `cuda` feature.
    #[error(
        "[train] device = \"cuda:{ordinal}\": this rtune was built without CUDA support; use \"cpu\", \
         or build with `cargo build --release --features cuda` (see benches/gpu/README.md)"
    )]
    NoCuda { ordinal: usize },
    /// GPU `ordinal` would not open (no such device, driver missing).
    #[error("[train] device = \"cuda:{ordinal}\": cannot open it: {source}")]
    DeviceOpen {
        ordinal: usize,
        source: candle_core::Error,
    },
    /// A call into the CUDA kernels crate failed (device memory queries).
    #[cfg(feature = "cuda")]
    #[error("cuda:{ordinal}: {source}")]
    Kernel {
        ordinal: usize,
        source: rtune_backend::KernelError,
    },
    /// A driver error cudarc recorded where it could not return it (in a `Drop`: freeing memory,
    /// destroying a stream or event), read at a step boundary or the end of the run.
    #[cfg(feature = "cuda")]
    #[error(
        "cuda:{ordinal}: after step {step}, the driver had reported an error while freeing or \
         synchronising (recorded by cudarc in a drop, where it could not be returned): {source}"
    )]
    DeviceDeferred {
        ordinal: usize,
        /// The last step that completed (the error happened during the next one or at the end).
        step: usize,
        source: cudarc::driver::DriverError,
    },
    /// An NCCL call (or the CUDA call around it) of a data-parallel CUDA run failed.
    #[error("NCCL {op} on cuda:{ordinal}: {message}")]
    Nccl {
        op: &'static str,
        ordinal: usize,
        message: String,
    },
    /// The checkpoint's settings differ from the config's: resuming would not reproduce the run.
    #[error(
        "cannot resume from {}: {}; the resumed run would not reproduce the original (--force resumes anyway)",
        checkpoint.display(),
        changed.join("; ")
    )]
    ResumeChanged {
        checkpoint: PathBuf,
        /// One entry per differing setting, `key: checkpoint → config`.
        changed: Vec<String>,
    },
    /// The output directory holds checkpoints and none of them verifies.
    #[error(
        "{}: none of its {found} checkpoint(s) verifies (see above); set [output] overwrite = true \
         to start over",
        dir.display()
    )]
    NoVerifiedCheckpoint { dir: PathBuf, found: usize },
    /// The ranks of a data-parallel run do not run the same thing (config, model or data).
    #[error(transparent)]
    Ranks(Box<rtune_dist::Disagreement>),
    /// The optimizer state in a checkpoint does not fit the adapter it is resumed with.
    #[error("optimizer state does not match the adapter's shapes")]
    OptimizerState,
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
    /// A stop request (SIGINT/SIGTERM) before the first step: nothing to checkpoint.
    #[error(
        "interrupted during {during}, before step 1: nothing was trained; the run directory is \
         left as it was found"
    )]
    Interrupted { during: &'static str },
    /// Every update of the run was skipped (see `RunState::check_trained`).
    #[error(
        "all {steps} steps' updates were skipped (loss or gradient not finite, or f16 overflow): \
         the adapter is untrained, so none was written; see the warnings above (try a lower \
         [train] lr, or check the model's config.json)"
    )]
    NothingTrained { steps: usize },
    #[error("{op}: {source}")]
    Candle {
        op: &'static str,
        source: candle_core::Error,
    },
    /// `[output] remote` cannot be used: the probe at start (write, read back, delete) failed.
    /// Sample completions during a run (`rtune-infer`).
    #[error(transparent)]
    Infer(Box<rtune_infer::InferError>),
    /// A resume whose `[train] steps` is below the step the checkpoint is already at.
    #[error(
        "{}: the checkpoint is at step {step}, past [train] steps = {steps}; a run cannot end \
         before its adapter's step: set train.steps above {step} to train on, or export this \
         checkpoint as it is (rtune export --checkpoint {step})",
        checkpoint.display()
    )]
    ResumePastSteps {
        checkpoint: PathBuf,
        step: usize,
        steps: usize,
    },
    /// The run's estimated peak memory is over what the machine has: found at start.
    #[error(
        "the run is estimated to need {:.1} MB at its peak, over the {:.1} MB of {what}; lower \
         [train] micro_batch_size or [data] max_seq_len (`rtune estimate` shows the breakdown and \
         what fits)",
        *need as f64 / 1e6,
        *have as f64 / 1e6
    )]
    TooLittleMemory { need: u64, have: u64, what: String },
    /// An objective that cannot run on several ranks yet, launched on several.
    #[error(
        "[train] objective = \"{objective}\" does not run data-parallel yet ({why}); run it in one \
         process (without mpirun or srun)"
    )]
    NotDataParallel {
        objective: &'static str,
        why: &'static str,
    },
    #[error("[output] remote: {0}")]
    Remote(Box<rtune_remote::RemoteError>),
    /// A GRPO reward function failed (a command's death, hang, wrong count or garbage).
    #[error(transparent)]
    Reward(Box<rtune_reward::RewardError>),
    /// The final uploads did not reach the store within `[output] remote_timeout`.
    #[error("[output] remote: {message}; the local run in {} is complete", dir.display())]
    RemoteUpload { dir: PathBuf, message: String },
}

impl TrainError {
    /// The input is wrong (exit status 2: config, model, data, adapter, output directory, device,
    /// checkpoint) rather than the run failing (1: a computation, a write, the network).
    pub fn is_input_error(&self) -> bool {
        use rtune_lora::LoraError;
        use rtune_model::ModelError;
        match self {
            TrainError::Config(_) | TrainError::Data(_) => true,
            TrainError::Model(m) => !matches!(**m, ModelError::Candle { .. }),
            TrainError::Lora(l) => !matches!(**l, LoraError::Candle { .. }),
            TrainError::Source(h) => h.is_input_error(),
            TrainError::Infer(i) => i.is_input_error(),
            TrainError::OutputDir { .. }
            | TrainError::NoCuda { .. }
            | TrainError::DeviceOpen { .. }
            | TrainError::ResumeChanged { .. }
            | TrainError::NoVerifiedCheckpoint { .. }
            | TrainError::Ranks(_)
            | TrainError::OptimizerState
            | TrainError::TooLittleMemory { .. }
            | TrainError::NotDataParallel { .. }
            | TrainError::ResumePastSteps { .. }
            | TrainError::Remote(_) => true,
            #[cfg(feature = "cuda")]
            TrainError::Kernel { .. } | TrainError::DeviceDeferred { .. } => false,
            TrainError::Output { .. }
            | TrainError::Nccl { .. }
            | TrainError::NonFinite { .. }
            | TrainError::NothingTrained { .. }
            | TrainError::Interrupted { .. }
            | TrainError::Candle { .. }
            | TrainError::RemoteUpload { .. } => false,
            TrainError::Reward(r) => matches!(**r, rtune_reward::RewardError::Spec { .. }),
        }
    }

    pub(crate) fn candle(op: &'static str) -> impl Fn(candle_core::Error) -> TrainError {
        move |source| TrainError::Candle { op, source }
    }
}

impl From<rtune_reward::RewardError> for TrainError {
    fn from(e: rtune_reward::RewardError) -> Self {
        TrainError::Reward(Box::new(e))
    }
}

impl From<rtune_config::ConfigError> for TrainError {
    fn from(e: rtune_config::ConfigError) -> Self {
        TrainError::Config(Box::new(e))
    }
}

/// Each data-parallel error as the variant it always was (same message, same exit status).
impl From<rtune_dist::DistError> for TrainError {
    fn from(e: rtune_dist::DistError) -> Self {
        use rtune_dist::DistError;
        match e {
            DistError::Ranks(d) => TrainError::Ranks(d),
            DistError::Nccl {
                op,
                ordinal,
                message,
            } => TrainError::Nccl {
                op,
                ordinal,
                message,
            },
            DistError::Candle { op, source } => TrainError::Candle { op, source },
        }
    }
}

/// The run directory's errors as the variants they always were (same message, same exit status).
impl From<rtune_run::RunError> for TrainError {
    fn from(e: rtune_run::RunError) -> Self {
        match e {
            rtune_run::RunError::OutputDir { path, message } => {
                TrainError::OutputDir { path, message }
            }
            rtune_run::RunError::Output { path, message } => TrainError::Output { path, message },
            rtune_run::RunError::Adapter(e) => TrainError::Lora(e),
            rtune_run::RunError::Remote(e) => TrainError::Remote(e),
            rtune_run::RunError::RemoteUpload { dir, message } => {
                TrainError::RemoteUpload { dir, message }
            }
        }
    }
}

impl From<rtune_infer::InferError> for TrainError {
    fn from(e: rtune_infer::InferError) -> Self {
        TrainError::Infer(Box::new(e))
    }
}

impl From<rtune_model::ModelError> for TrainError {
    fn from(e: rtune_model::ModelError) -> Self {
        TrainError::Model(Box::new(e))
    }
}

impl From<rtune_lora::LoraError> for TrainError {
    fn from(e: rtune_lora::LoraError) -> Self {
        TrainError::Lora(Box::new(e))
    }
}

impl From<Box<rtune_lora::LoraError>> for TrainError {
    fn from(e: Box<rtune_lora::LoraError>) -> Self {
        TrainError::Lora(e)
    }
}

impl From<rtune_data::DataError> for TrainError {
    fn from(e: rtune_data::DataError) -> Self {
        TrainError::Data(Box::new(e))
    }
}

impl From<rtune_hub::HubError> for TrainError {
    fn from(e: rtune_hub::HubError) -> Self {
        TrainError::Source(Box::new(e))
    }
}

impl From<rtune_fsio::IoError> for TrainError {
    fn from(e: rtune_fsio::IoError) -> Self {
        TrainError::Output {
            path: e.path,
            message: format!("{}: {}", e.op, e.source),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TrainError;
    use std::path::PathBuf;

    /// The exit status follows the error: the user's input (2) or the run (1), however nested.
    #[test]
    fn input_errors_are_told_from_run_failures() {
        let model_input = rtune_model::ModelError::MissingTensor {
            path: PathBuf::from("m"),
            name: "lm_head.weight".into(),
        };
        let model_run =
            rtune_model::ModelError::candle("matmul", candle_core::Error::Msg("x".into()));
        let changed = TrainError::ResumeChanged {
            checkpoint: PathBuf::from("out/checkpoint-2"),
            changed: vec!["lr: 0.001 → 0.002".into(), "seed: 1 → 2".into()],
        };
        assert!(changed.to_string().starts_with(
            "cannot resume from out/checkpoint-2: lr: 0.001 → 0.002; seed: 1 → 2; the resumed run"
        ));
        let none = TrainError::NoVerifiedCheckpoint {
            dir: PathBuf::from("out"),
            found: 3,
        };
        assert_eq!(
            none.to_string(),
            "out: none of its 3 checkpoint(s) verifies (see above); set [output] overwrite = true to start over"
        );
        for (e, input) in [
            (TrainError::from(model_input), true),
            (TrainError::from(model_run), false),
            (TrainError::NoCuda { ordinal: 0 }, true),
            (changed, true),
            (
                TrainError::NoVerifiedCheckpoint {
                    dir: PathBuf::from("out"),
                    found: 3,
                },
                true,
            ),
            (
                TrainError::Output {
                    path: PathBuf::from("out/metrics.jsonl"),
                    message: "No space left on device".into(),
                },
                false,
            ),
            (
                TrainError::NonFinite {
                    step: 3,
                    loss: f64::NAN,
                    grad_norm: f64::NAN,
                    in_a_row: 3,
                },
                false,
            ),
        ] {
            assert_eq!(e.is_input_error(), input, "{e}");
        }
    }
}
