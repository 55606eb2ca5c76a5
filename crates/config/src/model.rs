//! The `[model]` section, checked (as written: [`crate::ModelSection`]): the base model's path,
//! its compute dtype and how its frozen linear layers are held.

use std::path::{Path, PathBuf};

use crate::file::ModelSection;
use crate::{invalid, Result};

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

/// The checked `[model]` section (named apart from `rtune_model::ModelConfig`, the network's
/// `config.json`).
#[derive(Debug, Clone)]
pub struct BaseModelConfig {
    /// `[model] path` as written, until the run resolves it (`rtune_train::resolve_model`) to the
    /// local model directory (a hub id downloaded, a `.gguf` converted).
    pub path: PathBuf,
    pub dtype: DType,
    /// How the frozen linear layers are held (`[model] quantize` with `double_quant`).
    pub quantize: rtune_quant::Quantize,
}

impl ModelSection {
    pub(crate) fn validate(&self, path: &Path) -> Result<BaseModelConfig> {
        let dtype = match self.dtype.as_str() {
            "f32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" => DType::F16,
            "bf16-autocast" | "autocast" => DType::Bf16Autocast,
            other => {
                return Err(invalid(
                    path,
                    "model.dtype",
                    crate::suggest::not_one_of(other, &["f32", "bf16", "f16", "bf16-autocast"]),
                ))
            }
        };
        // `nf4` takes `double_quant` from its own key; `nf4-dq` says it in the name.
        let quantize = match self.quantize.parse() {
            Ok(rtune_quant::Quantize::Nf4 {
                double_quant: false,
            }) if self.quantize == "nf4" => rtune_quant::Quantize::Nf4 {
                double_quant: self.double_quant,
            },
            Ok(q) => q,
            Err(_) => {
                return Err(invalid(
                    path,
                    "model.quantize",
                    crate::suggest::not_one_of(&self.quantize, &rtune_quant::QUANTIZE_NAMES),
                ))
            }
        };
        if self.path.trim().is_empty() {
            return Err(invalid(path, "model.path", "is empty".into()));
        }
        if self.revision.trim().is_empty() {
            return Err(invalid(
                path,
                "model.revision",
                "is empty (a branch, tag or commit)".into(),
            ));
        }
        Ok(BaseModelConfig {
            path: PathBuf::from(&self.path),
            dtype,
            quantize,
        })
    }
}
