//! The checked runtime config: [`RunConfig`] holds one checked struct per TOML section, named as
//! the file names them (`cfg.model`, `cfg.lora`, `cfg.data`, `cfg.train`, `cfg.output`), each
//! built by its section's own `validate` (`model.rs`, `lora.rs`, `data.rs`, `train.rs`,
//! `output.rs`), as ripgrep turns `LowArgs` into `HiArgs` and candle a `LlamaConfig` into a
//! `Config`.

use std::path::{Path, PathBuf};

use crate::file::ConfigFile;
use crate::{BaseModelConfig, DataConfig, LoraConfig, OutputConfig, Result, TrainConfig};

/// Everything the trainer needs, checked, by section. Paths are as written (relative to the
/// working directory).
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The config as written after overrides (saved next to the outputs).
    pub file: ConfigFile,
    pub config_path: PathBuf,
    /// `[model]`: the base model's path, dtype and quantization.
    pub model: BaseModelConfig,
    /// `[lora]`: the adapter; [`LoraConfig::spec`] builds its `LoraSpec`.
    pub lora: LoraConfig,
    /// `[data]`: the training and validation files and how rows become examples.
    pub data: DataConfig,
    /// `[train]`: the optimizer, schedule, batch, device and evaluation.
    pub train: TrainConfig,
    /// `[output]`: the run directory, checkpoints, resume, remote mirror and tracking.
    pub output: OutputConfig,
    /// `[distributed]`: whether the ranks shard the frozen base.
    pub distributed: crate::DistributedSection,
    /// `[[reward]]`: GRPO's reward functions, checked, their weights with `reward_weights`
    /// applied (empty for the other objectives).
    pub rewards: Vec<rtune_reward::Reward>,
}

impl ConfigFile {
    /// Checks every value and builds the runtime config, section by section in the file's order
    /// (the first error is reported). `path` labels errors. Rules spanning sections are checked
    /// after them (a preference objective with packing or trainable token rows).
    pub fn validate(self, path: &Path) -> Result<RunConfig> {
        // `dtype = "auto"` depends on the device the run computes on.
        let device = crate::parse_device(&self.train.device).unwrap_or(crate::Device::Cpu);
        let model = self.model.validate(path, device)?;
        let lora = self.lora.validate(path)?;
        let data = self.data.validate(path)?;
        let train = self.train.validate(path)?;
        let output = self.output.validate(path)?;
        let objective = train.objective;
        if objective.is_preference() && data.packing {
            return Err(crate::invalid(
                path,
                "data.packing",
                format!(
                    "packs SFT examples; objective \"{}\" batches each pair's two sequences as \
                     rows of their own (set packing = false)",
                    objective.name()
                ),
            ));
        }
        // SFT's row settings have no meaning for pairs (their rows are told apart by their
        // keys, and the loss is on the completions by definition): refused, not ignored.
        if objective.is_preference() && data.format != crate::RowFormat::Auto {
            return Err(crate::invalid(
                path,
                "data.format",
                format!(
                    "is an SFT row format; objective \"{}\" reads preference rows, told apart \
                     by their keys (prompt/chosen/rejected as text or messages, their `_ids`, \
                     KTO's completion/label): leave format = \"auto\"",
                    objective.name()
                ),
            ));
        }
        if objective.is_preference() && data.train_on_all {
            return Err(crate::invalid(
                path,
                "data.train_on",
                format!(
                    "= \"all\" is for SFT chat rows; objective \"{}\" compares the \
                     completions' log-probabilities, so only completion tokens are trained \
                     (leave train_on = \"assistant\")",
                    objective.name()
                ),
            ));
        }
        if objective.is_preference() && !lora.trainable_tokens.is_empty() {
            return Err(crate::invalid(
                path,
                "lora.trainable_tokens",
                format!(
                    "is not supported with objective \"{}\" yet (SFT only)",
                    objective.name()
                ),
            ));
        }
        if self.distributed.shard_base && lora.init.mutates_base() {
            return Err(crate::invalid(
                path,
                "distributed.shard_base",
                format!(
                    "cannot be combined with [lora] init = \"{}\", which rewrites the base \
                     weights from their SVD (each rank would need the whole weight); start from \
                     an adapter made by such a run with init_from, or leave shard_base off",
                    lora.init
                ),
            ));
        }
        let rewards = self.grpo_rules(path, &train, &data, &lora)?;
        let d = &self.distributed;
        let needs_shard = [
            (d.keep_gathered_layers > 0, "keep_gathered_layers"),
            (d.prefetch, "prefetch"),
        ];
        if let Some((_, key)) = needs_shard.iter().find(|(set, _)| *set && !d.shard_base) {
            return Err(crate::invalid(
                path,
                &format!("distributed.{key}"),
                "is about the gathers of a sharded base: it needs distributed.shard_base = true \
                 (without it every rank holds the whole base)"
                    .into(),
            ));
        }
        Ok(RunConfig {
            config_path: path.to_path_buf(),
            model,
            lora,
            data,
            train,
            output,
            distributed: self.distributed.clone(),
            rewards,
            file: self,
        })
    }

    /// GRPO's rules across sections, and its `[[reward]]` tables checked (a table without
    /// `objective = "grpo"` is refused: nothing would read it).
    fn grpo_rules(
        &self,
        path: &Path,
        train: &TrainConfig,
        data: &DataConfig,
        lora: &LoraConfig,
    ) -> Result<Vec<rtune_reward::Reward>> {
        let bad = |key: &str, message: String| crate::invalid(path, key, message);
        let crate::Objective::Grpo(g) = train.objective else {
            if !self.rewards.is_empty() {
                return Err(bad(
                    "reward",
                    format!(
                        "[[reward]] tables are read by objective \"grpo\"; this run's objective \
                         is \"{}\"",
                        train.objective.name()
                    ),
                ));
            }
            return Ok(Vec::new());
        };
        let mut rewards =
            rtune_reward::check_all(&self.rewards).map_err(|e| bad("reward", e.to_string()))?;
        if rewards.is_empty() {
            return Err(bad(
                "reward",
                "objective \"grpo\" needs at least one [[reward]] table (name, kind = regex | \
                 answer | length | command)"
                    .into(),
            ));
        }
        if let Some(w) = &self.train.reward_weights {
            if w.len() != rewards.len() {
                return Err(bad(
                    "train.reward_weights",
                    format!(
                        "has {} weights for {} [[reward]] tables (one each, in order)",
                        w.len(),
                        rewards.len()
                    ),
                ));
            }
            if let Some(r) = self.rewards.iter().find(|r| r.weight.is_some()) {
                return Err(bad(
                    "train.reward_weights",
                    format!(
                        "and [[reward]] `{}`'s weight both set its weight: use one of them",
                        r.name.as_deref().unwrap_or_default()
                    ),
                ));
            }
            if let Some(x) = w.iter().find(|x| !x.is_finite()) {
                return Err(bad(
                    "train.reward_weights",
                    format!("{x} is not a finite number"),
                ));
            }
            for (r, w) in rewards.iter_mut().zip(w) {
                r.weight = *w;
            }
        }
        // TRL: the generation batch (micro-batch × steps_per_generation completions) holds
        // whole groups.
        let batch = train.micro_batch_size * g.steps_per_generation;
        if !batch.is_multiple_of(g.num_generations) {
            return Err(bad(
                "train.num_generations",
                format!(
                    "{} does not divide the generation batch of {batch} completions \
                     (micro_batch_size {} × steps_per_generation {}): a prompt's completions \
                     are one group",
                    g.num_generations, train.micro_batch_size, g.steps_per_generation
                ),
            ));
        }
        if g.max_completion_length >= data.max_seq_len {
            return Err(bad(
                "train.max_completion_length",
                format!(
                    "{} leaves no room for a prompt in data.max_seq_len = {} (a row is prompt + \
                     completion: raise max_seq_len or lower max_completion_length)",
                    g.max_completion_length, data.max_seq_len
                ),
            ));
        }
        let sft_only = [
            (data.packing, "data.packing", "packs SFT examples"),
            (
                data.format != crate::RowFormat::Auto,
                "data.format",
                "is an SFT row format (GRPO reads prompt rows: leave format = \"auto\")",
            ),
            (
                data.train_on_all,
                "data.train_on",
                "is for SFT chat rows (GRPO trains on its sampled completions)",
            ),
            (
                !lora.trainable_tokens.is_empty(),
                "lora.trainable_tokens",
                "is not supported with objective \"grpo\" yet (SFT only)",
            ),
        ];
        if let Some((_, key, why)) = sft_only.iter().find(|(set, _, _)| *set) {
            return Err(bad(key, format!("{why}; this run's objective is \"grpo\"")));
        }
        Ok(rewards)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Checkpointing, DType, Device, Schedule};

    fn parse(extra: &str) -> Result<RunConfig> {
        let text = format!("[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n{extra}");
        ConfigFile::parse(&text, Path::new("c.toml"), &[])?.validate(Path::new("c.toml"))
    }

    /// `[output] remote`, `remote_timeout`, `mlflow`: defaults, accepted forms, and one-line
    /// refusals naming the key (a URL carrying credentials among them).
    #[test]
    fn remote_and_mlflow_keys() {
        let c = parse("").unwrap();
        assert_eq!((c.output.remote, c.output.mlflow), (None, None));
        assert_eq!(c.output.remote_timeout, std::time::Duration::from_secs(600));
        assert_eq!(c.output.mlflow_experiment, "rtune");
        let c = parse(
            "[output]\nremote = \"s3://b/runs/x/\"\nremote_timeout = \"1m30s\"\nmlflow = \"http://h:5000/\"",
        )
        .unwrap();
        assert_eq!(c.output.remote.as_deref(), Some("s3://b/runs/x"));
        assert_eq!(c.output.remote_timeout, std::time::Duration::from_secs(90));
        assert_eq!(c.output.mlflow.as_deref(), Some("http://h:5000"));
        assert_eq!(
            parse("[output]\nremote_timeout = \"5\"")
                .unwrap()
                .output
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

    /// `[distributed]`: off by default; `keep_gathered_layers` needs `shard_base`, and a sharded
    /// base refuses an init that rewrites the base (each refusal names its key) but takes NF4
    /// expert stacks.
    #[test]
    fn distributed_keys() {
        let c = parse("").unwrap();
        assert!(!c.distributed.shard_base);
        assert_eq!(c.distributed.keep_gathered_layers, 0);
        assert!(!c.distributed.prefetch);
        let c =
            parse("[distributed]\nshard_base = true\nkeep_gathered_layers = 3\nprefetch = true")
                .unwrap();
        assert_eq!(c.distributed.keep_gathered_layers, 3);
        assert!(c.distributed.prefetch);
        for (extra, key) in [
            (
                "[distributed]\nkeep_gathered_layers = 2",
                "distributed.keep_gathered_layers",
            ),
            ("[distributed]\nprefetch = true", "distributed.prefetch"),
            (
                "[lora]\ninit = \"pissa\"\n[distributed]\nshard_base = true",
                "distributed.shard_base",
            ),
            ("[distributed]\nkeep_gathered = 2", "keep_gathered"),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
        let text = "[model]\npath = \"m\"\nquantize = \"nf4\"\nquantize_experts = true\n\
                    [data]\ntrain = \"d.jsonl\"\n[distributed]\nshard_base = true";
        let c = Path::new("c.toml");
        // NF4 expert stacks are sharded by expert (`rtune_model::moe::MoeShards`).
        let run = ConfigFile::parse(text, c, &[])
            .unwrap()
            .validate(c)
            .unwrap();
        assert!(run.distributed.shard_base && run.model.quantize.experts());
    }

    /// `[train] objective` and its knobs: defaults as TRL's, the knobs of another objective and
    /// combinations that cannot work refused with the key named.
    #[test]
    fn objective_and_its_knobs() {
        use crate::{DpoLoss, Objective};
        assert_eq!(parse("").unwrap().train.objective, Objective::Sft);
        let c = parse("[train]\nobjective = \"dpo\"").unwrap();
        let want = Objective::Dpo {
            beta: 0.1,
            loss: DpoLoss::Sigmoid,
            label_smoothing: 0.0,
        };
        assert_eq!(c.train.objective, want);
        let c = parse("[train]\nobjective = \"simpo\"\nbeta = 2.0").unwrap();
        let want = Objective::Simpo {
            beta: 2.0,
            gamma: 0.5,
            cpo_alpha: 1.0,
            label_smoothing: 0.0,
        };
        assert_eq!(c.train.objective, want);
        for (extra, key) in [
            ("[train]\nobjective = \"dpp\"", "train.objective"),
            (
                "[train]\nobjective = \"kto\"\ndesirable_weight = 0.0",
                "train.desirable_weight",
            ),
            (
                "[train]\nobjective = \"dpo\"\nundesirable_weight = 1.0",
                "train.undesirable_weight",
            ),
            ("[train]\nbeta = 0.2", "train.beta"),
            (
                "[train]\nobjective = \"dpo\"\nloss_type = \"sigmod\"",
                "train.loss_type",
            ),
            ("[train]\nobjective = \"dpo\"\nbeta = 0.0", "train.beta"),
            (
                "[train]\nobjective = \"dpo\"\nsimpo_gamma = 1.0",
                "train.simpo_gamma",
            ),
            (
                "[train]\nobjective = \"dpo\"\nlabel_smoothing = 0.5",
                "train.label_smoothing",
            ),
            (
                "[train]\nobjective = \"dpo\"\nloss_type = \"ipo\"\nlabel_smoothing = 0.1",
                "train.label_smoothing",
            ),
            (
                "packing = true\n[train]\nobjective = \"orpo\"",
                "data.packing",
            ),
            (
                "[lora]\ntrainable_tokens = [5]\n[train]\nobjective = \"dpo\"",
                "lora.trainable_tokens",
            ),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
        // Issue 46: a name in the wrong case was blamed on its knob (`train.beta`); the name is
        // checked first, with a suggestion.
        let e = parse("[train]\nobjective = \"DPO\"\nbeta = 0.2")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.objective")
                && e.contains("did you mean `dpo`")
                && !e.contains("train.beta"),
            "{e}"
        );
    }

    /// Issue 46: `[data] format` and `train_on` were silently ignored with a preference
    /// objective; they are SFT's and now refused naming the key. The settings the preference
    /// loader applies (truncation, on_bad_row, max_row_bytes) are accepted.
    #[test]
    fn preference_objectives_refuse_sft_row_settings() {
        for (extra, key) in [
            (
                "format = \"chat\"\n[train]\nobjective = \"dpo\"",
                "data.format",
            ),
            (
                "format = \"tokens\"\n[train]\nobjective = \"kto\"",
                "data.format",
            ),
            (
                "train_on = \"all\"\n[train]\nobjective = \"orpo\"",
                "data.train_on",
            ),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(key), "{extra}: {e}");
        }
        let ok = "format = \"auto\"\ntruncation = \"drop\"\non_bad_row = \"skip\"\n\
                  max_row_bytes = 4096\n[train]\nobjective = \"dpo\"";
        let c = parse(ok).unwrap();
        assert!(c.data.drop_long && c.data.skip_bad_rows && c.data.max_row_bytes == 4096);
        assert!(
            parse("format = \"chat\"\ntrain_on = \"all\"").is_ok(),
            "SFT keeps them"
        );
    }

    /// `[data] chat_template_kwargs`: a table of template variables (Qwen3's `enable_thinking`),
    /// none by default; the variables rtune sets itself and TOML dates are refused, naming the key.
    #[test]
    fn chat_template_kwargs() {
        assert!(parse("").unwrap().data.chat_template_kwargs.is_empty());
        let c = parse("chat_template_kwargs = { enable_thinking = false, tag = \"x\" }").unwrap();
        assert_eq!(
            c.data.chat_template_kwargs,
            vec![
                ("enable_thinking".to_string(), toml::Value::Boolean(false)),
                ("tag".to_string(), toml::Value::String("x".into())),
            ]
        );
        for (extra, needle) in [
            (
                "chat_template_kwargs = { messages = [] }",
                "`messages` is set by rtune",
            ),
            (
                "chat_template_kwargs = { add_generation_prompt = true }",
                "`add_generation_prompt` is set by rtune",
            ),
            (
                "chat_template_kwargs = { date = 2024-12-07 }",
                "a TOML date",
            ),
            ("chat_template_kwargs = true", "chat_template_kwargs"),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains("data.chat_template_kwargs"), "{extra}: {e}");
            assert!(e.contains(needle), "{extra}: {e}");
        }
    }

    #[test]
    fn defaults_validate() {
        let c = parse("").unwrap();
        assert_eq!(c.lora.r, 8);
        assert_eq!(c.lora.targets, vec!["all-linear"]);
        assert_eq!(c.train.schedule, Schedule::Cosine);
        assert_eq!(c.train.device, Device::Auto);
    }

    /// `gradient_checkpointing`: `"auto"` by default; `true`/`false` keep their meaning (also
    /// through `--set`, where `auto` arrives as a bare word); anything else names the key and the
    /// closest value; offloading the checkpoints turns `auto` on.
    #[test]
    fn gradient_checkpointing_is_auto_true_or_false() {
        assert_eq!(
            parse("").unwrap().train.gradient_checkpointing,
            Checkpointing::Auto
        );
        for (v, want) in [
            ("true", Checkpointing::On),
            ("false", Checkpointing::Off),
            ("\"auto\"", Checkpointing::Auto),
        ] {
            let c = parse(&format!("[train]\ngradient_checkpointing = {v}\n")).unwrap();
            assert_eq!(c.train.gradient_checkpointing, want, "{v}");
        }
        let text = "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n";
        for (set, want) in [
            ("train.gradient_checkpointing=auto", Checkpointing::Auto),
            ("train.gradient_checkpointing=false", Checkpointing::Off),
        ] {
            let f = ConfigFile::parse(text, Path::new("c.toml"), &[set.to_string()]).unwrap();
            let c = f.validate(Path::new("c.toml")).unwrap();
            assert_eq!(c.train.gradient_checkpointing, want, "{set}");
        }
        let e = parse("[train]\ngradient_checkpointing = \"atuo\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("train.gradient_checkpointing") && e.contains("did you mean `auto`"),
            "{e}"
        );
        let c = parse("[train]\ndevice = \"cuda:0\"\noffload_checkpoints = true\n").unwrap();
        assert_eq!(c.train.gradient_checkpointing, Checkpointing::On);
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
        assert_eq!(
            with("bf16-autocast").unwrap().model.dtype,
            DType::Bf16Autocast
        );
        assert_eq!(with("autocast").unwrap().model.dtype, DType::Bf16Autocast);
        assert_eq!(with("bf16").unwrap().model.dtype, DType::BF16);
        assert_eq!(DType::Bf16Autocast.as_str(), "bf16-autocast");
        let e = with("bf16-autocats").unwrap_err().to_string();
        assert!(e.contains("did you mean `bf16-autocast`"), "{e}");
    }

    /// `dtype = "auto"`: on a GPU bf16 from compute capability 8.0, f16 on 7.x, f32 below,
    /// whatever the host CPU has; on the CPU bf16 with AMX-BF16 or AVX-512 BF16 and oneDNN, f32
    /// without the instructions or without oneDNN; each with its reason. Parsed, it resolves to
    /// what this machine gives for the configured device and says why; a near miss names `auto`
    /// among the values.
    #[test]
    fn auto_dtype_resolves_by_the_device_and_says_why() {
        use crate::model::{auto_dtype, auto_gpu, Gpu};
        let (d, why) = auto_dtype(None, true, false, None);
        assert_eq!(
            (d, why.as_str()),
            (DType::BF16, "the CPU has AMX-BF16, oneDNN in use")
        );
        let (d, why) = auto_dtype(None, false, true, None);
        assert_eq!(d, DType::BF16);
        assert!(why.contains("AVX-512 BF16"), "{why}");
        let (d, why) = auto_dtype(None, false, false, None);
        assert_eq!(d, DType::F32);
        assert!(why.contains("neither"), "{why}");
        let (d, why) = auto_dtype(None, false, true, Some("RTUNE_ONEDNN=off"));
        assert_eq!(d, DType::F32);
        assert!(why.contains("RTUNE_ONEDNN=off"), "{why}");
        // A GPU decides by its capability alone: the host CPU's bf16 and oneDNN do not count.
        let gpu = |ordinal, capability| {
            Some(Gpu {
                ordinal,
                capability,
            })
        };
        for (cap, want) in [
            ((9, 0), DType::BF16),
            ((8, 0), DType::BF16),
            ((8, 6), DType::BF16),
            ((12, 0), DType::BF16),
            ((7, 5), DType::F16),
            ((7, 0), DType::F16),
            ((6, 1), DType::F32),
        ] {
            for (amx, avx, missing) in [(true, true, None), (false, false, Some("off"))] {
                let (d, why) = auto_dtype(gpu(1, cap), amx, avx, missing);
                assert_eq!(d, want, "{cap:?}: {why}");
                assert!(
                    why.starts_with(&format!(
                        "cuda:1 has compute capability {}.{}",
                        cap.0, cap.1
                    )),
                    "{why}"
                );
                assert!(!why.contains("CPU"), "{why}");
            }
        }
        assert!(auto_dtype(gpu(0, (7, 5)), false, false, None)
            .1
            .contains("no bf16 tensor cores"));
        let with_on = |d: &str, device: &str| {
            ConfigFile::parse(
                &format!(
                    "[model]\npath = \"m\"\ndtype = \"{d}\"\n[data]\ntrain = \"d\"\n\
                     [train]\ndevice = \"{device}\"\n"
                ),
                Path::new("c.toml"),
                &[],
            )
            .and_then(|f| f.validate(Path::new("c.toml")))
        };
        let with = |d: &str| with_on(d, "auto");
        let f = rtune_backend::cpu_features::get();
        let missing = rtune_backend::onednn::get().err().map(|e| e.to_string());
        for device in ["auto", "cpu", "cuda:0"] {
            let m = with_on("auto", device).unwrap().model;
            let gpu = auto_gpu(crate::parse_device(device).unwrap());
            let (want, why) = auto_dtype(gpu, f.amx_bf16, f.avx512_bf16, missing.as_deref());
            assert_eq!(
                (m.dtype, m.dtype_auto.as_deref()),
                (want, Some(why.as_str())),
                "{device}"
            );
            assert_eq!(m.dtype_said(), format!("{} (auto: {why})", want.as_str()));
        }
        // `device = "cpu"` never asks a GPU.
        assert_eq!(auto_gpu(crate::Device::Cpu), None);
        let bf16 = with("bf16").unwrap().model;
        assert_eq!((bf16.dtype_said(), bf16.dtype_auto), ("bf16".into(), None));
        let e = with("atuo").unwrap_err().to_string();
        assert!(e.contains("model.dtype") && e.contains("`auto`"), "{e}");
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
        assert_eq!(c.lora.init, rtune_lora::Init::Default);
        assert_eq!(c.train.loraplus_lr_ratio, 1.0);
        let c =
            parse("[lora]\ninit = \"pissa_niter_16\"\n[train]\nloraplus_lr_ratio = 8.0\n").unwrap();
        assert_eq!(c.lora.init, rtune_lora::Init::Pissa { niter: Some(16) });
        assert_eq!(c.train.loraplus_lr_ratio, 8.0);
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
            (
                "[train]\nrouter_aux_loss_coef = -0.001\n",
                "c.toml: [train.router_aux_loss_coef] must be a number ≥ 0 (0: no load-balancing loss), got -0.001",
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
            c.lora.trainable_tokens,
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

    /// `[model] quantize_experts`: NF4 expert stacks beside NF4 linears (with `nf4`'s own
    /// `double_quant`, or `nf4-dq`); refused without NF4, naming the file and the key; off by
    /// default; the printed `+experts` name is refused in the file (the key says it).
    #[test]
    fn quantize_experts_needs_nf4() {
        let check = |model: &str| {
            let text = format!("[model]\npath = \"m\"\n{model}\n[data]\ntrain = \"d\"\n");
            ConfigFile::parse(&text, Path::new("c.toml"), &[])
                .and_then(|f| f.validate(Path::new("c.toml")))
                .map(|c| c.model.quantize)
                .map_err(|e| e.to_string())
        };
        let q = |double_quant, experts| rtune_quant::Quantize::Nf4 {
            double_quant,
            experts,
        };
        let on = "quantize_experts = true";
        assert_eq!(
            check(&format!("quantize = \"nf4\"\n{on}")),
            Ok(q(true, true))
        );
        let plain = format!("quantize = \"nf4\"\ndouble_quant = false\n{on}");
        assert_eq!(check(&plain), Ok(q(false, true)));
        assert_eq!(
            check(&format!("quantize = \"nf4-dq\"\n{on}")),
            Ok(q(true, true))
        );
        assert_eq!(check("quantize = \"nf4\""), Ok(q(true, false)));
        let e = check(on).unwrap_err();
        assert!(
            e.starts_with("c.toml: [model.quantize_experts] = true needs quantize = \"nf4\""),
            "{e}"
        );
        let e = check("quantize = \"nf4+experts\"").unwrap_err();
        assert!(e.contains("quantize_experts = true"), "{e}");
    }
}
