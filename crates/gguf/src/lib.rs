//! llama.cpp's GGUF files as Hugging Face model directories, and back.
//!
//! - [`convert()`]: a `llama` or `gemma3` GGUF → `config.json`, `model.safetensors` (each tensor
//!   dequantized to f32; f16/bf16 tensors kept as stored), `tokenizer.json`,
//!   `tokenizer_config.json` (with `tokenizer.chat_template`) and `generation_config.json`,
//!   written into a temporary directory that is renamed into place, so a reader never sees half a
//!   conversion. Tensors are read, dequantized and written one at a time.
//! - [`meta`]: `llama.*` / `gemma3.*` metadata → config.json; [`names`]: llama.cpp tensor names ↔
//!   Hugging Face names per architecture, the q/k row permutation convert_hf_to_gguf.py applies
//!   for a llama's rope (undone here) and Gemma's `w + 1` norms (subtracted again);
//!   [`vocab`]: `tokenizer.ggml.*` → tokenizer.json (byte-level BPE, `tokenizer.ggml.model =
//!   gpt2`; Gemma 3's SentencePiece vocabulary as transformers' GGUF reader builds it).
//! - [`write::write_llama_gguf`], [`write::write_gemma3_gguf`]: the reverse, for tests and round
//!   trips (f32 or a ggml quantized type, laid out exactly as convert_hf_to_gguf.py does).
//!
//! Reference: llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel`, `Gemma3Model`,
//! `_set_vocab_gpt2`, `_set_vocab_sentencepiece`), `src/llama-vocab.cpp` (the pre-tokenizer
//! regexes behind `tokenizer.ggml.pre`), `src/models/gemma3.cpp` (what a gemma3 file leaves
//! implicit) and transformers' GGUF reader (`integrations/gguf/`), which
//! `scripts/check_gemma3_gguf.py` compares with on a real file.

pub mod convert;
pub mod merges;
pub mod meta;
pub mod names;
pub mod scan;
pub mod shapes;
pub mod vocab;
pub mod write;

pub use convert::{convert, planned_bytes, Converted};
pub use write::{write_gemma3_gguf, write_llama_gguf, SpmVocab};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {}", one_line(message))]
    File { path: PathBuf, message: String },
    #[error("{path}: metadata `{}`: {}", one_line(key), one_line(message))]
    Metadata {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("{path}: tensor `{}`: {}", one_line(name), one_line(message))]
    Tensor {
        path: PathBuf,
        name: String,
        message: String,
    },
    #[error("{path}: {} is not supported; {hint}", one_line(what))]
    Unsupported {
        path: PathBuf,
        what: String,
        hint: String,
    },
    #[error(
        "{path}: the conversion needs {needed} bytes ({:.2} GB) but the filesystem has {free} bytes \
         ({:.2} GB) free; free some space or set RTUNE_CACHE to a larger disk",
        *needed as f64 / 1e9,
        *free as f64 / 1e9
    )]
    DiskFull {
        path: PathBuf,
        needed: u64,
        free: u64,
    },
    #[error("{path}: interrupted by signal {signal}; the partial conversion was removed")]
    Interrupted { path: PathBuf, signal: i32 },
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
}

/// `s` with its control characters escaped (`\n` as the two characters `\` `n`): names, keys and
/// values from a GGUF are the file's, and an error about them stays on one line (the fuzz target
/// found a tensor name with a line break). Text without control characters, escaped text among
/// it, is left as it is.
fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return s.into();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

impl From<rtune_fsio::IoError> for GgufError {
    fn from(e: rtune_fsio::IoError) -> Self {
        GgufError::Io {
            path: e.path,
            op: e.op,
            source: e.source,
        }
    }
}

impl GgufError {
    /// The GGUF file (or the directory it converts from) is at fault — exit status 2; a failed
    /// write or a full disk is the machine's (1).
    pub fn is_input_error(&self) -> bool {
        match self {
            GgufError::File { .. }
            | GgufError::Metadata { .. }
            | GgufError::Tensor { .. }
            | GgufError::Unsupported { .. } => true,
            GgufError::DiskFull { .. } | GgufError::Interrupted { .. } | GgufError::Io { .. } => {
                false
            }
        }
    }
}

pub type Result<T> = std::result::Result<T, GgufError>;

/// A candle error as one line: without the backtrace candle captures under `RUST_BACKTRACE=1`
/// (printed inside the message, 46 to 178 lines), its context before the cause.
pub(crate) fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    let text = match e {
        E::WithBacktrace { inner, .. } => return candle_message(inner),
        E::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        E::WithPath { inner, path } => format!("{}: {}", path.display(), candle_message(inner)),
        other => other.to_string(),
    };
    // Any other multi-line message (a wrapped error's context) joined into one line.
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(": ")
}

#[cfg(test)]
mod one_line_tests {
    use super::*;

    /// A tensor name with a line break (the fuzz target's find) prints on one line; text without
    /// control characters, escaped text among it, is unchanged.
    #[test]
    fn errors_about_hostile_names_stay_on_one_line() {
        let e = GgufError::Tensor {
            path: "m.gguf".into(),
            name: "blk\n.attn_norm.weight".into(),
            message: "not a tensor\r\nof a Llama model".into(),
        }
        .to_string();
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.contains("`blk\\n.attn_norm.weight`"), "{e}");
        assert_eq!(one_line("a\\nb `x`"), "a\\nb `x`");
    }
}
