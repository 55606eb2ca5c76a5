//! The `[train]` section, checked (as written: [`crate::TrainSection`]): the optimizer and its
//! schedule, the batch, the device, checkpointing, evaluation and LoRA+.

use std::path::Path;

use crate::file::TrainSection;
use crate::{invalid, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda(usize),
}

/// `[train] gradient_checkpointing`: fixed by the user, or decided per run from the memory
/// estimate (`rtune_estimate::choose_checkpointing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpointing {
    Auto,
    On,
    Off,
}

impl Checkpointing {
    pub fn as_str(self) -> &'static str {
        match self {
            Checkpointing::Auto => "auto",
            Checkpointing::On => "true",
            Checkpointing::Off => "false",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    Constant,
    Linear,
    Cosine,
}

/// The checked `[train]` section.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub seed: u64,
    pub steps: usize,
    pub micro_batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub schedule: Schedule,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    /// `(adam_beta1, adam_beta2)`.
    pub betas: (f64, f64),
    /// `adam_eps`.
    pub eps: f64,
    pub device: Device,
    /// As configured; a run decides `Auto` at start (`rtune_estimate::choose_checkpointing`).
    pub gradient_checkpointing: Checkpointing,
    /// Layer inputs kept in host memory during the forward pass (CUDA, with checkpointing).
    pub offload_checkpoints: bool,
    pub log_every: usize,
    /// 0 = validation only at the end.
    pub eval_every: usize,
    pub eval_prompts: Vec<String>,
    pub eval_max_new_tokens: usize,
    pub max_bad_steps: usize,
    pub loss_scale_init: f64,
    pub loss_scale_growth_interval: usize,
    /// `[train] loraplus_lr_ratio`: the B matrices train at `lr ×` this (1 = plain LoRA).
    pub loraplus_lr_ratio: f64,
    /// `[train] loraplus_lr_embedding`: LoRA+'s lr of LoRA on embedding layers (none in rtune).
    pub loraplus_lr_embedding: f64,
    /// `[train] objective` with its knobs.
    pub objective: crate::Objective,
    /// `[train] router_aux_loss_coef` (mixtures of experts; `None`: transformers' rule, see
    /// `TrainSection::router_aux_loss_coef`).
    pub router_aux_loss_coef: Option<f64>,
}

/// Bounds on batch sizes (far above what fits any machine: the logits of 65536 rows of one token
/// over a 32k vocabulary are 8.6 GB).
pub const MAX_MICRO_BATCH: usize = 1 << 16;
pub const MAX_GRAD_ACCUM: usize = 1 << 20;

impl TrainSection {
    pub(crate) fn validate(&self, path: &Path) -> Result<TrainConfig> {
        let bad = |key: &str, message: String| invalid(path, key, message);
        let positive = |key: &str, v: usize| {
            if v == 0 {
                Err(bad(key, "must be at least 1".into()))
            } else {
                Ok(())
            }
        };
        positive("train.steps", self.steps)?;
        positive("train.micro_batch_size", self.micro_batch_size)?;
        positive("train.grad_accum", self.grad_accum)?;
        // Sizes that reach an allocator are bounded before anything runs (issue 35: a batch of
        // 1e9 rows ran 85 s and aborted); the memory estimate at start refuses what fits these
        // bounds but not the machine.
        for (key, v, max) in [
            (
                "train.micro_batch_size",
                self.micro_batch_size,
                MAX_MICRO_BATCH,
            ),
            ("train.grad_accum", self.grad_accum, MAX_GRAD_ACCUM),
        ] {
            if v > max {
                return Err(bad(
                    key,
                    format!("{v} is over {max}; no machine holds such a batch"),
                ));
            }
        }
        positive("train.log_every", self.log_every)?;
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(bad(
                "train.lr",
                format!("must be a positive number, got {}", self.lr),
            ));
        }
        let schedule = match self.schedule.as_str() {
            "constant" => Schedule::Constant,
            "linear" => Schedule::Linear,
            "cosine" => Schedule::Cosine,
            other => {
                return Err(bad(
                    "train.schedule",
                    crate::suggest::not_one_of(other, &["constant", "linear", "cosine"]),
                ))
            }
        };
        if self.warmup_steps > self.steps {
            return Err(bad(
                "train.warmup_steps",
                format!(
                    "{} is more than train.steps = {}",
                    self.warmup_steps, self.steps
                ),
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(bad(
                "train.weight_decay",
                format!("must be >= 0, got {}", self.weight_decay),
            ));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(bad(
                "train.max_grad_norm",
                format!("must be >= 0 (0 = off), got {}", self.max_grad_norm),
            ));
        }
        for (key, v) in [
            ("train.adam_beta1", self.adam_beta1),
            ("train.adam_beta2", self.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(bad(key, format!("must be in [0, 1), got {v}")));
            }
        }
        if !(self.adam_eps.is_finite() && self.adam_eps > 0.0) {
            return Err(bad(
                "train.adam_eps",
                format!("must be positive, got {}", self.adam_eps),
            ));
        }
        if !(self.loss_scale_init.is_finite() && self.loss_scale_init > 0.0) {
            return Err(bad(
                "train.loss_scale_init",
                format!("must be positive, got {}", self.loss_scale_init),
            ));
        }
        positive(
            "train.loss_scale_growth_interval",
            self.loss_scale_growth_interval,
        )?;
        let device = parse_device(&self.device).map_err(|m| bad("train.device", m))?;
        let gradient_checkpointing = match &self.gradient_checkpointing {
            crate::Switch::Bool(true) => Checkpointing::On,
            crate::Switch::Bool(false) => Checkpointing::Off,
            crate::Switch::Word(w) if w == "auto" => Checkpointing::Auto,
            crate::Switch::Word(w) => {
                return Err(bad(
                    "train.gradient_checkpointing",
                    crate::suggest::not_one_of(w, &["true", "false", "auto"]),
                ))
            }
        };
        // Offloading moves the checkpointed inputs: `auto` becomes on.
        let gradient_checkpointing = match gradient_checkpointing {
            Checkpointing::Auto if self.offload_checkpoints => Checkpointing::On,
            g => g,
        };
        if self.offload_checkpoints && gradient_checkpointing == Checkpointing::Off {
            return Err(bad(
                "train.offload_checkpoints",
                "needs gradient_checkpointing = true (only checkpointed layer inputs are offloaded)"
                    .into(),
            ));
        }
        if self.offload_checkpoints && device == Device::Cpu {
            return Err(bad(
                "train.offload_checkpoints",
                "moves layer inputs from GPU to host memory; with device = \"cpu\" they are there already"
                    .into(),
            ));
        }
        let loraplus_lr_ratio = self.loraplus_lr_ratio.unwrap_or(1.0);
        if !(loraplus_lr_ratio.is_finite() && loraplus_lr_ratio > 0.0) {
            return Err(bad(
                "train.loraplus_lr_ratio",
                format!("must be a positive number (usually 2 to 16), got {loraplus_lr_ratio}"),
            ));
        }
        let loraplus_lr_embedding = self.loraplus_lr_embedding.unwrap_or(1e-6);
        if !(loraplus_lr_embedding.is_finite() && loraplus_lr_embedding > 0.0) {
            return Err(bad(
                "train.loraplus_lr_embedding",
                format!("must be a positive number, got {loraplus_lr_embedding}"),
            ));
        }
        if let Some(c) = self
            .router_aux_loss_coef
            .filter(|c| !(c.is_finite() && *c >= 0.0))
        {
            return Err(bad(
                "train.router_aux_loss_coef",
                format!("must be a number ≥ 0 (0: no load-balancing loss), got {c}"),
            ));
        }
        if self.loraplus_lr_embedding.is_some() && self.loraplus_lr_ratio.is_none() {
            return Err(bad(
                "train.loraplus_lr_embedding",
                "is LoRA+'s setting; set train.loraplus_lr_ratio too".into(),
            ));
        }
        Ok(TrainConfig {
            seed: self.seed,
            steps: self.steps,
            micro_batch_size: self.micro_batch_size,
            grad_accum: self.grad_accum,
            lr: self.lr,
            schedule,
            warmup_steps: self.warmup_steps,
            weight_decay: self.weight_decay,
            max_grad_norm: self.max_grad_norm,
            betas: (self.adam_beta1, self.adam_beta2),
            eps: self.adam_eps,
            device,
            gradient_checkpointing,
            offload_checkpoints: self.offload_checkpoints,
            log_every: self.log_every,
            eval_every: self.eval_every,
            eval_prompts: self.eval_prompts.clone(),
            eval_max_new_tokens: self.eval_max_new_tokens,
            max_bad_steps: self.max_bad_steps,
            loss_scale_init: self.loss_scale_init,
            loss_scale_growth_interval: self.loss_scale_growth_interval,
            loraplus_lr_ratio,
            loraplus_lr_embedding,
            objective: self.objective(path)?,
            router_aux_loss_coef: self.router_aux_loss_coef,
        })
    }
}

/// `auto | cpu | cuda | cuda:N`.
pub fn parse_device(s: &str) -> std::result::Result<Device, String> {
    match s {
        "auto" => Ok(Device::Auto),
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => Err(crate::suggest::not_one_of(
                other,
                &["auto", "cpu", "cuda:N"],
            )),
        },
    }
}
