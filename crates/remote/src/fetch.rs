//! Bringing a run back from the store:
//! - [`newest_checkpoint`]: for `--resume` on a machine without the run (or with an older
//!   checkpoint): the newest remote checkpoint that verifies — its manifest present and every file
//!   it lists of the listed size and SHA-256 — written into the run directory as the trainer's
//!   own checkpoints are (`.checkpoint-<step>.tmp/`, then renamed), with metrics.jsonl and run.json.
//!   A corrupt or partial one is reported and the previous one tried.
//! - [`run_files`]: a finished run's adapter and records (and optionally one verified
//!   checkpoint) into a local directory, for `rtune export --run s3://…`.

use std::path::Path;

use rtune_fsio::{fsync_dir, sha256_bytes, write_atomic, Privacy};

use crate::{Manifest, Remote, RemoteError, LARGE_OBJECT_BYTES, MANIFEST, SMALL_OBJECT_BYTES};

/// Downloads `checkpoint-<step>/` into `run_dir/.checkpoint-<step>.tmp/`, verifying every file
/// against the remote manifest, then renames it to `checkpoint-<step>`.
fn checkpoint(
    remote: &Remote,
    step: usize,
    run_dir: &Path,
    privacy: Privacy,
) -> Result<(), RemoteError> {
    let name = format!("checkpoint-{step}");
    let mbytes = remote.get_bytes(&format!("{name}/{MANIFEST}"), SMALL_OBJECT_BYTES)?;
    let manifest = Manifest::parse(&mbytes, &format!("{}/{name}/{MANIFEST}", remote.url()))?;
    let tmp = run_dir.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(RemoteError::local(&tmp, "remove"))?;
    }
    privacy.create_dir_all(&tmp)?;
    let res = (|| {
        for (f, entry) in &manifest.files {
            let rel = format!("{name}/{f}");
            let bytes = remote.get_bytes(&rel, entry.bytes)?;
            if bytes.len() as u64 != entry.bytes || sha256_bytes(&bytes) != entry.sha256 {
                return Err(RemoteError::Checksum {
                    what: format!("{}/{rel}", remote.url()),
                });
            }
            write_atomic(&tmp.join(f), &bytes, privacy)?;
        }
        write_atomic(&tmp.join(MANIFEST), &mbytes, privacy)?;
        fsync_dir(&tmp)?;
        let dst = run_dir.join(&name);
        if dst.exists() {
            std::fs::remove_dir_all(&dst).map_err(RemoteError::local(&dst, "remove"))?;
        }
        std::fs::rename(&tmp, &dst).map_err(RemoteError::local(&dst, "rename"))?;
        Ok(fsync_dir(run_dir)?)
    })();
    if res.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    res
}

/// The length of metrics.jsonl a checkpoint's trainer_state.json records (`run.metrics_bytes`).
fn metrics_bytes(ckpt: &Path) -> Option<u64> {
    let text = std::fs::read(ckpt.join("trainer_state.json")).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    v.get("run")?.get("metrics_bytes")?.as_u64()
}

/// For `--resume`: the newest remote checkpoint newer than `local_step` (the newest complete local
/// one) that verifies, brought into `run_dir` (created) with metrics.jsonl (which must reach the
/// checkpoint's recorded length) and run.json. Each one passed over is reported through `warn`.
/// Returns its step, or `None` when the store has nothing newer that verifies.
pub fn newest_checkpoint(
    remote: &Remote,
    run_dir: &Path,
    local_step: Option<usize>,
    privacy: Privacy,
    warn: &mut dyn FnMut(String),
) -> Result<Option<usize>, RemoteError> {
    for (step, complete) in remote.checkpoints()? {
        if local_step.is_some_and(|l| step <= l) {
            break;
        }
        let url = format!("{}/checkpoint-{step}", remote.url());
        if !complete {
            warn(format!(
                "{url}: unusable (no {MANIFEST}: an upload that did not finish); trying the previous checkpoint"
            ));
            continue;
        }
        privacy.create_dir_all(run_dir)?;
        if let Err(e) = checkpoint(remote, step, run_dir, privacy) {
            if matches!(e, RemoteError::Local { .. }) {
                return Err(e);
            }
            warn(format!(
                "{url}: unusable ({e}); trying the previous checkpoint"
            ));
            continue;
        }
        let ckpt = run_dir.join(format!("checkpoint-{step}"));
        let need = metrics_bytes(&ckpt).unwrap_or(0);
        let metrics = remote
            .get_bytes("metrics.jsonl", LARGE_OBJECT_BYTES)
            .unwrap_or_default();
        if (metrics.len() as u64) < need {
            let _ = std::fs::remove_dir_all(&ckpt);
            warn(format!(
                "{url}: unusable ({}/metrics.jsonl has {} bytes, the checkpoint needs {need}); trying the previous checkpoint",
                remote.url(),
                metrics.len()
            ));
            continue;
        }
        write_atomic(&run_dir.join("metrics.jsonl"), &metrics, privacy)?;
        for f in ["run.json", "mlflow.json"] {
            if !run_dir.join(f).exists() {
                if let Ok(bytes) = remote.get_bytes(f, SMALL_OBJECT_BYTES) {
                    write_atomic(&run_dir.join(f), &bytes, privacy)?;
                }
            }
        }
        return Ok(Some(step));
    }
    Ok(None)
}

/// The files of a finished run an export reads, into `dir`: the adapter, run.json,
/// config.toml, summary.json; with `checkpoint`, that checkpoint too (verified). A file the
/// store does not have is skipped (the export then says what is missing).
pub fn run_files(
    remote: &Remote,
    dir: &Path,
    checkpoint_step: Option<usize>,
) -> Result<(), RemoteError> {
    let privacy = Privacy::PRIVATE;
    privacy.create_dir_all(dir)?;
    for f in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "run.json",
        "config.toml",
        "summary.json",
    ] {
        match remote.get_bytes(f, LARGE_OBJECT_BYTES) {
            Ok(bytes) => write_atomic(&dir.join(f), &bytes, privacy)?,
            Err(RemoteError::Store { ref reason, .. }) if reason.starts_with("not found") => {}
            Err(e) => return Err(e),
        }
    }
    if let Some(step) = checkpoint_step {
        checkpoint(remote, step, dir, privacy)?;
    }
    Ok(())
}
