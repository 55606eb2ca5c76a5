//! Training data: the model's tokenizer, JSONL examples, and right-padded micro-batches.
//!
//! An [`Example`] is `input_ids` with `labels` aligned to them as in transformers (`-100` = no loss;
//! the model shifts labels by one). Rows are read from JSONL in one [`Format`], set or detected from
//! the first row and required of every row (`formats`): raw `text`, `prompt`/`completion`, Alpaca
//! `instruction`/`input`/`output`, `messages` rendered with the model's [`ChatTemplate`] (loss on
//! the assistant turns, masks read from the rendered text by role: [`chat`]), or pre-tokenized
//! `input_ids`/`labels`. [`DataOptions`] holds the settings; [`RowParser`] parses a file's rows (in
//! chunks, so the cache can use all cores); [`load_jsonl_with`] reads a whole file.
//!
//! [`Batcher`] walks the examples epoch after epoch (shuffled per epoch by seed, or in file order)
//! and cuts micro-batches.
//!
//! Looking at data before training: [`inspect`] (`rtune data inspect`: samples with their loss
//! masks, the length histogram) and [`scan`] (`rtune data scan`: likely secrets and personal data).

mod batch;
pub mod cache;
pub mod chat;
mod formats;
mod ids;
pub mod inspect;
pub mod preference;
pub mod prompts;
mod pyjson;
pub mod rows;
pub mod scan;
mod settings;
mod template;
mod tokenizer;

pub use batch::{Batcher, Layout, MicroBatch, Row, PAD_SEGMENT};
pub use chat::{Conversation, RenderedChat, Role};
pub use formats::{detect_format, DataOptions, RowParser};
pub use preference::{Pair, PairBatch, PairSet};
pub use prompts::{load_prompts, Prompt, PromptOptions, PromptSet};
pub use settings::{Format, OnBadRow, TrainOn, Truncation};
pub use template::{ChatTemplate, TemplateError};
pub use tokenizer::{ByteRange, Tokenizer, PREFIX_MARGIN};

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}:{line}: {message}")]
    Row {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// The chat template's `raise_exception` refused this row's conversation.
    #[error("{path}:{line}: {source}")]
    RowTemplate {
        path: PathBuf,
        line: usize,
        source: TemplateError,
    },
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("tokenizer {op}: {message}")]
    Tokenizer { op: &'static str, message: String },
}

pub type Result<T> = std::result::Result<T, DataError>;

pub const IGNORE: i64 = -100;

#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub input_ids: Vec<u32>,
    /// Same length as `input_ids`; `-100` = no loss.
    pub labels: Vec<i64>,
}

impl Example {
    /// Tokens that carry a loss after the shift (label at positions 1..).
    pub fn target_tokens(&self) -> usize {
        self.labels.iter().skip(1).filter(|&&l| l != IGNORE).count()
    }
}

/// Examples read from one file (or one chunk of it), with what was cut or left out on the way.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub examples: Vec<Example>,
    pub format: Format,
    /// Non-empty lines read.
    pub rows: usize,
    /// Rows longer than `max_seq_len`, cut to it (`truncation = "truncate"`).
    pub truncated: usize,
    /// Rows longer than `max_seq_len`, left out (`truncation = "drop"`).
    pub dropped: usize,
    /// Rows left with no target token (e.g. a prompt that fills `max_seq_len`), left out.
    pub skipped: usize,
    /// Malformed rows passed over (`on_bad_row = "skip"`), and the first few of their
    /// `file:line: what is wrong` messages.
    pub bad_rows: usize,
    pub bad_row_samples: Vec<String>,
}

impl Dataset {
    /// How many bad-row messages are kept.
    pub const BAD_ROW_SAMPLES: usize = 10;

    pub fn empty(format: Format) -> Self {
        Dataset {
            examples: Vec::new(),
            format,
            rows: 0,
            truncated: 0,
            dropped: 0,
            skipped: 0,
            bad_rows: 0,
            bad_row_samples: Vec::new(),
        }
    }

    /// Appends a later chunk of the same file.
    pub fn absorb(&mut self, other: Dataset) {
        self.examples.extend(other.examples);
        self.rows += other.rows;
        self.truncated += other.truncated;
        self.dropped += other.dropped;
        self.skipped += other.skipped;
        self.bad_rows += other.bad_rows;
        let room = Self::BAD_ROW_SAMPLES.saturating_sub(self.bad_row_samples.len());
        self.bad_row_samples
            .extend(other.bad_row_samples.into_iter().take(room));
    }

    /// An error unless some example is left, saying where the rows went.
    pub fn check_not_empty(&self, path: &Path, max_seq_len: usize) -> Result<()> {
        if !self.examples.is_empty() {
            return Ok(());
        }
        let mut why = Vec::new();
        if self.bad_rows > 0 {
            why.push(format!("{} malformed (skipped)", self.bad_rows));
        }
        if self.dropped > 0 {
            why.push(format!(
                "{} longer than max_seq_len {max_seq_len} (dropped)",
                self.dropped
            ));
        }
        if self.skipped > 0 {
            why.push(format!(
                "{} with no token to train on (max_seq_len {max_seq_len} too short?)",
                self.skipped
            ));
        }
        Err(DataError::File {
            path: path.to_path_buf(),
            message: format!("no example left of {} rows: {}", self.rows, why.join(", ")),
        })
    }
}

/// Reads a JSONL file with the default [`DataOptions`] (format detected, loss on assistant turns,
/// over-long rows cut, bad rows an error). `tok` is needed for text rows; `vocab` bounds
/// pre-tokenized ids.
pub fn load_jsonl(
    path: &Path,
    tok: Option<&Tokenizer>,
    max_seq_len: usize,
    vocab: usize,
) -> Result<Dataset> {
    load_jsonl_with(path, tok, &DataOptions::new(max_seq_len), vocab)
}

/// [`load_jsonl`] on text already read; `path` labels errors.
pub fn parse_jsonl(
    text: &str,
    path: &Path,
    tok: Option<&Tokenizer>,
    max_seq_len: usize,
    vocab: usize,
) -> Result<Dataset> {
    parse_jsonl_with(text, path, tok, &DataOptions::new(max_seq_len), vocab)
}

/// Reads a JSONL file as `opts` says.
pub fn load_jsonl_with(
    path: &Path,
    tok: Option<&Tokenizer>,
    opts: &DataOptions,
    vocab: usize,
) -> Result<Dataset> {
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut open_data(path)?, &mut bytes).map_err(|e| DataError::File {
        path: path.to_path_buf(),
        message: format!("cannot read data: {e}"),
    })?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let ok = &e.as_bytes()[..e.utf8_error().valid_up_to()];
        let line_start = ok.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let line = ok.iter().filter(|&&b| b == b'\n').count() + 1;
        not_utf8(path, line, ok.len() - line_start)
    })?;

    parse_jsonl_with(&text, path, tok, opts, vocab)
}

/// One line of a data file as text: invalid UTF-8 is an error naming the file, the line and the
/// byte (a Latin-1 or UTF-16 file is the usual cause).
pub fn line_utf8(path: &Path, line: usize, bytes: Vec<u8>) -> Result<String> {
    String::from_utf8(bytes).map_err(|e| not_utf8(path, line, e.utf8_error().valid_up_to()))
}

/// `valid` bytes of the line decoded before the bad one.
fn not_utf8(path: &Path, line: usize, valid: usize) -> DataError {
    DataError::Row {
        path: path.to_path_buf(),
        line,
        message: format!(
            "not valid UTF-8 (byte {} of the line); save the file as UTF-8",
            valid + 1
        ),
    }
}

/// [`load_jsonl_with`] on text already read; `path` labels errors. An empty result is an error.
pub fn parse_jsonl_with(
    text: &str,
    path: &Path,
    tok: Option<&Tokenizer>,
    opts: &DataOptions,
    vocab: usize,
) -> Result<Dataset> {
    let format = detect_format(text, 1, path, opts)?;
    let d = RowParser::new(path, format, tok, opts, vocab)?.parse_chunk(text, 1)?;
    d.check_not_empty(path, opts.max_seq_len)?;
    Ok(d)
}

/// What a data file is to [`rtune_fsio::open_regular`]: any size (data is streamed, a line at a
/// time under `max_row_bytes`), but a regular file.
pub(crate) const DATA_FILE: rtune_fsio::FileKind = rtune_fsio::FileKind::Sized {
    cap: u64::MAX,
    name: "data file",
};

/// Opens a data file (JSONL) for reading: every data read starts here. A FIFO is refused without
/// blocking in `open` and a device (`/dev/zero`, which would be read forever) before any byte is
/// read: the check is `fstat` on the opened handle, so a symlink to one is refused too.
pub fn open_data(path: &Path) -> Result<std::fs::File> {
    rtune_fsio::open_regular(path, DATA_FILE).map_err(|e| DataError::File {
        path: path.to_path_buf(),
        message: format!("cannot read data: {e}"),
    })
}

/// `path`'s text, bounded as [`rtune_fsio::FileKind`] says; `None` when the file does not exist (an optional
/// file), an error when it exists but cannot be read or is not a regular file within its cap.
pub(crate) fn read_optional(path: &Path, kind: rtune_fsio::FileKind) -> Result<Option<String>> {
    match rtune_fsio::read_string_bounded(path, kind) {
        Ok(text) => Ok(Some(text)),
        Err(rtune_fsio::ReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(DataError::File {
            path: path.to_path_buf(),
            message: format!("cannot read {kind}: {e}"),
        }),
    }
}
