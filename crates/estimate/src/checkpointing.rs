//! `gradient_checkpointing = "auto"`: checkpointing trades a second forward pass per layer (about a
//! third more compute) for memory, so it is worth it only when the run would not fit without it.
//! The decision takes the memory model's peak for the run *without* checkpointing
//! ([`crate::estimate`], fitted to the data by the caller) and compares it, with [`HEADROOM`], to
//! the memory budget: available RAM on the CPU, free device memory on CUDA (what the run already
//! holds added back, since the estimate counts it too). `true`/`false` in the config are obeyed
//! as written. The choice and its reason are printed at start and recorded in run.json.

use rtune_config::Checkpointing;
use rtune_model::ModelConfig;
use serde::{Deserialize, Serialize};

use crate::Settings;

/// The estimate's peak times this must fit the budget for `auto` to leave checkpointing off: the
/// memory model is checked to ±10% against measured peaks (`benches/estimate_vs_measured.sh`),
/// so a run that fits only without that margin is checkpointed.
pub const HEADROOM: f64 = 1.10;

/// How a run's gradient checkpointing was decided.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointingChoice {
    /// As configured: `auto`, `true` or `false`.
    pub setting: String,
    /// Whether the run checkpoints.
    pub on: bool,
    /// Why, with the figures for `auto`.
    pub reason: String,
}

impl CheckpointingChoice {
    /// One line for the start of a run: `gradient checkpointing off (auto: ...)`.
    pub fn describe(&self) -> String {
        let on = if self.on { "on" } else { "off" };
        format!(
            "gradient checkpointing {on} ({}: {})",
            self.setting, self.reason
        )
    }
}

/// The memory a run may use, and what it is (`available RAM`, `free device memory`); `None`
/// when it cannot be read.
pub type Budget<'a> = Option<(u64, &'a str)>;

/// Decides checkpointing for a run with settings `s` (its `gradient_checkpointing` is ignored)
/// on model `c` within `budget`. `auto` without a readable budget turns it on: the setting
/// that uses the least memory, as before `auto` existed.
pub fn choose_checkpointing(
    setting: Checkpointing,
    c: &ModelConfig,
    s: &Settings,
    budget: Budget,
) -> CheckpointingChoice {
    let choice = |on: bool, reason: String| CheckpointingChoice {
        setting: setting.as_str().to_string(),
        on,
        reason,
    };
    match setting {
        Checkpointing::On => choice(true, "set in the config".into()),
        Checkpointing::Off => choice(false, "set in the config".into()),
        Checkpointing::Auto => {
            let mut off = s.clone();
            off.gradient_checkpointing = false;
            let peak = crate::estimate(c, &off).peak_bytes;
            let mb = |b: u64| format!("{:.1} MB", b as f64 / 1e6);
            let Some((budget, what)) = budget else {
                return choice(
                    true,
                    format!(
                        "without it the run is estimated at {}, and the memory budget cannot be \
                         read",
                        mb(peak)
                    ),
                );
            };
            let fits = peak as f64 * HEADROOM <= budget as f64;
            let verdict = if fits { "fits" } else { "does not fit" };
            choice(
                !fits,
                format!(
                    "without it the run is estimated at {} (+{:.0}% headroom), which {verdict} \
                     in {} of {what}",
                    mb(peak),
                    (HEADROOM - 1.0) * 100.0,
                    mb(budget)
                ),
            )
        }
    }
}
