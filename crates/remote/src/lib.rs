//! A run directory mirrored to S3-compatible storage (AWS S3, MinIO, s3s ...) through Apache
//! Arrow's `object_store`:
//! - [`Remote`]: one `s3://bucket/prefix` URL with its credentials from the standard `AWS_*`
//!   environment (never from the config, never printed), a small tokio runtime of its own, and the
//!   blocking operations the trainer needs: [`probe`](Remote::probe) (write, read back, delete),
//!   uploads checked against a SHA-256 (multipart above [`MULTIPART_BYTES`]), downloads, listing
//!   and deleting checkpoints;
//! - [`claim`]: the prefix claimed by one run (a marker object created conditionally), checked as
//!   a lease before every upload;
//! - [`mirror`]: the background uploader of checkpoints and of the run's final files;
//! - [`fetch`]: the newest remote checkpoint that verifies, brought back for `--resume`, and a
//!   finished run's files for `rtune export --run s3://…`.
//!
//! Layout under the prefix: the run directory's own (`checkpoint-<step>/…`, `metrics.jsonl`,
//! `run.json`, the adapter …). A checkpoint's `manifest.json` is uploaded last, so a remote
//! checkpoint exists exactly when its manifest does.

pub mod claim;
pub mod fetch;
pub mod mirror;

use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as Key;
use object_store::{
    BackoffConfig, ClientConfigKey, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
    WriteMultipart,
};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use claim::{Claim, ClaimMode, RUN_MARKER};
pub use mirror::{Mirror, Status};

/// Files above this size are uploaded in parts (S3's minimum part is 5 MiB).
pub const MULTIPART_BYTES: u64 = 16 << 20;
const PART_BYTES: usize = 8 << 20;
/// A checkpoint's manifest: the file that makes it exist.
pub const MANIFEST: &str = "manifest.json";

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The URL or the environment cannot make a store (an input error).
    #[error("{url}: {message}")]
    Setup { url: String, message: String },
    /// A request failed; `reason` names the cause (credentials, bucket, network).
    #[error("{url}: {op} {key}: {reason}")]
    Store {
        url: String,
        op: &'static str,
        key: String,
        reason: String,
    },
    /// What was read does not match its SHA-256 (an upload refused, or a download rejected).
    #[error("{what} does not match its checksum in manifest.json")]
    Checksum { what: String },
    /// The prefix belongs to another run (a finished one, or one that holds its marker).
    #[error("{url}: {message}")]
    Claimed { url: String, message: String },
    /// Another run claimed the prefix while this one was uploading: nothing more is uploaded.
    #[error("{url}: taken over by {by}; this run uploads nothing more there")]
    TakenOver { url: String, by: String },
    /// A local file could not be read or written.
    #[error("{}: {op}: {message}", path.display())]
    Local {
        path: PathBuf,
        op: &'static str,
        message: String,
    },
}

impl RemoteError {
    /// The store, its URL or what it holds is wrong (exit status 2), rather than this machine
    /// failing to write a local file (1).
    pub fn is_input_error(&self) -> bool {
        !matches!(self, RemoteError::Local { .. })
    }

    fn local<'a>(
        path: &'a Path,
        op: &'static str,
    ) -> impl FnOnce(std::io::Error) -> RemoteError + 'a {
        move |e| RemoteError::Local {
            path: path.to_path_buf(),
            op,
            message: e.to_string(),
        }
    }
}

impl From<rtune_fsio::IoError> for RemoteError {
    fn from(e: rtune_fsio::IoError) -> Self {
        RemoteError::Local {
            path: e.path,
            op: e.op,
            message: e.source.to_string(),
        }
    }
}

/// The cause of a failed request in a few words, then object_store's chain of errors.
fn describe(e: &object_store::Error) -> String {
    let mut chain = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let s_text = s.to_string();
        if !chain.contains(&s_text) {
            chain = format!("{chain}: {s_text}");
        }
        src = s.source();
    }
    let hint = if [
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "AccessDenied",
        "403",
    ]
    .iter()
    .any(|p| chain.contains(p))
    {
        "bad credentials (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
    } else if chain.contains("NoSuchBucket") {
        "no such bucket"
    } else if matches!(e, object_store::Error::NotFound { .. }) {
        "not found"
    } else if [
        "connect",
        "Connection refused",
        "timed out",
        "error sending request",
        "dns",
    ]
    .iter()
    .any(|p| chain.contains(p))
    {
        "unreachable"
    } else {
        "request failed"
    };
    let mut chain: String = chain.chars().take(400).collect();
    chain = chain.replace('\n', " ");
    format!("{hint} ({chain})")
}

/// One S3 URL, opened. Blocking methods; each runs on this value's own runtime.
pub struct Remote {
    url: String,
    store: AmazonS3,
    /// The key prefix under the bucket ("" for the bucket's root).
    prefix: String,
    rt: tokio::runtime::Runtime,
    /// The run id of this process's claim on the prefix, once made ([`claim`]).
    owner: Option<String>,
    /// Whether that claim created the marker (rather than took it over).
    created_marker: bool,
}

/// `s3://bucket/a/b` → `("bucket", "a/b")`.
fn split_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("s3://")?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    (!bucket.is_empty()).then_some((bucket, prefix.trim_matches('/')))
}

impl Remote {
    /// Opens `url` (`s3://bucket/prefix`) with the credentials, region and endpoint of the
    /// environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
    /// `AWS_REGION`/`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`). Nothing is sent
    /// yet. Requests give up after a few quick retries: the mirror retries with its own backoff.
    pub fn open(url: &str) -> Result<Self, RemoteError> {
        let setup = |message: String| RemoteError::Setup {
            url: url.to_string(),
            message,
        };
        let (bucket, prefix) =
            split_url(url).ok_or_else(|| setup("not an s3://bucket/prefix URL".into()))?;
        let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
        if std::env::var_os("AWS_REGION").is_none() {
            if let Ok(r) = std::env::var("AWS_DEFAULT_REGION") {
                b = b.with_region(r);
            }
        }
        let store = b
            .with_config(
                AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                "5s",
            )
            .with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), "120s")
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(1),
                    base: 2.0,
                },
                max_retries: 2,
                retry_timeout: Duration::from_secs(10),
            })
            .build()
            .map_err(|e| setup(describe(&e)))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| setup(format!("cannot start the upload runtime: {e}")))?;
        Ok(Self {
            url: url.to_string(),
            store,
            prefix: prefix.to_string(),
            rt,
            owner: None,
            created_marker: false,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// The key of `rel` (a `/`-separated path inside the run directory).
    fn key(&self, rel: &str) -> Key {
        if self.prefix.is_empty() {
            Key::from(rel)
        } else {
            Key::from(format!("{}/{rel}", self.prefix))
        }
    }

    fn store_err(
        &self,
        op: &'static str,
        rel: &str,
    ) -> impl FnOnce(object_store::Error) -> RemoteError + '_ {
        let key = rel.to_string();
        move |e| RemoteError::Store {
            url: self.url.clone(),
            op,
            key,
            reason: describe(&e),
        }
    }

    /// Writes a small object, reads it back, deletes it: the credentials, the bucket and the
    /// network all work, before a run depends on them.
    pub fn probe(&self) -> Result<(), RemoteError> {
        let rel = format!(".rtune-probe-{}", std::process::id());
        let body = format!("rtune probe {}\n", std::process::id()).into_bytes();
        self.put_bytes(&rel, body.clone())?;
        let back = self.get_bytes(&rel, body.len() as u64)?;
        if back != body {
            return Err(RemoteError::Store {
                url: self.url.clone(),
                op: "read back",
                key: rel,
                reason: "the object read back differs from what was written".into(),
            });
        }
        self.delete(&rel)
    }

    pub fn put_bytes(&self, rel: &str, bytes: Vec<u8>) -> Result<(), RemoteError> {
        let key = self.key(rel);
        self.rt
            .block_on(self.store.put(&key, PutPayload::from(bytes)))
            .map(|_| ())
            .map_err(self.store_err("put", rel))
    }

    /// Uploads the local file `local` as `rel`, in parts above [`MULTIPART_BYTES`]. With
    /// `sha256`, the bytes sent must have that SHA-256: a mismatch aborts the upload (nothing
    /// replaces the object) with [`RemoteError::Checksum`].
    pub fn put_file(
        &self,
        rel: &str,
        local: &Path,
        sha256: Option<&str>,
    ) -> Result<(), RemoteError> {
        let mut f = std::fs::File::open(local).map_err(RemoteError::local(local, "open"))?;
        let len = f
            .metadata()
            .map_err(RemoteError::local(local, "stat"))?
            .len();
        let mismatch = |h: Sha256| sha256.is_some_and(|want| want != hex(&h.finalize()));
        if len <= MULTIPART_BYTES {
            let mut bytes = Vec::with_capacity(len as usize);
            f.read_to_end(&mut bytes)
                .map_err(RemoteError::local(local, "read"))?;
            if mismatch(Sha256::new_with_prefix(&bytes)) {
                return Err(RemoteError::Checksum {
                    what: local.display().to_string(),
                });
            }
            return self.put_bytes(rel, bytes);
        }
        let key = self.key(rel);
        self.rt.block_on(async {
            let upload = self
                .store
                .put_multipart(&key)
                .await
                .map_err(self.store_err("start multipart upload", rel))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
            let (mut h, mut buf) = (Sha256::new(), vec![0u8; PART_BYTES]);
            loop {
                let n = match f.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) => {
                        let _ = w.abort().await;
                        return Err(RemoteError::local(local, "read")(e));
                    }
                };
                h.update(&buf[..n]);
                if let Err(e) = w.wait_for_capacity(4).await {
                    return Err(self.store_err("upload part", rel)(e));
                }
                w.write(&buf[..n]);
            }
            if mismatch(h) {
                let _ = w.abort().await;
                return Err(RemoteError::Checksum {
                    what: local.display().to_string(),
                });
            }
            w.finish()
                .await
                .map(|_| ())
                .map_err(self.store_err("finish multipart upload", rel))
        })
    }

    /// The object `rel`, at most `cap` bytes: an object the server says is larger is refused
    /// before its body is read, and one whose body runs past `cap` when it does. object_store's
    /// `bytes()` reserves the server's `Content-Length` up front (issue 46: a probe object claimed
    /// at 10 GB aborted the allocation); here memory grows only with the bytes that arrive.
    pub fn get_bytes(&self, rel: &str, cap: u64) -> Result<Vec<u8>, RemoteError> {
        let key = self.key(rel);
        self.rt.block_on(async {
            let r = self
                .store
                .get(&key)
                .await
                .map_err(self.store_err("get", rel))?;
            read_capped(r, cap)
                .await
                .map_err(|e| self.capped_err(rel, cap, e))
        })
    }

    fn capped_err(&self, rel: &str, cap: u64, e: Capped) -> RemoteError {
        match e {
            Capped::Store(e) => self.store_err("get", rel)(e),
            Capped::Over(size) => RemoteError::Store {
                url: self.url.clone(),
                op: "get",
                key: rel.to_string(),
                reason: format!(
                    "the server sends {size} bytes, over the {cap} this object can hold; refused \
                     unread (not an S3 server rtune can use, or not its object)"
                ),
            },
        }
    }

    /// Whether `rel` exists.
    pub fn exists(&self, rel: &str) -> Result<bool, RemoteError> {
        let key = self.key(rel);
        match self.rt.block_on(self.store.head(&key)) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.store_err("head", rel)(e)),
        }
    }

    pub fn delete(&self, rel: &str) -> Result<(), RemoteError> {
        let key = self.key(rel);
        self.rt
            .block_on(self.store.delete(&key))
            .map_err(self.store_err("delete", rel))
    }

    /// The remote checkpoints, newest first: `(step, has its manifest)`.
    pub fn checkpoints(&self) -> Result<Vec<(usize, bool)>, RemoteError> {
        let prefix = (!self.prefix.is_empty()).then(|| Key::from(self.prefix.as_str()));
        let listed = self
            .rt
            .block_on(self.store.list_with_delimiter(prefix.as_ref()))
            .map_err(self.store_err("list", ""))?;
        let mut steps: Vec<usize> = listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename()?.strip_prefix("checkpoint-")?.parse().ok())
            .collect();
        steps.sort_unstable_by(|a, b| b.cmp(a));
        steps
            .into_iter()
            .map(|s| Ok((s, self.exists(&format!("checkpoint-{s}/{MANIFEST}"))?)))
            .collect::<Result<Vec<(usize, bool)>, RemoteError>>()
    }

    /// Deletes `checkpoint-<step>/`: its manifest first, so a half-deleted checkpoint is never
    /// taken for a complete one.
    pub fn delete_checkpoint(&self, step: usize) -> Result<(), RemoteError> {
        let dir = format!("checkpoint-{step}");
        self.delete(&format!("{dir}/{MANIFEST}"))?;
        let key = self.key(&dir);
        let objects: Vec<_> = self.rt.block_on(async {
            let mut listed = self.store.list(Some(&key));
            let mut out = Vec::new();
            while let Some(m) = listed.next().await {
                out.push(m);
            }
            out
        });
        for m in objects {
            let m = m.map_err(self.store_err("list", &dir))?;
            self.rt
                .block_on(self.store.delete(&m.location))
                .map_err(self.store_err("delete", &dir))?;
        }
        Ok(())
    }
}

/// Why a capped read stopped.
enum Capped {
    Store(object_store::Error),
    /// The size the server announced, or the bytes it sent, past the cap.
    Over(u64),
}

/// The body of `r`, refused past `cap` bytes (see [`Remote::get_bytes`]).
async fn read_capped(r: object_store::GetResult, cap: u64) -> Result<Vec<u8>, Capped> {
    if r.meta.size > cap {
        return Err(Capped::Over(r.meta.size));
    }
    let mut out = Vec::new();
    let mut body = r.into_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(Capped::Store)?;
        let len = (out.len() + chunk.len()) as u64;
        if len > cap {
            return Err(Capped::Over(len));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Caps of what is read from the store: a checkpoint's manifest, run.json, the claim marker
/// (small JSON files), and the probe object.
pub const SMALL_OBJECT_BYTES: u64 = 16 << 20;
/// metrics.jsonl (a line per step, ~300 bytes: millions of steps) and a run's final files.
pub const LARGE_OBJECT_BYTES: u64 = 64 << 30;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A checkpoint's manifest.json (written by `rtune-train`'s checkpoint module): each file's size
/// and SHA-256.
#[derive(Debug, serde::Deserialize)]
pub struct Manifest {
    pub files: std::collections::BTreeMap<String, ManifestEntry>,
}

#[derive(Debug, serde::Deserialize)]
pub struct ManifestEntry {
    pub bytes: u64,
    pub sha256: String,
}

impl Manifest {
    pub fn parse(bytes: &[u8], what: &str) -> Result<Self, RemoteError> {
        serde_json::from_slice(bytes).map_err(|e| RemoteError::Checksum {
            what: format!("{what} (unreadable: {e})"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::split_url;

    #[test]
    fn urls_split_into_bucket_and_prefix() {
        assert_eq!(split_url("s3://b/runs/x/"), Some(("b", "runs/x")));
        assert_eq!(split_url("s3://b"), Some(("b", "")));
        assert_eq!(split_url("s3:///x"), None);
        assert_eq!(split_url("http://b/x"), None);
    }
}
