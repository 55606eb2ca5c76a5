//! The `[lora]` section, checked (as written: [`crate::LoraSection`]): the adapter's rank,
//! scale, dropout and targets, its variant (DoRA, `init`, trainable tokens) and where it starts.
//! [`LoraConfig::spec`] is the one place a run's [`rtune_lora::LoraSpec`] is built; the trainer
//! and the memory estimate both take it from there.

use std::path::{Path, PathBuf};

use crate::file::{LoraSection, Targets};
use crate::{invalid, TokenName};

/// The checked `[lora]` section.
#[derive(Debug, Clone)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Module names (`q_proj`, ...) or `["all-linear"]`, as written (expanded by [`Self::spec`]).
    pub targets: Vec<String>,
    pub rslora: bool,
    /// `[lora] dora`.
    pub dora: bool,
    pub init_from: Option<PathBuf>,
    /// `[lora] init`, checked: how a fresh adapter starts.
    pub init: rtune_lora::Init,
    /// `[lora] trainable_tokens`: tokens whose embedding rows train (PEFT's
    /// `trainable_token_indices`; resolved through the tokenizer when the model is loaded).
    pub trainable_tokens: Vec<TokenName>,
    /// `[lora] target_parameters` (PEFT's), in the order written: PEFT nests its wrappers in it.
    pub target_parameters: Vec<String>,
}

impl LoraConfig {
    /// The adapter's spec: `all-linear` expanded, targets in model order, DoRA on or off. Fails on
    /// a target that names no module (`[lora] targets: unknown module …`), which the run reports
    /// when it sets up (exit 2), as the estimate does. Boxed: the error is large (the trainer boxes
    /// it too).
    pub fn spec(&self) -> Result<rtune_lora::LoraSpec, Box<rtune_lora::LoraError>> {
        let spec =
            rtune_lora::LoraSpec::new(self.r, self.alpha, self.dropout, self.rslora, &self.targets)
                .map_err(Box::new)?;
        spec.with_dora(self.dora)
            .with_target_parameters(&self.target_parameters)
            .map_err(Box::new)
    }
}

impl LoraSection {
    pub(crate) fn validate(&self, path: &Path) -> crate::Result<LoraConfig> {
        let bad = |key: &str, message: String| invalid(path, key, message);
        if self.r == 0 {
            return Err(bad("lora.r", "must be at least 1".into()));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(bad(
                "lora.alpha",
                format!("must be a positive number, got {}", self.alpha),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(bad(
                "lora.dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            ));
        }
        let targets = match &self.targets {
            Targets::One(s) => vec![s.clone()],
            Targets::List(v) => v.clone(),
        };
        if targets.is_empty() || targets.iter().any(|t| t.trim().is_empty()) {
            return Err(bad(
                "lora.targets",
                "needs at least one module name, or \"all-linear\"".into(),
            ));
        }
        let init = match self.init.as_deref() {
            None => rtune_lora::Init::Default,
            Some(s) => s.parse().map_err(|_| {
                bad(
                    "lora.init",
                    crate::suggest::not_one_of(s, &rtune_lora::INIT_NAMES),
                )
            })?,
        };
        if init != rtune_lora::Init::Default && !self.init_from.trim().is_empty() {
            return Err(bad(
                "lora.init",
                format!(
                    "= \"{}\" initialises a fresh adapter; it cannot be combined with [lora] init_from",
                    init
                ),
            ));
        }
        if self.dora
            && matches!(
                init,
                rtune_lora::Init::Pissa { .. } | rtune_lora::Init::Olora
            )
        {
            // A PiSSA / OLoRA adapter is saved converted to a plain LoRA of the original base
            // (rank 2r); DoRA's magnitudes are relative to the residual base and do not convert.
            return Err(bad(
                "lora.init",
                format!(
                    "= \"{init}\" cannot be combined with [lora] dora = true (the adapter is saved \
                     converted to the original base, which DoRA's magnitudes do not survive)"
                ),
            ));
        }
        let tokens = self.trainable_tokens.clone().unwrap_or_default();
        if self.trainable_tokens.is_some() && tokens.is_empty() {
            return Err(bad(
                "lora.trainable_tokens",
                "is an empty list; name at least one token (\"<|im_end|>\" or an id) or remove \
                 the key"
                    .into(),
            ));
        }
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(i, t)| tokens[..*i].contains(t))
        {
            return Err(bad(
                "lora.trainable_tokens",
                format!(
                    "lists {t} twice (entries {} and {})",
                    tokens.iter().position(|u| u == t).unwrap_or(0) + 1,
                    i + 1
                ),
            ));
        }
        if !self.target_parameters.is_empty() && self.dropout != 0.0 {
            // PEFT's ParamWrapper refuses it: dropout cannot be factored out of W + ΔW.
            return Err(bad(
                "lora.dropout",
                format!(
                    "= {} with target_parameters: PEFT adapts expert stacks without dropout; \
                     set dropout = 0",
                    self.dropout
                ),
            ));
        }
        if !self.target_parameters.is_empty() && (self.dora || init != rtune_lora::Init::Default) {
            return Err(bad(
                "lora.target_parameters",
                "works with plain LoRA and the default init only (PEFT's ParamWrapper refuses \
                 DoRA; PiSSA/OLoRA/gaussian starts are not written for expert stacks)"
                    .into(),
            ));
        }
        let init_from = if self.init_from.trim().is_empty() {
            None
        } else {
            Some(PathBuf::from(&self.init_from))
        };
        Ok(LoraConfig {
            r: self.r,
            alpha: self.alpha,
            dropout: self.dropout,
            targets,
            rslora: self.rslora,
            dora: self.dora,
            target_parameters: self.target_parameters.clone(),
            init_from,
            init,
            trainable_tokens: tokens,
        })
    }
}
