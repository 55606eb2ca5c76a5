//! The Hugging Face hub cache, laid out as Python's `huggingface_hub` lays it out (so both share
//! downloads):
//!
//! ```text
//! <hub cache>/models--<org>--<name>/
//!     blobs/<etag>                       file contents
//!     snapshots/<commit>/<file>          symlinks into blobs/
//!     refs/<revision>                    the commit a branch or tag pointed at when last resolved
//! ```
//!
//! `<hub cache>` is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`.

use std::path::{Path, PathBuf};

use crate::{HubError, Result};

fn env_path(k: &str) -> Option<PathBuf> {
    std::env::var_os(k)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn user_cache(var: &dyn Fn(&str) -> Option<PathBuf>) -> PathBuf {
    var("XDG_CACHE_HOME")
        .or_else(|| var("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"))
}

/// The hub cache directory, as `huggingface_hub` chooses it.
pub fn hub_cache_dir() -> PathBuf {
    hub_cache_dir_with(&env_path)
}

/// [`hub_cache_dir`] with the environment given as a lookup (non-empty values only).
pub fn hub_cache_dir_with(var: &dyn Fn(&str) -> Option<PathBuf>) -> PathBuf {
    if let Some(d) = var("HF_HUB_CACHE") {
        return d;
    }
    if let Some(h) = var("HF_HOME") {
        return h.join("hub");
    }
    user_cache(var).join("huggingface").join("hub")
}

/// Where converted GGUF models are kept: `$RTUNE_CACHE/models`, else
/// `$XDG_CACHE_HOME/rtune/models`, else `~/.cache/rtune/models` (beside the tokenized-data cache).
pub fn models_cache_dir() -> PathBuf {
    if let Some(d) = env_path("RTUNE_CACHE") {
        return d.join("models");
    }
    user_cache(&env_path).join("rtune").join("models")
}

/// A full commit sha: revisions that are one need no ref.
pub fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit())
}

/// One model repository in the hub cache.
#[derive(Debug, Clone)]
pub struct RepoCache {
    pub root: PathBuf,
    pub repo: String,
}

impl RepoCache {
    pub fn new(hub_cache: &Path, repo: &str) -> Self {
        Self {
            root: hub_cache.to_path_buf(),
            repo: repo.to_string(),
        }
    }

    /// `<hub cache>/models--org--name`.
    pub fn dir(&self) -> PathBuf {
        self.root
            .join(format!("models--{}", self.repo.replace('/', "--")))
    }

    pub fn ref_path(&self, revision: &str) -> PathBuf {
        self.dir().join("refs").join(revision)
    }

    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.dir().join("snapshots").join(commit)
    }

    /// The commit `revision` names: itself when it is a commit sha, else `refs/<revision>`.
    pub fn commit(&self, revision: &str) -> Option<String> {
        if is_commit(revision) {
            return Some(revision.to_string());
        }
        let ref_file = rtune_fsio::FileKind::Sized {
            cap: 4096,
            name: "hub ref",
        };
        rtune_fsio::read_string_bounded(&self.ref_path(revision), ref_file)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    /// Points `refs/<revision>` at `commit` (not for a revision that is itself a commit).
    pub fn write_ref(&self, revision: &str, commit: &str) -> Result<()> {
        if revision == commit {
            return Ok(());
        }
        let p = self.ref_path(revision);
        let io = |op, source| HubError::Io {
            path: p.clone(),
            op,
            source,
        };
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io("create directory", e))?;
        }
        // Through the one atomic writer: never through a link planted at `.tmp` (issue 46).
        rtune_fsio::write_atomic(&p, commit.as_bytes(), rtune_fsio::Privacy::SHARED).map_err(|e| {
            HubError::Io {
                path: e.path,
                op: e.op,
                source: e.source,
            }
        })
    }
}

/// The files of a model snapshot that are missing: `config.json` and the weights
/// (`model.safetensors`, or the index and every shard it names).
pub fn missing_files(snapshot: &Path) -> Vec<String> {
    let mut missing = Vec::new();
    if !snapshot.join("config.json").exists() {
        missing.push("config.json".to_string());
    }
    let index = snapshot.join("model.safetensors.index.json");
    if index.exists() {
        match rtune_fsio::read_string_bounded(&index, rtune_fsio::FileKind::ShardIndex)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        {
            Some(v) => match shards(&v) {
                Ok(shards) => missing.extend(
                    shards
                        .into_iter()
                        .filter(|shard| !snapshot.join(shard).exists()),
                ),
                Err(why) => missing.push(format!("a valid model.safetensors.index.json ({why})")),
            },
            None => missing.push("a readable model.safetensors.index.json".into()),
        }
    } else if !snapshot.join("model.safetensors").exists() {
        missing.push("model.safetensors (or model.safetensors.index.json)".into());
    }
    missing
}

/// The shard files an index's `weight_map` names, sorted, each once; an entry that is not a plain
/// file name (`../x`, `/x`, `a/b`) is an error naming it (rtune_model::weights::index_shards).
pub fn shards(index: &serde_json::Value) -> std::result::Result<Vec<String>, String> {
    rtune_model::weights::index_shards(index)
}

/// `repo@revision` from the cache alone: the snapshot directory and its commit, or what is
/// missing (with `HF_HUB_OFFLINE` set, nothing else may be tried).
pub fn resolve_cached(hub_cache: &Path, repo: &str, revision: &str) -> Result<(String, PathBuf)> {
    let c = RepoCache::new(hub_cache, repo);
    let offline = |missing: Vec<String>| HubError::Offline {
        repo: repo.to_string(),
        revision: revision.to_string(),
        cache: hub_cache.to_path_buf(),
        missing,
    };
    let commit = c.commit(revision).ok_or_else(|| {
        offline(vec![format!(
            "refs/{revision} (the revision was never resolved here)"
        )])
    })?;
    let snap = c.snapshot(&commit);
    if !snap.is_dir() {
        return Err(offline(vec![format!("snapshots/{commit}")]));
    }
    let missing = missing_files(&snap);
    if !missing.is_empty() {
        return Err(offline(
            missing
                .into_iter()
                .map(|f| format!("snapshots/{commit}/{f}"))
                .collect(),
        ));
    }
    Ok((commit, snap))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_cache_dir_follows_huggingface_hub() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| PathBuf::from(v))
            }
        };
        let all = env(&[("HF_HUB_CACHE", "/hc"), ("HF_HOME", "/hh"), ("HOME", "/u")]);
        assert_eq!(hub_cache_dir_with(&all), PathBuf::from("/hc"));
        let home = env(&[("HF_HOME", "/hh"), ("HOME", "/u")]);
        assert_eq!(hub_cache_dir_with(&home), PathBuf::from("/hh/hub"));
        let xdg = env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/u")]);
        assert_eq!(
            hub_cache_dir_with(&xdg),
            PathBuf::from("/x/huggingface/hub")
        );
        let user = env(&[("HOME", "/u")]);
        assert_eq!(
            hub_cache_dir_with(&user),
            PathBuf::from("/u/.cache/huggingface/hub")
        );
    }

    #[test]
    fn repo_folder_names_and_commit_revisions() {
        let c = RepoCache::new(Path::new("/hub"), "HuggingFaceTB/SmolLM2-135M");
        assert_eq!(
            c.dir(),
            PathBuf::from("/hub/models--HuggingFaceTB--SmolLM2-135M")
        );
        let sha = "0123456789abcdef0123456789abcdef01234567";
        assert!(is_commit(sha) && !is_commit("main") && !is_commit(&sha[1..]));
        assert_eq!(c.commit(sha).as_deref(), Some(sha));
        assert_eq!(c.commit("main"), None);
    }
}
