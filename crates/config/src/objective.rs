//! `[train] objective` and its knobs, under TRL's names: what a training step minimises.
//!
//! | objective | TRL | loss of a pair (Δ = β·((πc − rc) − (πr − rr)), π/r policy/reference log-probs) |
//! |---|---|---|
//! | `sft` | `SFTTrainer` | next-token cross-entropy on completions (no pairs) |
//! | `dpo` | `DPOTrainer` | `loss_type`: `sigmoid` −log σ(Δ), `hinge` relu(1 − Δ), `ipo` (per-token averages), `robust` (with `label_smoothing`) |
//! | `simpo` | `CPOTrainer(loss_type="simpo")` | −log σ(β·(π̄c − π̄r) − γ) + `cpo_alpha`·NLL(chosen), π̄ per-token averages, no reference |
//! | `kto` | `KTOTrainer` | unpaired rows: w_d·(1 − σ(β·(πc − rc − KL))) if desirable, w_u·(1 − σ(β·(KL − (πc − rc)))) if not; KL from mismatched completions |
//! | `orpo` | `ORPOTrainer` | NLL(chosen, prompt included) − β·log σ(log-odds(π̄c) − log-odds(π̄r)), no reference |
//! | `grpo` | `GRPOTrainer` | no pairs: completions sampled in the step, TRL's clipped policy loss (`grpo.rs`) |

use std::path::Path;

use crate::file::TrainSection;
use crate::{invalid, Result};

/// DPO's `loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLoss {
    Sigmoid,
    Hinge,
    Ipo,
    Robust,
}

/// What a step minimises (module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    Sft,
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
    Kto {
        beta: f64,
        desirable_weight: f64,
        undesirable_weight: f64,
    },
    Grpo(crate::Grpo),
}

impl Objective {
    /// The config's name of the objective.
    pub fn name(&self) -> &'static str {
        match self {
            Objective::Sft => "sft",
            Objective::Dpo { .. } => "dpo",
            Objective::Simpo { .. } => "simpo",
            Objective::Orpo { .. } => "orpo",
            Objective::Kto { .. } => "kto",
            Objective::Grpo(_) => "grpo",
        }
    }

    /// Trains on preference pairs (prompt, chosen, rejected) rather than SFT examples.
    pub fn is_preference(&self) -> bool {
        !matches!(self, Objective::Sft | Objective::Grpo(_))
    }

    /// Samples its completions during training from prompt rows (GRPO).
    pub fn is_online(&self) -> bool {
        matches!(self, Objective::Grpo(_))
    }

    /// Its NLL term covers the chosen sequence's prompt too (ORPO: TRL's `ORPOTrainer` takes the
    /// chosen NLL over prompt and response).
    pub fn nll_on_prompt(&self) -> bool {
        matches!(self, Objective::Orpo { .. })
    }

    /// Needs the reference policy's log-probabilities (DPO; SimPO and ORPO are reference-free).
    pub fn needs_reference(&self) -> bool {
        matches!(self, Objective::Dpo { .. } | Objective::Kto { .. })
    }

    /// Trains on unpaired rows (`{prompt, completion, label}`: KTO) rather than pairs.
    pub fn is_unpaired(&self) -> bool {
        matches!(self, Objective::Kto { .. })
    }
}

impl TrainSection {
    pub(crate) fn objective(&self, path: &Path) -> Result<Objective> {
        let bad = |key: &str, message: String| invalid(path, key, message);
        let name = self.objective.as_deref().unwrap_or("sft");
        let names = ["sft", "dpo", "simpo", "orpo", "kto", "grpo"];
        // The name first: `objective = "DPO"` was blamed on `train.beta` ("a setting of dpo"); the
        // names are case-sensitive, as TRL's, and a near miss gets "did you mean".
        let Some(kind) = names.iter().position(|&n| n == name) else {
            return Err(bad(
                "train.objective",
                crate::suggest::not_one_of(name, &names),
            ));
        };
        // Knobs that belong to another objective are refused rather than ignored.
        let only = |key: &str, set: bool, for_: &[&str]| match set && !for_.contains(&name) {
            true => Err(bad(
                key,
                format!(
                    "is a setting of objective {}; this run's objective is \"{name}\"",
                    for_.join(" / ")
                ),
            )),
            false => Ok(()),
        };
        only(
            "train.beta",
            self.beta.is_some(),
            &["dpo", "simpo", "orpo", "kto", "grpo"],
        )?;
        for key in self.grpo_keys_set() {
            only(&format!("train.{key}"), true, &["grpo"])?;
        }
        if name == "grpo" {
            return Ok(Objective::Grpo(self.grpo(path)?));
        }
        only(
            "train.desirable_weight",
            self.desirable_weight.is_some(),
            &["kto"],
        )?;
        only(
            "train.undesirable_weight",
            self.undesirable_weight.is_some(),
            &["kto"],
        )?;
        only(
            "train.loss_type",
            self.loss_type.is_some(),
            &["dpo", "grpo"],
        )?;
        only(
            "train.label_smoothing",
            self.label_smoothing.is_some(),
            &["dpo", "simpo"],
        )?;
        only("train.simpo_gamma", self.simpo_gamma.is_some(), &["simpo"])?;
        only("train.cpo_alpha", self.cpo_alpha.is_some(), &["simpo"])?;
        // TRL's defaults: β 0.1 (DPO, CPO, ORPO), SimPO's γ 0.5, CPO's α 1.0.
        let beta = self.beta.unwrap_or(0.1);
        if !(beta.is_finite() && beta > 0.0) {
            return Err(bad(
                "train.beta",
                format!("must be a positive number (TRL's default 0.1), got {beta}"),
            ));
        }
        let label_smoothing = self.label_smoothing.unwrap_or(0.0);
        if !(0.0..0.5).contains(&label_smoothing) {
            return Err(bad(
                "train.label_smoothing",
                format!("must lie in [0, 0.5), got {label_smoothing}"),
            ));
        }
        let finite = |key: &str, v: f64| match v.is_finite() {
            true => Ok(v),
            false => Err(bad(key, format!("must be a finite number, got {v}"))),
        };
        Ok(match kind {
            // The position in `names`: no arm for a name the check above refused.
            0 /* sft */ => Objective::Sft,
            1 /* dpo */ => {
                let loss = match self.loss_type.as_deref().unwrap_or("sigmoid") {
                    "sigmoid" => DpoLoss::Sigmoid,
                    "hinge" => DpoLoss::Hinge,
                    "ipo" => DpoLoss::Ipo,
                    "robust" => DpoLoss::Robust,
                    other => {
                        let known = ["sigmoid", "hinge", "ipo", "robust"];
                        return Err(bad(
                            "train.loss_type",
                            crate::suggest::not_one_of(other, &known),
                        ));
                    }
                };
                // TRL 1.16's DPO reads label_smoothing in the robust loss alone (its sigmoid loss
                // is plain −log σ, cDPO's smoothing having moved to `robust`): refused where it
                // would be ignored.
                if label_smoothing > 0.0 && loss != DpoLoss::Robust {
                    return Err(bad(
                        "train.label_smoothing",
                        "is read by loss_type = \"robust\" only (TRL's sigmoid, hinge and ipo \
                         losses ignore it)"
                            .into(),
                    ));
                }
                Objective::Dpo {
                    beta,
                    loss,
                    label_smoothing,
                }
            }
            2 /* simpo */ => Objective::Simpo {
                beta,
                gamma: finite("train.simpo_gamma", self.simpo_gamma.unwrap_or(0.5))?,
                cpo_alpha: finite("train.cpo_alpha", self.cpo_alpha.unwrap_or(1.0))?,
                label_smoothing,
            },
            3 /* orpo */ => Objective::Orpo { beta },
            _ /* kto */ => {
                let weight = |key: &str, v: Option<f64>| match v.unwrap_or(1.0) {
                    w if w.is_finite() && w > 0.0 => Ok(w),
                    w => Err(bad(
                        key,
                        format!("must be a positive number (TRL's default 1), got {w}"),
                    )),
                };
                Objective::Kto {
                    beta,
                    desirable_weight: weight("train.desirable_weight", self.desirable_weight)?,
                    undesirable_weight: weight(
                        "train.undesirable_weight",
                        self.undesirable_weight,
                    )?,
                }
            }
        })
    }
}
