//! [`RunFiles`]: the one door through which a run writes its directory — clearing it for a fresh
//! run, run.json, config.toml, metrics.jsonl, TensorBoard events, samples.jsonl, checkpoints, the
//! adapter, the loss plot and summary.json.
//!
//! Whether this process writes at all is decided once, in [`RunFiles::new`]. Under data
//! parallelism (issue 16) only rank 0 writes; every other rank's `RunFiles` writes nothing but
//! still counts metrics.jsonl's bytes, so the trainer's counters stay the same on every rank.
//!
//! What the trainer's lines and summaries hold is its own (`rtune_train`'s metrics): here they are
//! anything serde writes, and TensorBoard scalars as `(name, value)` pairs. `remote.rs`: the
//! `[output] remote` store (probe, claim, fetch, final uploads); `mlflow.rs`: `[output] mlflow`.

mod mlflow;
mod remote;

pub use mlflow::MLFLOW_JSON;
use remote::with_remote_fields;

use serde::Serialize;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use rtune_config::RunConfig;
use rtune_fsio::{write_atomic, Privacy};
use rtune_lora::Adapter;
use rtune_watch::TbWriter;

use crate::checkpoint::{self, Moments, Step, TrainerState};
use crate::record::RunRecord;
use crate::RunError;
use rtune_fsio::{LockError, RunLock};
use rtune_remote::{Mirror, Remote};
use rtune_track::Tracker;

pub(crate) const METRICS: &str = "metrics.jsonl";
pub(crate) const SAMPLES: &str = "samples.jsonl";
/// What the run marker says to whoever opens it.
const RUN_MARKER_TEXT: &str =
    "rtune run directory: rtune writes here, and replaces only what it wrote here\n";

/// The run directory, as written by this process.
pub struct RunFiles {
    pub dir: PathBuf,
    privacy: Privacy,
    /// False: every method below writes nothing (a data-parallel rank other than 0).
    writes: bool,
    /// metrics.jsonl, open for appending once [`open`](Self::open) ran.
    metrics: Option<File>,
    /// TensorBoard scalars; best effort: `None` after a failure.
    tb: Option<TbWriter>,
    /// This process's hold on the directory ([`lock`](Self::lock)), released when the run ends.
    lock: Option<RunLock>,
    /// Whether [`lock`](Self::lock) created the lock file, and the directories it created (the
    /// run directory and any missing parents, deepest first): what [`abandon`](Self::abandon)
    /// removes again.
    created_lock: bool,
    created_dirs: Vec<PathBuf>,
    /// Whether [`lock`](Self::lock) wrote the run marker, and created the run directory itself.
    created_marker: bool,
    created_dir: bool,
    /// `[output] remote`, probed at start ([`connect_remote`](Self::connect_remote)) until the
    /// run opens; then the background uploader.
    remote: Option<Remote>,
    mirror: Option<Mirror>,
    /// `[output] mlflow`: the MLflow run fed from metrics.jsonl's lines; whether its id is saved.
    tracker: Option<Tracker>,
    tracker_id_saved: bool,
}

fn output_err(path: &Path, e: std::io::Error) -> RunError {
    RunError::Output {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

impl RunFiles {
    /// `cfg`'s output directory, written only when `writes` (a single process, or rank 0 of a
    /// data-parallel run): decided here and nowhere else.
    pub fn new(cfg: &RunConfig, writes: bool) -> Self {
        let privacy = if cfg.output.private {
            Privacy::PRIVATE
        } else {
            Privacy::SHARED
        };
        Self {
            dir: cfg.output.dir.clone(),
            privacy,
            writes,
            metrics: None,
            tb: None,
            lock: None,
            created_lock: false,
            created_dirs: Vec::new(),
            created_marker: false,
            created_dir: false,
            remote: None,
            mirror: None,
            tracker: None,
            tracker_id_saved: false,
        }
    }

    /// Takes the run directory for this process, creating it: a second `rtune train` (or a
    /// `--resume`) on the same directory is refused at once, naming the holder's pid and host. The
    /// lock is `flock`'s: it dies with the process, so `kill -9` leaves nothing to clean up.
    pub fn lock(&mut self) -> Result<(), RunError> {
        if !self.writes || self.lock.is_some() {
            return Ok(());
        }
        let out = |message: String| RunError::OutputDir {
            path: self.dir.clone(),
            message,
        };
        // `/`, the home directory, a non-empty directory that is not a run: refused before
        // anything is written.
        let found = crate::rundir::check(&self.dir)?;
        let created_dirs: Vec<PathBuf> = self
            .dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        self.privacy
            .create_dir_all(&self.dir)
            .map_err(|e| out(format!("cannot create: {}", e.source)))?;
        self.created_dirs = created_dirs;
        self.created_lock = !self.dir.join(rtune_fsio::LOCK_FILE).exists();
        let lock = RunLock::acquire(&self.dir, self.privacy).map_err(|e| match e {
            LockError::Held { pid, host, .. } => out(format!(
                "in use by another rtune process (pid {pid} on {host}); wait for it to finish, or \
                 use another [output] dir"
            )),
            LockError::Io { op, source, .. } => out(format!(
                "cannot lock ({op} {}): {source}",
                rtune_fsio::LOCK_FILE
            )),
        })?;
        self.lock = Some(lock);
        // The run's claim on the directory, from now on recognised as rtune's.
        let marker = self.dir.join(crate::rundir::RUN_MARKER);
        if !marker.exists() {
            // Its presence is the mark (a torn write still marks the directory): a plain create,
            // not one of the atomic writes `RTUNE_FAULT_ENOSPC_AFTER` counts.
            let mut f = self.privacy.create(&marker).map_err(RunError::from)?;
            self.created_marker = true;
            f.write_all(RUN_MARKER_TEXT.as_bytes())
                .map_err(|e| output_err(&marker, e))?;
        }
        self.created_dir = found == crate::rundir::Found::Missing;
        Ok(())
    }

    /// Whether this process created the run directory (only then is its mode rtune's to set).
    pub fn created_dir(&self) -> bool {
        self.created_dir
    }

    /// For a run that ends before its first step (a refusal found once the directory was
    /// locked): releases the lock and leaves the directory as it was found: the lock file is
    /// deleted if this process created it, and the directories [`lock`](Self::lock) created are
    /// removed while empty. Best effort: the refusal is what the user needs to see.
    pub fn abandon(&mut self) {
        let Some(lock) = self.lock.take() else {
            return;
        };
        if let Some(r) = self.remote.as_mut() {
            r.release();
        }
        if self.created_marker {
            let _ = std::fs::remove_file(self.dir.join(crate::rundir::RUN_MARKER));
        }
        if !self.created_lock {
            return;
        }
        if lock.remove().is_err() {
            return;
        }
        for d in std::mem::take(&mut self.created_dirs) {
            if std::fs::remove_dir(&d).is_err() {
                break;
            }
        }
    }

    /// Makes the directory ready for a fresh run (`fresh_output`: refuses to replace a
    /// finished or resumable run unless `[output] overwrite`).
    pub fn clear_for_fresh_run(&self, cfg: &RunConfig) -> Result<(), RunError> {
        if !self.writes {
            return Ok(());
        }
        fresh_output(cfg, self.privacy, self.created_dir)?;
        // What an earlier run left under the remote prefix goes too (the claim allowed it).
        if let Some(remote) = self.remote.as_ref().filter(|_| cfg.output.overwrite) {
            let mut files = crate::rundir::RUN_FILES.to_vec();
            files.push(MLFLOW_JSON);
            remote
                .clear_run(&files)
                .map_err(|e| RunError::Remote(Box::new(e)))?;
        }
        Ok(())
    }

    /// Removes checkpoints left half-written by a killed run; returns how many.
    pub fn remove_partial_checkpoints(&self) -> usize {
        if !self.writes {
            return 0;
        }
        checkpoint::remove_partial(&self.dir)
    }

    /// Cuts metrics.jsonl back to `len` bytes, its length at the checkpoint a run resumes from:
    /// lines written after the checkpoint are written again, identically.
    pub fn cut_metrics(&self, len: u64) -> Result<(), RunError> {
        if !self.writes {
            return Ok(());
        }
        let path = self.dir.join(METRICS);
        let f = self.privacy.append(&path).map_err(RunError::from)?;
        f.set_len(len).map_err(|e| output_err(&path, e))
    }

    /// Writes run.json and config.toml (the config as resolved), then opens metrics.jsonl and
    /// the TensorBoard events; returns a warning when TensorBoard cannot be written (a resumed
    /// run opens a new event file; TensorBoard shows the redone steps from both).
    pub fn open(
        &mut self,
        cfg: &RunConfig,
        record: &RunRecord,
    ) -> Result<Option<String>, RunError> {
        if !self.writes {
            return Ok(None);
        }
        self.record(record)?;
        if let Some(remote) = self.remote.take() {
            self.mirror = Some(Mirror::start(remote, &self.dir, cfg.output.keep_last));
        }
        self.start_tracking(cfg, record);
        let resolved = toml::to_string(&cfg.file).expect("config serialises");
        write_atomic(
            &self.dir.join("config.toml"),
            resolved.as_bytes(),
            self.privacy,
        )
        .map_err(RunError::from)?;
        let metrics = self.privacy.append(&self.dir.join(METRICS));
        self.metrics = Some(metrics.map_err(RunError::from)?);
        match TbWriter::create(&self.dir.join(rtune_watch::TB_DIR), self.privacy) {
            Ok(w) => self.tb = Some(w),
            Err(e) => return Ok(Some(format!("no TensorBoard events: {e}"))),
        }
        Ok(None)
    }

    /// run.json.
    pub fn record(&self, record: &RunRecord) -> Result<(), RunError> {
        if !self.writes {
            return Ok(());
        }
        record.write(&self.dir, self.privacy)
    }

    /// Appends one JSON line to metrics.jsonl; returns its length (the resume offset grows by it,
    /// on every rank).
    pub fn metrics_line(&mut self, v: &impl Serialize) -> Result<u64, RunError> {
        let mut line = serde_json::to_string(v).expect("metrics serialise");
        if let Some(m) = &self.mirror {
            line = with_remote_fields(line, &m.status());
        }
        self.track_line(&line);
        line.push('\n');
        if let Some(f) = self.metrics.as_mut() {
            f.write_all(line.as_bytes())
                .map_err(|e| output_err(&self.dir.join(METRICS), e))?;
        }
        Ok(line.len() as u64)
    }

    /// A step's TensorBoard scalars; after a failure (the warning returned) no more are written.
    pub fn step_scalars(&mut self, step: usize, scalars: &[(String, f64)]) -> Option<String> {
        let v: Vec<(&str, f64)> = scalars.iter().map(|(k, x)| (k.as_str(), *x)).collect();
        let e = self.tb.as_mut()?.scalars(step as u64, &v).err()?;
        self.tb = None;
        Some(format!("TensorBoard events: {e}; no more written"))
    }

    /// An evaluation's TensorBoard scalars; returns a warning on failure.
    pub fn eval_scalars(&mut self, step: usize, scalars: &[(String, f64)]) -> Option<String> {
        let w = self.tb.as_mut()?;
        let v: Vec<(&str, f64)> = scalars.iter().map(|(k, x)| (k.as_str(), *x)).collect();
        let e = w.scalars(step as u64, &v).err()?;
        Some(format!("TensorBoard events: {e}"))
    }

    /// Flushes the TensorBoard events; returns a warning on failure.
    pub fn flush_tb(&mut self) -> Option<String> {
        let e = self.tb.as_mut()?.flush().err()?;
        Some(format!("TensorBoard events: {e}"))
    }

    /// Appends the completions of one evaluation to samples.jsonl.
    pub fn samples(&self, samples: &[impl Serialize]) -> Result<(), RunError> {
        if !self.writes {
            return Ok(());
        }
        let path = self.dir.join(SAMPLES);
        let mut f = self.privacy.append(&path).map_err(RunError::from)?;
        for s in samples {
            let line = serde_json::to_string(s).expect("sample serialises") + "\n";
            f.write_all(line.as_bytes())
                .map_err(|e| output_err(&path, e))?;
        }
        Ok(())
    }

    /// Before a checkpoint: metrics.jsonl on disk (its length is what the checkpoint records), and
    /// the TensorBoard events flushed (a warning returned on failure).
    pub fn sync(&mut self) -> Result<Option<String>, RunError> {
        if let Some(f) = self.metrics.as_mut() {
            f.sync_all()
                .map_err(|e| output_err(&self.dir.join(METRICS), e))?;
        }
        Ok(self.flush_tb())
    }

    /// Writes `checkpoint-<step>/` (see [`checkpoint::save`]); its path, or `None` when this
    /// process does not write.
    pub fn checkpoint<C: Serialize + Step>(
        &self,
        state: &TrainerState<C>,
        adapter: &Adapter,
        moments: Moments<'_>,
        base_model: &str,
        keep_last: usize,
    ) -> Result<Option<PathBuf>, RunError> {
        if !self.writes {
            return Ok(None);
        }
        let path = checkpoint::save(
            &self.dir,
            state,
            adapter,
            moments,
            base_model,
            self.privacy,
            keep_last,
        )?;
        if let Some(m) = &self.mirror {
            m.checkpoint(state.run.step(), &path);
        }
        Ok(Some(path))
    }

    /// The PEFT adapter: `adapter_model.safetensors` and `adapter_config.json`.
    pub fn adapter(&self, adapter: &Adapter, base_model: &str) -> Result<(), RunError> {
        if !self.writes {
            return Ok(());
        }
        adapter
            .save_peft(&self.dir, base_model, self.privacy)
            .map_err(|e| RunError::Adapter(Box::new(e)))
    }

    /// loss.svg from metrics.jsonl; returns a warning on failure.
    pub fn plot(&self) -> Option<String> {
        if !self.writes {
            return None;
        }
        let e = rtune_watch::plot_run(&self.dir, self.privacy).err()?;
        Some(format!("no loss plot: {e}"))
    }

    /// summary.json, written last: its presence marks a finished run.
    pub fn summary(&self, summary: &impl Serialize) -> Result<(), RunError> {
        if !self.writes {
            return Ok(());
        }
        let text = serde_json::to_string_pretty(summary).expect("summary serialises");
        write_atomic(
            &self.dir.join("summary.json"),
            text.as_bytes(),
            self.privacy,
        )
        .map_err(RunError::from)
    }
}

/// Makes `dir` (an rtune run directory, see `rundir::check`) ready for a fresh run: refuses to
/// replace a finished or resumable run unless `overwrite`, then clears what the old run wrote —
/// its files, its checkpoints, its TensorBoard events — and nothing else. The directory's mode is
/// set only when this run `created` it.
fn fresh_output(cfg: &RunConfig, privacy: Privacy, created: bool) -> Result<(), RunError> {
    let dir = &cfg.output.dir;
    let out = |message: String| RunError::OutputDir {
        path: dir.clone(),
        message,
    };
    if dir.exists() {
        if !dir.is_dir() {
            return Err(out("exists and is not a directory".into()));
        }
        let finished = ["summary.json", "adapter_model.safetensors"]
            .iter()
            .any(|f| dir.join(f).exists());
        let checkpoints = checkpoint::list(dir);
        if finished && !cfg.output.overwrite {
            return Err(out(
                "already holds a finished run; choose another [output] dir or set [output] overwrite = true".into(),
            ));
        }
        if !checkpoints.is_empty() && !cfg.output.overwrite {
            return Err(out(format!(
                "holds checkpoints of an unfinished run (newest: step {}); pass --resume to continue it, or set \
                 [output] overwrite = true to start over",
                checkpoints[0].0
            )));
        }
        for f in crate::rundir::RUN_FILES {
            let p = dir.join(f);
            if p.exists() {
                std::fs::remove_file(&p).map_err(|e| out(format!("cannot remove old {f}: {e}")))?;
            }
        }
        for (_, c) in checkpoints {
            checkpoint::remove(&c)
                .map_err(|e| out(format!("cannot remove {}: {e}", c.display())))?;
        }
        checkpoint::remove_partial(dir);
        remove_tb_events(&dir.join(rtune_watch::TB_DIR)).map_err(out)?;
    }
    privacy
        .create_dir_all(dir)
        .map_err(|e| out(format!("cannot create: {}", e.source)))?;
    if cfg.output.private && created {
        privacy
            .apply_to_dir(dir)
            .map_err(|e| out(e.source.to_string()))?;
    }
    Ok(())
}

/// Removes the TensorBoard event files rtune wrote in `tb/` (`events.out.tfevents.*`), then
/// `tb/` itself if that left it empty: anything else in it stays.
fn remove_tb_events(tb: &Path) -> Result<(), String> {
    if !tb.is_dir() {
        return Ok(());
    }
    let entries =
        std::fs::read_dir(tb).map_err(|e| format!("cannot list {}: {e}", tb.display()))?;
    for e in entries.flatten() {
        let own = e
            .file_name()
            .to_string_lossy()
            .starts_with("events.out.tfevents.")
            && e.file_type().is_ok_and(|t| t.is_file());
        if own {
            std::fs::remove_file(e.path())
                .map_err(|err| format!("cannot remove old {}: {err}", e.path().display()))?;
        }
    }
    let _ = std::fs::remove_dir(tb);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path) -> RunFiles {
        let text = format!(
            "[model]\npath = \"m\"\n[data]\ntrain = \"d\"\n[output]\ndir = \"{}\"\n",
            dir.display()
        );
        let cfg = rtune_config::ConfigFile::parse(&text, Path::new("c.toml"), &[])
            .and_then(|f| f.validate(Path::new("c.toml")))
            .unwrap();
        RunFiles::new(&cfg, true)
    }

    #[test]
    fn abandon_leaves_the_directory_as_found() {
        let tmp = std::env::temp_dir().join(format!("rtune-abandon-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        // Created by the lock, with a missing parent: both removed.
        let new = tmp.join("a/run");
        let mut f = files(&new);
        f.lock().unwrap();
        assert!(new.join(rtune_fsio::LOCK_FILE).exists());
        f.abandon();
        assert!(!tmp.join("a").exists());
        // Existing and empty: taken (lock file and marker), then left empty again.
        let empty = tmp.join("empty");
        std::fs::create_dir(&empty).unwrap();
        let mut f = files(&empty);
        f.lock().unwrap();
        assert!(empty.join(crate::rundir::RUN_MARKER).exists());
        assert!(!f.created_dir());
        f.abandon();
        assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
        // Not a run: refused before anything is written.
        let user = tmp.join("user");
        std::fs::create_dir(&user).unwrap();
        std::fs::write(user.join("notes.txt"), "x").unwrap();
        assert!(files(&user).lock().is_err());
        assert_eq!(std::fs::read_dir(&user).unwrap().count(), 1);
        // An existing run with a file of the user's: the lock file goes, the rest stays.
        let old = tmp.join("old");
        std::fs::create_dir(&old).unwrap();
        std::fs::write(old.join(crate::rundir::RUN_MARKER), "").unwrap();
        std::fs::write(old.join("notes.txt"), "x").unwrap();
        let mut f = files(&old);
        f.lock().unwrap();
        f.abandon();
        assert!(!old.join(rtune_fsio::LOCK_FILE).exists());
        assert!(old.join("notes.txt").exists());
        // A lock file left by an earlier run is not this process's to delete.
        std::fs::write(old.join(rtune_fsio::LOCK_FILE), "1 host\n").unwrap();
        let mut f = files(&old);
        f.lock().unwrap();
        f.abandon();
        assert!(old.join(rtune_fsio::LOCK_FILE).exists());
        // Released either way: the directory can be taken again.
        files(&old).lock().unwrap();
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
