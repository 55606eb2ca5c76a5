//! Exports of a finished (or checkpointed) run, for the tools people load models with:
//!
//! | [`Format`] | what | for |
//! |---|---|---|
//! | `Peft` | the PEFT adapter directory, `base_model_name_or_path` pointing at a base that resolves | PEFT, vLLM, TGI, mistral.rs |
//! | `Merged` | `W' = W + scaling·B·A` in every adapted layer, a Hugging Face safetensors directory (sharded past `max_shard_bytes`) with the base's config and tokenizer files | transformers, anything that loads a plain checkpoint |
//! | `GgufLora` | the adapter as GGUF, laid out as llama.cpp's `convert_lora_to_gguf.py` writes it | llama.cpp `--lora` |
//!
//! [`RunSource`] finds what an export needs in a run directory: the adapter (the final one, or
//! `checkpoint-N`), the base model the run recorded in `run.json`, and the run's file privacy.
//! [`export`] checks the destination, builds the output beside it and renames it into place, so an
//! interrupted export leaves nothing that looks finished. The pieces ([`merge::merge_into`],
//! [`gguf::write_gguf_lora`], [`peft::export_peft`]) work on plain directories too.

pub mod gguf;
pub mod merge;
mod out;
pub mod peft;
mod source;

pub use merge::{MergeOptions, MergeReport, DEFAULT_MAX_SHARD_BYTES};
pub use source::RunSource;

use std::path::{Path, PathBuf};

use rtune_lora::{LoraError, LoraSpec, ModuleShape};
use rtune_model::{ModelConfig, ModelError};

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The run, the adapter, the base model or an argument is not usable as given.
    #[error("{path}: {message}")]
    Input { path: PathBuf, message: String },
    #[error("{path}: already exists; pass --force to replace it")]
    Exists { path: PathBuf },
    // Boxed: the library errors carry paths and shapes, and a large Err slows every Result.
    #[error(transparent)]
    Lora(Box<LoraError>),
    #[error(transparent)]
    Model(Box<ModelError>),
    /// Writing the export failed (disk full, permissions ...). Displayed, not chained: the
    /// message already ends with the OS error, and `{:#}` would print it twice.
    #[error("{0}")]
    Io(rtune_fsio::IoError),
    #[error("{op}: {cause}")]
    Candle {
        op: String,
        cause: Box<candle_core::Error>,
    },
}

impl From<rtune_fsio::IoError> for ExportError {
    fn from(e: rtune_fsio::IoError) -> Self {
        ExportError::Io(e)
    }
}

impl From<LoraError> for ExportError {
    fn from(e: LoraError) -> Self {
        ExportError::Lora(Box::new(e))
    }
}

impl From<ModelError> for ExportError {
    fn from(e: ModelError) -> Self {
        ExportError::Model(Box::new(e))
    }
}

impl ExportError {
    pub(crate) fn input(path: &Path, message: impl Into<String>) -> Self {
        ExportError::Input {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    pub(crate) fn candle(op: impl Into<String>) -> impl FnOnce(candle_core::Error) -> Self {
        let op = op.into();
        move |e| ExportError::Candle {
            op,
            cause: Box::new(e),
        }
    }

    /// True when the input is at fault (the CLI exits 2), false when the export itself failed (1).
    pub fn is_input_error(&self) -> bool {
        match self {
            ExportError::Input { .. } | ExportError::Exists { .. } => true,
            ExportError::Lora(e) => !matches!(**e, LoraError::Candle { .. } | LoraError::Io(_)),
            ExportError::Model(e) => !matches!(**e, ModelError::Candle { .. }),
            ExportError::Io(_) | ExportError::Candle { .. } => false,
        }
    }
}

pub type Result<T> = std::result::Result<T, ExportError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Peft,
    Merged,
    GgufLora,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Peft => "peft",
            Format::Merged => "merged",
            Format::GgufLora => "gguf-lora",
        }
    }

    /// Whether the export is one file (else a directory).
    pub fn writes_a_file(self) -> bool {
        self == Format::GgufLora
    }
}

/// What `rtune export` was asked to do.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    pub run: PathBuf,
    pub format: Format,
    pub out: PathBuf,
    /// `checkpoint-N` instead of the run's final adapter.
    pub checkpoint: Option<usize>,
    /// Replace an existing output (only one that looks like an earlier export).
    pub force: bool,
    /// The base model directory, instead of the one recorded in run.json.
    pub base: Option<PathBuf>,
    /// `base_model_name_or_path` for the PEFT export (e.g. a hub id), instead of the resolved path.
    pub base_name: Option<String>,
    pub max_shard_bytes: u64,
    /// Merged export of a QLoRA run: into the dequantized NF4 weights it trained against
    /// (`false`, the default) or into the original 16/32-bit weights (`true`).
    pub merge_into_original: bool,
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    pub out: PathBuf,
    /// The adapter directory exported (the run dir or one of its checkpoints).
    pub adapter: PathBuf,
    /// The base model used (none for a PEFT export whose base is not found locally).
    pub base: Option<PathBuf>,
    pub files: Vec<String>,
    /// Things the user should know (e.g. the base's config.json differs from the run's).
    pub warnings: Vec<String>,
}

/// Runs one export as asked.
pub fn export(opts: &ExportOptions) -> Result<Exported> {
    let src = RunSource::open(&opts.run, opts.checkpoint, opts.base.as_deref())?;
    out::check_destination(&opts.out, opts.force, opts.format, &src.protected())?;
    src.verify()?;
    let mut warnings = src.warnings.clone();
    let files = match opts.format {
        Format::Peft => {
            let name = match &opts.base_name {
                Some(n) => n.clone(),
                None => src.base_name(&mut warnings),
            };
            out::stage_dir(&opts.out, src.privacy, opts.format, |tmp| {
                peft::export_peft(&src.adapter, tmp, &name, src.privacy)
            })?
        }
        Format::Merged => {
            let base = src.require_base("merged")?;
            let dequantized = src.trained_nf4.filter(|_| !opts.merge_into_original);
            if let Some(dq) = dequantized {
                warnings.push(format!(
                    "QLoRA run: merging into the dequantized NF4 weights{} the adapter was trained \
                     against (--merge-into original uses the unquantized base instead)",
                    if dq { " (double quant)" } else { "" }
                ));
            }
            let mo = MergeOptions {
                max_shard_bytes: opts.max_shard_bytes,
                dequantized,
                dequantized_experts: dequantized.is_some() && src.trained_nf4_experts,
            };
            out::stage_dir(&opts.out, src.privacy, opts.format, |tmp| {
                merge::merge_into(base, &src.adapter, tmp, &mo, src.privacy).map(|r| r.files)
            })?
        }
        Format::GgufLora => {
            let base = src.require_base("gguf-lora")?;
            gguf::refuse_unsupported(&src.adapter)?;
            gguf::write_gguf_lora(base, &src.adapter, &opts.out, src.privacy)?;
            vec![opts
                .out
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()]
        }
    };
    Ok(Exported {
        out: opts.out.clone(),
        adapter: src.adapter.clone(),
        base: src.base.clone(),
        files,
        warnings,
    })
}

/// The LoRA spec an adapter directory was saved with (r, alpha, rsLoRA, targets).
pub fn adapter_spec(adapter_dir: &Path) -> Result<LoraSpec> {
    let cfg = rtune_lora::read_adapter_config(adapter_dir)?;
    let cfg_path = adapter_dir.join(rtune_lora::ADAPTER_CONFIG);
    let targets: Vec<String> = match &cfg.target_modules {
        serde_json::Value::String(s) => vec![s.clone()],
        // PEFT may save full module names (`model.layers.0.self_attn.q_proj`): the kind is the
        // last component (the adapter file must still hold every layer's pair).
        serde_json::Value::Array(a) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(|t| t.rsplit('.').next().unwrap_or(t).to_string())
            })
            .collect::<Option<_>>()
            .ok_or_else(|| {
                ExportError::input(&cfg_path, "target_modules is not a list of names")
            })?,
        other => {
            return Err(ExportError::input(
                &cfg_path,
                format!("target_modules is {other}; expected a list of module names"),
            ))
        }
    };
    let bad = |e: rtune_lora::LoraError| ExportError::input(&cfg_path, e.to_string());
    let spec = LoraSpec::new(
        cfg.r,
        cfg.lora_alpha,
        cfg.lora_dropout,
        cfg.use_rslora,
        &targets,
    )
    .map_err(bad)?
    .with_dora(cfg.use_dora);
    let params = cfg.target_parameters.as_deref().unwrap_or(&[]);
    spec.with_target_parameters(params).map_err(bad)
}

/// The adapted modules of a model with this config, in model order, named as in the checkpoint
/// (the same list [`rtune_model::Model::lora_modules`] gives, without loading any weight).
pub fn module_shapes(cfg: &ModelConfig, spec: &LoraSpec) -> Vec<ModuleShape> {
    let mut out = Vec::new();
    for l in 0..cfg.num_layers {
        for m in cfg.linears_of(l) {
            if spec.targets_module(m.short()) {
                out.push(ModuleShape {
                    name: format!("model.layers.{l}.{}", m.path),
                    in_features: m.in_features,
                    out_features: m.out_features,
                    experts: 1,
                });
            }
        }
        let experts = rtune_model::moe::expert_modules(cfg, l, spec);
        out.extend(experts.into_iter().map(|(m, _)| m));
    }
    out
}

/// `base/config.json` read and checked.
pub fn base_config(base: &Path) -> Result<ModelConfig> {
    let p = base.join("config.json");
    if !p.exists() {
        return Err(ExportError::input(
            base,
            "no config.json: the base model must be a Hugging Face model directory",
        ));
    }
    Ok(rtune_model::HfConfig::from_file(&p)?.into_config(&p)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_spec_reads_short_and_full_target_names() {
        let d = std::env::temp_dir().join(format!("rtune-export-spec-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let cfg = |targets: &str, rs: bool| {
            format!(
                r#"{{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": {rs},
                    "target_modules": {targets}}}"#
            )
        };
        let write =
            |text: String| std::fs::write(d.join(rtune_lora::ADAPTER_CONFIG), text).unwrap();
        // As PEFT saves "all-linear" for some models: full names, any order, repeated per layer.
        write(cfg(
            r#"["model.layers.1.self_attn.o_proj", "model.layers.0.self_attn.q_proj",
                "model.layers.0.self_attn.o_proj"]"#,
            true,
        ));
        let s = adapter_spec(&d).unwrap();
        assert_eq!(s.targets, vec!["q_proj", "o_proj"]);
        assert_eq!((s.r, s.alpha, s.rslora), (4, 8.0, true));
        write(cfg(r#""all-linear""#, false));
        assert_eq!(adapter_spec(&d).unwrap().targets, rtune_lora::KNOWN_LINEAR);
        write(cfg(r#"["lm_head"]"#, false));
        let e = adapter_spec(&d).unwrap_err();
        assert!(
            e.is_input_error() && e.to_string().contains("lm_head"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
