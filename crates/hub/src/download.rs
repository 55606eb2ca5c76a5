//! A hub model in the local cache: the revision resolved to a commit (one API call), then only the
//! files a model needs downloaded with hf-hub, pinned to that commit, after a free-disk check.
//! With `HF_HUB_OFFLINE=1` nothing is fetched: the cache must hold the model ([`resolve_cached`]).

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::cache::{hub_cache_dir, is_commit, missing_files, resolve_cached, shards, RepoCache};
use crate::{HubError, Resolved, Result, Source};

/// Files fetched when the repository has them (besides the weights); `config.json` is required.
pub const MODEL_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// What the environment says about the hub. `token` is never printed (Debug shows whether one is set).
#[derive(Clone)]
pub struct HubEnv {
    pub cache: PathBuf,
    pub offline: bool,
    pub token: Option<String>,
    pub endpoint: Option<String>,
}

impl fmt::Debug for HubEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubEnv")
            .field("cache", &self.cache)
            .field("offline", &self.offline)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

/// `huggingface_hub`'s truth values: 1, ON, YES, TRUE (any case).
fn truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_uppercase().as_str(),
        "1" | "ON" | "YES" | "TRUE"
    )
}

impl HubEnv {
    /// `HF_HUB_CACHE`/`HF_HOME`, `HF_HUB_OFFLINE`, `HF_TOKEN` (else the token file `huggingface-cli
    /// login` writes, which hf-hub reads), `HF_ENDPOINT`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        Self {
            cache: hub_cache_dir(),
            offline: var("HF_HUB_OFFLINE").is_some_and(|v| truthy(&v)),
            token: var("HF_TOKEN").map(|t| t.trim().to_string()),
            endpoint: var("HF_ENDPOINT"),
        }
    }
}

/// A file in the repository, with its size when the hub says it.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteFile {
    pub name: String,
    pub size: Option<u64>,
}

/// The model's files among `files`, in download order: the metadata files the repository has,
/// then the weights — `model.safetensors.index.json` (its shards are added once it is read) or
/// `model.safetensors`. Errors when there is no config or no safetensors weights.
pub fn wanted(repo: &str, files: &[RemoteFile]) -> Result<Vec<String>> {
    let has = |n: &str| files.iter().any(|f| f.name == n);
    if !has("config.json") {
        return Err(HubError::Repo {
            repo: repo.into(),
            message: "has no config.json: not a transformers model repository".into(),
        });
    }
    let mut out: Vec<String> = MODEL_FILES
        .iter()
        .filter(|n| has(n))
        .map(|n| n.to_string())
        .collect();
    if has("model.safetensors.index.json") {
        out.push("model.safetensors.index.json".into());
    } else if has("model.safetensors") {
        out.push("model.safetensors".into());
    } else {
        let other: Vec<&str> = files
            .iter()
            .map(|f| f.name.as_str())
            .filter(|n| n.ends_with(".bin") || n.ends_with(".pt") || n.ends_with(".gguf"))
            .collect();
        return Err(HubError::Repo {
            repo: repo.into(),
            message: format!(
                "has no safetensors weights (model.safetensors or model.safetensors.index.json); \
                 rtune reads safetensors only{}",
                if other.is_empty() {
                    String::new()
                } else {
                    format!(
                        " (it has {}; a .gguf can be downloaded and given as [model] path)",
                        other.join(", ")
                    )
                }
            ),
        });
    }
    Ok(out)
}

/// Refuses when `needed` bytes do not fit in `free`.
pub fn check_fits(path: &Path, needed: u64, free: u64) -> Result<()> {
    if needed > free {
        return Err(HubError::DiskFull {
            path: path.to_path_buf(),
            needed,
            free,
        });
    }
    Ok(())
}

/// Bytes still to fetch: the files of `names` not already in `snapshot`, by the hub's sizes
/// (a file of unknown size counts 0).
pub fn bytes_to_fetch(names: &[String], files: &[RemoteFile], snapshot: &Path) -> u64 {
    names
        .iter()
        .filter(|n| !snapshot.join(n).exists())
        .filter_map(|n| files.iter().find(|f| &f.name == n).and_then(|f| f.size))
        .sum()
}

fn existing_ancestor(p: &Path) -> PathBuf {
    let mut p = p.to_path_buf();
    while !p.exists() && p.pop() {}
    if p.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        p
    }
}

fn api_error(repo: &str, revision: &str, what: &str, e: ApiError) -> HubError {
    if let ApiError::RequestError(r) = &e {
        if let ureq::Error::StatusCode(code) = **r {
            return match code {
                401 | 403 => HubError::Auth {
                    repo: repo.into(),
                    status: code,
                },
                404 => HubError::NotFound {
                    repo: repo.into(),
                    message: format!("HTTP 404 for {what} at revision `{revision}`"),
                },
                _ => HubError::Network {
                    repo: repo.into(),
                    revision: revision.into(),
                    message: format!("{what}: HTTP {code}"),
                },
            };
        }
    }
    HubError::Network {
        repo: repo.into(),
        revision: revision.into(),
        message: format!("{what}: {e} (set HF_HUB_OFFLINE=1 to use the cache only)"),
    }
}

/// The commit and file list of `repo@revision`, from the hub's model API (`?blobs=true` for sizes).
fn repo_info(
    api: &hf_hub::api::sync::Api,
    repo: &str,
    revision: &str,
) -> Result<(String, Vec<RemoteFile>)> {
    let r = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let mut resp = r
        .info_request()
        .query("blobs", "true")
        .call()
        .map_err(|e| {
            api_error(
                repo,
                revision,
                "model info",
                ApiError::RequestError(Box::new(e)),
            )
        })?;
    let text = resp.body_mut().read_to_string().map_err(|e| {
        api_error(
            repo,
            revision,
            "model info",
            ApiError::RequestError(Box::new(e)),
        )
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| HubError::Network {
        repo: repo.into(),
        revision: revision.into(),
        message: format!("model info is not JSON: {e}"),
    })?;
    let commit = v["sha"]
        .as_str()
        .filter(|s| is_commit(s))
        .ok_or_else(|| HubError::Network {
            repo: repo.into(),
            revision: revision.into(),
            message: "model info has no commit sha".into(),
        })?
        .to_string();
    let files = v["siblings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            Some(RemoteFile {
                name: s["rfilename"].as_str()?.to_string(),
                size: s["size"].as_u64().or_else(|| s["lfs"]["size"].as_u64()),
            })
        })
        .collect();
    Ok((commit, files))
}

/// `repo@revision` as a local directory: from the cache only when `env.offline`, else resolved on
/// the hub and downloaded as needed (falling back to the cache when the hub cannot be reached).
pub fn resolve(repo: &str, revision: &str, env: &HubEnv) -> Result<Resolved> {
    let cached = |commit: String, dir: PathBuf| Resolved {
        dir,
        source: Source::Hub {
            repo: repo.into(),
            revision: revision.into(),
            commit,
            downloaded: 0,
        },
    };
    if env.offline {
        let (commit, dir) = resolve_cached(&env.cache, repo, revision)?;
        return Ok(cached(commit, dir));
    }
    let mut b = ApiBuilder::from_cache(Cache::new(env.cache.clone()))
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_retries(2);
    if let Some(t) = &env.token {
        b = b.with_token(Some(t.clone()));
    }
    if let Some(e) = &env.endpoint {
        b = b.with_endpoint(e.clone());
    }
    let api = b
        .build()
        .map_err(|e| api_error(repo, revision, "client", e))?;
    let (commit, files) = match repo_info(&api, repo, revision) {
        Ok(x) => x,
        Err(HubError::Network { message, .. }) => {
            // Unreachable hub: a complete cached snapshot of this revision still serves.
            let (commit, dir) =
                resolve_cached(&env.cache, repo, revision).map_err(|_| HubError::Network {
                    repo: repo.into(),
                    revision: revision.into(),
                    message,
                })?;
            tracing::warn!("{repo}@{revision}: hub unreachable; using the cached commit {commit}");
            return Ok(cached(commit, dir));
        }
        Err(e) => return Err(e),
    };
    let cache = RepoCache::new(&env.cache, repo);
    let snapshot = cache.snapshot(&commit);
    let pinned = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        commit.clone(),
    ));
    let mut names = wanted(repo, &files)?;
    let fetch = |name: &str| -> Result<PathBuf> {
        let have = snapshot.join(name);
        if have.exists() {
            return Ok(have);
        }
        pinned
            .download(name)
            .map_err(|e| api_error(repo, revision, &format!("download {name}"), e))
    };
    // The index is small; its shard list decides the rest.
    if names
        .last()
        .is_some_and(|n| n == "model.safetensors.index.json")
    {
        let p = fetch("model.safetensors.index.json")?;
        let text =
            rtune_fsio::read_string_bounded(&p, rtune_fsio::FileKind::ShardIndex).map_err(|e| {
                HubError::Io {
                    path: p.clone(),
                    op: "read",
                    source: e.into_io(),
                }
            })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| HubError::Repo {
            repo: repo.into(),
            message: format!("model.safetensors.index.json is not JSON: {e}"),
        })?;
        names.extend(shards(&v).map_err(|message| HubError::Repo {
            repo: repo.into(),
            message: format!("model.safetensors.index.json: {message}"),
        })?);
    }
    let needed = bytes_to_fetch(&names, &files, &snapshot);
    if needed > 0 {
        let at = existing_ancestor(&env.cache);
        let free = rtune_fsio::free_bytes(&at)?;
        // Room for the temporary `.part` file hf-hub renames into place is the file itself.
        check_fits(&env.cache, needed, free)?;
        tracing::info!(
            "{repo}@{revision}: downloading {:.1} MB into {}",
            needed as f64 / 1e6,
            env.cache.display()
        );
    }
    for n in &names {
        fetch(n)?;
    }
    // hf-hub records the pinned commit as a ref of its own name; huggingface_hub keeps only
    // named refs, so that one goes and `refs/<revision>` is written instead.
    if revision != commit {
        let _ = std::fs::remove_file(cache.ref_path(&commit));
    }
    cache.write_ref(revision, &commit)?;
    let missing = missing_files(&snapshot);
    if !missing.is_empty() {
        return Err(HubError::Repo {
            repo: repo.into(),
            message: format!(
                "after download, {} still lacks {}",
                snapshot.display(),
                missing.join(", ")
            ),
        });
    }
    Ok(Resolved {
        dir: snapshot,
        source: Source::Hub {
            repo: repo.into(),
            revision: revision.into(),
            commit,
            downloaded: needed,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(names: &[(&str, u64)]) -> Vec<RemoteFile> {
        names
            .iter()
            .map(|(n, s)| RemoteFile {
                name: n.to_string(),
                size: Some(*s),
            })
            .collect()
    }

    #[test]
    fn only_the_model_files_are_wanted() {
        let f = files(&[
            ("config.json", 1),
            ("tokenizer.json", 2),
            ("README.md", 3),
            ("model.safetensors", 4),
            ("pytorch_model.bin", 5),
            ("onnx/model.onnx", 6),
        ]);
        assert_eq!(
            wanted("o/m", &f).unwrap(),
            ["config.json", "tokenizer.json", "model.safetensors"]
        );
        let sharded = files(&[("config.json", 1), ("model.safetensors.index.json", 1)]);
        assert_eq!(
            wanted("o/m", &sharded).unwrap(),
            ["config.json", "model.safetensors.index.json"]
        );
        let pickle = files(&[("config.json", 1), ("pytorch_model.bin", 1)]);
        let e = wanted("o/m", &pickle).unwrap_err().to_string();
        assert!(
            e.contains("safetensors") && e.contains("pytorch_model.bin"),
            "{e}"
        );
        let e = wanted("o/m", &files(&[("model.safetensors", 1)])).unwrap_err();
        assert!(e.to_string().contains("config.json"), "{e}");
    }

    #[test]
    fn disk_full_refusal_names_the_numbers() {
        check_fits(Path::new("/c"), 10, 10).unwrap();
        let e = check_fits(Path::new("/c"), 5_000_000_001, 1_000_000_000).unwrap_err();
        assert!(matches!(
            e,
            HubError::DiskFull {
                needed: 5_000_000_001,
                free: 1_000_000_000,
                ..
            }
        ));
        let s = e.to_string();
        assert!(
            s.contains("5000000001")
                && s.contains("5.00 GB")
                && s.contains("1.00 GB")
                && s.contains("/c"),
            "{s}"
        );
        assert!(!e.is_input_error());
    }

    #[test]
    fn bytes_to_fetch_skips_files_in_the_snapshot() {
        let dir = std::env::temp_dir().join(format!("rtune-hub-fetch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        let f = files(&[("config.json", 100), ("model.safetensors", 7_000)]);
        let names = vec!["config.json".to_string(), "model.safetensors".to_string()];
        assert_eq!(bytes_to_fetch(&names, &f, &dir), 7_000);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn token_is_not_in_debug_output() {
        let env = HubEnv {
            cache: "/c".into(),
            offline: false,
            token: Some("hf_secretvalue".into()),
            endpoint: None,
        };
        let s = format!("{env:?}");
        assert!(!s.contains("hf_secretvalue") && s.contains("<set>"), "{s}");
        assert!(truthy("1") && truthy("true") && truthy("YES") && !truthy("0") && !truthy(""));
    }
}
