//! GRPO's math (issue 44), as TRL 1.16's `GRPOTrainer` computes it: the advantages from a
//! generation batch's rewards ([`advantages()`]) and the policy loss on per-token log-probabilities
//! with its hand-written gradient ([`loss`]). The recipe that samples, scores and calls these is
//! still to come (its [`super::Recipe`] impl); these files hold no state and read no config file.

pub mod advantages;
pub mod loss;
#[cfg(test)]
mod tests;

pub use advantages::{advantages, Advantages, Aggregation, ScaleRewards};
pub use loss::{policy_loss, Normalizer, Rows, Stats, Step};

/// TRL's `loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossType {
    /// Each completion's masked mean, averaged over completions.
    Grpo,
    /// The masked mean over every token of the micro-batch.
    Bnpo,
    /// The masked sum over `b · max_completion_length` (Dr. GRPO).
    DrGrpo,
    /// The masked sum over the generation batch's tokens (DAPO; TRL's default).
    Dapo,
    /// The clipped importance weight held constant, times `A · logp` (CISPO).
    Cispo,
    /// A soft gate `σ(τ(r − 1))·4/τ` instead of the clip (SAPO).
    Sapo,
}

impl LossType {
    /// The loss types with PPO's two-sided clip (and TRL's clip-ratio metrics).
    pub fn is_clipped(self) -> bool {
        matches!(
            self,
            LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo
        )
    }
}

/// TRL's `importance_sampling_level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// One ratio per token.
    Token,
    /// One ratio per completion: the exp of the masked mean log-ratio (GSPO).
    Sequence,
}

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
