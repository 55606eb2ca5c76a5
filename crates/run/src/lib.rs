//! The run directory, before and around training (issue 43: the run directory one crate):
//! - [`rundir`]: which directories a run may write, and which of their files are rtune's;
//! - [`disk`]: what a run will write, and whether its filesystem has room (checked at start);
//! - [`checkpoint`]: `checkpoint-<step>/`, atomic and verified: the adapter, AdamW's moments,
//!   the trainer's counters (a type of the trainer's, saved as they are) and a manifest;
//! - [`record`]: `run.json`, what was run, on what, from which inputs, and how each attempt
//!   ended (the git commit and Cargo.lock hash from `build.rs`).
//!
//! - [`files`]: [`files::RunFiles`], the one writer of a run directory (lock, fresh or resumed,
//!   run.json, config.toml, metrics.jsonl, TensorBoard, samples, checkpoints, the adapter, the
//!   plot, summary.json), with `[output] remote` and `[output] mlflow` beside it.
//!
//! [`RunError`] is the one error type; `rtune-train` turns it into its own variant of the same
//! name and message.

pub mod checkpoint;
pub mod disk;
pub mod files;
pub mod record;
pub mod rundir;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The output directory cannot be used as asked (before anything is written).
    #[error("{path}: {message}")]
    OutputDir { path: PathBuf, message: String },
    /// Writing the adapter of a checkpoint failed.
    #[error(transparent)]
    Adapter(Box<rtune_lora::LoraError>),
    /// `[output] remote`: the store refused or failed (opened, probed, claimed, fetched).
    #[error("[output] remote: {0}")]
    Remote(Box<rtune_remote::RemoteError>),
    /// The final uploads did not reach the store within `[output] remote_timeout`.
    #[error("[output] remote: {message}; the local run in {} is complete", dir.display())]
    RemoteUpload { dir: PathBuf, message: String },
    /// Writing (or hashing) a file of the run failed.
    #[error("{path}: {message}")]
    Output { path: PathBuf, message: String },
}

impl From<rtune_fsio::IoError> for RunError {
    fn from(e: rtune_fsio::IoError) -> Self {
        RunError::Output {
            path: e.path,
            message: format!("{}: {}", e.op, e.source),
        }
    }
}
