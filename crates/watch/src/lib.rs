//! Watching a run from outside: TensorBoard event files and a loss-curve image.
//!
//! - [`TbWriter`]: `dir/events.out.tfevents.<time>.<host>`, the TFRecord file TensorBoard reads, with
//!   one `Event{wall_time, step, summary{value{tag, simple_value}}}` per scalar. [`read_events`]
//!   reads such a file back, checking both CRCs of every record (the tests use it; TensorBoard has
//!   its own reader).
//! - [`write_loss_plot`]: `loss.svg`, train (and validation) loss against step, drawn with plotters'
//!   SVG backend (no fonts or system libraries needed). [`read_metrics`] takes the points from a
//!   run's `metrics.jsonl`; [`plot_run`] does both for a finished run directory.

mod plot;
mod tb;

pub use plot::{plot_run, read_metrics, write_loss_plot, Points, LOSS_PLOT};
pub use tb::{masked_crc32c, read_events, TbEvent, TbWriter, FILE_VERSION, TB_DIR};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error(transparent)]
    Io(#[from] rtune_fsio::IoError),
    /// An event file that is not a valid TFRecord/Event stream; `offset` is the record's byte offset.
    #[error("{path}: record at byte {offset}: {message}")]
    Record {
        path: PathBuf,
        offset: u64,
        message: String,
    },
    /// A metrics.jsonl line that cannot be read.
    #[error("{path}:{line}: {message}")]
    Metrics {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: cannot draw the loss plot: {message}")]
    Plot { path: PathBuf, message: String },
}

pub type Result<T> = std::result::Result<T, WatchError>;
