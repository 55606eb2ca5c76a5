//! Hub models without the network: a cache directory the test lays out as huggingface_hub does
//! (blobs, snapshot symlinks, refs) for offline resolution, and a fake hub on 127.0.0.1 (bounded:
//! one thread, a fixed number of connections, read timeouts) for the download path — file
//! selection, the commit pin, the Python cache layout, the token header, the disk check and the
//! HTTP errors.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rtune_hub::download::{resolve, HubEnv};
use rtune_hub::{HubError, Source};

const SHA: &str = "6d2b0f5e4f1c9a3b7e8d0c1f2a3b4c5d6e7f8091";

fn fixture(f: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-llama")
            .join(f),
    )
    .unwrap()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rtune-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn env(cache: &Path, offline: bool, endpoint: Option<String>) -> HubEnv {
    HubEnv {
        cache: cache.to_path_buf(),
        offline,
        token: None,
        endpoint,
    }
}

/// `models--org--tiny` with `files` as blobs, snapshot symlinks to them, and `refs/main`.
fn build_cache(cache: &Path, files: &[(&str, Vec<u8>)]) -> PathBuf {
    let repo = cache.join("models--org--tiny");
    let snap = repo.join("snapshots").join(SHA);
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for (i, (name, bytes)) in files.iter().enumerate() {
        let etag = format!("blob{i:04}");
        std::fs::write(repo.join("blobs").join(&etag), bytes).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{etag}"), snap.join(name)).unwrap();
    }
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), SHA).unwrap();
    snap
}

fn model_files() -> Vec<(&'static str, Vec<u8>)> {
    [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .into_iter()
    .map(|f| (f, fixture(f)))
    .collect()
}

#[test]
fn offline_resolution_reads_the_python_cache_layout() {
    let cache = tmp("offline");
    let snap = build_cache(&cache, &model_files());
    let r = resolve("org/tiny", "main", &env(&cache, true, None)).unwrap();
    assert_eq!(r.dir, snap);
    assert_eq!(
        r.source,
        Source::Hub {
            repo: "org/tiny".into(),
            revision: "main".into(),
            commit: SHA.into(),
            downloaded: 0
        }
    );
    // Through the symlinks the snapshot is an ordinary model directory.
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(r.dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["hidden_size"], 64);
    // A commit sha needs no ref.
    assert_eq!(
        resolve("org/tiny", SHA, &env(&cache, true, None))
            .unwrap()
            .dir,
        snap
    );
    // A revision never resolved here: the error names the ref and the cache.
    let e = resolve("org/tiny", "v2.0", &env(&cache, true, None)).unwrap_err();
    assert!(matches!(e, HubError::Offline { .. }));
    let s = e.to_string();
    assert!(
        s.contains("refs/v2.0")
            && s.contains(&cache.display().to_string())
            && s.contains("HF_HUB_OFFLINE"),
        "{s}"
    );
    // An unknown repository.
    let s = resolve("org/other", "main", &env(&cache, true, None))
        .unwrap_err()
        .to_string();
    assert!(
        s.contains("org/other@main") && s.contains("refs/main"),
        "{s}"
    );
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn offline_resolution_names_a_missing_shard() {
    let cache = tmp("shard");
    let index = br#"{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
        "b": "model-00002-of-00002.safetensors"}}"#;
    build_cache(
        &cache,
        &[
            ("config.json", fixture("config.json")),
            ("model.safetensors.index.json", index.to_vec()),
            ("model-00001-of-00002.safetensors", b"x".to_vec()),
        ],
    );
    let s = resolve("org/tiny", "main", &env(&cache, true, None))
        .unwrap_err()
        .to_string();
    assert!(
        s.contains(&format!("snapshots/{SHA}/model-00002-of-00002.safetensors")),
        "{s}"
    );
    assert!(!s.contains("00001"), "{s}");
    std::fs::remove_dir_all(&cache).unwrap();
}

/// What the fake hub serves and what it saw.
struct FakeHub {
    files: HashMap<String, Vec<u8>>,
    /// Sizes reported by the model API (the real ones unless overridden).
    sizes: HashMap<String, u64>,
    requests: Mutex<Vec<String>>,
    auth: Mutex<Vec<String>>,
}

fn respond(s: &mut std::net::TcpStream, status: &str, headers: &[(String, String)], body: &[u8]) {
    let mut head = format!(
        "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = s.write_all(head.as_bytes());
    let _ = s.write_all(body);
}

/// Serves `org/tiny` at commit SHA, `org/gated` as 401 and everything else as 404, for at most
/// 100 connections.
fn serve(hub: Arc<FakeHub>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in l.incoming().take(100) {
            let Ok(mut s) = stream else { continue };
            s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
                .unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            if r.read_line(&mut line).is_err() {
                continue;
            }
            let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
            let mut range = None;
            loop {
                let mut h = String::new();
                if r.read_line(&mut h).is_err() || h.trim().is_empty() {
                    break;
                }
                let (k, v) = h.split_once(':').unwrap_or(("", ""));
                match k.to_ascii_lowercase().as_str() {
                    "range" => range = Some(v.trim().to_string()),
                    "authorization" => hub.auth.lock().unwrap().push(v.trim().to_string()),
                    _ => {}
                }
            }
            hub.requests.lock().unwrap().push(path.clone());
            if path.starts_with("/api/models/org/gated") {
                respond(&mut s, "401 Unauthorized", &[], b"");
            } else if path.starts_with("/api/models/org/tiny/revision/main") {
                let siblings: Vec<serde_json::Value> = hub
                    .files
                    .keys()
                    .map(|f| serde_json::json!({"rfilename": f, "size": hub.sizes[f]}))
                    .collect();
                let body = serde_json::json!({"id": "org/tiny", "sha": SHA, "siblings": siblings});
                respond(&mut s, "200 OK", &[], body.to_string().as_bytes());
            } else if let Some(f) = path.strip_prefix(&format!("/org/tiny/resolve/{SHA}/")) {
                let Some(bytes) = hub.files.get(f) else {
                    respond(&mut s, "404 Not Found", &[], b"");
                    continue;
                };
                let start: usize = range
                    .as_deref()
                    .and_then(|r| r.strip_prefix("bytes="))
                    .and_then(|r| r.split('-').next())
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0);
                let end = if range.as_deref() == Some("bytes=0-0") {
                    1
                } else {
                    bytes.len()
                };
                let headers = [
                    (
                        "etag".to_string(),
                        format!("\"{}\"", rtune_fsio::sha256_bytes(bytes)),
                    ),
                    ("x-repo-commit".to_string(), SHA.to_string()),
                    (
                        "content-range".to_string(),
                        format!("bytes {start}-{}/{}", end.max(1) - 1, bytes.len()),
                    ),
                ];
                respond(&mut s, "206 Partial Content", &headers, &bytes[start..end]);
            } else {
                respond(&mut s, "404 Not Found", &[], b"");
            }
        }
    });
    addr
}

fn fake_hub(sizes: &[(&str, u64)]) -> Arc<FakeHub> {
    let mut files: HashMap<String, Vec<u8>> = model_files()
        .into_iter()
        .map(|(f, b)| (f.to_string(), b))
        .collect();
    files.insert("README.md".into(), b"# tiny".to_vec());
    files.insert("pytorch_model.bin".into(), b"not wanted".to_vec());
    let mut s: HashMap<String, u64> = files
        .iter()
        .map(|(f, b)| (f.clone(), b.len() as u64))
        .collect();
    for (f, n) in sizes {
        s.insert(f.to_string(), *n);
    }
    Arc::new(FakeHub {
        files,
        sizes: s,
        requests: Mutex::new(Vec::new()),
        auth: Mutex::new(Vec::new()),
    })
}

#[test]
fn download_fetches_only_model_files_into_the_python_layout() {
    let cache = tmp("download");
    let hub = fake_hub(&[]);
    let endpoint = serve(hub.clone());
    let mut e = env(&cache, false, Some(endpoint));
    e.token = Some("hf_testtoken".into());
    let r = resolve("org/tiny", "main", &e).unwrap();
    let repo = cache.join("models--org--tiny");
    assert_eq!(r.dir, repo.join("snapshots").join(SHA));
    let want: u64 = model_files().iter().map(|(_, b)| b.len() as u64).sum();
    assert!(
        matches!(&r.source, Source::Hub { commit, downloaded, .. } if commit == SHA && *downloaded == want)
    );
    for (f, bytes) in model_files() {
        let p = r.dir.join(f);
        assert!(
            p.symlink_metadata().unwrap().file_type().is_symlink(),
            "{f}"
        );
        assert_eq!(std::fs::read(&p).unwrap(), bytes, "{f}");
    }
    assert!(!r.dir.join("README.md").exists() && !r.dir.join("pytorch_model.bin").exists());
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        SHA
    );
    assert!(
        !repo.join("refs").join(SHA).exists(),
        "only named refs, as huggingface_hub keeps"
    );
    assert!(hub
        .auth
        .lock()
        .unwrap()
        .iter()
        .all(|a| a == "Bearer hf_testtoken"));
    assert!(!hub.auth.lock().unwrap().is_empty());
    // Files are fetched at the commit the revision resolved to.
    let reqs = hub.requests.lock().unwrap().clone();
    assert!(
        reqs.iter()
            .filter(|p| p.contains("/resolve/"))
            .all(|p| p.contains(SHA)),
        "{reqs:?}"
    );

    // Again: one API call, nothing downloaded; then offline from the same cache.
    let n = reqs.len();
    let again = resolve("org/tiny", "main", &e).unwrap();
    assert!(matches!(again.source, Source::Hub { downloaded: 0, .. }));
    assert_eq!(hub.requests.lock().unwrap().len(), n + 1);
    let off = resolve("org/tiny", "main", &env(&cache, true, None)).unwrap();
    assert_eq!(off.dir, r.dir);
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn download_that_does_not_fit_is_refused_before_any_file_is_fetched() {
    let cache = tmp("diskfull");
    // The hub says the weights are 4 EiB.
    let hub = fake_hub(&[("model.safetensors", 1 << 62)]);
    let e = env(&cache, false, Some(serve(hub.clone())));
    let err = resolve("org/tiny", "main", &e).unwrap_err();
    let s = err.to_string();
    let HubError::DiskFull { needed, free, .. } = err else {
        panic!("{s}")
    };
    assert!(needed >= 1 << 62 && free < needed);
    assert!(
        s.contains(&needed.to_string()) && s.contains(&free.to_string()),
        "{s}"
    );
    assert!(hub
        .requests
        .lock()
        .unwrap()
        .iter()
        .all(|p| !p.contains("/resolve/")));
    assert!(!cache.join("models--org--tiny/blobs").exists());
    std::fs::remove_dir_all(&cache).unwrap();
}

fn err_string(r: rtune_hub::Result<rtune_hub::Resolved>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn hub_errors_say_what_to_do() {
    let cache = tmp("errors");
    let hub = fake_hub(&[]);
    let e = env(&cache, false, Some(serve(hub)));
    let s = err_string(resolve("org/gated", "main", &e));
    assert!(s.contains("HTTP 401") && s.contains("HF_TOKEN"), "{s}");
    let s = err_string(resolve("org/nothing", "main", &e));
    assert!(s.contains("org/nothing") && s.contains("404"), "{s}");
    // Nothing listens on port 9 of the loopback: without a cache that is a network error ...
    let down = env(&cache, false, Some("http://127.0.0.1:9".into()));
    let err = resolve("org/tiny", "main", &down).unwrap_err();
    assert!(
        matches!(err, HubError::Network { .. }) && !err.is_input_error(),
        "{err}"
    );
    // ... and with the revision in the cache, the cached commit serves.
    build_cache(&cache, &model_files());
    let r = resolve("org/tiny", "main", &down).unwrap();
    assert!(matches!(r.source, Source::Hub { ref commit, .. } if commit == SHA));
    std::fs::remove_dir_all(&cache).unwrap();
}
