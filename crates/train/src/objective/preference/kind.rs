//! Which preference loss a run trains with: `rtune_config::Objective`'s preference variants as the
//! recipe takes them ([`Loss::of`]), a loss of pairs or KTO's of unpaired rows, and what each
//! needs (a reference pass, the chosen prompt's NLL, unpaired rows).

use rtune_config::{DpoLoss, Objective};

/// A preference objective's loss and knobs (`rtune_config::Objective`'s preference variants):
/// a loss of pairs, or KTO's of unpaired rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Loss {
    Pairs(PairLoss),
    Kto {
        beta: f64,
        desirable_weight: f64,
        undesirable_weight: f64,
    },
}

/// The losses of a (chosen, rejected) pair.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PairLoss {
    Dpo {
        beta: f64,
        loss: DpoLoss,
        label_smoothing: f64,
    },
    Simpo {
        beta: f64,
        gamma: f64,
        cpo_alpha: f64,
        label_smoothing: f64,
    },
    Orpo {
        beta: f64,
    },
}

impl Loss {
    /// The preference loss `[train] objective` names; `None` for SFT and GRPO.
    pub fn of(objective: Objective) -> Option<Loss> {
        Some(match objective {
            Objective::Sft | Objective::Grpo(_) => return None,
            Objective::Dpo {
                beta,
                loss,
                label_smoothing,
            } => Loss::Pairs(PairLoss::Dpo {
                beta,
                loss,
                label_smoothing,
            }),
            Objective::Simpo {
                beta,
                gamma,
                cpo_alpha,
                label_smoothing,
            } => Loss::Pairs(PairLoss::Simpo {
                beta,
                gamma,
                cpo_alpha,
                label_smoothing,
            }),
            Objective::Orpo { beta } => Loss::Pairs(PairLoss::Orpo { beta }),
            Objective::Kto {
                beta,
                desirable_weight,
                undesirable_weight,
            } => Loss::Kto {
                beta,
                desirable_weight,
                undesirable_weight,
            },
        })
    }

    /// The config's name.
    pub fn name(&self) -> &'static str {
        match self {
            Loss::Pairs(PairLoss::Dpo { .. }) => "dpo",
            Loss::Pairs(PairLoss::Simpo { .. }) => "simpo",
            Loss::Pairs(PairLoss::Orpo { .. }) => "orpo",
            Loss::Kto { .. } => "kto",
        }
    }

    /// Its NLL term covers the chosen sequence's prompt too (ORPO: TRL's `ORPOTrainer` takes the
    /// chosen NLL over prompt and response).
    pub fn nll_on_prompt(&self) -> bool {
        matches!(self, Loss::Pairs(PairLoss::Orpo { .. }))
    }

    /// Needs the reference policy's log-probabilities (DPO, KTO; SimPO and ORPO are
    /// reference-free).
    pub fn needs_reference(&self) -> bool {
        matches!(self, Loss::Pairs(PairLoss::Dpo { .. }) | Loss::Kto { .. })
    }

    /// Trains on unpaired rows (`{prompt, completion, label}`: KTO) rather than pairs.
    pub fn is_unpaired(&self) -> bool {
        matches!(self, Loss::Kto { .. })
    }
}
