//! The run configuration: what a user writes in `lora.toml`, and the checked form the trainer runs on.
//!
//! Two layers, as in candle's `into_config` and ripgrep's `LowArgs` → `HiArgs`: [`ConfigFile`]
//! mirrors the TOML exactly (one serde struct per section, `deny_unknown_fields`, defaults), and
//! [`ConfigFile::validate`] turns it into [`RunConfig`], which holds one checked struct per section
//! under the file's names — `model` ([`BaseModelConfig`]), `lora` ([`LoraConfig`]), `data`
//! ([`DataConfig`]), `train` ([`TrainConfig`]), `output` ([`OutputConfig`]), `distributed`
//! ([`DistributedSection`], two booleans, as written) — whose fields are ready
//! to use (enums instead of strings, ranges checked). Each section is checked by its own `validate`
//! in its own file; [`LoraConfig::spec`] is where the run's `LoraSpec` is built. Every error names
//! the file and the key (and the line, where the TOML parser knows it).

mod data;
mod file;
mod grpo;
#[cfg(test)]
mod grpo_tests;
mod lora;
mod model;
mod objective;
mod output;
mod run;
mod suggest;
mod train;

pub use data::{
    default_cache_dir, DataConfig, DataSection, RowFormat, TrainFile, TrainFiles, WeightedFile,
};
pub use file::{
    ConfigFile, DistributedSection, LoraSection, ModelSection, OutputSection, Switch, Targets,
    TokenName, TrainSection,
};
pub use grpo::{Grpo, Level, LossType, ScaleRewards};
pub use lora::LoraConfig;
pub use model::{auto_dtype, auto_gpu, BaseModelConfig, DType, Gpu};
pub use objective::{DpoLoss, Objective};
pub use output::OutputConfig;
pub use run::RunConfig;
pub use train::{parse_device, Checkpointing, Device, Schedule, TrainConfig};

use std::path::{Path, PathBuf};

/// Errors from reading, overriding or validating a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read config: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Syntax error, unknown key or wrong type in the file.
    #[error("{path}:{line}:{col}: {key}{message}")]
    Parse {
        path: PathBuf,
        line: usize,
        col: usize,
        key: String,
        message: String,
    },
    /// A `--set key=value` override that does not apply.
    #[error("--set {set}: {message}")]
    Override { set: String, message: String },
    /// A value that parses but is not allowed (`key` is `section.name`).
    #[error("{path}: [{key}] {message}")]
    Invalid {
        path: PathBuf,
        key: String,
        message: String,
    },
}

impl ConfigError {
    /// Whether the user's input is at fault (exit status 2), as `HubError::is_input_error` and
    /// `ExportError::is_input_error` say for theirs: every config error is — an unreadable file,
    /// a syntax error, an unknown key, a bad `--set`, a value out of range.
    pub fn is_input_error(&self) -> bool {
        match self {
            ConfigError::Read { .. }
            | ConfigError::Parse { .. }
            | ConfigError::Override { .. }
            | ConfigError::Invalid { .. } => true,
        }
    }
}

pub type Result<T> = std::result::Result<T, ConfigError>;

/// A value that parses but is not allowed: `key` is `section.name`.
pub(crate) fn invalid(path: &Path, key: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        path: path.to_path_buf(),
        key: key.to_string(),
        message,
    }
}

/// Reads `path`, applies `--set section.key=value` overrides and validates the result.
pub fn load(path: &Path, overrides: &[String]) -> Result<RunConfig> {
    let text =
        rtune_fsio::read_string_bounded(path, rtune_fsio::FileKind::RunConfig).map_err(|e| {
            ConfigError::Read {
                path: path.to_path_buf(),
                source: e.into_io(),
            }
        })?;
    let file = ConfigFile::parse(&text, path, overrides)?;
    file.validate(path)
}
