//! The trainer's side of `[output] remote` (the store itself is `rtune-remote`): a resume that
//! brings the newest verified remote checkpoint when this machine has none as new, the mirror's
//! notices on the progress line, and the end of a run waiting for its uploads (exit 1 naming what
//! failed past `[output] remote_timeout`; the local run is complete either way). The end also
//! closes the MLflow run (`[output] mlflow`): FINISHED, KILLED (stopped by a signal) or FAILED.

use std::time::Duration;

use super::{Event, Outcome, RunOptions, Trainer};
use crate::TrainError;

impl<R: crate::objective::Recipe> Trainer<'_, R> {
    /// When resuming with a remote: the newest remote checkpoint that verifies, if newer than
    /// every local one, is brought into the (locked) run directory. Returns whether the run
    /// directory now holds a run to resume (`existed`, or something was fetched).
    pub(super) fn fetch_remote_checkpoint(
        &mut self,
        opts: &RunOptions,
        existed: bool,
    ) -> Result<bool, TrainError> {
        if !(opts.resume || self.cfg.output.resume) || self.cfg.output.remote.is_none() {
            return Ok(existed);
        }
        let on_event = &mut self.on_event;
        let fetched = self
            .files
            .fetch_remote_checkpoint(&mut |w| on_event(Event::Warning(w)))?;
        if let Some(step) = fetched {
            let url = self.cfg.output.remote.as_deref().unwrap_or_default();
            self.warn(format!("fetched checkpoint-{step} from {url}"));
        }
        Ok(existed || fetched.is_some())
    }

    /// The mirror's failures and recoveries since the last step, as warnings.
    pub(super) fn report_remote(&mut self) {
        for w in self.files.remote_notices() {
            self.warn(w);
        }
    }

    /// After the attempt ended (run.json written): the last checkpoint and the run's files
    /// uploaded, waiting up to `remote_timeout` (a failed run waits at most a minute: its error
    /// is what matters).
    pub(super) fn finish_remote(
        &mut self,
        outcome: Result<Outcome, TrainError>,
    ) -> Result<Outcome, TrainError> {
        let timeout = self.cfg.output.remote_timeout;
        let status = match &outcome {
            Ok(Outcome::Completed(_)) => "FINISHED",
            Ok(Outcome::Stopped { .. }) => "KILLED",
            Err(_) => "FAILED",
        };
        if let Some(w) = self
            .files
            .finish_tracking(status, timeout.min(Duration::from_secs(60)))
        {
            self.warn(w);
        }
        let done = match &outcome {
            Ok(_) => self.files.finish_remote(timeout),
            Err(_) => self
                .files
                .finish_remote(timeout.min(Duration::from_secs(60))),
        };
        self.report_remote();
        let outcome = outcome?;
        done?;
        Ok(outcome)
    }
}
