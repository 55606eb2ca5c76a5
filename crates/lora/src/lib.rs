//! LoRA adapters: the spec (rank, alpha, targets), the weights, PEFT's initialisation and PEFT's
//! on-disk format.
//!
//! A LoRA module adds `scaling · (x·Aᵀ)·Bᵀ` to a frozen linear layer `x·Wᵀ`, with `A: (r, in)`,
//! `B: (out, r)` and `scaling = alpha / r` (or `alpha / √r` with rsLoRA, Kalajdzievski 2023).
//! [`Adapter`] keeps the modules in model order under their checkpoint names
//! (`model.layers.0.self_attn.q_proj`); PEFT's names (`base_model.model.<name>.lora_A.weight`) appear
//! only in [`peft`], at the file boundary ([`peft::lora_a_key`] and its siblings name every tensor
//! rtune writes for PEFT or beside it). Master weights are always f32. [`init`] holds the other
//! starts PEFT offers (`[lora] init`: gaussian, PiSSA, OLoRA) and the conversion of a PiSSA / OLoRA
//! adapter back to the original base.
//!
//! DoRA (Liu et al. 2024, PEFT's `use_dora`) adds a magnitude vector `m: (out,)` per module
//! ([`LoraPair::m`]); the model side (`rtune_model::dora`) holds its math.
//!
//! Trainable tokens (PEFT's `trainable_token_indices`) train a few rows of the input embedding
//! ([`TokenRows`]: the rows themselves, not a difference, as PEFT's `trainable_tokens_delta`); the
//! model (`rtune_model::tokens`) puts them in place of the embedding's rows and, when the lm_head
//! is tied to the embedding, of the lm_head's.

pub mod init;
pub mod peft;
#[cfg(test)]
mod test_util;

pub use init::{Init, INIT_NAMES};

pub use peft::{
    parse_adapter_config, read_adapter_config, PeftAdapterConfig, ADAPTER_CONFIG, ADAPTER_WEIGHTS,
};

use candle_core::{Device, Tensor};
use rand::Rng;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: tensor `{key}` has shape {got:?}, the model needs {want:?} ({hint})")]
    Shape {
        path: PathBuf,
        key: String,
        got: Vec<usize>,
        want: Vec<usize>,
        hint: String,
    },
    #[error("{path}: adapter has no tensor `{key}` (it was trained for other targets or another model?)")]
    Missing { path: PathBuf, key: String },
    #[error("{path}: adapter tensor `{key}` targets no module of this model")]
    Unexpected { path: PathBuf, key: String },
    #[error(transparent)]
    Io(#[from] rtune_fsio::IoError),
    #[error("lora {op}: {source}")]
    Candle {
        op: &'static str,
        source: candle_core::Error,
    },
}

pub type Result<T> = std::result::Result<T, LoraError>;

pub(crate) fn cerr(op: &'static str) -> impl FnOnce(candle_core::Error) -> LoraError {
    move |source| LoraError::Candle { op, source }
}

/// The linear modules of a Llama-family decoder layer, in PEFT's `all-linear` order.
pub const ALL_LINEAR: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The linear modules of a Phi-3 decoder layer, whose q/k/v and gate/up are one weight each: PEFT
/// adapts `qkv_proj` as one module (`A: (r, hidden)`, `B: (q + 2·kv, r)`), and so does rtune.
pub const FUSED_LINEAR: [&str; 4] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"];

/// The 3-D parameters `target_parameters` can name: a mixture-of-experts layer's fused expert
/// stacks (Qwen3-MoE's, transformers 5's names under `model.layers.N.`).
pub const KNOWN_PARAMETERS: [&str; 2] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

/// Every family's module names, in model order: what `all-linear` expands to before a model
/// narrows it to its own ([`LoraSpec::check_for`]).
pub const KNOWN_LINEAR: [&str; 9] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
];

/// Rank, scale and targets of an adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    pub rslora: bool,
    /// Short module names (`q_proj`, ...), already expanded from `all-linear` (to
    /// [`KNOWN_LINEAR`]: a model adapts those of its family's names it has).
    pub targets: Vec<String>,
    /// The targets were `all-linear`: no named module may be missing from a model.
    pub all_linear: bool,
    /// DoRA (PEFT's `use_dora`): every pair carries a magnitude vector `m`.
    pub dora: bool,
    /// PEFT's `target_parameters`: the 3-D expert stacks adapted, one pair each with rank `r`
    /// per expert ([`KNOWN_PARAMETERS`]), in the order given (PEFT nests its wrappers in it,
    /// which names the saved keys).
    pub target_parameters: Vec<String>,
}

impl LoraSpec {
    /// Expands `all-linear` and checks names against [`KNOWN_LINEAR`] (a model checks them
    /// against its own with [`LoraSpec::check_for`]).
    pub fn new(
        r: usize,
        alpha: f64,
        dropout: f64,
        rslora: bool,
        targets: &[String],
    ) -> Result<Self> {
        let mut out: Vec<String> = Vec::new();
        let mut all_linear = false;
        for t in targets {
            if t == "all-linear" {
                all_linear = true;
                out.extend(KNOWN_LINEAR.iter().map(|s| s.to_string()));
            } else if KNOWN_LINEAR.contains(&t.as_str()) {
                out.push(t.clone());
            } else {
                return Err(LoraError::File {
                    path: PathBuf::from("[lora] targets"),
                    message: format!(
                        "unknown module `{t}`; use \"all-linear\" or some of {ALL_LINEAR:?} \
                         (Llama, Mistral, Qwen, Gemma) or {FUSED_LINEAR:?} (Phi-3)"
                    ),
                });
            }
        }
        // Model order, no duplicates.
        let targets = KNOWN_LINEAR
            .iter()
            .filter(|n| out.iter().any(|o| o == *n))
            .map(|s| s.to_string())
            .collect();
        Ok(Self {
            r,
            alpha,
            dropout,
            rslora,
            targets,
            all_linear,
            dora: false,
            target_parameters: Vec::new(),
        })
    }

    /// The same spec adapting the expert stacks `params` (PEFT's `target_parameters`), each one
    /// of [`KNOWN_PARAMETERS`], order kept, no duplicates.
    pub fn with_target_parameters(mut self, params: &[String]) -> Result<Self> {
        for (i, p) in params.iter().enumerate() {
            if !KNOWN_PARAMETERS.contains(&p.as_str()) || params[..i].contains(p) {
                return Err(LoraError::File {
                    path: PathBuf::from("[lora] target_parameters"),
                    message: format!(
                        "`{p}` is not one of {KNOWN_PARAMETERS:?} or is listed twice (the \
                         experts' fused stacks of a mixture-of-experts model)"
                    ),
                });
            }
        }
        self.target_parameters = params.to_vec();
        Ok(self)
    }

    /// Checks the targets against the linear modules of a model of architecture `arch` (its
    /// [`ALL_LINEAR`] or [`FUSED_LINEAR`]): a module named in `[lora] targets` that this model does
    /// not have is an error naming the ones it has (`q_proj` on Phi-3, whose q/k/v are one
    /// `qkv_proj`). `all-linear` fits every model.
    pub fn check_for(&self, arch: &str, modules: &[&str]) -> Result<()> {
        if self.all_linear {
            return Ok(());
        }
        match self.targets.iter().find(|t| !modules.contains(&t.as_str())) {
            None => Ok(()),
            Some(t) => Err(LoraError::File {
                path: PathBuf::from("[lora] targets"),
                message: format!(
                    "{arch} has no module `{t}`; its linear modules are {} (or \"all-linear\")",
                    modules.join(", ")
                ),
            }),
        }
    }

    /// The same spec with DoRA on or off.
    pub fn with_dora(mut self, dora: bool) -> Self {
        self.dora = dora;
        self
    }

    /// `alpha / r`, or `alpha / √r` with rsLoRA.
    pub fn scaling(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    pub fn targets_module(&self, short_name: &str) -> bool {
        self.targets.iter().any(|t| t == short_name)
    }
}

/// One LoRA module's weights: `a: (r, in)`, `b: (out, r)`, f32.
#[derive(Debug, Clone)]
pub struct LoraPair {
    pub a: Tensor,
    pub b: Tensor,
    /// DoRA's magnitude `(out,)` f32, trained; `None` for plain LoRA. Initialised by the model
    /// (it needs `W`: `rtune_model::Model::init_dora`).
    pub m: Option<Tensor>,
}

/// Where a module lives and its shape: `name` like `model.layers.0.self_attn.q_proj`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleShape {
    pub name: String,
    pub in_features: usize,
    pub out_features: usize,
    /// 1 for a linear module; `E` for an expert stack adapted through `target_parameters`
    /// (PEFT's `ParamWrapper`: `A: (E·r, in)`, `B: (out, r·E)`, its name PEFT's module path,
    /// e.g. `model.layers.0.mlp.experts.base_layer`).
    pub experts: usize,
}

/// PEFT's trainable tokens: `rows[k]` replaces row `ids[k]` of the input embedding (and of the
/// tied lm_head). `rows: (n, hidden)` f32, trained; initialised to the embedding's own rows.
#[derive(Debug, Clone)]
pub struct TokenRows {
    pub ids: Vec<u32>,
    pub rows: Tensor,
}

/// All LoRA modules of a model, in model order, and the trainable token rows if any.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub spec: LoraSpec,
    pub names: Vec<String>,
    pub pairs: Vec<LoraPair>,
    /// `[lora] trainable_tokens`; `None` when the run trains no token rows.
    pub tokens: Option<TokenRows>,
}

impl Adapter {
    /// PEFT's default init: A ~ kaiming_uniform(a=√5) = U(-1/√in, 1/√in), B = 0.
    pub fn init(
        spec: LoraSpec,
        modules: &[ModuleShape],
        seed: u64,
        device: &Device,
    ) -> Result<Self> {
        init::fresh(spec, modules, seed, device, |rng, m| {
            let bound = 1.0 / (m.in_features as f64).sqrt();
            rng.random_range(-bound..bound) as f32
        })
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }

    pub fn num_params(&self) -> usize {
        self.trainable().iter().map(|(_, t)| t.elem_count()).sum()
    }

    /// Every trained tensor with its PEFT key, in the optimizer's order: `A0, B0, A1, B1, …`, then
    /// the DoRA magnitudes `m0, m1, …` (after all pairs, so a plain adapter's order is unchanged),
    /// then the trainable token rows.
    pub fn trainable(&self) -> Vec<(String, &Tensor)> {
        let mut out = Vec::with_capacity(self.pairs.len() * 3);
        for (name, p) in self.names.iter().zip(&self.pairs) {
            out.push((peft::lora_a_key(name), &p.a));
            out.push((peft::lora_b_key(name), &p.b));
        }
        for (name, p) in self.names.iter().zip(&self.pairs) {
            if let Some(m) = &p.m {
                out.push((peft::magnitude_key(name), m));
            }
        }
        if let Some(t) = &self.tokens {
            out.push((peft::TOKENS_KEY.to_string(), &t.rows));
        }
        out
    }

    /// [`trainable`](Self::trainable)'s tensors, mutable, in the same order.
    pub fn trainable_mut(&mut self) -> Vec<&mut Tensor> {
        let mut out = Vec::with_capacity(self.pairs.len() * 3);
        let mut ms = Vec::new();
        for p in self.pairs.iter_mut() {
            out.push(&mut p.a);
            out.push(&mut p.b);
            if let Some(m) = p.m.as_mut() {
                ms.push(m);
            }
        }
        out.extend(ms);
        if let Some(t) = self.tokens.as_mut() {
            out.push(&mut t.rows);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_linear_expands_in_model_order() {
        let s = LoraSpec::new(4, 8.0, 0.0, false, &["v_proj".into(), "q_proj".into()]).unwrap();
        assert_eq!(s.targets, vec!["q_proj", "v_proj"]);
        let s = LoraSpec::new(4, 8.0, 0.0, true, &["all-linear".into()]).unwrap();
        assert_eq!(s.targets, KNOWN_LINEAR);
        assert!(s.check_for("Phi3ForCausalLM", &FUSED_LINEAR).is_ok());
        let q = LoraSpec::new(4, 8.0, 0.0, true, &["q_proj".into(), "o_proj".into()]).unwrap();
        assert!(q.check_for("LlamaForCausalLM", &ALL_LINEAR).is_ok());
        let e = q.check_for("Phi3ForCausalLM", &FUSED_LINEAR).unwrap_err();
        assert!(
            e.to_string()
                .contains("Phi3ForCausalLM has no module `q_proj`; its linear modules are qkv_proj, o_proj, gate_up_proj, down_proj"),
            "{e}"
        );
        assert!((s.scaling() - 4.0).abs() < 1e-12);
        assert!(LoraSpec::new(4, 8.0, 0.0, false, &["qproj".into()]).is_err());
    }

    /// `target_parameters`: PEFT's two expert-stack names, in the order given (it names the
    /// saved keys); anything else, or a name twice, refused naming it.
    #[test]
    fn target_parameters_keep_order_and_refuse_unknown_names() {
        let s = LoraSpec::new(4, 8.0, 0.0, false, &["q_proj".into()]).unwrap();
        let p = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let down_first = p(&["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]);
        let t = s.clone().with_target_parameters(&down_first).unwrap();
        assert_eq!(t.target_parameters, down_first);
        for bad in [
            p(&["experts.gate_up_proj"]),
            p(&["mlp.experts.down_proj", "mlp.experts.down_proj"]),
        ] {
            let e = s.clone().with_target_parameters(&bad).unwrap_err();
            assert!(e.to_string().contains("[lora] target_parameters"), "{e}");
        }
    }

    #[test]
    fn init_matches_peft_bounds() {
        let spec = LoraSpec::new(8, 16.0, 0.0, false, &["all-linear".into()]).unwrap();
        let m = ModuleShape {
            name: "x".into(),
            in_features: 100,
            out_features: 30,
            experts: 1,
        };
        let ad = Adapter::init(spec, &[m], 1, &Device::Cpu).unwrap();
        let a: Vec<f32> = ad.pairs[0].a.flatten_all().unwrap().to_vec1().unwrap();
        let bound = 0.1f32;
        assert!(a.iter().all(|v| v.abs() <= bound));
        // Uniform on [-b, b]: the max is close to b, the mean close to 0.
        let max = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max > 0.95 * bound, "{max}");
        let b: Vec<f32> = ad.pairs[0].b.flatten_all().unwrap().to_vec1().unwrap();
        assert!(b.iter().all(|v| *v == 0.0));
        assert_eq!(ad.pairs[0].b.dims(), &[30, 8]);
    }
}
