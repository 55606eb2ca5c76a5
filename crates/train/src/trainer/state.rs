//! [`RunState`]: what a run has done so far — the counters the loop moves each step, saved as they
//! are in a checkpoint's `trainer_state.json` (under `run`) and restored from it on resume. With the
//! adapter, AdamW's moments and the data cursor, this is everything a resumed run needs to continue
//! bit for bit.

use serde::{Deserialize, Deserializer, Serialize};

use super::metrics::StepMetrics;
use crate::optim::{Applied, LossScaler};
use crate::TrainError;

/// A checkpoint's trainer_state.json with these counters under `run`.
pub type TrainerState = rtune_run::checkpoint::TrainerState<RunState>;
/// A checkpoint read back, these counters under `state.run`.
pub type Loaded = rtune_run::checkpoint::Loaded<RunState>;

impl rtune_run::checkpoint::Step for RunState {
    fn step(&self) -> usize {
        self.step
    }
}

/// The trainer's counters (all ranks hold the same ones under data parallelism).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Optimizer steps done; a skipped update counts (the schedule and the data move on).
    pub step: usize,
    /// Non-padding input tokens over all steps.
    pub total_tokens: usize,
    /// Tokens/s of every step but the first (it pays warm-up costs), for the summary's median.
    pub speeds: Vec<f64>,
    /// Loss of the last step: NaN before the first, or when that step's loss was not finite.
    #[serde(deserialize_with = "nan_if_null")]
    pub last_loss: f64,
    /// Wall-clock seconds of the attempts before this one; a checkpoint stores them with this
    /// attempt's seconds added.
    pub wall_s: f64,
    /// f16 only: the dynamic loss scale and its clean steps.
    pub scaler: Option<LossScaler>,
    /// Updates skipped for a non-finite loss or gradient: the current streak, and in all.
    pub bad_in_a_row: usize,
    pub skipped_steps: usize,
    /// Length of metrics.jsonl; a resumed run cuts the file back to it and writes the rest again.
    pub metrics_bytes: u64,
}

/// JSON has no NaN: serde_json writes it as `null`, read back here as NaN.
fn nan_if_null<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl RunState {
    /// Step 0 of a fresh run; `scaler` for f16.
    pub fn fresh(scaler: Option<LossScaler>) -> Self {
        Self {
            step: 0,
            total_tokens: 0,
            speeds: Vec::new(),
            last_loss: f64::NAN,
            wall_s: 0.0,
            scaler,
            bad_in_a_row: 0,
            skipped_steps: 0,
            metrics_bytes: 0,
        }
    }

    /// Continues from `saved`, a checkpoint's state. The loss scale and its clean steps come from
    /// the checkpoint, the growth interval from this run's config; whether there is a scaler at all
    /// is this run's dtype (a `--force`d change of dtype starts or drops one).
    pub fn resume(&mut self, saved: RunState) {
        let scaler = match (self.scaler.take(), saved.scaler.as_ref()) {
            (Some(now), Some(s)) => Some(LossScaler {
                scale: s.scale,
                clean_steps: s.clean_steps,
                interval: now.interval,
            }),
            (now, _) => now,
        };
        *self = RunState { scaler, ..saved };
    }

    /// The seed of the dropout masks of this step's micro-batch `micro`: a function of (seed, step),
    /// so a resumed run draws the masks the uninterrupted one drew.
    pub fn dropout_seed(&self, seed: u64, micro: usize) -> u64 {
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((self.step as u64) << 20) ^ micro as u64
    }

    /// The factor this step's loss (and so its gradients) is multiplied by: 1 without a scaler.
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale)
    }

    /// Books what the optimizer did with step `self.step + 1`, computed at `loss_scale`: a clean
    /// update ends a streak of bad steps; an f16 overflow halves the scale and is retried, as torch's
    /// GradScaler does; a NaN/Inf loss or gradient is skipped, and the `max_bad_steps`-th of them in
    /// a row stops the run (0 counts as 1: the first bad step stops it). Each skip is reported through `warn`.
    pub fn count_update(
        &mut self,
        done: Applied,
        loss: f64,
        loss_scale: f64,
        max_bad_steps: usize,
        warn: &mut dyn FnMut(String),
    ) -> Result<(), TrainError> {
        let (step, grad_norm) = (self.step + 1, done.grad_norm);
        let overflow = !done.applied && loss.is_finite() && self.scaler.is_some();
        if let Some(s) = self.scaler.as_mut() {
            s.update(overflow);
        }
        if done.applied {
            self.bad_in_a_row = 0;
        } else if overflow {
            self.skipped_steps += 1;
            warn(format!(
                "step {step}: gradients overflow f16 at loss scale {loss_scale}; update skipped, scale now {}",
                loss_scale / 2.0
            ));
            if loss_scale < 1e-6 {
                return Err(TrainError::NonFinite {
                    step,
                    loss,
                    grad_norm,
                    in_a_row: self.bad_in_a_row + 1,
                });
            }
        } else {
            self.bad_in_a_row += 1;
            self.skipped_steps += 1;
            if self.bad_in_a_row >= max_bad_steps {
                return Err(TrainError::NonFinite {
                    step,
                    loss,
                    grad_norm,
                    in_a_row: self.bad_in_a_row,
                });
            }
            warn(format!(
                "step {step}: loss {loss} / gradient norm {grad_norm} not finite; update skipped ({} in a row, \
                 the run stops at {max_bad_steps} in a row: [train] max_bad_steps)",
                self.bad_in_a_row
            ));
        }
        Ok(())
    }

    /// At the end of a run: some update was applied. A run whose every update was skipped (a
    /// loss or gradient never finite, in fewer steps than `max_bad_steps`; every f16 step
    /// overflowing) has an untrained adapter and must not end as if it trained (issue 46).
    pub fn check_trained(&self) -> Result<(), TrainError> {
        match self.step > 0 && self.skipped_steps >= self.step {
            true => Err(TrainError::NothingTrained { steps: self.step }),
            false => Ok(()),
        }
    }

    /// Counts the finished step `m` (of `steps` in the run).
    pub fn count_step(&mut self, m: &StepMetrics, steps: usize) {
        self.step += 1;
        if self.step > 1 || steps == 1 {
            self.speeds.push(m.tokens_per_s);
        }
        self.total_tokens += m.tokens;
        self.last_loss = m.loss;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step_metrics(tokens: usize, tokens_per_s: f64, loss: f64) -> StepMetrics {
        StepMetrics {
            step: 0,
            loss,
            lr: 0.0,
            grad_norm: 0.0,
            tokens,
            target_tokens: 0,
            tokens_per_s,
            skipped: false,
            loss_scale: None,
            recipe: Default::default(),
            peak_memory_bytes: 0,
            estimated_peak_bytes: None,
            elapsed_s: 0.0,
        }
    }

    /// A checkpoint's state comes back exactly (the f64s bit for bit, a NaN loss as NaN): resume
    /// is bitwise only if it does.
    #[test]
    fn state_round_trips_through_json() {
        let mut s = RunState::fresh(Some(LossScaler::new(65536.0, 2000)));
        s.count_step(&step_metrics(1234, 0.1 + 0.2, 1.0 / 3.0), 10);
        s.count_step(&step_metrics(99, 7e-310, f64::NAN), 10);
        s.wall_s = 12.345_678_901_234_567;
        let text = serde_json::to_vec(&s).unwrap();
        let back: RunState = serde_json::from_slice(&text).unwrap();
        assert!(back.last_loss.is_nan());
        s.last_loss = 0.0;
        let back = RunState {
            last_loss: 0.0,
            ..back
        };
        assert_eq!(back, s);
        assert_eq!(back.speeds[0].to_bits(), 7e-310f64.to_bits());
    }

    /// The scale comes from the checkpoint, the growth interval from the config as it is now.
    #[test]
    fn resume_keeps_the_configured_scaler_interval() {
        let mut saved = RunState::fresh(Some(LossScaler::new(1024.0, 100)));
        saved.scaler.as_mut().unwrap().clean_steps = 7;
        saved.step = 5;
        let mut now = RunState::fresh(Some(LossScaler::new(65536.0, 3)));
        now.resume(saved.clone());
        assert_eq!(now.step, 5);
        let s = now.scaler.unwrap();
        assert_eq!((s.scale, s.clean_steps, s.interval), (1024.0, 7, 3));
        let mut f32_run = RunState::fresh(None);
        f32_run.resume(saved);
        assert_eq!(f32_run.scaler, None);
    }

    /// `max_bad_steps` non-finite steps in a row stop the run; a clean one resets the streak.
    #[test]
    fn bad_steps_are_counted_then_stop_the_run() {
        let mut s = RunState::fresh(None);
        let bad = Applied {
            grad_norm: f64::NAN,
            applied: false,
        };
        let good = Applied {
            grad_norm: 1.0,
            applied: true,
        };
        let mut warnings = Vec::new();
        let mut warn = |w: String| warnings.push(w);
        s.count_update(bad, f64::NAN, 1.0, 2, &mut warn).unwrap();
        s.count_update(good, 2.0, 1.0, 2, &mut warn).unwrap();
        s.count_update(bad, f64::NAN, 1.0, 2, &mut warn).unwrap();
        let e = s
            .count_update(bad, f64::NAN, 1.0, 2, &mut warn)
            .unwrap_err();
        assert!(
            matches!(e, TrainError::NonFinite { in_a_row: 2, .. }),
            "{e}"
        );
        assert_eq!((s.skipped_steps, warnings.len()), (3, 2));
    }

    /// Issue 46: a run of 2 steps, both skipped, under `max_bad_steps = 5` is refused at its end;
    /// one applied update (or none made yet) passes.
    #[test]
    fn a_run_whose_every_update_was_skipped_is_not_trained() {
        let bad = Applied {
            grad_norm: f64::NAN,
            applied: false,
        };
        let good = Applied {
            grad_norm: 1.0,
            applied: true,
        };
        let mut warn = |_: String| {};
        let mut s = RunState::fresh(None);
        assert!(s.check_trained().is_ok());
        for _ in 0..2 {
            s.count_update(bad, f64::NAN, 1.0, 5, &mut warn).unwrap();
            s.count_step(&step_metrics(1, 1.0, f64::NAN), 2);
        }
        let e = s.check_trained().unwrap_err();
        assert!(matches!(e, TrainError::NothingTrained { steps: 2 }), "{e}");
        assert!(!e.is_input_error());
        let mut s = RunState::fresh(None);
        s.count_update(good, 1.0, 1.0, 5, &mut warn).unwrap();
        s.count_step(&step_metrics(1, 1.0, 1.0), 2);
        s.count_update(bad, f64::NAN, 1.0, 5, &mut warn).unwrap();
        s.count_step(&step_metrics(1, 1.0, f64::NAN), 2);
        assert!(s.check_trained().is_ok());
    }

    /// Issue 35: `max_bad_steps = 5` stopped on the 6th bad step in a row; it stops on the 5th, as
    /// the README says ("this many in a row stop the run"), and each earlier one warns with the limit.
    #[test]
    fn max_bad_steps_5_stops_on_the_5th_bad_step() {
        let mut s = RunState::fresh(None);
        let bad = Applied {
            grad_norm: f64::NAN,
            applied: false,
        };
        let mut warnings = Vec::new();
        let mut warn = |w: String| warnings.push(w);
        for _ in 0..4 {
            s.count_update(bad, f64::NAN, 1.0, 5, &mut warn).unwrap();
            s.step += 1;
        }
        let e = s
            .count_update(bad, f64::NAN, 1.0, 5, &mut warn)
            .unwrap_err();
        assert!(
            matches!(
                e,
                TrainError::NonFinite {
                    step: 5,
                    in_a_row: 5,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("for 5 steps in a row"), "{e}");
        assert_eq!(warnings.len(), 4);
        assert!(
            warnings[3].contains("4 in a row, the run stops at 5 in a row"),
            "{}",
            warnings[3]
        );
    }
}
