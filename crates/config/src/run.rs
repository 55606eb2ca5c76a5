//! The checked runtime config.

use std::path::{Path, PathBuf};

use crate::file::{ConfigFile, Targets};
use crate::{ConfigError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// `bf16-autocast`: an f32 model whose products take bf16-rounded operands with f32
    /// accumulation (PEFT under `torch.autocast('cpu', dtype=torch.bfloat16)`); the frozen
    /// weights are held in bf16.
    Bf16Autocast,
}

impl DType {
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::Bf16Autocast => "bf16-autocast",
        }
    }
}

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

/// Everything the trainer needs, checked. Paths are as written (relative to the working directory).
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The config as written after overrides (saved next to the outputs).
    pub file: ConfigFile,
    pub config_path: PathBuf,
    pub model_path: PathBuf,
    pub dtype: DType,
    /// How the frozen linear layers are held (`[model] quantize` with `double_quant`).
    pub quantize: rtune_quant::Quantize,
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Module names (`q_proj`, ...) or `["all-linear"]`.
    pub targets: Vec<String>,
    pub rslora: bool,
    pub init_from: Option<PathBuf>,
    /// `[lora] dora`.
    pub dora: bool,
    pub data: crate::DataConfig,
    pub seed: u64,
    pub steps: usize,
    pub micro_batch_size: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub schedule: Schedule,
    pub warmup_steps: usize,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    pub betas: (f64, f64),
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
    pub output_dir: PathBuf,
    pub overwrite: bool,
    pub save_every: usize,
    pub keep_last: usize,
    pub resume: bool,
    pub private: bool,
    /// Keep training when a checkpoint cannot be written (warn instead of stopping).
    pub continue_on_save_error: bool,
    /// Refuse to start without room for the run's outputs (`[output] check_disk`).
    pub check_disk: bool,
    /// `[lora] init`, checked: how a fresh adapter starts.
    pub init: rtune_lora::Init,
    /// `[lora] trainable_tokens`: tokens whose embedding rows train (PEFT's
    /// `trainable_token_indices`; resolved through the tokenizer when the model is loaded).
    pub trainable_tokens: Vec<crate::TokenName>,
    /// `[train] loraplus_lr_ratio`: the B matrices train at `lr ×` this (1 = plain LoRA).
    pub loraplus_lr_ratio: f64,
    /// `[train] loraplus_lr_embedding`: LoRA+'s lr of LoRA on embedding layers (none in rtune).
    pub loraplus_lr_embedding: f64,
    /// `[output] remote`: the S3 URL the run directory is mirrored to.
    pub remote: Option<String>,
    /// `[output] remote_timeout`: how long the end of a run waits for its uploads.
    pub remote_timeout: std::time::Duration,
    /// `[output] mlflow`: the tracking server's URL, and the experiment.
    pub mlflow: Option<String>,
    pub mlflow_experiment: String,
}

impl ConfigFile {
    /// Checks every value and builds the runtime config. `path` labels errors.
    pub fn validate(self, path: &Path) -> Result<RunConfig> {
        let bad = |key: &str, message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            key: key.to_string(),
            message,
        };
        let dtype = match self.model.dtype.as_str() {
            "f32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" => DType::F16,
            "bf16-autocast" | "autocast" => DType::Bf16Autocast,
            other => {
                return Err(bad(
                    "model.dtype",
                    crate::suggest::not_one_of(other, &["f32", "bf16", "f16", "bf16-autocast"]),
                ))
            }
        };
        // `nf4` takes `double_quant` from its own key; `nf4-dq` says it in the name.
        let quantize = match self.model.quantize.parse() {
            Ok(rtune_quant::Quantize::Nf4 {
                double_quant: false,
            }) if self.model.quantize == "nf4" => rtune_quant::Quantize::Nf4 {
                double_quant: self.model.double_quant,
            },
            Ok(q) => q,
            Err(_) => {
                return Err(bad(
                    "model.quantize",
                    crate::suggest::not_one_of(&self.model.quantize, &rtune_quant::QUANTIZE_NAMES),
                ))
            }
        };
        if self.model.path.trim().is_empty() {
            return Err(bad("model.path", "is empty".into()));
        }
        if self.model.revision.trim().is_empty() {
            return Err(bad(
                "model.revision",
                "is empty (a branch, tag or commit)".into(),
            ));
        }
        let l = &self.lora;
        if l.r == 0 {
            return Err(bad("lora.r", "must be at least 1".into()));
        }
        if !(l.alpha.is_finite() && l.alpha > 0.0) {
            return Err(bad(
                "lora.alpha",
                format!("must be a positive number, got {}", l.alpha),
            ));
        }
        if !(0.0..1.0).contains(&l.dropout) {
            return Err(bad(
                "lora.dropout",
                format!("must be in [0, 1), got {}", l.dropout),
            ));
        }
        let targets = match &l.targets {
            Targets::One(s) => vec![s.clone()],
            Targets::List(v) => v.clone(),
        };
        if targets.is_empty() || targets.iter().any(|t| t.trim().is_empty()) {
            return Err(bad(
                "lora.targets",
                "needs at least one module name, or \"all-linear\"".into(),
            ));
        }
        let data = self.data.validate(path)?;
        let t = &self.train;
        let positive = |key: &str, v: usize| {
            if v == 0 {
                Err(bad(key, "must be at least 1".into()))
            } else {
                Ok(())
            }
        };
        positive("train.steps", t.steps)?;
        positive("train.micro_batch_size", t.micro_batch_size)?;
        positive("train.grad_accum", t.grad_accum)?;
        positive("train.log_every", t.log_every)?;
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(bad(
                "train.lr",
                format!("must be a positive number, got {}", t.lr),
            ));
        }
        let schedule = match t.schedule.as_str() {
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
        if t.warmup_steps > t.steps {
            return Err(bad(
                "train.warmup_steps",
                format!("{} is more than train.steps = {}", t.warmup_steps, t.steps),
            ));
        }
        if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
            return Err(bad(
                "train.weight_decay",
                format!("must be >= 0, got {}", t.weight_decay),
            ));
        }
        if !(t.max_grad_norm.is_finite() && t.max_grad_norm >= 0.0) {
            return Err(bad(
                "train.max_grad_norm",
                format!("must be >= 0 (0 = off), got {}", t.max_grad_norm),
            ));
        }
        for (key, v) in [
            ("train.adam_beta1", t.adam_beta1),
            ("train.adam_beta2", t.adam_beta2),
        ] {
            if !(0.0..1.0).contains(&v) {
                return Err(bad(key, format!("must be in [0, 1), got {v}")));
            }
        }
        if !(t.adam_eps.is_finite() && t.adam_eps > 0.0) {
            return Err(bad(
                "train.adam_eps",
                format!("must be positive, got {}", t.adam_eps),
            ));
        }
        if !(t.loss_scale_init.is_finite() && t.loss_scale_init > 0.0) {
            return Err(bad(
                "train.loss_scale_init",
                format!("must be positive, got {}", t.loss_scale_init),
            ));
        }
        positive(
            "train.loss_scale_growth_interval",
            t.loss_scale_growth_interval,
        )?;
        let device = parse_device(&t.device).map_err(|m| bad("train.device", m))?;
        let gradient_checkpointing = match &t.gradient_checkpointing {
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
            Checkpointing::Auto if t.offload_checkpoints => Checkpointing::On,
            g => g,
        };
        if t.offload_checkpoints && gradient_checkpointing == Checkpointing::Off {
            return Err(bad(
                "train.offload_checkpoints",
                "needs gradient_checkpointing = true (only checkpointed layer inputs are offloaded)"
                    .into(),
            ));
        }
        if t.offload_checkpoints && device == Device::Cpu {
            return Err(bad(
                "train.offload_checkpoints",
                "moves layer inputs from GPU to host memory; with device = \"cpu\" they are there already"
                    .into(),
            ));
        }
        if self.output.dir.trim().is_empty() {
            return Err(bad("output.dir", "is empty".into()));
        }
        let o = &self.output;
        let resume = match o.resume.as_str() {
            "never" => false,
            "auto" => true,
            other => {
                return Err(bad(
                    "output.resume",
                    crate::suggest::not_one_of(other, &["never", "auto"]),
                ))
            }
        };
        let continue_on_save_error = match o.on_save_error.as_str() {
            "stop" => false,
            "continue" => true,
            other => {
                return Err(bad(
                    "output.on_save_error",
                    crate::suggest::not_one_of(other, &["stop", "continue"]),
                ))
            }
        };
        let (remote, remote_timeout, mlflow) = remote_keys(o).map_err(|(k, m)| bad(k, m))?;
        let mlflow_experiment = o.mlflow_experiment.clone();
        let init_from = if l.init_from.trim().is_empty() {
            None
        } else {
            Some(PathBuf::from(&l.init_from))
        };
        let (init, trainable_tokens, loraplus_lr_ratio, loraplus_lr_embedding) =
            self.validate_variants(path)?;
        Ok(RunConfig {
            config_path: path.to_path_buf(),
            model_path: PathBuf::from(&self.model.path),
            dtype,
            quantize,
            r: l.r,
            alpha: l.alpha,
            dropout: l.dropout,
            targets,
            rslora: l.rslora,
            init_from,
            dora: l.dora,
            data,
            seed: t.seed,
            steps: t.steps,
            micro_batch_size: t.micro_batch_size,
            grad_accum: t.grad_accum,
            lr: t.lr,
            schedule,
            warmup_steps: t.warmup_steps,
            weight_decay: t.weight_decay,
            max_grad_norm: t.max_grad_norm,
            betas: (t.adam_beta1, t.adam_beta2),
            eps: t.adam_eps,
            device,
            gradient_checkpointing,
            offload_checkpoints: t.offload_checkpoints,
            log_every: t.log_every,
            eval_every: t.eval_every,
            eval_prompts: t.eval_prompts.clone(),
            eval_max_new_tokens: t.eval_max_new_tokens,
            max_bad_steps: t.max_bad_steps,
            loss_scale_init: t.loss_scale_init,
            loss_scale_growth_interval: t.loss_scale_growth_interval,
            output_dir: PathBuf::from(&self.output.dir),
            overwrite: self.output.overwrite,
            save_every: o.save_every,
            keep_last: o.keep_last,
            resume,
            private: o.private,
            continue_on_save_error,
            check_disk: o.check_disk,
            init,
            trainable_tokens,
            loraplus_lr_ratio,
            loraplus_lr_embedding,
            remote,
            remote_timeout,
            mlflow,
            mlflow_experiment,
            file: self,
        })
    }
}

impl ConfigFile {
    /// The LoRA variants' keys (`[lora] init`, `trainable_tokens`; `[train] loraplus_*`), checked.
    #[allow(clippy::type_complexity)]
    fn validate_variants(
        &self,
        path: &Path,
    ) -> Result<(rtune_lora::Init, Vec<crate::TokenName>, f64, f64)> {
        let bad = |key: &str, message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            key: key.to_string(),
            message,
        };
        let init = match self.lora.init.as_deref() {
            None => rtune_lora::Init::Default,
            Some(s) => s.parse().map_err(|_| {
                bad(
                    "lora.init",
                    crate::suggest::not_one_of(s, &rtune_lora::INIT_NAMES),
                )
            })?,
        };
        if init != rtune_lora::Init::Default && !self.lora.init_from.trim().is_empty() {
            return Err(bad(
                "lora.init",
                format!(
                    "= \"{}\" initialises a fresh adapter; it cannot be combined with [lora] init_from",
                    init
                ),
            ));
        }
        if self.lora.dora
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
        let tokens = self.lora.trainable_tokens.clone().unwrap_or_default();
        if self.lora.trainable_tokens.is_some() && tokens.is_empty() {
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
        let ratio = self.train.loraplus_lr_ratio.unwrap_or(1.0);
        if !(ratio.is_finite() && ratio > 0.0) {
            return Err(bad(
                "train.loraplus_lr_ratio",
                format!("must be a positive number (usually 2 to 16), got {ratio}"),
            ));
        }
        let emb = self.train.loraplus_lr_embedding.unwrap_or(1e-6);
        if !(emb.is_finite() && emb > 0.0) {
            return Err(bad(
                "train.loraplus_lr_embedding",
                format!("must be a positive number, got {emb}"),
            ));
        }
        if self.train.loraplus_lr_embedding.is_some() && self.train.loraplus_lr_ratio.is_none() {
            return Err(bad(
                "train.loraplus_lr_embedding",
                "is LoRA+'s setting; set train.loraplus_lr_ratio too".into(),
            ));
        }
        Ok((init, tokens, ratio, emb))
    }
}

/// `[output] remote`, `remote_timeout` and `mlflow`, checked: an `s3://bucket[/prefix]` URL without
/// credentials in it (they come from the environment only, so they never reach run.json), a
/// duration such as "10m", an `http(s)://` URL. Errors are `(key, message)`.
type RemoteKeys = (Option<String>, std::time::Duration, Option<String>);
fn remote_keys(
    o: &crate::file::OutputSection,
) -> std::result::Result<RemoteKeys, (&'static str, String)> {
    let remote = match o.remote.trim() {
        "" => None,
        url => {
            let rest = url.strip_prefix("s3://").ok_or((
                "output.remote",
                format!("`{url}` is not an s3://bucket/prefix URL"),
            ))?;
            let bucket = rest.split('/').next().unwrap_or("");
            if bucket.is_empty() {
                return Err(("output.remote", format!("`{url}` names no bucket")));
            }
            if bucket.contains('@') || bucket.contains(':') {
                return Err((
                    "output.remote",
                    "must not carry credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
                     in the environment"
                        .into(),
                ));
            }
            Some(url.trim_end_matches('/').to_string())
        }
    };
    let remote_timeout = parse_duration(&o.remote_timeout).ok_or((
        "output.remote_timeout",
        format!(
            "`{}` is not a duration such as \"10m\" or \"90s\"",
            o.remote_timeout
        ),
    ))?;
    let mlflow = match o.mlflow.trim() {
        "" => None,
        url if url.starts_with("http://") || url.starts_with("https://") => {
            Some(url.trim_end_matches('/').to_string())
        }
        url => {
            return Err((
                "output.mlflow",
                format!("`{url}` is not an http:// or https:// URL"),
            ))
        }
    };
    if mlflow.is_some() && o.mlflow_experiment.trim().is_empty() {
        return Err(("output.mlflow_experiment", "is empty".into()));
    }
    Ok((remote, remote_timeout, mlflow))
}

/// "90s", "10m", "1h", "1h30m", or a bare number of seconds.
fn parse_duration(s: &str) -> Option<std::time::Duration> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<f64>() {
        return (secs >= 0.0 && secs.is_finite()).then(|| std::time::Duration::from_secs_f64(secs));
    }
    let (mut total, mut num) = (0.0f64, String::new());
    for c in s.chars() {
        match c {
            '0'..='9' | '.' => num.push(c),
            'h' | 'm' | 's' => {
                let n: f64 = num.parse().ok()?;
                total += n * match c {
                    'h' => 3600.0,
                    'm' => 60.0,
                    _ => 1.0,
                };
                num.clear();
            }
            _ => return None,
        }
    }
    (num.is_empty() && !s.is_empty()).then(|| std::time::Duration::from_secs_f64(total))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &str) -> Result<RunConfig> {
        let text = format!("[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n{extra}");
        ConfigFile::parse(&text, Path::new("c.toml"), &[])?.validate(Path::new("c.toml"))
    }

    /// `[output] remote`, `remote_timeout`, `mlflow`: defaults, accepted forms, and one-line
    /// refusals naming the key (a URL carrying credentials among them).
    #[test]
    fn remote_and_mlflow_keys() {
        let c = parse("").unwrap();
        assert_eq!((c.remote, c.mlflow), (None, None));
        assert_eq!(c.remote_timeout, std::time::Duration::from_secs(600));
        assert_eq!(c.mlflow_experiment, "rtune");
        let c = parse(
            "[output]\nremote = \"s3://b/runs/x/\"\nremote_timeout = \"1m30s\"\nmlflow = \"http://h:5000/\"",
        )
        .unwrap();
        assert_eq!(c.remote.as_deref(), Some("s3://b/runs/x"));
        assert_eq!(c.remote_timeout, std::time::Duration::from_secs(90));
        assert_eq!(c.mlflow.as_deref(), Some("http://h:5000"));
        assert_eq!(
            parse("[output]\nremote_timeout = \"5\"")
                .unwrap()
                .remote_timeout
                .as_secs(),
            5
        );
        for (extra, key) in [
            ("remote = \"b/x\"", "output.remote"),
            ("remote = \"s3://\"", "output.remote"),
            ("remote = \"s3://key:secret@b/x\"", "output.remote"),
            ("remote_timeout = \"soon\"", "output.remote_timeout"),
            ("mlflow = \"h:5000\"", "output.mlflow"),
        ] {
            let e = parse(&format!("[output]\n{extra}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{extra}: {e}");
            assert!(!e.contains("secret@"), "credentials are not echoed: {e}");
        }
    }

    #[test]
    fn defaults_validate() {
        let c = parse("").unwrap();
        assert_eq!(c.r, 8);
        assert_eq!(c.targets, vec!["all-linear"]);
        assert_eq!(c.schedule, Schedule::Cosine);
        assert_eq!(c.device, Device::Auto);
    }

    /// `gradient_checkpointing`: `"auto"` by default; `true`/`false` keep their meaning (also
    /// through `--set`, where `auto` arrives as a bare word); anything else names the key and the
    /// closest value; offloading the checkpoints turns `auto` on.
    #[test]
    fn gradient_checkpointing_is_auto_true_or_false() {
        assert_eq!(
            parse("").unwrap().gradient_checkpointing,
            Checkpointing::Auto
        );
        for (v, want) in [
            ("true", Checkpointing::On),
            ("false", Checkpointing::Off),
            ("\"auto\"", Checkpointing::Auto),
        ] {
            let c = parse(&format!("[train]\ngradient_checkpointing = {v}\n")).unwrap();
            assert_eq!(c.gradient_checkpointing, want, "{v}");
        }
        let text = "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n";
        for (set, want) in [
            ("train.gradient_checkpointing=auto", Checkpointing::Auto),
            ("train.gradient_checkpointing=false", Checkpointing::Off),
        ] {
            let f = ConfigFile::parse(text, Path::new("c.toml"), &[set.to_string()]).unwrap();
            let c = f.validate(Path::new("c.toml")).unwrap();
            assert_eq!(c.gradient_checkpointing, want, "{set}");
        }
        let e = parse("[train]\ngradient_checkpointing = \"atuo\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.gradient_checkpointing") && e.contains("did you mean `auto`"),
            "{e}"
        );
        let c = parse("[train]\ndevice = \"cuda:0\"\noffload_checkpoints = true\n").unwrap();
        assert_eq!(c.gradient_checkpointing, Checkpointing::On);
    }

    /// `bf16-autocast` (and its alias `autocast`) is its own dtype; `bf16` keeps its meaning; a
    /// near miss is named with the closest value.
    #[test]
    fn autocast_dtype_parses() {
        let with = |d: &str| {
            ConfigFile::parse(
                &format!("[model]\npath = \"m\"\ndtype = \"{d}\"\n[data]\ntrain = \"d\"\n"),
                Path::new("c.toml"),
                &[],
            )
            .and_then(|f| f.validate(Path::new("c.toml")))
        };
        assert_eq!(with("bf16-autocast").unwrap().dtype, DType::Bf16Autocast);
        assert_eq!(with("autocast").unwrap().dtype, DType::Bf16Autocast);
        assert_eq!(with("bf16").unwrap().dtype, DType::BF16);
        assert_eq!(DType::Bf16Autocast.as_str(), "bf16-autocast");
        let e = with("bf16-autocats").unwrap_err().to_string();
        assert!(e.contains("did you mean `bf16-autocast`"), "{e}");
    }

    #[test]
    fn bad_values_name_the_key() {
        for (extra, key) in [
            ("[lora]\nr = 0\n", "lora.r"),
            ("[lora]\ndropout = 1.5\n", "lora.dropout"),
            ("[train]\nschedule = \"exp\"\n", "train.schedule"),
            ("[train]\ndevice = \"tpu\"\n", "train.device"),
            (
                "[train]\nsteps = 2\nwarmup_steps = 5\n",
                "train.warmup_steps",
            ),
            ("[model]\npath = \"m\"\ndtype = \"f8\"\n", "model.dtype"),
        ] {
            let text = if extra.starts_with("[model]") {
                format!("{extra}[data]\ntrain = \"d\"\n")
            } else {
                format!("[model]\npath = \"m\"\n[data]\ntrain = \"d\"\n{extra}")
            };
            let e = ConfigFile::parse(&text, Path::new("c.toml"), &[])
                .and_then(|f| f.validate(Path::new("c.toml")))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
    }

    /// `[lora] init` and LoRA+'s keys: parsed, defaulted, and bad values named with what is allowed.
    #[test]
    fn variant_keys_validate() {
        let c = parse("").unwrap();
        assert_eq!(c.init, rtune_lora::Init::Default);
        assert_eq!(c.loraplus_lr_ratio, 1.0);
        let c =
            parse("[lora]\ninit = \"pissa_niter_16\"\n[train]\nloraplus_lr_ratio = 8.0\n").unwrap();
        assert_eq!(c.init, rtune_lora::Init::Pissa { niter: Some(16) });
        assert_eq!(c.loraplus_lr_ratio, 8.0);
        for (extra, want) in [
            (
                "[lora]\ninit = \"olor\"\n",
                "c.toml: [lora.init] `olor` is not one of default, gaussian, pissa, pissa_niter_N, olora (did you mean `olora`?)",
            ),
            (
                "[lora]\ninit = \"pissa\"\ninit_from = \"a\"\n",
                "c.toml: [lora.init] = \"pissa\" initialises a fresh adapter; it cannot be combined with [lora] init_from",
            ),
            (
                "[lora]\ninit = \"olora\"\ndora = true\n",
                "c.toml: [lora.init] = \"olora\" cannot be combined with [lora] dora = true (the adapter is saved converted to the original base, which DoRA's magnitudes do not survive)",
            ),
            (
                "[train]\nloraplus_lr_ratio = 0.0\n",
                "c.toml: [train.loraplus_lr_ratio] must be a positive number (usually 2 to 16), got 0",
            ),
            (
                "[train]\nloraplus_lr_embedding = 1e-5\n",
                "c.toml: [train.loraplus_lr_embedding] is LoRA+'s setting; set train.loraplus_lr_ratio too",
            ),
        ] {
            assert_eq!(parse(extra).unwrap_err().to_string(), want, "{extra}");
        }
        let e = parse("[lora]\ntrainable_tokens = []\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lora.trainable_tokens") && e.contains("empty"),
            "{e}"
        );
        let e = parse("[lora]\ntrainable_tokens = [\"<s>\", 5, \"<s>\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"<s>\" twice (entries 1 and 3)"), "{e}");
        // Text and ids mix, as written.
        let c = parse("[lora]\ntrainable_tokens = [\"<|im_end|>\", 7]\n").unwrap();
        assert_eq!(
            c.trainable_tokens,
            vec![
                crate::TokenName::Text("<|im_end|>".into()),
                crate::TokenName::Id(7)
            ]
        );
    }

    #[test]
    fn bad_enum_value_suggests_the_closest() {
        let text = "[model]\npath = \"m\"\nquantize = \"nf\"\n[data]\ntrain = \"d\"\n[train]\nschedule = \"cosin\"\n";
        let e = ConfigFile::parse(text, Path::new("c.toml"), &[])
            .and_then(|f| f.validate(Path::new("c.toml")))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "c.toml: [model.quantize] `nf` is not one of none, nf4, nf4-dq (did you mean `nf4`?)"
        );
        let e = ConfigFile::parse(&text.replace("\"nf\"", "\"nf4\""), Path::new("c.toml"), &[])
            .and_then(|f| f.validate(Path::new("c.toml")))
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("(did you mean `cosine`?)"), "{e}");
    }
}
