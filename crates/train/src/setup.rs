//! Everything before the first step: the device, the model, the data, the adapter (fresh, from
//! `init_from`, or from a checkpoint), and the run directory. Inputs are all checked before the
//! directory is touched, so bad input never leaves a directory behind.

use candle_core::{DType, Device};
use std::collections::BTreeMap;
use std::path::Path;

use rtune_config::RunConfig;
use rtune_data::Tokenizer;
use rtune_fsio::{sha256_file, Privacy};
use rtune_lora::{Adapter, LoraSpec, ModuleShape};
use rtune_model::Model;

use crate::checkpoint;
use crate::dataset::{self, RunData};
use crate::TrainError;

/// The compute device for a config value. `auto` is the first GPU when this rtune was built with
/// the `cuda` feature and one opens, else the CPU; `cuda:N` needs that build.
pub fn device(d: rtune_config::Device) -> Result<Device, TrainError> {
    match d {
        rtune_config::Device::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        rtune_config::Device::Auto => Ok(rtune_model::cuda::open(0).unwrap_or(Device::Cpu)),
        #[cfg(not(feature = "cuda"))]
        rtune_config::Device::Auto => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        rtune_config::Device::Cuda(n) => rtune_model::cuda::open(n).map_err(|e| {
            TrainError::Device(format!("[train] device = \"cuda:{n}\": cannot open it: {e}"))
        }),
        #[cfg(not(feature = "cuda"))]
        rtune_config::Device::Cuda(n) => Err(TrainError::Device(format!(
            "[train] device = \"cuda:{n}\": this rtune was built without CUDA support; use \"cpu\", \
             or build with `cargo build --release --features cuda` (see benches/gpu/README.md)"
        ))),
    }
}

pub fn dtype(d: rtune_config::DType) -> DType {
    match d {
        rtune_config::DType::F32 => DType::F32,
        rtune_config::DType::BF16 => DType::BF16,
        rtune_config::DType::F16 => DType::F16,
    }
}

/// Turns `[model] path` into a local model directory: a directory as is, a llama `.gguf` file
/// converted once into the rtune cache, a hub id (`org/name`) at `[model] revision` downloaded
/// into the Hugging Face cache. Sets `cfg.model_path` to it and returns what was resolved (the hub
/// commit, the GGUF's sha256) for the run record.
pub fn resolve_model(cfg: &mut RunConfig) -> Result<rtune_hub::Resolved, TrainError> {
    let r = rtune_hub::resolve(&cfg.file.model.path, &cfg.file.model.revision)?;
    cfg.model_path = r.dir.clone();
    Ok(r)
}

/// How the config asks for the frozen linear layers.
pub fn quantize(cfg: &RunConfig) -> rtune_model::Quantize {
    match cfg.nf4 {
        Some(double_quant) => rtune_model::Quantize::Nf4 { double_quant },
        None => rtune_model::Quantize::None,
    }
}

pub struct Prepared {
    pub model: Model,
    pub spec: LoraSpec,
    pub modules: Vec<ModuleShape>,
    pub adapter: Adapter,
    pub data: RunData,
    pub tok: Option<Tokenizer>,
    pub pad_id: u32,
    /// Settings a resumed run must share with the original to reproduce it.
    pub settings: BTreeMap<String, String>,
}

pub fn prepare(cfg: &RunConfig, dev: &Device) -> Result<Prepared, TrainError> {
    let mut model = Model::load_with(&cfg.model_path, dtype(cfg.dtype), dev, quantize(cfg))?;
    let tok = if cfg.model_path.join("tokenizer.json").exists() {
        Some(Tokenizer::load(
            &cfg.model_path,
            model.cfg.eos_token_ids.first().copied(),
        )?)
    } else {
        None
    };
    let data = dataset::load(
        &cfg.data,
        &cfg.model_path,
        tok.as_ref(),
        model.cfg.vocab_size,
        cfg.seed,
    )?;
    let spec = LoraSpec::new(cfg.r, cfg.alpha, cfg.dropout, cfg.rslora, &cfg.targets)?;
    let modules = model.lora_modules(&spec);
    let adapter = match &cfg.init_from {
        Some(dir) => {
            let a = Adapter::load_peft(dir, &spec, &modules, dev)?;
            let saved = rtune_lora::read_adapter_config(dir)?;
            if saved.lora_alpha != cfg.alpha || saved.use_rslora != cfg.rslora {
                tracing::warn!(
                    "{}: adapter was saved with lora_alpha {} / use_rslora {}; training uses the config's {} / {}",
                    dir.display(),
                    saved.lora_alpha,
                    saved.use_rslora,
                    cfg.alpha,
                    cfg.rslora
                );
            }
            a
        }
        None => Adapter::init(spec.clone(), &modules, cfg.seed, dev)?,
    };
    model.attach(&adapter);
    let pad_id = tok
        .as_ref()
        .and_then(|t| t.pad_id)
        .or(model.cfg.pad_token_id)
        .unwrap_or(0);
    let settings = settings(cfg)?;
    Ok(Prepared {
        model,
        spec,
        modules,
        adapter,
        data,
        tok,
        pad_id,
        settings,
    })
}

/// The config values (and input checksums) that determine a run's numbers.
fn settings(cfg: &RunConfig) -> Result<BTreeMap<String, String>, TrainError> {
    let sha = |p: &Path| sha256_file(p).map_err(TrainError::from);
    let f = &cfg.file;
    let mut s = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        s.insert(k.to_string(), v);
    };
    put("model.path", f.model.path.clone());
    put(
        "model.config.json sha256",
        sha(&cfg.model_path.join("config.json"))?,
    );
    put("model.dtype", cfg.dtype.as_str().into());
    put("model.quantize", f.model.quantize.clone());
    put("model.double_quant", f.model.double_quant.to_string());
    put("lora.r", cfg.r.to_string());
    put("lora.alpha", cfg.alpha.to_string());
    put("lora.dropout", cfg.dropout.to_string());
    put("lora.targets", cfg.targets.join(","));
    put("lora.rslora", cfg.rslora.to_string());
    put("lora.init_from", f.lora.init_from.clone());
    let d = &cfg.data;
    for (i, t) in d.train.iter().enumerate() {
        put(&format!("data.train[{i}]"), t.path.display().to_string());
        put(&format!("data.train[{i}] sha256"), sha(&t.path)?);
        put(&format!("data.train[{i}] weight"), t.weight.to_string());
    }
    if let Some(v) = &d.valid {
        put("data.valid sha256", sha(v)?);
    }
    if let Some(t) = &d.chat_template {
        put("data.chat_template sha256", sha(t)?);
    }
    put("data.valid_fraction", d.valid_fraction.to_string());
    put("data.format", f.data.format.clone());
    put("data.train_on", f.data.train_on.clone());
    put("data.max_seq_len", d.max_seq_len.to_string());
    put("data.truncation", f.data.truncation.clone());
    put("data.on_bad_row", f.data.on_bad_row.clone());
    put("data.shuffle", d.shuffle.to_string());
    put("data.packing", d.packing.to_string());
    put("data.group_by_length", d.group_by_length.to_string());
    put("train.seed", cfg.seed.to_string());
    put("train.steps", cfg.steps.to_string());
    put("train.micro_batch_size", cfg.micro_batch_size.to_string());
    put("train.grad_accum", cfg.grad_accum.to_string());
    put("train.lr", cfg.lr.to_string());
    put("train.schedule", f.train.schedule.clone());
    put("train.warmup_steps", cfg.warmup_steps.to_string());
    put("train.weight_decay", cfg.weight_decay.to_string());
    put("train.max_grad_norm", cfg.max_grad_norm.to_string());
    put("train.adam_beta1", cfg.betas.0.to_string());
    put("train.adam_beta2", cfg.betas.1.to_string());
    put("train.adam_eps", cfg.eps.to_string());
    Ok(s)
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

/// Files of a run directory that a fresh run replaces.
pub const RUN_FILES: [&str; 8] = [
    "summary.json",
    "samples.jsonl",
    "loss.svg",
    "adapter_model.safetensors",
    "adapter_config.json",
    "metrics.jsonl",
    "config.toml",
    "run.json",
];

/// Makes `dir` ready for a fresh run: refuses to replace a finished or resumable run unless
/// `overwrite`, then clears the old run's files and checkpoints.
pub fn fresh_output(cfg: &RunConfig, privacy: Privacy) -> Result<(), TrainError> {
    let dir = &cfg.output_dir;
    let out = |message: String| TrainError::OutputDir {
        path: dir.clone(),
        message,
    };
    if dir.exists() {
        if !dir.is_dir() {
            return Err(out("exists and is not a directory".into()));
        }
        let finished = ["summary.json", "adapter_model.safetensors"]
            .iter()
            .any(|f| dir.join(f).exists());
        let checkpoints = checkpoint::list(dir);
        if finished && !cfg.overwrite {
            return Err(out(
                "already holds a finished run; choose another [output] dir or set [output] overwrite = true".into(),
            ));
        }
        if !checkpoints.is_empty() && !cfg.overwrite {
            return Err(out(format!(
                "holds checkpoints of an unfinished run (newest: step {}); pass --resume to continue it, or set \
                 [output] overwrite = true to start over",
                checkpoints[0].0
            )));
        }
        for f in RUN_FILES {
            let p = dir.join(f);
            if p.exists() {
                std::fs::remove_file(&p).map_err(|e| out(format!("cannot remove old {f}: {e}")))?;
            }
        }
        for (_, c) in checkpoints {
            std::fs::remove_dir_all(&c)
                .map_err(|e| out(format!("cannot remove {}: {e}", c.display())))?;
        }
        checkpoint::remove_partial(dir);
        let tb = dir.join(rtune_watch::TB_DIR);
        if tb.is_dir() {
            std::fs::remove_dir_all(&tb)
                .map_err(|e| out(format!("cannot remove old {}: {e}", tb.display())))?;
        }
    }
    privacy
        .create_dir_all(dir)
        .map_err(|e| out(format!("cannot create: {}", e.source)))?;
    if cfg.private {
        privacy
            .apply_to_dir(dir)
            .map_err(|e| out(e.source.to_string()))?;
    }
    Ok(())
}

/// What PEFT records as the base model: the path as the user gave it.
pub fn base_model_name(path: &Path) -> String {
    path.to_string_lossy().trim_end_matches('/').to_string()
}
