//! Which directories a run may write (issue 35): one it creates, an empty one, or one it
//! recognises as an rtune run — its marker [`RUN_MARKER`], written when a run takes a directory,
//! or the `run.json` of a run made before the marker existed. Never `/` or the user's home, never
//! a non-empty directory that is not a run. Inside a run only what rtune wrote is replaced: a
//! `checkpoint-N/` is rtune's when its `manifest.json` or `trainer_state.json` names rtune's
//! checkpoint format ([`is_own_checkpoint`]); any other one stops the run at start.
//!
//! Everything here only reads: the refusal comes before anything is written.

use std::path::{Path, PathBuf};

// The crate's error under the name this file was written with (it moved from rtune-train).
use crate::RunError as TrainError;

/// The file that marks a directory as an rtune run directory (written by `RunFiles::lock`).
pub const RUN_MARKER: &str = ".rtune-run";

/// The most of a small JSON file (run.json, a manifest) read to recognise it.
const MAX_JSON_BYTES: u64 = 64 << 20;

/// What `[output] dir` is, once checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Does not exist: the run creates it (and may set its mode).
    Missing,
    /// An empty directory (or one holding only a lock file): the run takes it, mode untouched.
    Empty,
    /// An rtune run directory.
    Run,
}

fn refuse(dir: &Path, message: String) -> TrainError {
    TrainError::OutputDir {
        path: dir.to_path_buf(),
        message,
    }
}

/// `dir` resolved through symlinks and `..` as far as it exists, the rest appended.
fn resolved(dir: &Path) -> PathBuf {
    let abs = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir().map_or(dir.to_path_buf(), |c| c.join(dir))
    };
    let mut missing = Vec::new();
    let mut cur = abs.as_path();
    loop {
        if let Ok(c) = std::fs::canonicalize(cur) {
            return missing.iter().rev().fold(c, |p, m| p.join(m));
        }
        match (cur.parent(), cur.file_name()) {
            (Some(p), Some(n)) => {
                missing.push(n.to_os_string());
                cur = p;
            }
            _ => return abs,
        }
    }
}

/// Checks `[output] dir` before anything is written: refuses `/`, the user's home and any
/// non-empty directory that is not an rtune run, and a run directory holding a `checkpoint-N/`
/// rtune did not write.
pub fn check(dir: &Path) -> Result<Found, TrainError> {
    let real = resolved(dir);
    if real.parent().is_none() {
        return Err(refuse(
            dir,
            "is the root directory; rtune writes only into a run directory of its own: choose a new \
             [output] dir"
                .into(),
        ));
    }
    if rtune_fsio::home_dirs().contains(&real) {
        return Err(refuse(
            dir,
            "is your home directory; rtune writes only into a run directory of its own: choose a \
             new [output] dir, e.g. runs/NAME"
                .into(),
        ));
    }
    let meta = match std::fs::symlink_metadata(&real) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Missing),
        Err(e) => return Err(refuse(dir, format!("cannot inspect: {e}"))),
    };
    if !meta.is_dir() {
        return Err(refuse(dir, "exists and is not a directory".into()));
    }
    let entries: Vec<String> = std::fs::read_dir(&real)
        .map_err(|e| refuse(dir, format!("cannot list: {e}")))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    // A link where rtune writes (its lock, marker, record, metrics...) is refused before anything
    // is written (issue 46): it may lead to a user's file. A directory holding only a linked
    // lock file is not empty.
    let own = OWN_NAMES.iter().chain(&RUN_FILES);
    let with_tmp = own.flat_map(|n| [n.to_string(), format!("{n}.tmp")]);
    if let Some(link) = with_tmp
        .into_iter()
        .find(|n| rtune_fsio::is_symlink(&real.join(n)))
    {
        return Err(refuse(
            dir,
            format!("holds {link}, which {}", rtune_fsio::LINK_REFUSED),
        ));
    }
    if entries.iter().all(|n| n == rtune_fsio::LOCK_FILE) {
        return Ok(Found::Empty);
    }
    if !is_run(&real) {
        return Err(refuse(
            dir,
            format!(
                "is a non-empty directory that is not an rtune run (no {RUN_MARKER} or run.json; \
                 {} entries); rtune writes only into a run directory of its own: choose a new or \
                 empty [output] dir",
                entries.len()
            ),
        ));
    }
    let mut foreign: Vec<&String> = entries
        .iter()
        .filter(|n| checkpoint_step(n).is_some() && !is_own_checkpoint(&real.join(n)))
        .collect();
    foreign.sort();
    if let Some(f) = foreign.first() {
        return Err(refuse(
            dir,
            format!(
                "holds {f}/, which rtune did not write (no rtune manifest.json or \
                 trainer_state.json); move it out of the run directory"
            ),
        ));
    }
    Ok(Found::Run)
}

/// Files of a run directory that a fresh run replaces.
pub const RUN_FILES: [&str; 9] = [
    "summary.json",
    "samples.jsonl",
    // GRPO's completions (objective = "grpo").
    "rollouts.jsonl",
    "loss.svg",
    "adapter_model.safetensors",
    "adapter_config.json",
    "metrics.jsonl",
    "config.toml",
    "run.json",
];

/// The names rtune creates, truncates or appends to directly in a run directory besides
/// [`RUN_FILES`] (checkpoints and TensorBoard events live in subdirectories of their own).
const OWN_NAMES: [&str; 2] = [rtune_fsio::LOCK_FILE, RUN_MARKER];

/// Whether `dir` carries rtune's marker (a plain file, not a link), or a run.json that rtune wrote
/// (a run from before the marker).
pub fn is_run(dir: &Path) -> bool {
    if std::fs::symlink_metadata(dir.join(RUN_MARKER)).is_ok_and(|m| m.is_file()) {
        return true;
    }
    read_json(&dir.join("run.json")).is_some_and(|v| {
        v.get("rtune_version").is_some_and(|x| x.is_string()) && v.get("attempts").is_some()
    })
}

/// `checkpoint-<step>` → step.
pub fn checkpoint_step(name: &str) -> Option<usize> {
    name.strip_prefix("checkpoint-")?.parse().ok()
}

/// The files of a checkpoint rtune writes.
const CHECKPOINT_FILES: [&str; 5] = [
    "manifest.json",
    "trainer_state.json",
    "adapter_model.safetensors",
    "adapter_config.json",
    "optimizer.safetensors",
];

/// Whether `dir` (a `checkpoint-N/`) is one rtune wrote: its manifest.json or
/// trainer_state.json names rtune's checkpoint format (either may be damaged, not both), or — a
/// checkpoint an older rtune was deleting when it was killed — both are gone and nothing but
/// rtune's checkpoint files is left.
pub fn is_own_checkpoint(dir: &Path) -> bool {
    let rtune_format = |f: &str| {
        read_json(&dir.join(f)).is_some_and(|v| {
            v.get("format")
                .and_then(|x| x.as_str())
                .is_some_and(|s| s.starts_with("rtune-checkpoint/"))
        })
    };
    if CHECKPOINT_FILES[..2].iter().any(|f| rtune_format(f)) {
        return true;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let mut names = Vec::new();
    for e in entries {
        let Ok(e) = e else { return false };
        if !e.file_type().is_ok_and(|t| t.is_file()) {
            return false;
        }
        names.push(e.file_name().to_string_lossy().into_owned());
    }
    names
        .iter()
        .all(|n| CHECKPOINT_FILES[2..].contains(&n.as_str()))
}

/// A regular file's JSON, read up to [`MAX_JSON_BYTES`]; `None` for anything else (a FIFO is
/// not waited on).
fn read_json(path: &Path) -> Option<serde_json::Value> {
    let kind = rtune_fsio::FileKind::Sized {
        cap: MAX_JSON_BYTES,
        name: "run record",
    };
    let bytes = rtune_fsio::read_bounded(path, kind).ok()?;
    serde_json::from_slice(&bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rtune-rundir-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn message(r: Result<Found, TrainError>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn root_and_home_are_refused() {
        assert!(message(check(Path::new("/"))).contains("root directory"));
        assert!(message(check(Path::new("/tmp/.."))).contains("root directory"));
        if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            assert!(message(check(Path::new(&h))).contains("home directory"));
        }
    }

    #[test]
    fn directories_are_told_apart() {
        let d = tmp("kinds");
        assert_eq!(check(&d.join("new/run")).unwrap(), Found::Missing);
        let empty = d.join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert_eq!(check(&empty).unwrap(), Found::Empty);
        std::fs::write(empty.join(rtune_fsio::LOCK_FILE), "").unwrap();
        assert_eq!(check(&empty).unwrap(), Found::Empty);
        let user = d.join("user");
        std::fs::create_dir_all(user.join("checkpoint-99")).unwrap();
        assert!(message(check(&user)).contains("not an rtune run"));
        // run.json of another program is not rtune's.
        std::fs::write(user.join("run.json"), "{\"name\": \"x\"}").unwrap();
        assert!(message(check(&user)).contains("not an rtune run"));
        let old = d.join("old");
        std::fs::create_dir(&old).unwrap();
        std::fs::write(
            old.join("run.json"),
            "{\"rtune_version\": \"0.1.0\", \"attempts\": []}",
        )
        .unwrap();
        assert_eq!(check(&old).unwrap(), Found::Run);
        let run = d.join("run");
        std::fs::create_dir_all(run.join("checkpoint-3")).unwrap();
        std::fs::write(run.join(RUN_MARKER), "").unwrap();
        std::fs::write(
            run.join("checkpoint-3/trainer_state.json"),
            "{\"format\": \"rtune-checkpoint/2\"}",
        )
        .unwrap();
        assert_eq!(check(&run).unwrap(), Found::Run);
        // Half deleted by a killed rtune: only rtune's files left (or none).
        std::fs::create_dir(run.join("checkpoint-7")).unwrap();
        std::fs::write(run.join("checkpoint-7/optimizer.safetensors"), "").unwrap();
        assert_eq!(check(&run).unwrap(), Found::Run);
        std::fs::create_dir(run.join("checkpoint-99")).unwrap();
        std::fs::write(run.join("checkpoint-99/weights.bin"), "mine").unwrap();
        assert!(message(check(&run)).contains("checkpoint-99/, which rtune did not write"));
        // Another trainer's state file: not rtune's, whatever else is there.
        std::fs::remove_file(run.join("checkpoint-99/weights.bin")).unwrap();
        std::fs::write(
            run.join("checkpoint-99/trainer_state.json"),
            "{\"global_step\": 99}",
        )
        .unwrap();
        assert!(message(check(&run)).contains("checkpoint-99/, which rtune did not write"));
        let file = d.join("file");
        std::fs::write(&file, "x").unwrap();
        assert!(message(check(&file)).contains("not a directory"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Issue 46: a directory holding only a planted `.rtune.lock` link is not empty, and a run
    /// with a link where rtune writes is refused before anything is written.
    #[test]
    fn planted_links_are_refused_at_the_check() {
        let d = tmp("links");
        let victim = d.join("victim.txt");
        std::fs::write(&victim, "precious").unwrap();
        let only_link = d.join("only-link");
        std::fs::create_dir(&only_link).unwrap();
        std::os::unix::fs::symlink(&victim, only_link.join(rtune_fsio::LOCK_FILE)).unwrap();
        let m = message(check(&only_link));
        assert!(
            m.contains(".rtune.lock") && m.contains("symbolic link"),
            "{m}"
        );
        let run = d.join("run");
        std::fs::create_dir(&run).unwrap();
        std::fs::write(run.join(RUN_MARKER), "").unwrap();
        assert_eq!(check(&run).unwrap(), Found::Run);
        std::os::unix::fs::symlink(&victim, run.join("run.json.tmp")).unwrap();
        let m = message(check(&run));
        assert!(
            m.contains("run.json.tmp") && m.contains("symbolic link"),
            "{m}"
        );
        std::fs::remove_file(run.join("run.json.tmp")).unwrap();
        std::os::unix::fs::symlink(&victim, run.join("metrics.jsonl")).unwrap();
        let m = message(check(&run));
        assert!(
            m.contains("metrics.jsonl") && m.contains("symbolic link"),
            "{m}"
        );
        // A linked marker does not make a directory a run.
        let fake = d.join("fake");
        std::fs::create_dir(&fake).unwrap();
        std::fs::write(fake.join("mine.txt"), "x").unwrap();
        std::os::unix::fs::symlink(run.join(RUN_MARKER), fake.join(RUN_MARKER)).unwrap();
        assert!(!is_run(&fake));
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
