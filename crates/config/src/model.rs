//! The `[model]` section, checked (as written: [`crate::ModelSection`]): the base model's path,
//! its compute dtype and how its frozen linear layers are held.
//!
//! `dtype = "auto"` is resolved here, once, by [`auto_dtype`], for the device the run computes on
//! (`train.device`; `auto` is `cuda:0` when a GPU answers, as `rtune_train::device` opens it):
//! on a GPU bf16 from compute capability 8.0 (Ampere's bf16 tensor cores), f16 on 7.x (f16 tensor
//! cores, with the loss scaler), f32 below; on the CPU bf16 where it multiplies bf16 natively
//! (AMX-BF16 or AVX-512 BF16, `rtune_backend::cpu_features`) and oneDNN serves its bf16 products
//! (`rtune_backend::onednn`), f32 otherwise. The checked config keeps the reason
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

/// A GPU as `dtype = "auto"` sees it: its ordinal and compute capability `(major, minor)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpu {
    pub ordinal: usize,
    pub capability: (i32, i32),
}

/// What `dtype = "auto"` means on `gpu` (`None`: the run computes on the CPU), or on a CPU with
/// these bf16 instructions, given why oneDNN does not serve bf16 products (`None`: it does).
/// GPU: bf16 from compute capability 8.0, f16 on 7.x (no bf16 tensor cores, f16 ones, the loss
/// scaler), f32 below (neither). CPU: bf16 with AMX-BF16 or AVX-512 BF16 and oneDNN, f32
/// otherwise (bf16 on candle's gemm is slower than f32 on a BLAS). The reason names the device,
/// capability or instruction set, or what is missing.
pub fn auto_dtype(
    gpu: Option<Gpu>,
    amx_bf16: bool,
    avx512_bf16: bool,
    onednn_missing: Option<&str>,
) -> (DType, String) {
    if let Some(Gpu {
        ordinal,
        capability: (major, minor),
    }) = gpu
    {
        let card = format!("cuda:{ordinal} has compute capability {major}.{minor}");
        return match major {
            8.. => (DType::BF16, format!("{card} (bf16 tensor cores)")),
            7 => (
                DType::F16,
                format!("{card}: no bf16 tensor cores (8.0), f16 ones (with the loss scaler)"),
            ),
            _ => (
                DType::F32,
                format!("{card}: neither bf16 (8.0) nor f16 (7.0) tensor cores"),
            ),
        };
    }
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

/// The GPU a run on `device` computes on, as `rtune_train::device` opens it: `cuda:N`, or for
/// `auto` `cuda:0` when it answers; `None` for the CPU (or no GPU). A `cuda:N` that does not
/// answer gets the CPU's rule here; the run then stops at opening it, naming the error.
pub fn auto_gpu(device: crate::Device) -> Option<Gpu> {
    let ordinal = match device {
        crate::Device::Cpu => return None,
        crate::Device::Auto => 0,
        crate::Device::Cuda(n) => n,
    };
    rtune_backend::cuda_capability(ordinal).map(|capability| Gpu {
        ordinal,
        capability,
    })
}

/// [`auto_dtype`] for a run on `device`, this machine's CPU and this process's oneDNN.
pub(crate) fn auto_here(device: crate::Device) -> (DType, String) {
    let f = rtune_backend::cpu_features::get();
    let missing = rtune_backend::onednn::get().err().map(|e| e.to_string());
    auto_dtype(
        auto_gpu(device),
        f.amx_bf16,
        f.avx512_bf16,
        missing.as_deref(),
    )
}

impl ModelSection {
    /// Checked, with `dtype = "auto"` resolved for a run on `device` (`train.device`; a bad
    /// value there is `[train]`'s error, the CPU's rule here).
    pub(crate) fn validate(&self, path: &Path, device: crate::Device) -> Result<BaseModelConfig> {
        let mut dtype_auto = None;
        let dtype = match self.dtype.as_str() {
            "f32" | "float32" => DType::F32,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" => DType::F16,
            "bf16-autocast" | "autocast" => DType::Bf16Autocast,
            "auto" => {
                let (d, why) = auto_here(device);
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
        // `nf4` takes `double_quant` from its own key; `nf4-dq` says it in the name. The printed
        // names' `+experts` is the `quantize_experts` key here (one way to write it).
        if self.quantize.ends_with(rtune_quant::EXPERTS_SUFFIX) {
            return Err(invalid(
                path,
                "model.quantize",
                format!(
                    "`{}`: write quantize = \"{}\" with quantize_experts = true",
                    self.quantize,
                    self.quantize.trim_end_matches(rtune_quant::EXPERTS_SUFFIX)
                ),
            ));
        }
        let quantize = match self.quantize.parse() {
            Ok(rtune_quant::Quantize::Nf4 {
                double_quant: false,
                experts,
            }) if self.quantize == "nf4" => rtune_quant::Quantize::Nf4 {
                double_quant: self.double_quant,
                experts,
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
        // The expert stacks in NF4 (`rtune_experts::moe::stack`): only beside NF4 linear layers
        // (a model that has no experts is refused where config.json is read, `Model::build_with`).
        let quantize = match (quantize, self.quantize_experts) {
            (q, false) => q,
            (rtune_quant::Quantize::Nf4 { double_quant, .. }, true) => rtune_quant::Quantize::Nf4 {
                double_quant,
                experts: true,
            },
            (rtune_quant::Quantize::None, true) => {
                return Err(invalid(
                    path,
                    "model.quantize_experts",
                    format!(
                        "= true needs quantize = \"nf4\" or \"nf4-dq\" (quantize is \"{}\"): \
                         the expert stacks are held in NF4 beside NF4 linear layers only",
                        self.quantize
                    ),
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
