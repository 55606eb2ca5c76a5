//! The config as written: one struct per TOML section, defaults included (`[data]`'s in `data.rs`).
//! Each section's `validate` (in `model.rs`, `lora.rs`, `data.rs`, `train.rs`, `output.rs`) turns it
//! into its checked form in [`crate::RunConfig`].

use serde::{Deserialize, Serialize};
use std::path::Path;

use crate::{ConfigError, DataSection, Result};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub model: ModelSection,
    #[serde(default)]
    pub lora: LoraSection,
    pub data: DataSection,
    #[serde(default)]
    pub train: TrainSection,
    #[serde(default)]
    pub output: OutputSection,
    #[serde(default)]
    pub distributed: DistributedSection,
    /// `[[reward]]` tables: the reward functions of `objective = "grpo"` (`rtune_reward`).
    #[serde(default, rename = "reward", skip_serializing_if = "Vec::is_empty")]
    pub rewards: Vec<rtune_reward::RewardTable>,
}

/// `[distributed]`: how the ranks of a run launched by `mpirun` or `srun` share the work (data
/// parallelism always; the rest here). Checked by `RawConfig::check` (a key that needs
/// `shard_base`); it is also the checked form ([`crate::RunConfig::distributed`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistributedSection {
    /// Each rank keeps 1/world of every frozen weight and gathers a layer's just before it
    /// computes (FSDP-style): for a base too big for one rank's memory. Off: every rank holds the
    /// whole base (faster when it fits).
    #[serde(default)]
    pub shard_base: bool,
    /// With `shard_base`: how many of the last layers the forward gathers stay gathered for the
    /// backward, which needs them first, instead of being gathered again (each costs one layer's
    /// weights at full size; `rtune estimate` counts them). 0: every layer is gathered again.
    /// More than the model's layers keeps them all.
    #[serde(default)]
    pub keep_gathered_layers: usize,
    /// With `shard_base`: the next layer's gather runs on another thread while this layer
    /// computes (one more gathered layer alive). Off (the default): every gather in turn on the
    /// main thread, which on CPU ranks sharing a host's cores was faster (README).
    #[serde(default)]
    pub prefetch: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json), a llama `.gguf`
    /// file (converted once into the rtune cache), or a hub id `org/name` (downloaded into the
    /// Hugging Face cache).
    pub path: String,
    /// Hub models: branch, tag or commit sha to use.
    #[serde(default = "d_main")]
    pub revision: String,
    /// Compute dtype: auto | f32 | bf16 | f16 | bf16-autocast (f32 with bf16 products, as
    /// torch.autocast); `auto`: bf16 where the CPU has native bf16 and oneDNN, f32 otherwise.
    #[serde(default = "d_dtype")]
    pub dtype: String,
    /// Frozen linear layers: `none` (compute dtype) or `nf4` (QLoRA, bitsandbytes-exact).
    #[serde(default = "d_none")]
    pub quantize: String,
    /// With nf4: also quantize the per-block scales (8-bit, saves 0.373 bit/param).
    #[serde(default = "d_true")]
    pub double_quant: bool,
    /// With nf4 on a mixture of experts: hold the expert stacks in NF4 too, each expert's matrix
    /// quantized as bitsandbytes would quantize it alone and dequantized per expert on the fly
    /// (~4× less resident expert memory). Off by default, as bitsandbytes (which quantizes
    /// `nn.Linear`s only: the fused 3-D stacks stay in the compute dtype). Left out of the saved
    /// config when off.
    #[serde(default, skip_serializing_if = "is_false")]
    pub quantize_experts: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Targets {
    /// `"all-linear"` or a single module name.
    One(String),
    List(Vec<String>),
}

/// A setting that is `true`, `false` or a word (`"auto"`), as written; checked in `validate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Switch {
    Bool(bool),
    Word(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSection {
    #[serde(default = "d_r")]
    pub r: usize,
    #[serde(default = "d_alpha")]
    pub alpha: f64,
    #[serde(default)]
    pub dropout: f64,
    #[serde(default = "d_targets")]
    pub targets: Targets,
    #[serde(default)]
    pub rslora: bool,
    /// A PEFT adapter directory to continue from ("" = fresh init).
    #[serde(default)]
    pub init_from: String,
    /// DoRA (PEFT's `use_dora`): a trained magnitude per output row. Left out of the saved config
    /// when off, so runs saved before the key existed resume unchanged.
    #[serde(default, skip_serializing_if = "is_false")]
    pub dora: bool,
    /// How a fresh adapter starts (PEFT's `init_lora_weights`): default | gaussian | pissa |
    /// pissa_niter_N | olora. Unset = default; written to the settings only when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<String>,
    /// PEFT's `trainable_token_indices`: tokens whose embedding rows train (and lm_head's, tied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable_tokens: Option<Vec<TokenName>>,
    /// PEFT's `target_parameters`: a mixture-of-experts model's expert stacks
    /// (`"mlp.experts.gate_up_proj"`, `"mlp.experts.down_proj"`), one LoRA each with rank r per
    /// expert. Written to the settings only when set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_parameters: Vec<String>,
}

/// One entry of `[lora] trainable_tokens`: a token as text (`"<|im_end|>"`, resolved through the
/// tokenizer) or its id (as PEFT's `trainable_token_indices` takes it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenName {
    Id(u32),
    Text(String),
}

impl std::fmt::Display for TokenName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenName::Id(i) => write!(f, "{i}"),
            TokenName::Text(t) => write!(f, "{t:?}"),
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    #[serde(default = "d_seed")]
    pub seed: u64,
    #[serde(default = "d_steps")]
    pub steps: usize,
    #[serde(default = "d_mbs")]
    pub micro_batch_size: usize,
    #[serde(default = "d_one")]
    pub grad_accum: usize,
    #[serde(default = "d_lr")]
    pub lr: f64,
    #[serde(default = "d_schedule")]
    pub schedule: String,
    #[serde(default)]
    pub warmup_steps: usize,
    #[serde(default)]
    pub weight_decay: f64,
    #[serde(default = "d_max_grad_norm")]
    pub max_grad_norm: f64,
    #[serde(default = "d_beta1")]
    pub adam_beta1: f64,
    #[serde(default = "d_beta2")]
    pub adam_beta2: f64,
    #[serde(default = "d_eps")]
    pub adam_eps: f64,
    /// auto | cpu | cuda:N
    #[serde(default = "d_device")]
    pub device: String,
    /// Keep only each decoder layer's input in the forward pass and recompute the layer in backward:
    /// `true`, `false`, or `"auto"` (on when `rtune estimate` says the run would not fit the memory
    /// without it; see `rtune_estimate::choose_checkpointing`).
    #[serde(default = "d_auto")]
    pub gradient_checkpointing: Switch,
    /// CUDA with checkpointing: keep the layer inputs in host memory instead of device memory,
    /// copied out and back on a side stream overlapping with compute.
    #[serde(default)]
    pub offload_checkpoints: bool,
    /// f16 only: initial dynamic loss scale, and clean steps before it doubles (torch's defaults).
    #[serde(default = "d_loss_scale_init")]
    pub loss_scale_init: f64,
    #[serde(default = "d_loss_scale_growth_interval")]
    pub loss_scale_growth_interval: usize,
    /// Consecutive steps with a NaN/Inf loss or gradient (each skipped) before the run stops.
    #[serde(default = "d_max_bad_steps")]
    pub max_bad_steps: usize,
    /// Print a progress line every N optimizer steps (metrics.jsonl always has every step).
    #[serde(default = "d_one")]
    pub log_every: usize,
    /// Validation loss every N steps (0 = only at the end); needs `[data] valid` or valid_fraction.
    #[serde(default)]
    pub eval_every: usize,
    /// Prompts completed (greedy) at each evaluation, written to `samples.jsonl` in the run dir.
    #[serde(default)]
    pub eval_prompts: Vec<String>,
    #[serde(default = "d_eval_tokens")]
    pub eval_max_new_tokens: usize,
    /// LoRA+ (PEFT's `create_loraplus_optimizer`): B matrices train at `lr × ratio`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loraplus_lr_ratio: Option<f64>,
    /// LoRA+: the learning rate of LoRA on embedding layers (PEFT's default 1e-6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loraplus_lr_embedding: Option<f64>,
    /// Mixtures of experts: the load-balancing loss's coefficient, TRL's `router_aux_loss_coef`.
    /// Set, the loss adds `coef · aux` whatever config.json's `output_router_logits` says, as
    /// TRL 1.16's SFT/DPO/KTO/GRPO trainers do (0: none); unset, transformers' rule (added only
    /// with `output_router_logits`, at config.json's coefficient).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_aux_loss_coef: Option<f64>,
    /// `sft` (default) | `dpo` | `simpo` | `orpo` (`crate::objective`), and their knobs under
    /// TRL's names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub beta: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_smoothing: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simpo_gamma: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpo_alpha: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desirable_weight: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undesirable_weight: Option<f64>,
    /// `objective = "grpo"`: TRL 1.16's `GRPOConfig` keys (checked in `grpo.rs`; `beta` and
    /// `loss_type` above are shared with DPO under TRL's names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_generations: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_length: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon_high: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<f64>,
    /// `"group"` | `"batch"` | `"none"` (TRL also takes `true` = group, `false` = none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_rewards: Option<Switch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub importance_sampling_level: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_iterations: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_per_generation: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_truncated_completions: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward_weights: Option<Vec<f64>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    #[serde(default = "d_out_dir")]
    pub dir: String,
    /// Replace a finished run already in `dir` (otherwise rtune refuses to touch it).
    #[serde(default)]
    pub overwrite: bool,
    /// Write `dir/checkpoint-<step>/` every N optimizer steps (0 = only at the end).
    #[serde(default = "d_save_every")]
    pub save_every: usize,
    /// Keep the newest K checkpoints (0 = all); older ones are deleted once a new one is complete.
    #[serde(default = "d_keep_last")]
    pub keep_last: usize,
    /// "never" | "auto": continue from the newest complete checkpoint in `dir` (also `--resume`).
    #[serde(default = "d_resume")]
    pub resume: String,
    /// Directories 0700 and files 0600.
    #[serde(default = "d_true")]
    pub private: bool,
    /// "stop" | "continue": what a failed checkpoint write does to the run.
    #[serde(default = "d_on_save_error")]
    pub on_save_error: String,
    /// Refuse to start when the output filesystem cannot hold what the run will write (kept
    /// checkpoints + one being written, the adapter, logs); `false` skips the check.
    #[serde(default = "d_true")]
    pub check_disk: bool,
    /// Mirror the run directory to S3-compatible storage: "s3://bucket/prefix" ("" = no mirror).
    /// Credentials and endpoint come from the AWS_* environment only.
    #[serde(default)]
    pub remote: String,
    /// How long the end of a run waits for the final uploads ("10m", "90s").
    #[serde(default = "d_remote_timeout")]
    pub remote_timeout: String,
    /// MLflow tracking server, "http://host:5000" ("" = no tracking).
    #[serde(default)]
    pub mlflow: String,
    /// MLflow experiment the run is logged under (created if missing).
    #[serde(default = "d_mlflow_experiment")]
    pub mlflow_experiment: String,
}

fn d_remote_timeout() -> String {
    "10m".into()
}
fn d_mlflow_experiment() -> String {
    "rtune".into()
}

fn d_main() -> String {
    "main".into()
}
fn d_dtype() -> String {
    "f32".into()
}
fn d_r() -> usize {
    8
}
fn d_alpha() -> f64 {
    16.0
}
fn d_targets() -> Targets {
    Targets::One("all-linear".into())
}
fn d_true() -> bool {
    true
}
fn d_auto() -> Switch {
    Switch::Word("auto".into())
}
fn d_eval_tokens() -> usize {
    48
}
fn d_none() -> String {
    "none".into()
}
fn d_seed() -> u64 {
    42
}
fn d_steps() -> usize {
    100
}
fn d_mbs() -> usize {
    4
}
fn d_one() -> usize {
    1
}
fn d_lr() -> f64 {
    2e-4
}
fn d_schedule() -> String {
    "cosine".into()
}
fn d_max_grad_norm() -> f64 {
    1.0
}
fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.999
}
fn d_eps() -> f64 {
    1e-8
}
fn d_device() -> String {
    "auto".into()
}
fn d_loss_scale_init() -> f64 {
    65536.0
}
fn d_loss_scale_growth_interval() -> usize {
    2000
}
fn d_max_bad_steps() -> usize {
    5
}
fn d_save_every() -> usize {
    100
}
fn d_keep_last() -> usize {
    3
}
fn d_resume() -> String {
    "never".into()
}
fn d_on_save_error() -> String {
    "stop".into()
}
fn d_out_dir() -> String {
    "runs/default".into()
}

impl Default for LoraSection {
    fn default() -> Self {
        toml::from_str("").expect("LoraSection defaults")
    }
}
impl Default for TrainSection {
    fn default() -> Self {
        toml::from_str("").expect("TrainSection defaults")
    }
}
impl Default for OutputSection {
    fn default() -> Self {
        toml::from_str("").expect("OutputSection defaults")
    }
}

impl ConfigFile {
    /// Parses TOML text; `path` only labels errors. Overrides are `section.key=value`, the value
    /// read as TOML (`lr=1e-3`, `shuffle=false`) or, failing that, as a bare string.
    pub fn parse(text: &str, path: &Path, overrides: &[String]) -> Result<Self> {
        // First the file as written, so errors carry its line and column.
        let file: ConfigFile = from_str_located(text, path)?;
        if overrides.is_empty() {
            return Ok(file);
        }
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| located(text, path, "", e))?;
        for set in overrides {
            apply_override(&mut table, set)?;
        }
        let last = overrides.join(" ");
        let merged = toml::to_string(&table).map_err(|e| ConfigError::Override {
            set: last.clone(),
            message: e.to_string(),
        })?;
        let de = toml::Deserializer::new(&merged);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let message = e.inner().message();
            ConfigError::Override {
                set: last,
                message: crate::suggest::unknown_field(&key, message)
                    .unwrap_or_else(|| format!("{key}: {message}")),
            }
        })
    }
}

fn from_str_located(text: &str, path: &Path) -> Result<ConfigFile> {
    let de = toml::Deserializer::new(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let key = e.path().to_string();
        located(text, path, &key, e.into_inner())
    })
}

fn located(text: &str, path: &Path, key: &str, e: toml::de::Error) -> ConfigError {
    let (line, col) = match e.span() {
        Some(span) => line_col(text, span.start),
        None => (1, 1),
    };
    let message = e.message().trim();
    // An unknown key: one short line naming it in full, with the closest allowed name.
    if let Some(message) = crate::suggest::unknown_field(key, message) {
        return ConfigError::Parse {
            path: path.to_path_buf(),
            line,
            col,
            key: String::new(),
            message,
        };
    }
    let key = if key.is_empty() || key == "." {
        String::new()
    } else {
        format!("key `{key}`: ")
    };
    ConfigError::Parse {
        path: path.to_path_buf(),
        line,
        col,
        key,
        message: message.to_string(),
    }
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

fn apply_override(table: &mut toml::Table, set: &str) -> Result<()> {
    let err = |message: &str| ConfigError::Override {
        set: set.to_string(),
        message: message.to_string(),
    };
    // A line break would end the TOML value below early and drop the rest silently (issue 35);
    // the message names the key only, so that it stays one line.
    if set.contains(['\n', '\r']) {
        let key = set
            .split(['=', '\n', '\r'])
            .next()
            .unwrap_or_default()
            .trim();
        return Err(ConfigError::Override {
            set: key.to_string(),
            message: "the value contains a line break; give it on one line (in a TOML string, \
                      write a newline as \\n)"
                .into(),
        });
    }
    let (key, raw) = set
        .split_once('=')
        .ok_or_else(|| err("expected section.key=value"))?;
    // `section.key`, or a longer path into a nested table (`data.chat_template_kwargs.
    // enable_thinking`): each part names a table inside the one before, made when missing.
    let parts: Vec<&str> = key.trim().split('.').map(str::trim).collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(err("the key must be section.key, e.g. train.lr"));
    }
    let value: toml::Value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
        Ok(mut t) => t.remove("v").expect("parsed key"),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let (name, tables) = parts.split_last().expect("two parts or more");
    let mut at = table;
    for (i, part) in tables.iter().enumerate() {
        let entry = at
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        at = entry
            .as_table_mut()
            .ok_or_else(|| err(&format!("`{}` is not a table", parts[..=i].join("."))))?;
    }
    at.insert(name.to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = "[model]\npath = \"m\"\n[data]\ntrain = \"d.jsonl\"\n";

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let text = format!("{MIN}[train]\nsteps = 3\nlearning_rate = 1.0\n");
        let e = ConfigFile::parse(&text, Path::new("x.toml"), &[])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("x.toml:7:"), "{e}");
        assert!(e.contains("learning_rate"), "{e}");
        // One short line naming the key in full, the closest field, and not the list of 22.
        let text = format!("{MIN}[train]\nlr_rate = 1.0\n");
        let e = ConfigFile::parse(&text, Path::new("x.toml"), &[])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e, "x.toml:6:1: unknown key `train.lr_rate` (did you mean `lr`?)",
            "{e}"
        );
        let e = ConfigFile::parse(&format!("{MIN}[trian]\n"), Path::new("x.toml"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("unknown key `trian` (did you mean `train`?)"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_names_the_key() {
        let text = format!("{MIN}[train]\nlr = \"fast\"\n");
        let e = ConfigFile::parse(&text, Path::new("x.toml"), &[])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("x.toml:6:"), "{e}");
        assert!(e.contains("train.lr"), "{e}");
    }

    #[test]
    fn overrides_apply_and_are_typed() {
        let sets = vec![
            "train.lr=1e-3".to_string(),
            "data.shuffle=false".into(),
            "output.dir=runs/x".into(),
        ];
        let f = ConfigFile::parse(MIN, Path::new("x.toml"), &sets).unwrap();
        assert_eq!(f.train.lr, 1e-3);
        assert!(!f.data.shuffle);
        assert_eq!(f.output.dir, "runs/x");
        let bad =
            ConfigFile::parse(MIN, Path::new("x.toml"), &["train.steps=many".into()]).unwrap_err();
        assert!(bad.to_string().contains("train.steps"), "{bad}");
        let unknown =
            ConfigFile::parse(MIN, Path::new("x.toml"), &["train.nope=1".into()]).unwrap_err();
        assert!(unknown.to_string().contains("nope"), "{unknown}");
        let typo =
            ConfigFile::parse(MIN, Path::new("x.toml"), &["train.stpes=1".into()]).unwrap_err();
        assert_eq!(
            typo.to_string(),
            "--set train.stpes=1: unknown key `train.stpes` (did you mean `steps`?)"
        );
    }

    /// Issue 46: `--set data.chat_template_kwargs.enable_thinking=false` was inserted as one key
    /// `chat_template_kwargs.enable_thinking` of `[data]`; a dotted path goes into the nested
    /// table (kept beside what the file set), and a path through a value is refused naming it.
    #[test]
    fn override_of_a_nested_key() {
        let text = format!("{MIN}chat_template_kwargs = {{ tag = \"x\" }}\n");
        let set = "data.chat_template_kwargs.enable_thinking=false";
        for text in [MIN, text.as_str()] {
            let f = ConfigFile::parse(text, Path::new("x.toml"), &[set.into()]).unwrap();
            let kwargs = &f.data.chat_template_kwargs;
            assert_eq!(
                kwargs.get("enable_thinking"),
                Some(&toml::Value::Boolean(false)),
                "{kwargs:?}"
            );
            assert_eq!(kwargs.contains_key("tag"), text != MIN, "{kwargs:?}");
        }
        let e = ConfigFile::parse(MIN, Path::new("x.toml"), &["train.lr.x=1".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`train.lr` is not a table") || e.contains("train.lr"),
            "{e}"
        );
        for bad in ["data..x=1", "train.=1", ".lr=1"] {
            let e = ConfigFile::parse(MIN, Path::new("x.toml"), &[bad.into()])
                .unwrap_err()
                .to_string();
            assert!(e.contains("section.key"), "{bad}: {e}");
        }
    }

    /// Issue 35: `--set 'train.lr=1e-3\nsteps=9'` parsed as two TOML lines, kept the first and
    /// dropped the rest without a word. A line break anywhere is refused, naming the key on one line.
    #[test]
    fn override_with_a_line_break_is_refused() {
        for set in [
            "train.lr=1e-3\nsteps=9",
            "output.dir=runs/x\r\n",
            "train.eval_prompts=[\"a\",\n\"b\"]",
        ] {
            let e = ConfigFile::parse(MIN, Path::new("x.toml"), &[set.into()])
                .unwrap_err()
                .to_string();
            let key = set.split('=').next().unwrap();
            assert!(e.starts_with(&format!("--set {key}: ")), "{e}");
            assert!(
                e.contains("line break") && !e.contains(['\n', '\r']),
                "{e:?}"
            );
        }
    }
}
