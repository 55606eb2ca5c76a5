//! [`RunFiles`]: the one door through which a run writes its directory — clearing it for a fresh
//! run, run.json, config.toml, metrics.jsonl, TensorBoard events, samples.jsonl, checkpoints, the
//! adapter, the loss plot and summary.json.
//!
//! Whether this process writes at all is decided once, in [`RunFiles::new`]. Under data
//! parallelism (issue 16) only rank 0 writes; every other rank's `RunFiles` writes nothing but
//! still counts metrics.jsonl's bytes, so the [`RunState`](super::state::RunState) of every rank
//! stays the same.

use serde::Serialize;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use rtune_config::RunConfig;
use rtune_fsio::{write_atomic, Privacy};
use rtune_lora::Adapter;
use rtune_watch::TbWriter;

use super::metrics::{eval_scalars, StepMetrics, Summary};
use super::state::TrainerState;
use crate::evaluate::{EvalMetrics, Sample};
use crate::optim::LoraOptimizer;
use crate::setup::fresh_output;
use crate::TrainError;
use rtune_fsio::{LockError, RunLock};
use rtune_remote::{Claim, ClaimMode, Mirror, Remote};
use rtune_run::checkpoint::{self, Moments};
use rtune_run::record::RunRecord;
use rtune_track::{Start, Tracker};

const METRICS: &str = "metrics.jsonl";
const SAMPLES: &str = "samples.jsonl";
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

fn output_err(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::Output {
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
    pub fn lock(&mut self) -> Result<(), TrainError> {
        if !self.writes || self.lock.is_some() {
            return Ok(());
        }
        let out = |message: String| TrainError::OutputDir {
            path: self.dir.clone(),
            message,
        };
        // `/`, the home directory, a non-empty directory that is not a run: refused before
        // anything is written.
        let found = rtune_run::rundir::check(&self.dir)?;
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
        let marker = self.dir.join(rtune_run::rundir::RUN_MARKER);
        if !marker.exists() {
            // Its presence is the mark (a torn write still marks the directory): a plain create,
            // not one of the atomic writes `RTUNE_FAULT_ENOSPC_AFTER` counts.
            let mut f = self.privacy.create(&marker).map_err(TrainError::from)?;
            self.created_marker = true;
            f.write_all(RUN_MARKER_TEXT.as_bytes())
                .map_err(|e| output_err(&marker, e))?;
        }
        self.created_dir = found == rtune_run::rundir::Found::Missing;
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
            let _ = std::fs::remove_file(self.dir.join(rtune_run::rundir::RUN_MARKER));
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

    /// Makes the directory ready for a fresh run (`setup::fresh_output`: refuses to replace a
    /// finished or resumable run unless `[output] overwrite`).
    pub fn clear_for_fresh_run(&self, cfg: &RunConfig) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        fresh_output(cfg, self.privacy, self.created_dir)?;
        // What an earlier run left under the remote prefix goes too (the claim allowed it).
        if let Some(remote) = self.remote.as_ref().filter(|_| cfg.output.overwrite) {
            let mut files = rtune_run::rundir::RUN_FILES.to_vec();
            files.push(MLFLOW_JSON);
            remote
                .clear_run(&files)
                .map_err(|e| TrainError::Remote(Box::new(e)))?;
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
    pub fn cut_metrics(&self, len: u64) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        let path = self.dir.join(METRICS);
        let f = self.privacy.append(&path).map_err(TrainError::from)?;
        f.set_len(len).map_err(|e| output_err(&path, e))
    }

    /// Writes run.json and config.toml (the config as resolved), then opens metrics.jsonl and
    /// the TensorBoard events; returns a warning when TensorBoard cannot be written (a resumed
    /// run opens a new event file; TensorBoard shows the redone steps from both).
    pub fn open(
        &mut self,
        cfg: &RunConfig,
        record: &RunRecord,
    ) -> Result<Option<String>, TrainError> {
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
        .map_err(TrainError::from)?;
        let metrics = self.privacy.append(&self.dir.join(METRICS));
        self.metrics = Some(metrics.map_err(TrainError::from)?);
        match TbWriter::create(&self.dir.join(rtune_watch::TB_DIR), self.privacy) {
            Ok(w) => self.tb = Some(w),
            Err(e) => return Ok(Some(format!("no TensorBoard events: {e}"))),
        }
        Ok(None)
    }

    /// run.json.
    pub fn record(&self, record: &RunRecord) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        Ok(record.write(&self.dir, self.privacy)?)
    }

    /// Appends one JSON line to metrics.jsonl; returns its length (the resume offset grows by it,
    /// on every rank).
    pub fn metrics_line(&mut self, v: &impl Serialize) -> Result<u64, TrainError> {
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
    pub fn step_scalars(&mut self, m: &StepMetrics) -> Option<String> {
        let v = m.scalars();
        let v: Vec<(&str, f64)> = v.iter().map(|(k, x)| (k.as_str(), *x)).collect();
        let e = self.tb.as_mut()?.scalars(m.step as u64, &v).err()?;
        self.tb = None;
        Some(format!("TensorBoard events: {e}; no more written"))
    }

    /// An evaluation's TensorBoard scalars; returns a warning on failure.
    pub fn eval_scalars(&mut self, ev: &EvalMetrics) -> Option<String> {
        let w = self.tb.as_mut()?;
        let v = eval_scalars(ev);
        let v: Vec<(&str, f64)> = v.iter().map(|(k, x)| (k.as_str(), *x)).collect();
        let e = w.scalars(ev.step as u64, &v).err()?;
        Some(format!("TensorBoard events: {e}"))
    }

    /// Flushes the TensorBoard events; returns a warning on failure.
    pub fn flush_tb(&mut self) -> Option<String> {
        let e = self.tb.as_mut()?.flush().err()?;
        Some(format!("TensorBoard events: {e}"))
    }

    /// Appends the completions of one evaluation to samples.jsonl.
    pub fn samples(&self, samples: &[Sample]) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        let path = self.dir.join(SAMPLES);
        let mut f = self.privacy.append(&path).map_err(TrainError::from)?;
        for s in samples {
            let line = serde_json::to_string(s).expect("sample serialises") + "\n";
            f.write_all(line.as_bytes())
                .map_err(|e| output_err(&path, e))?;
        }
        Ok(())
    }

    /// Before a checkpoint: metrics.jsonl on disk (its length is what the checkpoint records), and
    /// the TensorBoard events flushed (a warning returned on failure).
    pub fn sync(&mut self) -> Result<Option<String>, TrainError> {
        if let Some(f) = self.metrics.as_mut() {
            f.sync_all()
                .map_err(|e| output_err(&self.dir.join(METRICS), e))?;
        }
        Ok(self.flush_tb())
    }

    /// Writes `checkpoint-<step>/` (see [`checkpoint::save`]); its path, or `None` when this
    /// process does not write.
    pub fn checkpoint(
        &self,
        state: &TrainerState,
        adapter: &Adapter,
        opt: &LoraOptimizer,
        base_model: &str,
        keep_last: usize,
    ) -> Result<Option<PathBuf>, TrainError> {
        if !self.writes {
            return Ok(None);
        }
        let dir = &self.dir;
        let (m, v) = opt.moments()?;
        let path = checkpoint::save(
            dir,
            state,
            adapter,
            Moments { m: &m, v: &v },
            base_model,
            self.privacy,
            keep_last,
        )?;
        if let Some(m) = &self.mirror {
            m.checkpoint(state.run.step, &path);
        }
        Ok(Some(path))
    }

    /// The PEFT adapter: `adapter_model.safetensors` and `adapter_config.json`.
    pub fn adapter(&self, adapter: &Adapter, base_model: &str) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        Ok(adapter.save_peft(&self.dir, base_model, self.privacy)?)
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
    pub fn summary(&self, summary: &Summary) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        let text = serde_json::to_string_pretty(summary).expect("summary serialises");
        write_atomic(
            &self.dir.join("summary.json"),
            text.as_bytes(),
            self.privacy,
        )
        .map_err(TrainError::from)
    }
}

/// A metrics.jsonl line (a JSON object) with the mirror's state appended: `remote_step` (the
/// newest checkpoint in the store, null before the first), `remote_pending` (one is waiting or
/// being uploaded), `remote_failures` (failed attempts so far).
fn with_remote_fields(mut line: String, s: &rtune_remote::Status) -> String {
    if line.ends_with('}') {
        line.pop();
        let step = s
            .uploaded_step
            .map_or("null".to_string(), |s| s.to_string());
        line += &format!(
            ",\"remote_step\":{step},\"remote_pending\":{},\"remote_failures\":{}}}",
            s.pending, s.failures
        );
    }
    line
}

/// `[output] remote`: the store, its probe at start, the fetch on resume, the final uploads.
impl RunFiles {
    /// Opens `[output] remote` and probes it (write, read back, delete a small object) before
    /// the run directory is touched; a failure is an input error naming the URL and the reason.
    pub fn connect_remote(&mut self, cfg: &RunConfig) -> Result<(), TrainError> {
        let Some(url) = cfg.output.remote.as_deref().filter(|_| self.writes) else {
            return Ok(());
        };
        let remote = Remote::open(url).map_err(|e| TrainError::Remote(Box::new(e)))?;
        remote
            .probe()
            .map_err(|e| TrainError::Remote(Box::new(e)))?;
        self.remote = Some(remote);
        Ok(())
    }

    /// Claims the remote prefix for this run (`rtune_remote::claim`: a marker object created
    /// conditionally): refused (exit 2) on a prefix holding a finished run unless `overwrite`, or
    /// another run's marker or checkpoints unless `resume` or `overwrite`, or a marker of a live
    /// run on this machine.
    pub fn claim_remote(&mut self, cfg: &RunConfig, resume: bool) -> Result<(), TrainError> {
        let Some(remote) = self.remote.as_mut() else {
            return Ok(());
        };
        let mode = ClaimMode {
            resume,
            overwrite: cfg.output.overwrite,
        };
        remote
            .claim(&Claim::new(), mode)
            .map_err(|e| TrainError::Remote(Box::new(e)))
    }

    /// For a resume: the newest verified remote checkpoint newer than every complete local one,
    /// brought into the run directory (see `rtune_remote::fetch::newest_checkpoint`); its step.
    pub fn fetch_remote_checkpoint(
        &self,
        warn: &mut dyn FnMut(String),
    ) -> Result<Option<usize>, TrainError> {
        let Some(remote) = &self.remote else {
            return Ok(None);
        };
        let local = checkpoint::list(&self.dir)
            .into_iter()
            .find(|(_, d)| d.join(rtune_remote::MANIFEST).is_file())
            .map(|(s, _)| s);
        rtune_remote::fetch::newest_checkpoint(remote, &self.dir, local, self.privacy, warn)
            .map_err(|e| TrainError::Remote(Box::new(e)))
    }

    /// The mirror's and the MLflow tracker's notices since the last call.
    pub fn remote_notices(&self) -> Vec<String> {
        let mut n = self
            .mirror
            .as_ref()
            .map(Mirror::take_notices)
            .unwrap_or_default();
        n.extend(
            self.tracker
                .as_ref()
                .map(Tracker::take_notices)
                .unwrap_or_default(),
        );
        n
    }

    /// Uploads the run's files after the last checkpoint (summary.json last) and waits up to
    /// `timeout`; the error names what is not in the store.
    pub fn finish_remote(&mut self, timeout: std::time::Duration) -> Result<(), TrainError> {
        let Some(mirror) = self.mirror.as_mut() else {
            return Ok(());
        };
        let mut names: Vec<String> = [
            rtune_lora::ADAPTER_WEIGHTS,
            rtune_lora::ADAPTER_CONFIG,
            "config.toml",
            METRICS,
            SAMPLES,
            "loss.svg",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let tb = self.dir.join(rtune_watch::TB_DIR);
        let mut events: Vec<String> = std::fs::read_dir(&tb)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| {
                format!(
                    "{}/{}",
                    rtune_watch::TB_DIR,
                    e.file_name().to_string_lossy()
                )
            })
            .collect();
        events.sort();
        names.extend(events);
        names.extend(["mlflow.json", "run.json", "summary.json"].map(String::from));
        let files = names
            .into_iter()
            .map(|n| {
                let p = self.dir.join(&n);
                (n, p)
            })
            .collect();
        mirror
            .finish(files, timeout)
            .map_err(|message| TrainError::RemoteUpload {
                dir: self.dir.clone(),
                message,
            })
    }
}

/// The file that keeps a run's MLflow ids, so a resume continues the same MLflow run.
pub const MLFLOW_JSON: &str = "mlflow.json";

/// `[output] mlflow`: one MLflow run per rtune run.
impl RunFiles {
    /// Starts the tracker: the resolved config as params, the record's version, commit and
    /// checksums as tags, the run continued when mlflow.json names one.
    fn start_tracking(&mut self, cfg: &RunConfig, record: &RunRecord) {
        let Some(url) = cfg.output.mlflow.as_deref().filter(|_| self.writes) else {
            return;
        };
        let saved = std::fs::read(self.dir.join(MLFLOW_JSON))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        let run_id = saved
            .as_ref()
            .map(|v| rtune_track::str_at(v, &["run_id"]))
            .filter(|r| !r.is_empty());
        self.tracker_id_saved = run_id.is_some();
        let mut params = Vec::new();
        let config = serde_json::to_value(&cfg.file).expect("config serialises");
        rtune_track::flatten_params("", &config, &mut params);
        let mut tags = vec![
            ("rtune.version".to_string(), record.rtune_version.clone()),
            ("rtune.git_commit".to_string(), record.git_commit.clone()),
            (
                "rtune.cargo_lock_sha256".to_string(),
                record.cargo_lock_sha256.clone(),
            ),
            ("rtune.model_path".to_string(), record.model_path.clone()),
        ];
        for f in &record.model_files {
            let name = Path::new(&f.path)
                .file_name()
                .map_or(f.path.clone(), |n| n.to_string_lossy().into_owned());
            tags.push((format!("rtune.model.{name}.sha256"), f.sha256.clone()));
        }
        for (i, f) in record.data.iter().enumerate() {
            tags.push((format!("rtune.data.{i}.path"), f.path.clone()));
            tags.push((format!("rtune.data.{i}.sha256"), f.sha256.clone()));
        }
        let run_name = self
            .dir
            .file_name()
            .map_or("rtune".into(), |n| n.to_string_lossy().into_owned());
        self.tracker = Some(Tracker::start(Start {
            url: url.to_string(),
            experiment: cfg.output.mlflow_experiment.clone(),
            run_name,
            run_id,
            params,
            tags,
        }));
    }

    /// Sends one metrics.jsonl line's numbers (booleans as 0/1) at its `step`, and saves the
    /// MLflow ids once the run exists.
    fn track_line(&mut self, line: &str) {
        let Some(t) = &self.tracker else {
            return;
        };
        let Ok(serde_json::Value::Object(map)) = serde_json::from_str(line) else {
            return;
        };
        let step = map.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
        let values = map
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| {
                let x = v.as_f64().or_else(|| v.as_bool().map(|b| b as u8 as f64))?;
                Some((k.clone(), x))
            })
            .collect();
        t.metrics(step, values);
        if !self.tracker_id_saved {
            if let Some((exp, run)) = t.ids() {
                let text = serde_json::json!({ "experiment_id": exp, "run_id": run }).to_string();
                self.tracker_id_saved =
                    write_atomic(&self.dir.join(MLFLOW_JSON), text.as_bytes(), self.privacy)
                        .is_ok();
            }
        }
    }

    /// The end of the run for MLflow: what is buffered, the adapter, loss.svg and run.json as
    /// artifacts, and `status` (FINISHED, KILLED, FAILED), within `timeout`; a warning on failure.
    pub fn finish_tracking(
        &mut self,
        status: &str,
        timeout: std::time::Duration,
    ) -> Option<String> {
        let t = self.tracker.as_mut()?;
        let artifacts = [
            rtune_lora::ADAPTER_WEIGHTS,
            rtune_lora::ADAPTER_CONFIG,
            "loss.svg",
            "run.json",
        ]
        .iter()
        .map(|n| (n.to_string(), self.dir.join(n)))
        .collect();
        let r = t.finish(status, artifacts, timeout).err();
        if !self.tracker_id_saved {
            if let Some((exp, run)) = t.ids() {
                let text = serde_json::json!({ "experiment_id": exp, "run_id": run }).to_string();
                let _ = write_atomic(&self.dir.join(MLFLOW_JSON), text.as_bytes(), self.privacy);
            }
        }
        r.map(|e| format!("MLflow: {e}"))
    }
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
        assert!(empty.join(rtune_run::rundir::RUN_MARKER).exists());
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
        std::fs::write(old.join(rtune_run::rundir::RUN_MARKER), "").unwrap();
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
