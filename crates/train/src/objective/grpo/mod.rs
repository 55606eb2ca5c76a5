//! GRPO's math (issue 44), as TRL 1.16's `GRPOTrainer` computes it: the advantages from a
//! generation batch's rewards ([`advantages()`]) and the policy loss on per-token log-probabilities
//! with its hand-written gradient ([`loss`]); the recipe that samples, scores and calls them.
//!
//! | file | what |
//! |---|---|
//! | [`recipe`] | the [`super::Recipe`]: generation batches, the head, state for resume, rollouts.jsonl |
//! | [`rollout`] | sampling with the live adapter, the old/reference log-probs, rows as micro-batches |
//! | [`prompts`] | the prompt rows of the run's files, the stop tokens |
//! | [`metrics`] | TRL's metric names |
//! | [`advantages()`], [`loss`] | the math, stateless |

pub mod advantages;
pub mod loss;
pub mod metrics;
pub mod prompts;
pub mod recipe;
pub mod rollout;
#[cfg(test)]
mod tests;

pub use advantages::{advantages, Advantages, Aggregation, ScaleRewards};
pub use loss::{policy_loss, Normalizer, Rows, Stats, Step};

pub use rtune_config::{Level, LossType};

/// The settings the policy loss reads (TRL's `GRPOConfig` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    pub loss_type: LossType,
    pub level: Level,
    /// `epsilon` (0.2).
    pub epsilon_low: f32,
    /// `epsilon_high` (default: `epsilon`).
    pub epsilon_high: f32,
    /// Two-sided clipping's upper bound on the ratio, when set.
    pub delta: Option<f32>,
    /// The KL coefficient (0: no reference model).
    pub beta: f32,
    /// `use_bias_correction_kl` (true): the KL term times the importance ratio.
    pub bias_correction_kl: bool,
    pub sapo_temperature_pos: f32,
    pub sapo_temperature_neg: f32,
}

impl Default for PolicyConfig {
    /// TRL 1.16's defaults.
    fn default() -> Self {
        PolicyConfig {
            loss_type: LossType::Dapo,
            level: Level::Token,
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            delta: None,
            beta: 0.0,
            bias_correction_kl: true,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
        }
    }
}
