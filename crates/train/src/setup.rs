//! Everything before the first step: the device, the model, the data, the adapter (fresh, from
//! `init_from`, or from a checkpoint), and the run directory. Inputs are all checked before the
//! directory is touched, so bad input never leaves a directory behind.

use candle_core::Device;
use std::collections::BTreeMap;
use std::path::Path;

use rtune_config::RunConfig;
use rtune_data::{Example, Tokenizer};
use rtune_fsio::sha256_file;
use rtune_lora::Adapter;
use rtune_model::{Gather, Model};
use std::rc::Rc;

use crate::dataset::RunData;
use crate::optim::LossScaler;
use crate::TrainError;

/// Turns `[model] path` into a local model directory: a directory as is, a llama `.gguf` file
/// converted once into the rtune cache, a hub id (`org/name`) at `[model] revision` downloaded
/// into the Hugging Face cache. Sets `cfg.model.path` to it and returns what was resolved (the hub
/// commit, the GGUF's sha256) for the run record.
pub fn resolve_model(cfg: &mut RunConfig) -> Result<rtune_hub::Resolved, TrainError> {
    let r = rtune_hub::resolve(&cfg.file.model.path, &cfg.file.model.revision)?;
    cfg.model.path = r.dir.clone();
    Ok(r)
}

/// What [`prepare`] loaded: the model with the adapter attached, and the run's data.
pub struct Prepared {
    pub model: Model,
    pub adapter: Adapter,
    pub data: RunData,
    pub tok: Option<Tokenizer>,
    pub pad_id: u32,
    /// PiSSA / OLoRA: the initial factors, for saving the adapter against the original base.
    pub initial: Option<crate::variants::InitialAdapter>,
}

/// Loads the model (this rank's shard of its base with `shard`), the data (as `recipe` takes it)
/// and the adapter.
pub fn prepare<R: crate::objective::Recipe>(
    cfg: &RunConfig,
    recipe: &mut R,
    dev: &Device,
    shard: Option<&Rc<dyn Gather>>,
) -> Result<Prepared, TrainError> {
    let spec = cfg.lora.spec()?;
    // `[lora] init` (issue 17): PiSSA / OLoRA load the model with the residual base.
    let (mut model, fresh, initial) = if cfg.lora.init_from.is_none() {
        let (m, a, i) = crate::variants::fresh(cfg, &spec, dev, shard)?;
        (m, Some(a), i)
    } else {
        (crate::variants::load_model(cfg, dev, shard)?, None, None)
    };
    // `[lora] targets` naming a module this architecture does not have (q_proj on Phi-3).
    model.check_targets(&spec)?;
    // `[train] router_aux_loss_coef`: TRL's rule for the load-balancing loss over config.json's.
    if let Some(coef) = cfg.train.router_aux_loss_coef {
        model.cfg.set_router_aux_loss_coef(coef)?;
    }
    if cfg.model.dtype == rtune_config::DType::Bf16Autocast {
        model.set_autocast()?;
    }
    let tok = if cfg.model.path.join("tokenizer.json").exists() {
        Some(Tokenizer::load(
            &cfg.model.path,
            model.cfg.eos_token_ids.first().copied(),
        )?)
    } else {
        None
    };
    // `[lora] trainable_tokens` resolved before the data is read: a bad token fails fast.
    let token_ids = crate::tokens::resolve(cfg, tok.as_ref(), model.cfg.vocab_size)?;
    let data = recipe.load(cfg, tok.as_ref(), model.cfg.vocab_size)?;
    let modules = model.lora_modules(&spec);
    let adapter = match &cfg.lora.init_from {
        Some(dir) => {
            let a = Adapter::load_peft(dir, &spec, &modules, dev)?;
            let saved = rtune_lora::read_adapter_config(dir)?;
            if saved.lora_alpha != cfg.lora.alpha || saved.use_rslora != cfg.lora.rslora {
                tracing::warn!(
                    "{}: adapter was saved with lora_alpha {} / use_rslora {}; training uses the config's {} / {}",
                    dir.display(),
                    saved.lora_alpha,
                    saved.use_rslora,
                    cfg.lora.alpha,
                    cfg.lora.rslora
                );
            }
            a
        }
        None => match fresh {
            Some(a) => a,
            None => Adapter::init(spec.clone(), &modules, cfg.train.seed, dev)?,
        },
    };
    let mut adapter = adapter;
    crate::tokens::attach(cfg, &model, &mut adapter, &token_ids)?;
    model.attach(&adapter);
    if spec.dora && cfg.lora.init_from.is_none() {
        // PEFT's init: m = ‖W + s·B·A‖ row-wise (B = 0, so ‖W‖).
        model.init_dora(&mut adapter)?;
    }
    let pad_id = pad_id(cfg, tok.as_ref(), &model.cfg)?;
    Ok(Prepared {
        model,
        adapter,
        data,
        tok,
        pad_id,
        initial,
    })
}

/// The id padding fills rows with: the tokenizer's pad token, else config.json's
/// `pad_token_id`, else 0. One outside the vocabulary is refused here, before the run directory
/// exists (issue 46: it failed at the first padded batch's embedding lookup, exit 1, the
/// directory made), naming where it came from.
pub(crate) fn pad_id(
    cfg: &RunConfig,
    tok: Option<&Tokenizer>,
    model: &rtune_model::ModelConfig,
) -> Result<u32, TrainError> {
    let (id, from, key) = match (tok.and_then(|t| t.pad_id), model.pad_token_id) {
        (Some(id), _) => (id, "tokenizer_config.json", "pad_token"),
        (None, Some(id)) => (id, "config.json", "pad_token_id"),
        (None, None) => return Ok(0),
    };
    if (id as usize) < model.vocab_size {
        return Ok(id);
    }
    Err(rtune_model::ModelError::File {
        path: cfg.model.path.join(from),
        message: format!(
            "{key} = {id} is outside the model's vocabulary (vocab_size {} in config.json): \
             padding would look up an embedding row that does not exist",
            model.vocab_size
        ),
    }
    .into())
}

/// Decides `[train] gradient_checkpointing` for this attempt (`auto`: from the memory estimate
/// of the run without it, fitted to the data, against the memory budget). Called with the model
/// and data loaded, so the budget is what is free plus what this process already holds (the
/// estimate counts both): available RAM + resident set on the CPU, free device memory + the
/// device pool's high-water mark on CUDA. A resumed run decides again: checkpointing changes
/// memory, not the numbers (it is in [`MAY_CHANGE`]). `world`: the ranks, for a sharded base.
pub fn checkpointing(
    cfg: &RunConfig,
    model: &rtune_model::ModelConfig,
    examples: &[Example],
    dev: &Device,
    world: usize,
) -> Result<rtune_estimate::CheckpointingChoice, TrainError> {
    let budget = memory_budget(dev);
    Ok(rtune_estimate::checkpointing_for(
        cfg,
        model,
        Some(examples),
        budget,
        world,
    )?)
}

/// The memory a run may use: available RAM + resident set on the CPU, free device memory + the
/// device pool's high-water mark on CUDA (the estimate counts what the process already holds).
pub fn memory_budget(dev: &Device) -> rtune_estimate::Budget<'static> {
    match dev.location() {
        #[cfg(feature = "cuda")]
        candle_core::DeviceLocation::Cuda { gpu_id } => crate::memory::device_free_bytes(gpu_id)
            .ok()
            .map(|free| (free + crate::memory::peak_bytes(dev), "free device memory")),
        _ => crate::memory::ram_available_bytes()
            .map(|free| (free + crate::memory::current_rss_bytes(), "available RAM")),
    }
}

/// A run whose estimated peak (with checkpointing as decided) is over the memory budget cannot
/// fit: refused before the run directory exists, with the figures (issue 35: a micro-batch of
/// 1e9 rows ran 85 s and aborted). The estimate is within ±10% of measured peaks, so a run over
/// the budget would swap or be killed.
pub fn check_memory(
    estimated: Option<u64>,
    budget: rtune_estimate::Budget,
) -> Result<(), TrainError> {
    match (estimated, budget) {
        (Some(need), Some((have, what))) if need > have => Err(TrainError::TooLittleMemory {
            need,
            have,
            what: what.to_string(),
        }),
        _ => Ok(()),
    }
}

/// Keys of the config as written that a resumed run may change: they do not decide which rows a
/// step sees or the numbers it computes. Every other key is serialised into the settings and must
/// stay equal, so a key added to the config is checked on resume unless it is named here. A name
/// covers its sub-keys (`output` is the whole section).
const MAY_CHANGE: [&str; 18] = [
    // Where and how often files are written, and whether an old run may be replaced.
    "output",
    // Pinned by config.json's checksum (below), not by the revision that named it.
    "model.revision",
    // Pinned by checksum (below): the files may move. Training files are also listed by path and
    // weight, as resolved.
    "data.train",
    "data.valid",
    "data.chat_template",
    // Where tokenized rows are cached, not what they are.
    "data.cache",
    "data.cache_dir",
    // Where and how a step is computed: the same numbers, up to the device's rounding.
    "train.device",
    "train.gradient_checkpointing",
    "train.offload_checkpoints",
    // A sharded base computes the whole base's bits.
    "distributed",
    // f16: the loss scale itself is restored from the checkpoint; the run's patience for bad steps.
    "train.loss_scale_init",
    "train.loss_scale_growth_interval",
    "train.max_bad_steps",
    // What is printed and evaluated along the way.
    "train.log_every",
    "train.eval_every",
    "train.eval_prompts",
    "train.eval_max_new_tokens",
];

/// The settings that determine a run's numbers, `key → value`: the config as written (less
/// [`MAY_CHANGE`]) flattened to `section.key`, plus the checksums of the files it names.
pub(crate) fn settings(cfg: &RunConfig) -> Result<BTreeMap<String, String>, TrainError> {
    let sha = |p: &Path| sha256_file(p).map_err(TrainError::from);
    let mut s = BTreeMap::new();
    let file = serde_json::to_value(&cfg.file).expect("the config serialises");
    flatten("", &file, &mut s);
    s.retain(|k, _| {
        !MAY_CHANGE.iter().any(|m| {
            k.strip_prefix(m)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
        })
    });
    // As resolved: `float32` and `f32` are one dtype.
    s.insert("model.dtype".into(), cfg.model.dtype.as_str().into());
    let config_json = cfg.model.path.join("config.json");
    s.insert("model.config.json sha256".into(), sha(&config_json)?);
    for (i, t) in cfg.data.train.iter().enumerate() {
        s.insert(format!("data.train[{i}]"), t.path.display().to_string());
        s.insert(format!("data.train[{i}] sha256"), sha(&t.path)?);
        s.insert(format!("data.train[{i}] weight"), t.weight.to_string());
    }
    if let Some(v) = &cfg.data.valid {
        s.insert("data.valid sha256".into(), sha(v)?);
    }
    if let Some(t) = &cfg.data.chat_template {
        s.insert("data.chat_template sha256".into(), sha(t)?);
    }
    Ok(s)
}

/// `{"train": {"lr": 0.005}}` → `train.lr = 0.005`. A list of plain values is one comma-joined
/// value (`lora.targets = q_proj,v_proj`); a list holding tables is indexed (`key[0].path`).
fn flatten(key: &str, v: &serde_json::Value, out: &mut BTreeMap<String, String>) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                let sub = if key.is_empty() {
                    k.clone()
                } else {
                    format!("{key}.{k}")
                };
                flatten(&sub, v, out);
            }
        }
        Value::Array(items) if items.iter().any(|x| x.is_object() || x.is_array()) => {
            for (i, x) in items.iter().enumerate() {
                flatten(&format!("{key}[{i}]"), x, out);
            }
        }
        Value::Array(items) => {
            let parts: Vec<String> = items.iter().map(plain).collect();
            out.insert(key.to_string(), parts.join(","));
        }
        v => {
            out.insert(key.to_string(), plain(v));
        }
    }
}

/// A string as itself (no quotes), anything else as JSON writes it.
fn plain(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

/// Names every setting that differs between a checkpoint and the current config.
pub fn settings_diff(
    saved: &BTreeMap<String, String>,
    now: &BTreeMap<String, String>,
) -> Vec<String> {
    let none = String::from("(unset)");
    let mut keys: Vec<&String> = saved.keys().chain(now.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter_map(|k| {
            let (a, b) = (saved.get(k).unwrap_or(&none), now.get(k).unwrap_or(&none));
            (a != b).then(|| format!("{k} was {a}, is now {b}"))
        })
        .collect()
}

/// f16's dynamic loss scaler; none in f32/bf16.
pub fn loss_scaler(cfg: &RunConfig) -> Option<LossScaler> {
    (cfg.model.dtype == rtune_config::DType::F16).then(|| {
        LossScaler::new(
            cfg.train.loss_scale_init,
            cfg.train.loss_scale_growth_interval,
        )
    })
}

/// Steps whose loss tests poison with NaN to exercise the skip path: `RTUNE_FAULT_NAN_STEPS`,
/// comma-separated, 1-based.
pub fn fault_nan_steps() -> Vec<usize> {
    std::env::var("RTUNE_FAULT_NAN_STEPS")
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// What PEFT records as the base model: the path as the user gave it.
pub fn base_model_name(path: &Path) -> String {
    path.to_string_lossy().trim_end_matches('/').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> RunConfig {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        let text = format!(
            "[model]\npath = \"{}\"\n[data]\ntrain = \"{}\"\n{extra}",
            fixtures.join("tiny-llama3").display(),
            fixtures.join("smoke.jsonl").display()
        );
        let path = Path::new("settings-test.toml");
        let file = rtune_config::ConfigFile::parse(&text, path, &[]).unwrap();
        file.validate(path).unwrap()
    }

    /// The checked settings are the keys checked when they were listed by hand (before they were
    /// serialised from the config): a key that appears or vanishes here changes what resume accepts.
    #[test]
    fn settings_are_the_config_less_what_may_change() {
        let s = settings(&config("")).unwrap();
        let keys: Vec<&str> = s.keys().map(String::as_str).collect();
        let want = [
            "data.format",
            "data.group_by_length",
            // Which rows are dropped unread: decides the data like max_seq_len (new in round 4).
            "data.max_row_bytes",
            "data.max_seq_len",
            "data.on_bad_row",
            "data.packing",
            "data.shuffle",
            "data.train[0]",
            "data.train[0] sha256",
            "data.train[0] weight",
            "data.train_on",
            "data.truncation",
            "data.valid_fraction",
            "lora.alpha",
            "lora.dropout",
            "lora.init_from",
            "lora.r",
            "lora.rslora",
            "lora.targets",
            "model.config.json sha256",
            "model.double_quant",
            "model.dtype",
            "model.path",
            "model.quantize",
            "train.adam_beta1",
            "train.adam_beta2",
            "train.adam_eps",
            "train.grad_accum",
            "train.lr",
            "train.max_grad_norm",
            "train.micro_batch_size",
            "train.schedule",
            "train.seed",
            "train.steps",
            "train.warmup_steps",
            "train.weight_decay",
        ];
        assert_eq!(keys, want);
        assert_eq!(s["data.train[0] sha256"].len(), 64);
    }

    /// Output, evaluation and device settings may change on resume; a setting that changes the
    /// numbers is named with both values, as resolved (`float32` is `f32`; a target list is one value).
    #[test]
    fn only_settings_that_change_the_numbers_differ() {
        let base = settings(&config("")).unwrap();
        let same = config(
            "[train]\neval_every = 3\ndevice = \"cpu\"\nlog_every = 5\n\
             [output]\nsave_every = 1\ndir = \"elsewhere\"",
        );
        assert!(settings_diff(&base, &settings(&same).unwrap()).is_empty());
        let mut alias = config("");
        alias.file.model.dtype = "float32".into();
        assert!(settings_diff(&base, &settings(&alias).unwrap()).is_empty());
        let changed = config("[train]\nlr = 1e-3\n[lora]\ntargets = [\"q_proj\", \"v_proj\"]");
        assert_eq!(
            settings_diff(&base, &settings(&changed).unwrap()),
            vec![
                "lora.targets was all-linear, is now q_proj,v_proj",
                "train.lr was 0.0002, is now 0.001",
            ]
        );
    }
}
