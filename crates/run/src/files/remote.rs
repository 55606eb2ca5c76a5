//! `[output] remote` for [`RunFiles`]: the store opened and probed at start, the prefix claimed,
//! the newest verified checkpoint fetched on resume, the mirror's state in metrics lines, and the
//! final uploads.

use super::{RunFiles, METRICS, SAMPLES};
use crate::checkpoint;
use crate::RunError;
use rtune_config::RunConfig;
use rtune_remote::{Claim, ClaimMode, Mirror, Remote};
use rtune_track::Tracker;

/// A metrics.jsonl line (a JSON object) with the mirror's state appended: `remote_step` (the
/// newest checkpoint in the store, null before the first), `remote_pending` (one is waiting or
/// being uploaded), `remote_failures` (failed attempts so far).
pub(super) fn with_remote_fields(mut line: String, s: &rtune_remote::Status) -> String {
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
    pub fn connect_remote(&mut self, cfg: &RunConfig) -> Result<(), RunError> {
        let Some(url) = cfg.output.remote.as_deref().filter(|_| self.writes) else {
            return Ok(());
        };
        let remote = Remote::open(url).map_err(|e| RunError::Remote(Box::new(e)))?;
        remote.probe().map_err(|e| RunError::Remote(Box::new(e)))?;
        self.remote = Some(remote);
        Ok(())
    }

    /// Claims the remote prefix for this run (`rtune_remote::claim`: a marker object created
    /// conditionally): refused (exit 2) on a prefix holding a finished run unless `overwrite`, or
    /// another run's marker or checkpoints unless `resume` or `overwrite`, or a marker of a live
    /// run on this machine.
    pub fn claim_remote(&mut self, cfg: &RunConfig, resume: bool) -> Result<(), RunError> {
        let Some(remote) = self.remote.as_mut() else {
            return Ok(());
        };
        let mode = ClaimMode {
            resume,
            overwrite: cfg.output.overwrite,
        };
        remote
            .claim(&Claim::new(), mode)
            .map_err(|e| RunError::Remote(Box::new(e)))
    }

    /// For a resume: the newest verified remote checkpoint newer than every complete local one,
    /// brought into the run directory (see `rtune_remote::fetch::newest_checkpoint`); its step.
    pub fn fetch_remote_checkpoint(
        &self,
        warn: &mut dyn FnMut(String),
    ) -> Result<Option<usize>, RunError> {
        let Some(remote) = &self.remote else {
            return Ok(None);
        };
        let local = checkpoint::list(&self.dir)
            .into_iter()
            .find(|(_, d)| d.join(rtune_remote::MANIFEST).is_file())
            .map(|(s, _)| s);
        rtune_remote::fetch::newest_checkpoint(remote, &self.dir, local, self.privacy, warn)
            .map_err(|e| RunError::Remote(Box::new(e)))
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
    pub fn finish_remote(&mut self, timeout: std::time::Duration) -> Result<(), RunError> {
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
            .map_err(|message| RunError::RemoteUpload {
                dir: self.dir.clone(),
                message,
            })
    }
}
