//! What [`train`](super::train) is told by its caller ([`RunOptions`]), what it reports while it
//! runs ([`Event`]) and how it ended ([`Outcome`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use super::metrics::{StepMetrics, Summary};
use crate::dataset::FileReport;
use crate::evaluate::EvalMetrics;

/// How a call to [`train`](super::train) ended.
pub enum Outcome {
    Completed(Summary),
    /// Stopped by the caller's flag (SIGINT/SIGTERM) after a step; the checkpoint to resume from.
    Stopped {
        step: usize,
        checkpoint: PathBuf,
    },
}

/// What [`train`](super::train) reports while it runs.
pub enum Event<'a> {
    /// Everything checked; training starts (at `start_step` when resumed).
    Start {
        examples: usize,
        valid_examples: usize,
        /// Rows read, truncated, dropped and skipped, over all files.
        counts: rtune_data::cache::RowCounts,
        /// Per-file: path, examples, tokens, cache reused, tokenisation tokens/s.
        files: &'a [FileReport],
        warnings: Vec<String>,
        lora_params: usize,
        model_params: usize,
        /// Bytes of the frozen weights as held (4-bit layers at their packed size).
        model_bytes: usize,
        start_step: usize,
        /// Whether this attempt checkpoints, and why (`auto` decided from the estimate).
        checkpointing: &'a rtune_estimate::CheckpointingChoice,
    },
    Step(&'a StepMetrics),
    /// Validation loss and perplexity (every `eval_every` steps and at the end).
    Eval(&'a EvalMetrics),
    Checkpoint {
        step: usize,
        path: &'a Path,
    },
    Warning(String),
}

/// Caller's choices that are not in the config file.
#[derive(Default)]
pub struct RunOptions<'a> {
    /// Continue from the newest complete checkpoint (also `[output] resume = "auto"`).
    pub resume: bool,
    /// Resume even when settings changed since the checkpoint.
    pub force: bool,
    /// Set (e.g. by a signal handler) to stop after the current step with a checkpoint.
    pub stop: Option<&'a AtomicBool>,
    /// This process's rank in a data-parallel run (`None`: a single process).
    pub world: Option<&'a rtune_dist::World>,
}
