//! `[train] objective = "grpo"`'s knobs, checked: TRL 1.16's `GRPOConfig` names, meanings and
//! defaults (issue 44). The reward functions are `[[reward]]` tables (`rtune_reward`), checked
//! into [`crate::RunConfig::rewards`] by `run.rs`, which also checks the rules that span
//! sections (the generation batch in whole groups, room for the completion in `max_seq_len`).

use std::path::Path;

use crate::file::TrainSection;
use crate::{invalid, Result, Switch};

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

/// TRL's `scale_rewards`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleRewards {
    /// By the std of the completion's group.
    Group,
    /// By the std of the whole batch.
    Batch,
    /// Not scaled (the group std still decides `frac_reward_zero_std`).
    None,
}

/// GRPO's checked settings (TRL 1.16's `GRPOConfig` names; `None`: unset, TRL's `None`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grpo {
    /// Completions sampled per prompt (8).
    pub num_generations: usize,
    /// Most new tokens a completion has (512).
    pub max_completion_length: usize,
    pub temperature: f64,
    pub top_p: f64,
    /// 0: off (TRL's `None`).
    pub top_k: usize,
    pub min_p: Option<f64>,
    pub repetition_penalty: f64,
    /// The KL coefficient (0.0: no reference pass).
    pub beta: f64,
    pub epsilon: f64,
    /// Default: `epsilon`.
    pub epsilon_high: f64,
    pub delta: Option<f64>,
    pub loss_type: LossType,
    pub scale_rewards: ScaleRewards,
    pub importance_sampling_level: Level,
    /// μ: optimizer passes over each generation batch (old log-probs kept from sampling).
    pub num_iterations: usize,
    /// Micro-batches per generation (default: `grad_accum`).
    pub steps_per_generation: usize,
    pub mask_truncated_completions: bool,
}

/// Keys read by GRPO alone (`beta` and `loss_type` are DPO's too).
pub(crate) const GRPO_KEYS: [&str; 16] = [
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "epsilon",
    "epsilon_high",
    "delta",
    "scale_rewards",
    "importance_sampling_level",
    "num_iterations",
    "steps_per_generation",
    "mask_truncated_completions",
    "reward_weights",
];

impl TrainSection {
    /// The GRPO keys set in this section.
    pub(crate) fn grpo_keys_set(&self) -> Vec<&'static str> {
        let set = [
            self.num_generations.is_some(),
            self.max_completion_length.is_some(),
            self.temperature.is_some(),
            self.top_p.is_some(),
            self.top_k.is_some(),
            self.min_p.is_some(),
            self.repetition_penalty.is_some(),
            self.epsilon.is_some(),
            self.epsilon_high.is_some(),
            self.delta.is_some(),
            self.scale_rewards.is_some(),
            self.importance_sampling_level.is_some(),
            self.num_iterations.is_some(),
            self.steps_per_generation.is_some(),
            self.mask_truncated_completions.is_some(),
            self.reward_weights.is_some(),
        ];
        GRPO_KEYS
            .iter()
            .zip(set)
            .filter(|(_, s)| *s)
            .map(|(k, _)| *k)
            .collect()
    }

    /// Checks the GRPO keys into [`Grpo`] (TRL's defaults for those unset).
    pub(crate) fn grpo(&self, path: &Path) -> Result<Grpo> {
        let bad = |key: &str, message: String| invalid(path, key, message);
        let num_generations = self.num_generations.unwrap_or(8);
        if !(2..=4096).contains(&num_generations) {
            return Err(bad(
                "train.num_generations",
                format!(
                    "must be 2 to 4096 (a group's advantages need two completions to compare; \
                     TRL's default 8), got {num_generations}"
                ),
            ));
        }
        let max_completion_length = self.max_completion_length.unwrap_or(512);
        if max_completion_length == 0 {
            return Err(bad(
                "train.max_completion_length",
                "must be at least 1 token".into(),
            ));
        }
        let positive = |key: &str, v: f64| match v.is_finite() && v > 0.0 {
            true => Ok(v),
            false => Err(bad(key, format!("must be a positive number, got {v}"))),
        };
        let temperature = positive("train.temperature", self.temperature.unwrap_or(1.0))?;
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(bad(
                "train.top_p",
                format!("must lie in (0, 1] (1: off), got {top_p}"),
            ));
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(bad("train.min_p", format!("must lie in [0, 1], got {p}")));
            }
        }
        let repetition_penalty = positive(
            "train.repetition_penalty",
            self.repetition_penalty.unwrap_or(1.0),
        )?;
        let beta = self.beta.unwrap_or(0.0);
        if !(beta.is_finite() && beta >= 0.0) {
            return Err(bad(
                "train.beta",
                format!("must be a number ≥ 0 (GRPO's default 0.0: no reference), got {beta}"),
            ));
        }
        let epsilon = positive("train.epsilon", self.epsilon.unwrap_or(0.2))?;
        let epsilon_high = positive("train.epsilon_high", self.epsilon_high.unwrap_or(epsilon))?;
        let delta = match self.delta {
            Some(d) if !(d.is_finite() && d > 1.0) => {
                return Err(bad(
                    "train.delta",
                    format!("must be a number > 1 (an upper bound on the ratio), got {d}"),
                ))
            }
            d => d,
        };
        let loss_type = match self.loss_type.as_deref().unwrap_or("dapo") {
            "grpo" => LossType::Grpo,
            "bnpo" => LossType::Bnpo,
            "dr_grpo" => LossType::DrGrpo,
            "dapo" => LossType::Dapo,
            "cispo" => LossType::Cispo,
            "sapo" => LossType::Sapo,
            other => {
                let known = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"];
                return Err(bad(
                    "train.loss_type",
                    crate::suggest::not_one_of(other, &known),
                ));
            }
        };
        let scale_rewards = match &self.scale_rewards {
            None | Some(Switch::Bool(true)) => ScaleRewards::Group,
            Some(Switch::Bool(false)) => ScaleRewards::None,
            Some(Switch::Word(w)) => match w.as_str() {
                "group" => ScaleRewards::Group,
                "batch" => ScaleRewards::Batch,
                "none" => ScaleRewards::None,
                other => {
                    return Err(bad(
                        "train.scale_rewards",
                        crate::suggest::not_one_of(other, &["group", "batch", "none"]),
                    ))
                }
            },
        };
        let importance_sampling_level =
            match self.importance_sampling_level.as_deref().unwrap_or("token") {
                "token" => Level::Token,
                "sequence" => Level::Sequence,
                other => {
                    return Err(bad(
                        "train.importance_sampling_level",
                        crate::suggest::not_one_of(other, &["token", "sequence"]),
                    ))
                }
            };
        let num_iterations = self.num_iterations.unwrap_or(1);
        let steps_per_generation = self.steps_per_generation.unwrap_or(self.grad_accum);
        for (key, v) in [
            ("train.num_iterations", num_iterations),
            ("train.steps_per_generation", steps_per_generation),
        ] {
            if !(1..=1 << 16).contains(&v) {
                return Err(bad(key, format!("must be 1 to 65536, got {v}")));
            }
        }
        Ok(Grpo {
            num_generations,
            max_completion_length,
            temperature,
            top_p,
            top_k: self.top_k.unwrap_or(0),
            min_p: self.min_p,
            repetition_penalty,
            beta,
            epsilon,
            epsilon_high,
            delta,
            loss_type,
            scale_rewards,
            importance_sampling_level,
            num_iterations,
            steps_per_generation,
            mask_truncated_completions: self.mask_truncated_completions.unwrap_or(false),
        })
    }
}
