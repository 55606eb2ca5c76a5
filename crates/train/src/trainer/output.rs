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
use crate::checkpoint::{self, TrainerState};
use crate::evaluate::{EvalMetrics, Sample};
use crate::optim::LoraOptimizer;
use crate::record::RunRecord;
use crate::setup::fresh_output;
use crate::TrainError;
use rtune_fsio::{LockError, RunLock};

const METRICS: &str = "metrics.jsonl";
const SAMPLES: &str = "samples.jsonl";

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
        let privacy = if cfg.private {
            Privacy::PRIVATE
        } else {
            Privacy::SHARED
        };
        Self {
            dir: cfg.output_dir.clone(),
            privacy,
            writes,
            metrics: None,
            tb: None,
            lock: None,
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
        if self.dir.exists() && !self.dir.is_dir() {
            return Err(out("exists and is not a directory".into()));
        }
        self.privacy
            .create_dir_all(&self.dir)
            .map_err(|e| out(format!("cannot create: {}", e.source)))?;
        let lock = RunLock::acquire(&self.dir, self.privacy).map_err(|e| match e {
            LockError::Held { pid, host, .. } => out(format!(
                "in use by another rtune process (pid {pid} on {host}); wait for it to finish, or \
                 use another [output] dir"
            )),
            LockError::Io { op, source, .. } => out(format!("cannot lock ({op}): {source}")),
        })?;
        self.lock = Some(lock);
        Ok(())
    }

    /// Makes the directory ready for a fresh run (`setup::fresh_output`: refuses to replace a
    /// finished or resumable run unless `[output] overwrite`).
    pub fn clear_for_fresh_run(&self, cfg: &RunConfig) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        fresh_output(cfg, self.privacy)
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
        record.write(&self.dir, self.privacy)
    }

    /// Appends one JSON line to metrics.jsonl; returns its length (the resume offset grows by it,
    /// on every rank).
    pub fn metrics_line(&mut self, v: &impl Serialize) -> Result<u64, TrainError> {
        let line = serde_json::to_string(v).expect("metrics serialise") + "\n";
        if let Some(f) = self.metrics.as_mut() {
            f.write_all(line.as_bytes())
                .map_err(|e| output_err(&self.dir.join(METRICS), e))?;
        }
        Ok(line.len() as u64)
    }

    /// A step's TensorBoard scalars; after a failure (the warning returned) no more are written.
    pub fn step_scalars(&mut self, m: &StepMetrics) -> Option<String> {
        let e = self
            .tb
            .as_mut()?
            .scalars(m.step as u64, &m.scalars())
            .err()?;
        self.tb = None;
        Some(format!("TensorBoard events: {e}; no more written"))
    }

    /// An evaluation's TensorBoard scalars; returns a warning on failure.
    pub fn eval_scalars(&mut self, ev: &EvalMetrics) -> Option<String> {
        let w = self.tb.as_mut()?;
        let e = w.scalars(ev.step as u64, &eval_scalars(ev)).err()?;
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
        checkpoint::save(
            dir,
            state,
            adapter,
            opt,
            base_model,
            self.privacy,
            keep_last,
        )
        .map(Some)
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
