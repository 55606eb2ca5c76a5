//! Where a model comes from: `[model] path` (or `--model`) resolved to a local Hugging Face
//! model directory.
//!
//! | `path` | [`Source`] | directory |
//! |---|---|---|
//! | an existing directory | `Local` | itself |
//! | a `.gguf` file | `Gguf` | converted once (rtune-gguf) into `<models cache>/<sha256 of the file>` |
//! | `org/name` (not a local path) | `Hub` | the Hugging Face cache's `models--org--name/snapshots/<commit>` |
//!
//! - [`cache`]: the Hugging Face cache layout Python's `huggingface_hub` shares
//!   (`models--org--name/{blobs,snapshots/<commit>,refs/<revision>}` under `HF_HUB_CACHE`,
//!   `$HF_HOME/hub` or `~/.cache/huggingface/hub`), and resolution from it alone
//!   (`HF_HUB_OFFLINE=1`);
//! - [`download`]: hf-hub downloads of only the files a model needs (config, tokenizer, generation
//!   config, the safetensors shards named in the index), pinned to the commit the revision
//!   resolved to, after a free-disk check; `HF_TOKEN` is sent, never logged;
//! - [`gguf`]: the GGUF conversion cache (`$RTUNE_CACHE/models`, `~/.cache/rtune/models`).

pub mod cache;
pub mod download;
pub mod gguf;

use std::fmt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(transparent)]
    Gguf(#[from] rtune_gguf::GgufError),
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Path { path: PathBuf, message: String },
    #[error(
        "`{repo}` is neither a local directory nor a model repository on the hub ({message}); \
         check the spelling, or give a local path"
    )]
    NotFound { repo: String, message: String },
    #[error(
        "{repo}: the hub refused access (HTTP {status}): the model is gated or private; accept its \
         licence on the hub and set HF_TOKEN to a token that has access"
    )]
    Auth { repo: String, status: u16 },
    #[error("{repo}@{revision}: {message}")]
    Network {
        repo: String,
        revision: String,
        message: String,
    },
    #[error(
        "{repo}@{revision}: HF_HUB_OFFLINE is set and the cache {cache} lacks {}; run once without \
         HF_HUB_OFFLINE to download it, or point HF_HUB_CACHE / HF_HOME at a cache that has it",
        missing.join(", ")
    )]
    Offline {
        repo: String,
        revision: String,
        cache: PathBuf,
        missing: Vec<String>,
    },
    #[error("{repo}: {message}")]
    Repo { repo: String, message: String },
    #[error(
        "{path}: downloading needs {needed} bytes ({:.2} GB) but only {free} bytes ({:.2} GB) are \
         free; free some space or set HF_HUB_CACHE to a larger disk",
        *needed as f64 / 1e9,
        *free as f64 / 1e9
    )]
    DiskFull {
        path: PathBuf,
        needed: u64,
        free: u64,
    },
}

impl From<rtune_fsio::IoError> for HubError {
    fn from(e: rtune_fsio::IoError) -> Self {
        HubError::Io {
            path: e.path,
            op: e.op,
            source: e.source,
        }
    }
}

impl HubError {
    /// The input is wrong (exit status 2) rather than the run failing (1: network, disk, I/O).
    pub fn is_input_error(&self) -> bool {
        match self {
            HubError::Gguf(g) => g.is_input_error(),
            e => !matches!(
                e,
                HubError::Network { .. } | HubError::Io { .. } | HubError::DiskFull { .. }
            ),
        }
    }
}

pub type Result<T> = std::result::Result<T, HubError>;

/// What a model path resolved to.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    Local,
    Gguf {
        file: PathBuf,
        sha256: String,
        /// Converted by this call (false: the cached conversion was used).
        converted: bool,
    },
    Hub {
        repo: String,
        revision: String,
        /// The commit the revision pointed at: record it to reproduce the run.
        commit: String,
        /// Bytes downloaded by this call (0: everything was in the cache).
        downloaded: u64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// A Hugging Face model directory (config.json, safetensors, tokenizer files).
    pub dir: PathBuf,
    pub source: Source,
}

impl fmt::Display for Resolved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Source::Local => write!(f, "{}", self.dir.display()),
            Source::Gguf {
                file,
                sha256,
                converted,
            } => write!(
                f,
                "{} (GGUF sha256 {}, {} {})",
                file.display(),
                &sha256[..sha256.len().min(12)],
                if *converted {
                    "converted into"
                } else {
                    "cached in"
                },
                self.dir.display()
            ),
            Source::Hub {
                repo,
                revision,
                commit,
                ..
            } => write!(
                f,
                "{repo}@{revision} (commit {commit}) in {}",
                self.dir.display()
            ),
        }
    }
}

/// `org/name`: two non-empty parts of letters, digits, `-`, `_`, `.` (no `..`, no leading `.`),
/// at most 96 characters — the hub's repo-id rule. A path with more parts or that exists is local.
pub fn looks_like_repo_id(s: &str) -> bool {
    let ok = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && !p.contains("..")
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    s.len() <= 96
        && matches!(s.split_once('/'), Some((org, name)) if ok(org) && ok(name) && !name.contains('/'))
        && !s.ends_with(".gguf")
}

/// Resolves `path` (as written in the config) at `revision` (hub models only) to a local model
/// directory: see the module docs.
pub fn resolve(path: &str, revision: &str) -> Result<Resolved> {
    let p = Path::new(path);
    let is_gguf = p
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if p.is_dir() {
        return Ok(Resolved {
            dir: p.to_path_buf(),
            source: Source::Local,
        });
    }
    if is_gguf {
        // Only a missing path is "not found": a FIFO or a device is named for what it is by the
        // GGUF reader (a regular file only, opened without blocking).
        if !p.exists() {
            return Err(HubError::Path {
                path: p.to_path_buf(),
                message: "GGUF file not found".into(),
            });
        }
        return gguf::resolve(p, &cache::models_cache_dir());
    }
    if p.exists() {
        return Err(HubError::Path {
            path: p.to_path_buf(),
            message:
                "is a file; [model] path is a model directory, a .gguf file or a hub id (org/name)"
                    .into(),
        });
    }
    if looks_like_repo_id(path) {
        return download::resolve(path, revision, &download::HubEnv::from_env());
    }
    // Not there and not a repo id: the model loader reports the missing directory.
    Ok(Resolved {
        dir: p.to_path_buf(),
        source: Source::Local,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_and_paths() {
        for id in [
            "HuggingFaceTB/SmolLM2-135M",
            "meta-llama/Llama-3.2-1B",
            "a/b.c_d",
        ] {
            assert!(looks_like_repo_id(id), "{id}");
        }
        for p in [
            "tests/fixtures/tiny-llama",
            "./model",
            "/abs/model",
            "model",
            "org/",
            "../x",
            "a/b/c",
            "a/..",
            "org/model.gguf",
            "a b/c",
        ] {
            assert!(!looks_like_repo_id(p), "{p}");
        }
    }

    #[test]
    fn local_directory_and_missing_path() {
        let dir = std::env::temp_dir();
        let r = resolve(dir.to_str().unwrap(), "main").unwrap();
        assert_eq!((r.dir, r.source), (dir, Source::Local));
        // Not a repo id: left for the model loader to report.
        let r = resolve("no-such-model", "main").unwrap();
        assert_eq!(r.source, Source::Local);
        let e = resolve("missing.gguf", "main").unwrap_err().to_string();
        assert!(e.contains("missing.gguf") && e.contains("not found"), "{e}");
    }
}
