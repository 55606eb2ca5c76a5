//! The `[data]` section: as written, and checked.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::{ConfigError, Result};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// JSONL file(s): `"a.jsonl"` or `["a.jsonl", {path = "b.jsonl", weight = 0.5}]`.
    pub train: TrainFiles,
    /// Validation JSONL ("" = none, or a `valid_fraction` of the training rows).
    #[serde(default)]
    pub valid: String,
    /// Fraction of the training rows held out for validation, chosen by seed (0 = none).
    #[serde(default)]
    pub valid_fraction: f64,
    /// auto | text | prompt_completion | alpaca | chat | tokens.
    #[serde(default = "d_auto")]
    pub format: String,
    /// Chat rows: loss on `assistant` turns only, or on `all` tokens.
    #[serde(default = "d_assistant")]
    pub train_on: String,
    /// A `.jinja` file replacing the tokenizer's chat template ("" = the model's own).
    #[serde(default)]
    pub chat_template: String,
    /// Extra variables for the chat template, as transformers' `apply_chat_template(**kwargs)`
    /// passes them, e.g. `{ enable_thinking = false }` for Qwen3.
    #[serde(default)]
    pub chat_template_kwargs: toml::Table,
    #[serde(default = "d_max_seq_len")]
    pub max_seq_len: usize,
    /// Rows longer than `max_seq_len`: `truncate` them or `drop` them.
    #[serde(default = "d_truncate")]
    pub truncation: String,
    /// A malformed row: `error` (stop, naming file:line) or `skip` (counted).
    #[serde(default = "d_error")]
    pub on_bad_row: String,
    /// Rows longer than this many bytes are dropped unread (counted apart: `over max_row_bytes`),
    /// so one stray blob cannot take the machine's memory; 0 = max(8 MiB, 256 bytes ×
    /// max_seq_len), past which no tokenizer fits a row in max_seq_len tokens.
    #[serde(default)]
    pub max_row_bytes: usize,
    #[serde(default = "d_true")]
    pub shuffle: bool,
    /// Several samples a row up to `max_seq_len`, each attending only to itself.
    #[serde(default)]
    pub packing: bool,
    /// Without packing: samples of similar length share a micro-batch (less padding).
    #[serde(default = "d_true")]
    pub group_by_length: bool,
    /// Reuse tokenized data across runs (keyed by the sha256 of data, tokenizer, template, settings).
    #[serde(default = "d_true")]
    pub cache: bool,
    /// Where the tokenized cache lives ("" = `$XDG_CACHE_HOME/rtune/data` or `~/.cache/rtune/data`).
    #[serde(default)]
    pub cache_dir: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TrainFiles {
    One(String),
    Many(Vec<TrainFile>),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TrainFile {
    Path(String),
    Weighted { path: String, weight: f64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowFormat {
    Auto,
    Text,
    PromptCompletion,
    Alpaca,
    Chat,
    Tokens,
}

/// One training file and its sampling weight: each epoch holds `weight ×` its rows (fractional
/// parts drawn by seed).
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedFile {
    pub path: PathBuf,
    pub weight: f64,
}

/// The checked `[data]` section.
#[derive(Debug, Clone)]
pub struct DataConfig {
    pub train: Vec<WeightedFile>,
    pub valid: Option<PathBuf>,
    pub valid_fraction: f64,
    pub format: RowFormat,
    /// Chat rows: loss on every token instead of the assistant turns only.
    pub train_on_all: bool,
    pub chat_template: Option<PathBuf>,
    /// `[data] chat_template_kwargs`, by name (checked: no variable rtune sets itself, no dates).
    pub chat_template_kwargs: Vec<(String, toml::Value)>,
    pub max_seq_len: usize,
    /// Drop over-long rows instead of truncating them.
    pub drop_long: bool,
    /// Rows longer than this (bytes) are dropped unread (`[data] max_row_bytes`, resolved).
    pub max_row_bytes: usize,
    pub skip_bad_rows: bool,
    pub shuffle: bool,
    pub packing: bool,
    pub group_by_length: bool,
    /// `None`: no cache.
    pub cache_dir: Option<PathBuf>,
}

/// The longest row rtune tokenizes or trains on (2^24 tokens; no model's context is longer).
pub const MAX_SEQ_LEN: usize = 1 << 24;

impl DataSection {
    pub(crate) fn validate(&self, path: &Path) -> Result<DataConfig> {
        let bad = |key: &str, message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            key: format!("data.{key}"),
            message,
        };
        let pick = |key: &str, v: &str, options: &[&str]| -> Result<usize> {
            options
                .iter()
                .position(|o| *o == v)
                .ok_or_else(|| bad(key, crate::suggest::not_one_of(v, options)))
        };
        let files = match &self.train {
            TrainFiles::One(p) => vec![TrainFile::Path(p.clone())],
            TrainFiles::Many(v) => v.clone(),
        };
        let mut train = Vec::with_capacity(files.len());
        for f in files {
            let (p, weight) = match f {
                TrainFile::Path(p) => (p, 1.0),
                TrainFile::Weighted { path, weight } => (path, weight),
            };
            if p.trim().is_empty() {
                return Err(bad("train", "has an empty path".into()));
            }
            if !(weight.is_finite() && weight > 0.0) {
                return Err(bad(
                    "train",
                    format!("weight of `{p}` must be a positive number, got {weight}"),
                ));
            }
            train.push(WeightedFile {
                path: PathBuf::from(p),
                weight,
            });
        }
        if train.is_empty() {
            return Err(bad("train", "names no file".into()));
        }
        if !(0.0..0.5).contains(&self.valid_fraction) {
            return Err(bad(
                "valid_fraction",
                format!("must be in [0, 0.5), got {}", self.valid_fraction),
            ));
        }
        let valid = (!self.valid.trim().is_empty()).then(|| PathBuf::from(&self.valid));
        if valid.is_some() && self.valid_fraction > 0.0 {
            return Err(bad(
                "valid_fraction",
                "cannot be used together with data.valid: choose one".into(),
            ));
        }
        if self.max_seq_len < 2 {
            return Err(bad(
                "max_seq_len",
                format!("must be at least 2, got {}", self.max_seq_len),
            ));
        }
        if self.max_seq_len > MAX_SEQ_LEN {
            return Err(bad(
                "max_seq_len",
                format!(
                    "{} is over {MAX_SEQ_LEN} tokens, beyond any model's context",
                    self.max_seq_len
                ),
            ));
        }
        use RowFormat::*;
        let formats = [
            "auto",
            "text",
            "prompt_completion",
            "alpaca",
            "chat",
            "tokens",
        ];
        let format = [Auto, Text, PromptCompletion, Alpaca, Chat, Tokens]
            [pick("format", &self.format, &formats)?];
        let train_on_all = pick("train_on", &self.train_on, &["assistant", "all"])? == 1;
        let drop_long = pick("truncation", &self.truncation, &["truncate", "drop"])? == 1;
        let skip_bad_rows = pick("on_bad_row", &self.on_bad_row, &["error", "skip"])? == 1;
        let chat_template =
            (!self.chat_template.trim().is_empty()).then(|| PathBuf::from(&self.chat_template));
        let mut chat_template_kwargs = Vec::new();
        for (k, v) in &self.chat_template_kwargs {
            if RESERVED_TEMPLATE_VARS.contains(&k.as_str()) {
                return Err(bad(
                    "chat_template_kwargs",
                    format!(
                        "`{k}` is set by rtune for every render; the keys are the template's own \
                         variables (e.g. enable_thinking)"
                    ),
                ));
            }
            if has_datetime(v) {
                return Err(bad(
                    "chat_template_kwargs",
                    format!("`{k}` holds a TOML date, which a template cannot receive; quote it"),
                ));
            }
            chat_template_kwargs.push((k.clone(), v.clone()));
        }
        let cache_dir = self.cache.then(|| {
            if self.cache_dir.trim().is_empty() {
                default_cache_dir()
            } else {
                PathBuf::from(&self.cache_dir)
            }
        });
        Ok(DataConfig {
            train,
            valid,
            valid_fraction: self.valid_fraction,
            format,
            train_on_all,
            chat_template,
            chat_template_kwargs,
            max_seq_len: self.max_seq_len,
            drop_long,
            max_row_bytes: match self.max_row_bytes {
                0 => (8usize << 20).max(256 * self.max_seq_len),
                n => n,
            },
            skip_bad_rows,
            shuffle: self.shuffle,
            packing: self.packing,
            group_by_length: self.group_by_length,
            cache_dir,
        })
    }
}

/// The variables rtune passes to every chat-template render itself (as transformers does).
const RESERVED_TEMPLATE_VARS: [&str; 4] =
    ["messages", "tools", "documents", "add_generation_prompt"];

fn has_datetime(v: &toml::Value) -> bool {
    match v {
        toml::Value::Datetime(_) => true,
        toml::Value::Array(a) => a.iter().any(has_datetime),
        toml::Value::Table(t) => t.values().any(has_datetime),
        _ => false,
    }
}

/// `$RTUNE_CACHE/data`, else `$XDG_CACHE_HOME/rtune/data`, else `~/.cache/rtune/data`.
pub fn default_cache_dir() -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("RTUNE_CACHE") {
        return d.join("data");
    }
    let base = env("XDG_CACHE_HOME")
        .or_else(|| env("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("rtune").join("data")
}

fn d_auto() -> String {
    "auto".into()
}
fn d_assistant() -> String {
    "assistant".into()
}
fn d_truncate() -> String {
    "truncate".into()
}
fn d_error() -> String {
    "error".into()
}
fn d_max_seq_len() -> usize {
    512
}
fn d_true() -> bool {
    true
}
