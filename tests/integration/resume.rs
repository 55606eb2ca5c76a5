//! Checkpoints that survive anything: exact resume after SIGTERM and kill -9, corrupt checkpoints,
//! a full disk, changed settings, private files.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{fixture, root, rtune_env, stderr};

/// A short run that exercises every piece of state: shuffling across epochs, a cursor inside an
/// epoch (3 rows a micro-batch of 6 examples... 2 micro-batches a step), dropout, clipping, a
/// cosine schedule with warm-up.
pub(crate) fn config(dir: &Path, out: &Path, extra: &str) -> PathBuf {
    let cfg = format!(
        r#"[model]
path = "{model}"
[lora]
r = 4
alpha = 8
dropout = 0.1
[data]
train = "{data}"
max_seq_len = 64
[train]
seed = 7
steps = 30
micro_batch_size = 4
grad_accum = 2
lr = 5e-3
warmup_steps = 3
max_grad_norm = 0.5
[output]
dir = "{out}"
save_every = 4
keep_last = 2
{extra}
"#,
        model = fixture("fixtures/tiny-llama3").display(),
        data = fixture("fixtures/smoke.jsonl").display(),
        out = out.display(),
    );
    let p = dir.join(format!(
        "run-{}.toml",
        out.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&p, cfg).unwrap();
    p
}

pub(crate) fn train(cfg: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
    args.extend(extra);
    rtune_env(&args, &[])
}

/// metrics.jsonl without the wall-clock and memory fields, which no two runs share.
pub(crate) fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.remove("tokens_per_s");
            o.remove("elapsed_s");
            o.remove("peak_memory_bytes");
            v
        })
        .collect()
}

fn assert_same_run(a: &Path, b: &Path) {
    let (fa, fb) = (
        a.join("adapter_model.safetensors"),
        b.join("adapter_model.safetensors"),
    );
    assert_eq!(
        std::fs::read(fa).unwrap(),
        std::fs::read(fb).unwrap(),
        "adapters differ"
    );
    assert_eq!(metrics(a), metrics(b), "metrics differ");
    assert_eq!(metrics(a).len(), 30);
}

fn reference(tmp: &Path) -> PathBuf {
    let out = tmp.join("reference");
    let o = train(&config(tmp, &out, ""), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    out
}

/// Starts `rtune train` on `cfg` and returns once `steps` lines are in metrics.jsonl.
pub(crate) fn spawn_until_step(cfg: &Path, out: &Path, steps: usize) -> std::process::Child {
    let child = Command::new(env!("CARGO_BIN_EXE_rtune"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
        < steps
    {
        assert!(t0.elapsed() < Duration::from_secs(60), "run did not start");
        std::thread::sleep(Duration::from_millis(2));
    }
    child
}

/// `kill -9` of a run of `cfg` once `steps` lines are in metrics.jsonl, then `--resume`: it must
/// say so and end with the uninterrupted run's adapter (in `reference`), byte for byte. The caller
/// compares what else its objective writes.
pub(crate) fn kill_then_resume_equals(cfg: &Path, out: &Path, steps: usize, reference: &Path) {
    let mut child = spawn_until_step(cfg, out, steps);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.join("summary.json").exists(), "killed before the end");
    let o = train(cfg, &["--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming at step"), "{}", stderr(&o));
    let read = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
    assert_eq!(read(reference), read(out), "adapters differ");
}

#[test]
fn sigterm_then_resume_is_bitwise_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path());
    let out = tmp.path().join("stopped");
    let cfg = config(tmp.path(), &out, "");
    let child = spawn_until_step(&cfg, &out, 6);
    // SAFETY: kill(2) on the pid of our own live child; no memory is involved.
    unsafe { libc_kill(child.id() as i32, 15) };
    let o = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "SIGTERM exits 0: {}", stderr(&o));
    assert!(
        said.contains("stopped after step") && said.contains("--resume"),
        "{said}"
    );
    assert!(!out.join("summary.json").exists());
    // Without --resume the unfinished run is not silently replaced.
    let o = train(&cfg, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--resume"), "{}", stderr(&o));
    let o = train(&cfg, &["--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming at step"), "{}", stderr(&o));
    assert_same_run(&reference, &out);
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("run.json")).unwrap()).unwrap();
    let attempts = record["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0]["status"], "stopped");
    assert_eq!(attempts[1]["status"], "completed");
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// kill -9 at 10 moments of the run — half after a seeded delay of 0–40 ms, half the moment a
/// checkpoint write is seen in progress — and resume after each: the final adapter and metrics equal
/// an uninterrupted run's.
#[test]
fn kill_9_anywhere_then_resume_is_bitwise_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path());
    let out = tmp.path().join("killed");
    // Checkpoint every step so that many kills land inside a checkpoint write.
    let cfg = config(tmp.path(), &out, "");
    let sets = ["--set", "output.save_every=1"];
    let mut lcg = 12345u64;
    let (mut kills, mut partial_seen) = (0, 0);
    for attempt in 0..40 {
        if out.join("summary.json").exists() {
            break;
        }
        let mut args = vec!["train", "--config", cfg.to_str().unwrap(), "--resume"];
        args.extend(sets);
        let mut child = Command::new(env!("CARGO_BIN_EXE_rtune"))
            .args(&args)
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if kills < 10 {
            // Let the run make progress (a newer checkpoint appears), then kill it within the next
            // step or so: sometimes mid-step, sometimes mid-checkpoint-write.
            let newest = |out: &Path| checkpoint_dirs(out).last().cloned();
            let before = if out.exists() { newest(&out) } else { None };
            let t0 = Instant::now();
            while child.try_wait().unwrap().is_none()
                && (!out.exists() || newest(&out) == before)
                && t0.elapsed() < Duration::from_secs(60)
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            lcg = lcg
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if kills % 2 == 0 {
                std::thread::sleep(Duration::from_millis((lcg >> 33) % 40));
            } else {
                // Odd kills aim at a checkpoint write: kill as soon as a temporary one shows up.
                let t1 = Instant::now();
                while child.try_wait().unwrap().is_none() && t1.elapsed() < Duration::from_secs(5) {
                    let writing = std::fs::read_dir(&out).is_ok_and(|d| {
                        d.flatten()
                            .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
                    });
                    if writing {
                        break;
                    }
                }
            }
            if child.try_wait().unwrap().is_none() {
                child.kill().unwrap(); // SIGKILL
                kills += 1;
                let _ = child.wait();
                let leftovers = std::fs::read_dir(&out).map_or(0, |d| {
                    d.flatten()
                        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
                        .count()
                });
                partial_seen += leftovers;
                continue;
            }
        }
        let status = child.wait().unwrap();
        assert!(status.success(), "attempt {attempt} failed");
    }
    eprintln!("{kills} kills, {partial_seen} left a partial write behind");
    assert!(kills >= 8, "only {kills} kills landed");
    assert_same_run(&reference, &out);
}

fn checkpoint_dirs(out: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("checkpoint-")
        })
        .collect();
    v.sort_by_key(|p| {
        p.file_name()
            .unwrap()
            .to_string_lossy()
            .trim_start_matches("checkpoint-")
            .parse::<usize>()
            .unwrap()
    });
    v
}

/// A run stopped by an injected failure after checkpoint-8 and checkpoint-12... then one checkpoint is
/// damaged in each of three ways; resume falls back to the previous one, says so, and still ends
/// bitwise identical.
#[test]
fn corrupt_checkpoints_fall_back_to_the_previous_one() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path());
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 3] = [
        ("truncated", |c| {
            let f = c.join("optimizer.safetensors");
            let len = std::fs::metadata(&f).unwrap().len();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&f)
                .unwrap()
                .set_len(len / 2)
                .unwrap();
        }),
        ("flipped byte", |c| {
            let f = c.join("adapter_model.safetensors");
            let mut b = std::fs::read(&f).unwrap();
            let n = b.len();
            b[n - 3] ^= 0x40;
            std::fs::write(&f, b).unwrap();
        }),
        ("missing file", |c| {
            std::fs::remove_file(c.join("trainer_state.json")).unwrap()
        }),
    ];
    for (what, damage) in damages {
        let out = tmp.path().join(what.replace(' ', "-"));
        let cfg = config(tmp.path(), &out, "");
        // Stop the run by failing every write after the second checkpoint (a full disk).
        let o = rtune_env(
            &[
                "train",
                "--config",
                cfg.to_str().unwrap(),
                "--set",
                "output.keep_last=0",
            ],
            &[("RTUNE_FAULT_ENOSPC_AFTER", "16")],
        );
        assert_eq!(o.status.code(), Some(1), "{what}: {}", stderr(&o));
        let cps = checkpoint_dirs(&out);
        assert!(cps.len() >= 2, "{what}: {cps:?}");
        damage(cps.last().unwrap());
        let o = train(&cfg, &["--resume"]);
        assert!(o.status.success(), "{what}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.contains("unusable") && err.contains("trying the previous checkpoint"),
            "{what}: {err}"
        );
        assert_same_run(&reference, &out);
    }
}

/// A full disk during a checkpoint write: the previous checkpoint stays intact and the run stops
/// with the reason; with on_save_error = "continue" it warns and finishes.
#[test]
fn disk_full_keeps_the_previous_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("full");
    let cfg = config(tmp.path(), &out, "");
    // Each checkpoint is 5 atomic writes, after 3 at start (run.json, config.toml) ... let the
    // first checkpoint through and fail inside the second.
    let o = rtune_env(
        &["train", "--config", cfg.to_str().unwrap()],
        &[("RTUNE_FAULT_ENOSPC_AFTER", "9")],
    );
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("No space left on device"), "{err}");
    let cps = checkpoint_dirs(&out);
    assert_eq!(cps.len(), 1, "{cps:?}");
    assert!(!std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".tmp")));
    let o = train(&cfg, &["--resume"]);
    assert!(
        o.status.success(),
        "previous checkpoint usable: {}",
        stderr(&o)
    );

    let out2 = tmp.path().join("continue");
    let cfg2 = config(tmp.path(), &out2, "on_save_error = \"continue\"");
    let o = rtune_env(
        &["train", "--config", cfg2.to_str().unwrap()],
        &[("RTUNE_FAULT_ENOSPC_AFTER", "9")],
    );
    // It trains on; the final writes fail too, so the run cannot end well, but every periodic
    // failure was a warning.
    assert!(
        stderr(&o).matches("not written").count() >= 2,
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read_to_string(out2.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        30
    );
}

#[test]
fn changed_settings_are_refused_unless_forced() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("changed");
    let cfg = config(tmp.path(), &out, "");
    let o = rtune_env(
        &["train", "--config", cfg.to_str().unwrap()],
        &[("RTUNE_FAULT_ENOSPC_AFTER", "9")],
    );
    assert!(!o.status.success());
    let o = train(
        &cfg,
        &[
            "--resume",
            "--set",
            "train.lr=1e-3",
            "--set",
            "train.micro_batch_size=2",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(
        err.contains("train.lr was 0.005, is now 0.001") && err.contains("train.micro_batch_size"),
        "{err}"
    );
    assert!(err.contains("--force"), "{err}");
    let o = train(&cfg, &["--resume", "--force", "--set", "train.lr=1e-3"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn outputs_are_private_and_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let out = reference(tmp.path());
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&out), 0o700);
    for e in walk(&out) {
        let want = if e.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(mode(&e), want, "{}", e.display());
    }
    // keep_last = 2: the last two of 4, 8, ..., 28, 30
    let names: Vec<String> = checkpoint_dirs(&out)
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["checkpoint-28", "checkpoint-30"]);
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(r["seed"], 7);
    assert_eq!(r["config"]["train"]["steps"], 30);
    assert!(r["git_commit"].as_str().unwrap().len() >= 7);
    assert_eq!(r["cargo_lock_sha256"].as_str().unwrap().len(), 64);
    let files = r["model_files"].as_array().unwrap();
    assert!(files.iter().any(|f| f["path"]
        .as_str()
        .unwrap()
        .ends_with("model-00001-of-00002.safetensors")));
    assert!(files
        .iter()
        .all(|f| f["sha256"].as_str().unwrap().len() == 64));
    assert_eq!(
        r["data"][0]["sha256"].as_str().unwrap(),
        rtune_fsio::sha256_file(&fixture("fixtures/smoke.jsonl")).unwrap()
    );
    assert!(r["hardware"]["cores"].as_u64().unwrap() >= 1);
    // The dtype as resolved (written as f32 here: no `auto` reason).
    assert_eq!(r["dtype"], "f32");
    assert_eq!(r["attempts"][0]["status"], "completed");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

/// A second signal exits at once (status 130) — and leaves nothing that a resume trips over.
#[test]
fn second_signal_exits_at_once_without_damage() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path());
    let out = tmp.path().join("twice");
    let cfg = config(tmp.path(), &out, "");
    let child = spawn_until_step(&cfg, &out, 3);
    // SAFETY: kill(2) on the pid of our own live child; no memory is involved.
    unsafe {
        libc_kill(child.id() as i32, 2);
        libc_kill(child.id() as i32, 15);
    }
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    let o = train(&cfg, &["--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_same_run(&reference, &out);
}

/// When no checkpoint verifies, resume refuses rather than silently starting over.
#[test]
fn resume_refuses_when_every_checkpoint_is_corrupt() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("all-bad");
    let cfg = config(tmp.path(), &out, "");
    let o = rtune_env(
        &["train", "--config", cfg.to_str().unwrap()],
        &[("RTUNE_FAULT_ENOSPC_AFTER", "16")],
    );
    assert_eq!(o.status.code(), Some(1));
    let cps = checkpoint_dirs(&out);
    assert!(!cps.is_empty());
    for c in &cps {
        std::fs::remove_file(c.join("manifest.json")).unwrap();
    }
    let o = train(&cfg, &["--resume"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("none of its"), "{}", stderr(&o));
    assert_eq!(checkpoint_dirs(&out).len(), cps.len(), "nothing deleted");
}

/// A resume keeps the f32 CBLAS its run recorded (issue 47; `rtune_backend::pin`), since two
/// CBLASes sum in different orders. The run starts on MKL (`RTUNE_BLAS` names `RTUNE_TEST_MKL`'s
/// file) and is stopped by SIGTERM; the resume sets nothing, in an environment where the default
/// search finds OpenBLAS alone (no `VIRTUAL_ENV` / `CONDA_PREFIX`, so MKL's wheel is out of
/// reach): without the pin it would run on OpenBLAS. It must run on MKL and end with the
/// uninterrupted MKL run's adapter and metrics, byte for byte. A recorded library that does not
/// load is refused unless `--force`.
#[test]
fn resume_keeps_the_cblas_the_run_recorded() {
    let Ok(mkl) = std::env::var("RTUNE_TEST_MKL") else {
        return eprintln!("RTUNE_TEST_MKL unset (scripts/deps/cpu-libs.sh); nothing to check");
    };
    let run = |cfg: &Path, extra: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_rtune"));
        c.args(["train", "--config", cfg.to_str().unwrap()])
            .args(extra)
            .current_dir(root());
        for k in ["RTUNE_BLAS", "RTUNE_MKL", "VIRTUAL_ENV", "CONDA_PREFIX"] {
            c.env_remove(k);
        }
        c.envs(env.iter().copied());
        c
    };
    let tmp = tempfile::tempdir().unwrap();
    let on_mkl = [("RTUNE_BLAS", mkl.as_str())];
    let reference = tmp.path().join("reference");
    let o = run(&config(tmp.path(), &reference, ""), &[], &on_mkl)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));

    let out = tmp.path().join("stopped");
    let cfg = config(tmp.path(), &out, "");
    let child = run(&cfg, &[], &on_mkl)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |m| m.lines().count()) < 6 {
        assert!(t0.elapsed() < Duration::from_secs(60), "run did not start");
        std::thread::sleep(Duration::from_millis(2));
    }
    // SAFETY: kill(2) on the pid of our own live child; no memory is involved.
    unsafe { libc_kill(child.id() as i32, 15) };
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "SIGTERM exits 0: {}", stderr(&o));

    // The recorded library gone: refused (the record is put back after).
    let record = std::fs::read(out.join("run.json")).unwrap();
    let mut gone: serde_json::Value = serde_json::from_slice(&record).unwrap();
    gone["hardware"]["blas"] = "/nonexistent/libmkl_rt.so.3 (RTUNE_BLAS names it)".into();
    std::fs::write(out.join("run.json"), serde_json::to_vec(&gone).unwrap()).unwrap();
    let o = run(&cfg, &["--resume"], &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("/nonexistent/libmkl_rt.so.3") && err.contains("--force"),
        "{err}"
    );
    std::fs::write(out.join("run.json"), &record).unwrap();

    let o = run(&cfg, &["--resume"], &[]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming at step"), "{}", stderr(&o));
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("run.json")).unwrap()).unwrap();
    let attempts = record["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2);
    let blas = |a: &serde_json::Value| a["blas"].as_str().unwrap_or("").to_string();
    assert!(blas(&attempts[0]).starts_with(&mkl), "{record}");
    assert!(blas(&attempts[1]).starts_with(&mkl), "{record}");
    assert!(blas(&attempts[1]).contains("pinned"), "{record}");
    assert_same_run(&reference, &out);
}
