//! The `[model]` section, checked (as written: [`crate::ModelSection`]): the base model's path,
//! its compute dtype and how its frozen linear layers are held.
//!
//! `dtype = "auto"` is resolved here, once, by [`auto_dtype`]: bf16 where the CPU multiplies bf16
//! natively (AMX-BF16 or AVX-512 BF16, `rtune_backend::cpu_features`) and oneDNN serves its bf16
//! products (`rtune_backend::onednn`), f32 otherwise; the checked config keeps the reason
//! ([`BaseModelConfig::dtype_auto`]) for `rtune check` and run.json.

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
    /// `Some(why)` when `dtype = "auto"` chose [`BaseModelConfig::dtype`] (see [`auto_dtype`]).
    pub dtype_auto: Option<String>,
    /// How the frozen linear layers are held (`[model] quantize` with `double_quant`).
    pub quantize: rtune_quant::Quantize,
}

impl BaseModelConfig {
    /// The dtype as resolved, with `auto`'s reason: `bf16 (auto: the CPU has AVX-512 BF16, …)`.
    pub fn dtype_said(&self) -> String {
        match &self.dtype_auto {
            Some(why) => format!("{} (auto: {why})", self.dtype.as_str()),
            None => self.dtype.as_str().to_string(),
        }
    }
}

/// What `dtype = "auto"` means on a CPU with these bf16 instructions, given why oneDNN does not
/// serve bf16 products (`None`: it does): bf16 with AMX-BF16 or AVX-512 BF16 and oneDNN, f32
/// otherwise (bf16 on candle's gemm is slower than f32 on a BLAS). The reason names the
/// instruction set or what is missing.
pub fn auto_dtype(
    amx_bf16: bool,
    avx512_bf16: bool,
    onednn_missing: Option<&str>,
) -> (DType, String) {
    let isa = if amx_bf16 {
        "AMX-BF16"
    } else if avx512_bf16 {
        "AVX-512 BF16"
    } else {
        return (
            DType::F32,
            "the CPU has neither AMX-BF16 nor AVX-512 BF16".into(),
        );
    };
    match onednn_missing {
        None => (DType::BF16, format!("the CPU has {isa}, oneDNN in use")),
        Some(why) => (
            DType::F32,
            format!("the CPU has {isa} but oneDNN is not in use ({why})"),
        ),
    }
}

/// [`auto_dtype`] for this CPU and this process's oneDNN.
fn auto_here() -> (DType, String) {
    let f = rtune_backend::cpu_features::get();
    let missing = rtune_backend::onednn::get().err().map(|e| e.to_string());
    auto_dtype(f.amx_bf16, f.avx512_bf16, missing.as_deref())
}

impl ModelSection {
    pub(crate) fn validate(&self, path: &Path) -> Result<BaseModelConfig> {
        let mut dtype_auto = None;
        let dtype = match self.dtype.as_str() {
            "f32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" => DType::F16,
            "bf16-autocast" | "autocast" => DType::Bf16Autocast,
            "auto" => {
                let (d, why) = auto_here();
                dtype_auto = Some(why);
                d
            }
            other => {
                return Err(invalid(
                    path,
                    "model.dtype",
                    crate::suggest::not_one_of(
                        other,
                        &["auto", "f32", "bf16", "f16", "bf16-autocast"],
                    ),
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
            dtype_auto,
            quantize,
        })
    }
}
