//! `[output] remote` against a real S3 server: `s3s-fs` (the S3 protocol with signature checks over
//! a directory; installed by scripts/deps/s3s-fs.sh), started by each test on a free 127.0.0.1
//! port. The bucket is a directory of the server's root, so the tests read (and corrupt) what the
//! store holds directly. Cases: every checkpoint and the final files uploaded, verified against
//! the local manifests, and `rtune export --run s3://…`; kill -9, the local directory deleted, the
//! newest remote checkpoint corrupted, `--resume` → the previous remote checkpoint, and an adapter
//! identical to an uninterrupted run's; a resume from the store pinned to the CBLAS the store's
//! run.json records; the server down for part of the run → uploads catch up;
//! never back → exit 1 after `remote_timeout` with the local run complete; a wrong secret key →
//! exit 2 before anything is written. Issue 35: a finished run's prefix is not reused without
//! `overwrite`; a second run on a claimed prefix is refused at start; a run whose prefix is taken
//! over stops uploading.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{root, rtune_env, stderr};
use crate::resume::config;

const KEY: &str = "rtune-test-key";
const SECRET: &str = "rtune-test-secret-0123456789";
const BUCKET: &str = "runs";

/// Where scripts/deps/s3s-fs.sh installs the server.
fn s3s_fs() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache"));
    let bin = cache.join("rtune-deps/s3s-fs/bin/s3s-fs");
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/test.sh (or scripts/deps/s3s-fs.sh) to install the S3 test server",
        bin.display()
    );
    bin
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until something accepts connections on `port`.
pub(crate) fn wait_for_port(port: u16, what: &str, limit: Duration) {
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < limit, "{what} did not start on port {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An s3s-fs process over `root` (the bucket `runs` is `root/runs`); killed when dropped.
struct S3 {
    child: Option<Child>,
    port: u16,
    root: PathBuf,
}

impl S3 {
    fn start(root: &Path) -> Self {
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        let mut s = Self {
            child: None,
            port: free_port(),
            root: root.to_path_buf(),
        };
        s.restart();
        s
    }

    fn restart(&mut self) {
        let child = Command::new(s3s_fs())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", KEY, "--secret-key", SECRET])
            .arg(&self.root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start s3s-fs");
        self.child = Some(child);
        wait_for_port(self.port, "s3s-fs", Duration::from_secs(20));
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The environment rtune reads its store settings from.
    fn env(&self, secret: &str) -> Vec<(String, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID".into(), KEY.into()),
            ("AWS_SECRET_ACCESS_KEY".into(), secret.into()),
            (
                "AWS_ENDPOINT_URL".into(),
                format!("http://127.0.0.1:{}", self.port),
            ),
            ("AWS_ALLOW_HTTP".into(), "true".into()),
            ("AWS_REGION".into(), "us-east-1".into()),
        ]
    }

    /// What the store holds under `prefix`, as files.
    fn dir(&self, prefix: &str) -> PathBuf {
        self.root.join(BUCKET).join(prefix)
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        self.stop();
    }
}

fn url(prefix: &str) -> String {
    format!("s3://{BUCKET}/{prefix}")
}

fn run_with(cfg: &Path, args: &[&str], env: &[(String, String)]) -> Output {
    let mut a = vec!["train", "--config", cfg.to_str().unwrap()];
    a.extend(args);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    rtune_env(&a, &env)
}

/// `rtune train` in the background with `env`.
fn spawn(cfg: &Path, args: &[&str], env: &[(String, String)]) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rtune"));
    c.args(["train", "--config", cfg.to_str().unwrap()])
        .args(args)
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn steps_done(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
}

fn manifest_sums(dir: &Path) -> serde_json::Value {
    let text = std::fs::read(dir.join("manifest.json")).unwrap();
    serde_json::from_slice::<serde_json::Value>(&text).unwrap()["files"].clone()
}

fn sha256(path: &Path) -> String {
    rtune_fsio::sha256_file(path).unwrap()
}

/// Every checkpoint reaches the store (or is reported as skipped for a newer one), each file
/// matching the local manifest; the final files are there, byte for byte; metrics.jsonl carries
/// the mirror's state; `rtune export --run s3://…` exports the remote run.
#[test]
fn a_run_is_mirrored_checkpoints_and_final_files() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3::start(&tmp.path().join("store"));
    let out = tmp.path().join("mirrored");
    let extra = format!("remote = \"{}\"", url("team/a"));
    let cfg = config(tmp.path(), &out, &extra);
    // Every checkpoint kept, here and in the store.
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("keep_last = 2\n", "keep_last = 0\n")).unwrap();
    let o = run_with(&cfg, &[], &s3.env(SECRET));
    assert!(o.status.success(), "{}", stderr(&o));
    let remote = s3.dir("team/a");
    let log = stderr(&o);
    for step in (4..=28).step_by(4).chain([30]) {
        let (local, there) = (
            out.join(format!("checkpoint-{step}")),
            remote.join(format!("checkpoint-{step}")),
        );
        if !there.join("manifest.json").exists() {
            assert!(
                log.contains(&format!("checkpoint-{step} not uploaded (checkpoint-")) && step != 30,
                "checkpoint-{step} neither uploaded nor reported skipped:\n{log}"
            );
            continue;
        }
        assert_eq!(manifest_sums(&there), manifest_sums(&local));
        for (f, e) in manifest_sums(&there).as_object().unwrap() {
            assert_eq!(
                sha256(&there.join(f)),
                e["sha256"].as_str().unwrap(),
                "{step}/{f}"
            );
        }
    }
    for f in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "run.json",
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "loss.svg",
    ] {
        assert_eq!(
            std::fs::read(remote.join(f)).unwrap(),
            std::fs::read(out.join(f)).unwrap(),
            "{f}"
        );
    }
    let events: Vec<_> = std::fs::read_dir(remote.join("tb")).unwrap().collect();
    assert_eq!(events.len(), 1, "TensorBoard events uploaded");
    let run_json = std::fs::read_to_string(out.join("run.json")).unwrap();
    assert!(
        run_json.contains(&url("team/a")) && !run_json.contains(SECRET) && !log.contains(SECRET)
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert!(
        last["remote_step"].is_u64() || last["remote_step"].is_null(),
        "{last}"
    );
    assert_eq!(last["remote_failures"], 0, "{last}");

    let exported = tmp.path().join("exported");
    let owned = s3.env(SECRET);
    let env2: Vec<(&str, &str)> = owned
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let u = url("team/a");
    let o = rtune_env(
        &[
            "export",
            "--run",
            &u,
            "--format",
            "peft",
            "--out",
            exported.to_str().unwrap(),
        ],
        &env2,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(exported.join("adapter_model.safetensors")).unwrap(),
        std::fs::read(out.join("adapter_model.safetensors")).unwrap()
    );
}

/// kill -9 mid-run, the local directory deleted, the newest remote checkpoint's adapter flipped:
/// `--resume` reports it, takes the previous remote checkpoint, and ends with the adapter of a run
/// never interrupted.
#[test]
fn resume_from_the_store_after_kill_9_skips_a_corrupt_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    let o = run_with(&config(tmp.path(), &reference, ""), &[], &[]);
    assert!(o.status.success(), "{}", stderr(&o));

    let s3 = S3::start(&tmp.path().join("store"));
    let out = tmp.path().join("spot");
    let extra = format!("remote = \"{}\"", url("spot"));
    let cfg = config(tmp.path(), &out, &extra);
    let remote = s3.dir("spot");
    let mut child = spawn(&cfg, &[], &s3.env(SECRET));
    wait_for("two remote checkpoints", Duration::from_secs(120), || {
        (4..30)
            .filter(|s| {
                remote
                    .join(format!("checkpoint-{s}/manifest.json"))
                    .exists()
            })
            .count()
            >= 2
    });
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
    std::fs::remove_dir_all(&out).unwrap();
    let newest = (4..=30)
        .rev()
        .find(|s| {
            remote
                .join(format!("checkpoint-{s}/manifest.json"))
                .exists()
        })
        .unwrap();
    let adapter = remote.join(format!("checkpoint-{newest}/adapter_model.safetensors"));
    let mut bytes = std::fs::read(&adapter).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&adapter, bytes).unwrap();

    let o = run_with(&cfg, &["--resume"], &s3.env(SECRET));
    let log = stderr(&o);
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains(&format!("{}/checkpoint-{newest}: unusable", url("spot"))),
        "the corrupt checkpoint is reported:\n{log}"
    );
    assert!(log.contains("fetched checkpoint-"), "{log}");
    assert!(log.contains("resuming at step"), "{log}");
    assert_eq!(
        std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
        std::fs::read(reference.join("adapter_model.safetensors")).unwrap(),
        "the resumed run's adapter differs from the uninterrupted run's"
    );
}

/// A resume from the store keeps the CBLAS the run recorded (`rtune_backend::pin`), though the
/// store's run.json arrives with the checkpoint, after `main` loads the libraries: `main` reads it
/// first. The run starts with `RTUNE_BLAS=off` (run.json: `hardware.blas` null, candle's gemm),
/// is killed after a remote checkpoint, its local directory deleted; the resume sets no
/// variable, so unpinned it would load OpenBLAS (skipped where OpenBLAS is not installed). It
/// must record no CBLAS for its attempt and end with the adapter and metrics of an uninterrupted
/// `RTUNE_BLAS=off` run, byte for byte.
#[test]
fn a_resume_from_the_store_keeps_the_cblas_the_run_recorded() {
    let has_openblas = Command::new("ldconfig")
        .arg("-p")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("libopenblas.so.0"));
    if !has_openblas {
        return eprintln!(
            "no libopenblas.so.0 here: a resume would not load it either; nothing to check"
        );
    }
    let train = |cfg: &Path, args: &[&str], env: &[(String, String)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_rtune"));
        c.args(["train", "--config", cfg.to_str().unwrap()])
            .args(args)
            .current_dir(root())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for k in ["RTUNE_BLAS", "RTUNE_MKL", "VIRTUAL_ENV", "CONDA_PREFIX"] {
            c.env_remove(k);
        }
        c.envs(env.iter().map(|(k, v)| (k, v)));
        c
    };
    let off = |mut env: Vec<(String, String)>| {
        env.push(("RTUNE_BLAS".into(), "off".into()));
        env
    };
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    let o = train(&config(tmp.path(), &reference, ""), &[], &off(Vec::new()))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));

    let s3 = S3::start(&tmp.path().join("store"));
    let out = tmp.path().join("pinned");
    let cfg = config(tmp.path(), &out, &format!("remote = \"{}\"", url("pinned")));
    let remote = s3.dir("pinned");
    let mut child = train(&cfg, &[], &off(s3.env(SECRET))).spawn().unwrap();
    wait_for("a remote checkpoint", Duration::from_secs(120), || {
        (4..30).any(|s| {
            remote
                .join(format!("checkpoint-{s}/manifest.json"))
                .exists()
        })
    });
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
    std::fs::remove_dir_all(&out).unwrap();

    let o = train(&cfg, &["--resume"], &s3.env(SECRET))
        .output()
        .unwrap();
    let log = stderr(&o);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("fetched checkpoint-"), "{log}");
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("run.json")).unwrap()).unwrap();
    let attempts = record["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{record}");
    assert!(
        attempts.iter().all(|a| a["blas"].is_null()),
        "each attempt on candle's gemm, as the store's run.json records: {record}"
    );
    assert_eq!(
        std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
        std::fs::read(reference.join("adapter_model.safetensors")).unwrap(),
        "the resumed run's adapter differs from the uninterrupted run's"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].clone())
            .collect::<Vec<_>>(),
        std::fs::read_to_string(reference.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].clone())
            .collect::<Vec<_>>(),
        "the resumed run's losses differ from the uninterrupted run's"
    );
}

/// The store goes away after the first steps and comes back: training never waits, failures are
/// reported, and the uploads catch up (the final checkpoint and files are in the store).
#[test]
fn uploads_catch_up_after_the_store_returns() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s3 = S3::start(&tmp.path().join("store"));
    let out = tmp.path().join("flaky");
    let extra = format!("remote = \"{}\"\nremote_timeout = \"2m\"", url("flaky"));
    let cfg = config(tmp.path(), &out, &extra);
    let child = spawn(&cfg, &[], &s3.env(SECRET));
    wait_for("step 2", Duration::from_secs(60), || steps_done(&out) >= 2);
    s3.stop();
    wait_for(
        "step 20 with the store down",
        Duration::from_secs(120),
        || steps_done(&out) >= 20,
    );
    std::thread::sleep(Duration::from_secs(1));
    s3.restart();
    let o = child.wait_with_output().unwrap();
    let log = stderr(&o);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("remote: upload failed, retrying"), "{log}");
    assert!(log.contains("reachable again"), "{log}");
    let remote = s3.dir("flaky");
    assert!(remote.join("checkpoint-30/manifest.json").exists());
    assert_eq!(
        std::fs::read(remote.join("adapter_model.safetensors")).unwrap(),
        std::fs::read(out.join("adapter_model.safetensors")).unwrap()
    );
    assert!(remote.join("summary.json").exists());
}

/// The store goes away for good: the run completes locally, waits `remote_timeout`, and exits 1
/// naming what was not uploaded.
#[test]
fn a_store_that_never_returns_fails_the_run_after_the_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s3 = S3::start(&tmp.path().join("store"));
    let out = tmp.path().join("gone");
    let extra = format!("remote = \"{}\"\nremote_timeout = \"3s\"", url("gone"));
    let cfg = config(tmp.path(), &out, &extra);
    let child = spawn(&cfg, &[], &s3.env(SECRET));
    wait_for("step 1", Duration::from_secs(60), || steps_done(&out) >= 1);
    s3.stop();
    let t0 = Instant::now();
    let o = child.wait_with_output().unwrap();
    let log = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{log}");
    assert!(t0.elapsed() >= Duration::from_secs(3));
    assert!(log.contains("within [output] remote_timeout"), "{log}");
    assert!(
        log.contains("summary.json") && log.contains("adapter_model.safetensors"),
        "{log}"
    );
    assert!(log.contains("the local run in"), "{log}");
    for f in [
        "summary.json",
        "adapter_model.safetensors",
        "checkpoint-30/manifest.json",
    ] {
        assert!(out.join(f).exists(), "{f} missing locally");
    }
}

/// A wrong secret key is refused at start (exit 2), naming the URL and the reason, before the run
/// directory is created.
#[test]
fn a_wrong_secret_key_is_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3::start(&tmp.path().join("store"));
    let out = tmp.path().join("refused");
    let extra = format!("remote = \"{}\"", url("refused"));
    let cfg = config(tmp.path(), &out, &extra);
    let o = run_with(&cfg, &[], &s3.env("not-the-secret"));
    let log = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{log}");
    assert!(
        log.contains(&url("refused")) && log.contains("bad credentials"),
        "{log}"
    );
    assert!(
        !log.contains("not-the-secret"),
        "the secret is never printed"
    );
    assert!(!out.exists(), "nothing written");
}

/// The run marker in the store, parsed.
fn marker(s3: &S3, prefix: &str) -> serde_json::Value {
    let text = std::fs::read(s3.dir(prefix).join("rtune-run.json")).unwrap();
    serde_json::from_slice(&text).unwrap()
}

/// Issue 35: a new run pointed at a prefix holding a finished run replaced it silently. Now it is
/// refused at start (exit 2, nothing written here or there) unless `[output] overwrite = true`,
/// which replaces the earlier run's objects.
#[test]
fn a_finished_runs_prefix_is_not_reused_without_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3::start(&tmp.path().join("store"));
    let extra = format!("remote = \"{}\"", url("done"));
    let short = ["--set", "train.steps=8"];
    let first = tmp.path().join("first");
    let o = run_with(&config(tmp.path(), &first, &extra), &short, &s3.env(SECRET));
    assert!(o.status.success(), "{}", stderr(&o));
    let remote = s3.dir("done");
    let summary = std::fs::read(remote.join("summary.json")).unwrap();
    let first_run = marker(&s3, "done")["run_id"].clone();
    assert!(first_run.is_string(), "the run marked the prefix");

    let second = tmp.path().join("second");
    let cfg = config(tmp.path(), &second, &extra);
    for args in [&short[..], &["--set", "train.steps=8", "--resume"][..]] {
        let o = run_with(&cfg, args, &s3.env(SECRET));
        let log = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{log}");
        assert!(log.contains("holds a finished run"), "{log}");
        assert!(log.contains(&url("done")), "{log}");
        assert!(!second.exists(), "nothing written locally");
        assert_eq!(std::fs::read(remote.join("summary.json")).unwrap(), summary);
    }

    let o = run_with(
        &cfg,
        &["--set", "train.steps=4", "--set", "output.overwrite=true"],
        &s3.env(SECRET),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    for f in ["summary.json", "adapter_model.safetensors"] {
        assert_eq!(
            std::fs::read(remote.join(f)).unwrap(),
            std::fs::read(second.join(f)).unwrap(),
            "{f} is the new run's"
        );
    }
    // (s3s-fs keeps a prefix's directory once its objects are deleted.)
    for f in [
        "manifest.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
    ] {
        assert!(
            !remote.join("checkpoint-8").join(f).exists(),
            "the earlier run's checkpoint-8/{f} is gone"
        );
    }
    assert!(remote.join("checkpoint-4/manifest.json").exists());
    assert_ne!(
        marker(&s3, "done")["run_id"],
        first_run,
        "the prefix is the new run's"
    );
}

/// Issue 35: two runs on one prefix at once both exited 0 and the store ended with a mix. Now the
/// second is refused at start (exit 2, fresh or `--resume`), and the first's run is what the
/// store holds.
#[test]
fn a_second_run_on_a_claimed_prefix_is_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3::start(&tmp.path().join("store"));
    let extra = format!("remote = \"{}\"", url("shared"));
    let a = tmp.path().join("a");
    let child = spawn(&config(tmp.path(), &a, &extra), &[], &s3.env(SECRET));
    let remote = s3.dir("shared");
    wait_for("the run marker", Duration::from_secs(60), || {
        remote.join("rtune-run.json").exists()
    });
    let pid = child.id();
    assert_eq!(marker(&s3, "shared")["pid"], pid);
    let b = tmp.path().join("b");
    let cfg = config(tmp.path(), &b, &extra);
    for (args, refusal) in [
        (&[][..], "is claimed by run"),
        (&["--resume"][..], "still running on this machine"),
    ] {
        let o = run_with(&cfg, args, &s3.env(SECRET));
        let log = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{log}");
        assert!(log.contains(refusal), "{log}");
        assert!(!b.exists(), "nothing written locally");
    }
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(remote.join("adapter_model.safetensors")).unwrap(),
        std::fs::read(a.join("adapter_model.safetensors")).unwrap()
    );
    assert_eq!(
        marker(&s3, "shared")["pid"],
        pid,
        "the prefix stayed the first run's"
    );
}

/// The lease: a run whose prefix another run claimed meanwhile uploads nothing more and exits 1
/// saying so (its local run is complete).
#[test]
fn a_run_whose_prefix_is_taken_over_stops_uploading() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3::start(&tmp.path().join("store"));
    let extra = format!("remote = \"{}\"", url("lease"));
    let a = tmp.path().join("a");
    let child = spawn(&config(tmp.path(), &a, &extra), &[], &s3.env(SECRET));
    let remote = s3.dir("lease");
    wait_for("the run marker", Duration::from_secs(60), || {
        remote.join("rtune-run.json").exists()
    });
    let mut other = marker(&s3, "lease");
    other["run_id"] = "another-run".into();
    other["pid"] = 1.into();
    std::fs::write(
        remote.join("rtune-run.json"),
        serde_json::to_vec(&other).unwrap(),
    )
    .unwrap();
    let o = child.wait_with_output().unwrap();
    let log = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{log}");
    assert!(log.contains("taken over by run another-run"), "{log}");
    assert!(a.join("summary.json").exists(), "the local run is complete");
    assert!(!remote.join("summary.json").exists(), "{log}");
}

/// A raw HTTP server on 127.0.0.1 that answers every PUT with 200 and every GET with a
/// `Content-Length` of `claimed` bytes, then sends a few and hangs up: a lying S3 server.
fn lying_server(claimed: u64) -> u16 {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let mut r = BufReader::new(conn);
            let (mut head, mut body_len) = (String::new(), 0usize);
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    body_len = v.trim().parse().unwrap_or(0);
                }
                head.push_str(&line);
            }
            let mut body = vec![0u8; body_len];
            let _ = r.read_exact(&mut body);
            let mut conn = r.into_inner();
            let common = "ETag: \"e\"\r\nLast-Modified: Tue, 15 Nov 1994 08:12:31 GMT\r\nConnection: close\r\n";
            if !head.starts_with("GET") {
                let reply = format!("HTTP/1.1 200 OK\r\n{common}Content-Length: 0\r\n\r\n");
                let _ = conn.write_all(reply.as_bytes());
                continue;
            }
            // The body in two pieces: a reader that reserves the claimed length does so when
            // the second arrives (object_store's `collect_bytes`).
            let head = format!("HTTP/1.1 200 OK\r\n{common}Content-Length: {claimed}\r\n\r\n");
            for piece in [head.as_str(), "rtune ", "probe"] {
                let _ = conn.write_all(piece.as_bytes());
                let _ = conn.flush();
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    });
    port
}

/// Issue 46: the start-up probe read its object back with object_store's `bytes()`, which
/// reserves the server's `Content-Length`: a server claiming 10 GB aborted the run (under a
/// 6 GiB address-space limit). What is read is capped at what the probe wrote; the run is
/// refused at start, one line naming the store, nothing written.
#[test]
fn a_probe_object_claimed_at_10_gb_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let port = lying_server(10_000_000_000);
    let out = tmp.path().join("lied-to");
    let cfg = config(tmp.path(), &out, &format!("remote = \"{}\"", url("lied")));
    // Under a 6 GiB address space, as the issue measured it.
    let mut c = Command::new("bash");
    c.arg("-c")
        .arg(format!(
            "ulimit -v 6291456 && exec \"$0\" train --config {}",
            cfg.display()
        ))
        .arg(env!("CARGO_BIN_EXE_rtune"))
        .current_dir(root())
        .env("RTUNE_CACHE", tmp.path().join("cache"))
        .env("AWS_ACCESS_KEY_ID", KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET)
        .env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_REGION", "us-east-1");
    let o = c.output().unwrap();
    let log = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{log}");
    let lines: Vec<&str> = log.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains(&url("lied")) && lines[0].contains("10000000000 bytes"),
        "{log}"
    );
    assert!(!out.exists(), "nothing written");
}
