//! `config.json` as Hugging Face writes it ([`HfConfig`]), and the checked form the model is built
//! from ([`ModelConfig`]). Both the transformers v4 layout (`rope_theta`, `rope_scaling`) and the v5
//! layout (`rope_parameters`) are read; the RoPE keys in `rope`.

pub mod family;
pub mod moe;
mod rope;
mod values;

pub(crate) use values::positive;

use serde::Deserialize;
use std::path::Path;

use crate::{ModelError, Result};
use family::{Act, Family};

/// The subset of config.json that rtune reads; other keys are ignored (HF configs carry many).
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// Per layer: "full_attention" | "sliding_attention" (Qwen2 in transformers v5).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub pad_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub quantization_config: Option<serde_json::Value>,
    /// Gemma's activation name (`hidden_act` in the other families).
    #[serde(default)]
    pub hidden_activation: Option<String>,
    /// Gemma: scores are scaled by `1/√query_pre_attn_scalar`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 3 (transformers 4): the RoPE base of the local (sliding) layers.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// Gemma 3 (transformers 4): every `pattern`-th layer is global, the others sliding.
    #[serde(default, alias = "_sliding_window_pattern")]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3 embedding models attend both ways: not a causal LM.
    #[serde(default)]
    pub use_bidirectional_attention: Option<bool>,
    /// RoPE on the first `factor · head_dim` of each head (transformers 4's place for it; 5
    /// moves it into `rope_parameters`). Phi-4-mini: 0.75.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// LongRoPE's pre-training length (Phi-3 keeps it at the top level; default 4096 there).
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// Phi-3's dropouts, applied by transformers in training mode only; rtune has none.
    #[serde(default)]
    pub resid_pdrop: Option<f64>,
    #[serde(default)]
    pub embd_pdrop: Option<f64>,
    #[serde(default)]
    pub attention_dropout: Option<f64>,
    /// Mixture-of-experts keys (Qwen3-MoE's names; [`moe`]).
    /// transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts` (Mixtral's name).
    #[serde(default, alias = "num_local_experts")]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    pub router_aux_loss_coef: Option<f64>,
    #[serde(default)]
    pub output_router_logits: Option<bool>,
    /// Mixtral's router noise in training (`router_jitter_noise`): random, so refused above 0.
    #[serde(default)]
    pub router_jitter_noise: Option<f64>,
    /// gpt-oss's clamped SwiGLU: the clamp (`swiglu_limit`, 7.0) and the sigmoid's gain
    /// (`swiglu_alpha`, 1.702).
    #[serde(default)]
    pub swiglu_limit: Option<f64>,
    #[serde(default)]
    pub swiglu_alpha: Option<f64>,
}

fn d_eps() -> f64 {
    1e-6
}

/// A model family: its descriptor ([`crate::family`]).
pub type Arch = &'static Family;

/// What a family changes in the Llama layer; all off for Llama, Mistral and Qwen2.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Variant {
    /// An RMSNorm on q and on k before RoPE (`self_attn.q_norm`, `self_attn.k_norm`): per head
    /// over `head_dim` (Qwen3, Gemma 3), or over the whole projection width with
    /// [`qk_norm_whole`](Self::qk_norm_whole).
    pub qk_norm: bool,
    /// The q/k norms span the whole projection (`(H·Dh)` and `(Hkv·Dh)` weights: OLMo 2).
    pub qk_norm_whole: bool,
    /// Norm weights are stored as `w` and applied as `1 + w` (Gemma's `Gemma2RMSNorm`).
    pub plus_one_norms: bool,
    /// The attention's and the MLP's outputs are normed before their residual adds
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`: Gemma 2 and 3 beside their
    /// pre-norms, OLMo 2 instead of them); set from the family's [`family::LayerNorms`].
    pub sandwich_norms: bool,
    /// Norms multiply by their weight in f32 and round once at the end (Gemma's and OLMo 2's
    /// `(w·x).to(dtype)`, unlike Llama's `w·x.to(dtype)`); the same on f32.
    pub f32_norms: bool,
    /// RoPE's cos/sin stay f32 in a bf16/f16 model and q/k rotate in f32, rounded once (OLMo 2:
    /// `Olmo2RotaryEmbedding` does not cast its tables, Llama's does); the same on f32.
    pub f32_rope: bool,
    /// The MLP is `down(gelu_tanh(gate)·up)` (GeGLU) instead of SwiGLU.
    pub geglu: bool,
    /// The embeddings are multiplied by this (Gemma: `√hidden_size`, rounded to the model dtype).
    pub embed_scale: Option<f64>,
    /// Scores scaled by this instead of `1/√head_dim` (Gemma: `1/√query_pre_attn_scalar`).
    pub attn_scale: Option<f64>,
    /// Attention scores soft-capped: `cap·tanh(s/cap)` (Gemma 2's `attn_logit_softcapping`).
    pub attn_softcap: Option<f64>,
    /// Final logits soft-capped (Gemma 2's `final_logit_softcapping`).
    pub final_softcap: Option<f64>,
    /// The RoPE base and scaling of the sliding-window layers when they differ from the global
    /// one (Gemma 3: `rope_local_base_freq`, or `rope_parameters.sliding_attention`).
    pub local_rope: Option<(f64, RopeScaling)>,
    /// q/k/v and gate/up are one weight each in the checkpoint, `self_attn.qkv_proj` (rows q, k,
    /// v) and `mlp.gate_up_proj` (rows gate, up), and a LoRA adapts each as one module (Phi-3).
    pub fused_proj: bool,
    /// RoPE rotates the first `rotary_dim` of each head and passes the rest through
    /// (`partial_rotary_factor`); `None`: the whole head.
    pub rotary_dim: Option<usize>,
    /// Each attention layer has a learned logit per query head (`self_attn.sinks: (H,)`) that
    /// joins its softmax's denominator (gpt-oss; [`rtune_ops::attention::sinks`]).
    pub attn_sinks: bool,
}

/// Rotary embedding frequencies' scaling rule: the RoPE op's ([`rtune_ops::rope::RopeScaling`]).
pub use rtune_ops::rope::{RopeScaling, Yarn};

/// The checked model shape.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v (Qwen2; Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on o_proj (Llama with `attention_bias`).
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Sliding-window size of the layers that use one (`window_layers`): keys `window` or more
    /// positions back are masked. Mistral: every layer; Qwen2 with `use_sliding_window`: the layers
    /// marked `sliding_attention` in `layer_types` (or from `max_window_layers` on).
    pub sliding_window: Option<usize>,
    pub window_layers: Vec<bool>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub variant: Variant,
    /// The mixture-of-experts MLP of the sparse layers, `None` for a dense model.
    pub moe: Option<moe::MoeConfig>,
}

impl ModelConfig {
    /// The rotated width of a head: `head_dim`, or its first part (`partial_rotary_factor`).
    pub fn rotary_dim(&self) -> usize {
        self.variant.rotary_dim.unwrap_or(self.head_dim)
    }

    /// The linear modules of every decoder layer as the checkpoint holds them, in model order:
    /// the one list the model's loader, the exports and the memory estimate read.
    pub fn layer_linears(&self) -> Vec<LayerLinear> {
        let (d, i) = (self.hidden_size, self.intermediate_size);
        let (qd, kvd) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        let m = |path, in_features, out_features, bias| LayerLinear {
            path,
            in_features,
            out_features,
            bias,
        };
        let (o, mlp) = (self.o_bias, self.mlp_bias);
        if self.variant.fused_proj {
            // Phi-3: rows q, k, v of qkv_proj and gate, up of gate_up_proj; no biases.
            return vec![
                m("self_attn.qkv_proj", d, qd + 2 * kvd, self.qkv_bias),
                m("self_attn.o_proj", qd, d, o),
                m("mlp.gate_up_proj", d, 2 * i, mlp),
                m("mlp.down_proj", i, d, mlp),
            ];
        }
        vec![
            m("self_attn.q_proj", d, qd, self.qkv_bias),
            m("self_attn.k_proj", d, kvd, self.qkv_bias),
            m("self_attn.v_proj", d, kvd, self.qkv_bias),
            m("self_attn.o_proj", qd, d, o),
            m("mlp.gate_proj", d, i, mlp),
            m("mlp.up_proj", d, i, mlp),
            m("mlp.down_proj", i, d, mlp),
        ]
    }
}

/// One linear module of a decoder layer: `path` under `model.layers.N.` (`self_attn.q_proj`),
/// the weight `(out_features, in_features)`, and whether it has a bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerLinear {
    pub path: &'static str,
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
}

impl LayerLinear {
    /// The module's short name (`q_proj`): PEFT's target name.
    pub fn short(&self) -> &'static str {
        self.path.rsplit('.').next().unwrap_or(self.path)
    }
}

impl ModelConfig {
    /// `[train] router_aux_loss_coef`: the load-balancing loss at `coef` whatever
    /// `output_router_logits` says, as TRL 1.16's trainers add it (0: none). Refused on a model
    /// without experts, as TRL refuses it.
    pub fn set_router_aux_loss_coef(&mut self, coef: f64) -> Result<()> {
        let Some(moe) = self.moe.as_mut() else {
            return Err(ModelError::File {
                path: "[train] router_aux_loss_coef".into(),
                message: format!(
                    "is set, but {} has no experts (no load-balancing loss to weight); remove \
                     the key",
                    self.arch.hf_name
                ),
            });
        };
        moe.aux_coef = (coef != 0.0).then_some(coef);
        Ok(())
    }

    /// Whether decoder layer `l`'s MLP is a mixture of experts.
    pub fn is_sparse(&self, l: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| m.sparse_layers.get(l).copied().unwrap_or(false))
    }

    /// The linear modules of decoder layer `l`: [`Self::layer_linears`] without the dense MLP on
    /// a sparse layer (its experts are [`moe::MoeConfig::stacks`]).
    pub fn linears_of(&self, l: usize) -> Vec<LayerLinear> {
        let sparse = self.is_sparse(l);
        self.layer_linears()
            .into_iter()
            .filter(|m| !sparse || !m.path.starts_with("mlp."))
            .collect()
    }
}

/// Token ids of a key that holds one or a list (negative ones, `-1` in some configs, are
/// none). One past u32 saturates rather than wrapping onto a real token (2³² would be id 0):
/// no vocabulary reaches it, so a check against `vocab_size` refuses it.
fn ids(v: &Option<serde_json::Value>) -> Vec<u32> {
    let id = |x: &serde_json::Value| x.as_u64().map(|x| u32::try_from(x).unwrap_or(u32::MAX));
    match v {
        Some(serde_json::Value::Number(_)) => v.iter().filter_map(id).collect(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(id).collect(),
        _ => Vec::new(),
    }
}

/// Bounds of [`HfConfig::check_sizes`].
const MAX_LAYERS: usize = 4096;
const MAX_DIM: usize = 1 << 20;
const MAX_HEADS: usize = 1 << 14;
const MAX_VOCAB: usize = 1 << 24;

impl HfConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = rtune_fsio::read_string_bounded(path, rtune_fsio::FileKind::ModelConfig)
            .map_err(|e| ModelError::File {
                path: path.to_path_buf(),
                message: format!("cannot read: {e}"),
            })?;
        Self::parse(&text).map_err(|message| ModelError::File {
            path: path.to_path_buf(),
            message,
        })
    }

    /// config.json's text as an [`HfConfig`]. serde's type errors name no key (`invalid type:
    /// string "0.5", expected f64`): the key is found as the one whose value alone fails the
    /// same way, so a present key of the wrong type is an error naming it (issue 46).
    fn parse(text: &str) -> std::result::Result<Self, String> {
        // Straight from the text first: serde's own errors (a duplicate key) stay as they are.
        let first = match serde_json::from_str(text) {
            Ok(c) => return Ok(c),
            Err(e) => format!("not a model config: {e}"),
        };
        let Ok(serde_json::Value::Object(map)) = serde_json::from_str(text) else {
            return Err(first);
        };
        let e = match Self::deserialize(&serde_json::Value::Object(map.clone())) {
            Err(e) if !e.to_string().starts_with("missing field") => e.to_string(),
            // A missing key fails every one-key object the same way: only values are searched.
            _ => return Err(first),
        };
        let key = map.iter().find(|(k, x)| {
            let one =
                serde_json::Value::Object([((*k).clone(), (*x).clone())].into_iter().collect());
            Self::deserialize(&one).is_err_and(|alone| alone.to_string() == e)
        });
        Err(match key {
            Some((k, _)) => format!("not a model config: `{k}`: {e}"),
            None => first,
        })
    }

    /// The norm epsilon, which reaches a norm's denominator (issue 46: a negative one trained to
    /// NaN). The families' own values (Gemma's score scale and soft caps) are checked by their
    /// descriptors ([`crate::family`]); RoPE's bases and factors where they are read (`rope`).
    fn check_values(&self) -> std::result::Result<(), String> {
        let eps = self.rms_norm_eps;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(format!(
                "rms_norm_eps = {eps}: must be a number at or above 0 (a negative one makes the \
                 norm's square root NaN)"
            ));
        }
        Ok(())
    }

    /// Checks the architecture and every shape; `path` labels errors.
    /// Sizes that reach an allocator (a `Vec` per layer, tables of `vocab × hidden`) are checked
    /// before anything is allocated: a corrupt or hostile config.json (`num_hidden_layers:
    /// 1000000000`) is an error naming the key, not an abort (issue 35). The bounds are far above
    /// any released model (405B: 126 layers, hidden 16384; vocabularies up to ~260k).
    fn check_sizes(&self, head_dim: usize) -> std::result::Result<(), String> {
        let limits: [(&str, usize, usize); 6] = [
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("hidden_size", self.hidden_size, MAX_DIM),
            ("intermediate_size", self.intermediate_size, MAX_DIM),
            ("head_dim", head_dim, MAX_DIM),
            ("num_attention_heads", self.num_attention_heads, MAX_HEADS),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
        ];
        for (key, value, max) in limits {
            if value == 0 || value > max {
                return Err(format!(
                    "{key} = {value} is outside 1..={max}, beyond any model rtune can load; the \
                     config is corrupt or not this checkpoint's"
                ));
            }
        }
        Ok(())
    }

    /// The checked config: what every family reads alike here, then the family's own part
    /// ([`Family::map`], found by `architectures` in [`family::FAMILIES`]).
    pub fn into_config(self, path: &Path) -> Result<ModelConfig> {
        let bad = |message: String| ModelError::File {
            path: path.to_path_buf(),
            message,
        };
        let arch_name = self.architectures.first().cloned().unwrap_or_default();
        let Some(arch) = family::by_name(&arch_name) else {
            let got = if arch_name.is_empty() {
                format!(
                    "no `architectures` (model_type {:?})",
                    self.model_type.as_deref().unwrap_or("?")
                )
            } else {
                format!("architecture `{arch_name}`")
            };
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                what: got,
                supported: family::supported(),
            });
        };
        match arch.act {
            Act::GeGlu => {
                // transformers reads hidden_activation (hidden_act only in old Gemma 1 configs).
                let act = self
                    .hidden_activation
                    .as_deref()
                    .or(self.hidden_act.as_deref())
                    .unwrap_or("gelu_pytorch_tanh");
                if !matches!(act, "gelu_pytorch_tanh" | "gelu_tanh") {
                    return Err(bad(format!(
                        "hidden_activation `{act}`: only gelu_pytorch_tanh (GeGLU) is supported \
                         for {arch_name}"
                    )));
                }
            }
            Act::SwiGlu => {
                if let Some(act) = self.hidden_act.as_ref().filter(|a| *a != "silu") {
                    return Err(bad(format!(
                        "hidden_act `{act}`: only silu (SwiGLU) is supported"
                    )));
                }
            }
        }
        let dropouts = [
            ("resid_pdrop", self.resid_pdrop),
            ("embd_pdrop", self.embd_pdrop),
            ("attention_dropout", self.attention_dropout),
        ];
        if let Some((key, Some(p))) = dropouts.iter().find(|(_, p)| p.is_some_and(|p| p != 0.0)) {
            // transformers drops out there in training mode; rtune would train another model.
            return Err(bad(format!(
                "{key} = {p}: dropout inside the model is not supported (only the LoRA input's, \
                 [lora] dropout); set it to 0.0"
            )));
        }
        // gpt-oss's release: MXFP4 experts, dequantized at load where the family's experts
        // may be stored so (checked after the family's mapping below).
        let mxfp4 = self
            .quantization_config
            .as_ref()
            .and_then(|q| q.get("quant_method"))
            .and_then(|v| v.as_str())
            == Some("mxfp4");
        if let Some(q) = self.quantization_config.as_ref().filter(|_| !mxfp4) {
            // bitsandbytes 4-bit checkpoints load as stored; other schemes are not read.
            let method = q.get("quant_method").and_then(|v| v.as_str()).unwrap_or("");
            let four_bit = q.get("load_in_4bit").and_then(|v| v.as_bool()) == Some(true);
            if method != "bitsandbytes" || !four_bit {
                return Err(bad(format!(
                    "quantization_config {q}: only bitsandbytes 4-bit (load_in_4bit, nf4/fp4) \
                     checkpoints are supported"
                )));
            }
        }
        let heads = self.num_attention_heads;
        let kv = self.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
            return Err(bad(format!("num_attention_heads {heads} must be a positive multiple of num_key_value_heads {kv}")));
        }
        let head_dim = match self.head_dim.or(arch.default_head_dim) {
            Some(d) => d,
            None if self.hidden_size.is_multiple_of(heads) => self.hidden_size / heads,
            None => {
                return Err(bad(format!(
                    "hidden_size {} is not divisible by {heads} heads",
                    self.hidden_size
                )))
            }
        };
        if head_dim % 2 != 0 {
            return Err(bad(format!(
                "head_dim {head_dim} must be even for rotary embeddings"
            )));
        }
        self.check_sizes(head_dim).map_err(bad)?;
        self.check_values().map_err(bad)?;
        let rope = rope::rope(&self, &arch.rope, head_dim).map_err(bad)?;
        let layers = self.num_hidden_layers;
        // Llama's reading; the family's `map` changes what it has otherwise.
        let mut cfg = ModelConfig {
            arch,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim,
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            sliding_window: None,
            window_layers: vec![false; layers],
            bos_token_id: ids(&self.bos_token_id).first().copied(),
            eos_token_ids: ids(&self.eos_token_id),
            pad_token_id: ids(&self.pad_token_id).first().copied(),
            variant: Variant {
                sandwich_norms: arch.norms.post_attn.is_some(),
                local_rope: rope.local,
                rotary_dim: rope.rotary_dim,
                ..Variant::default()
            },
            moe: None,
        };
        (arch.map)(&self, &mut cfg).map_err(bad)?;
        if mxfp4 && !cfg.moe.as_ref().is_some_and(|m| m.mxfp4) {
            return Err(bad(format!(
                "quantization_config mxfp4: only GptOssForCausalLM's experts are read in MXFP4, \
                 not {}'s",
                arch.hf_name
            )));
        }
        if cfg.sliding_window == Some(0) {
            // A window of 0 masks every key, the diagonal too: the softmax of no scores is NaN.
            return Err(bad(
                "sliding_window = 0: a window of no positions masks every key; give the \
                 window's length, or null for none"
                    .into(),
            ));
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests;

/// The parts of `generation_config.json` rtune uses: the stop tokens.
#[derive(Debug, Clone, Default)]
pub struct GenerationConfig {
    pub eos_token_ids: Vec<u32>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; a missing file is an empty config, a malformed one an error.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        let text = match rtune_fsio::read_string_bounded(&path, rtune_fsio::FileKind::ModelConfig) {
            Ok(text) => text,
            Err(rtune_fsio::ReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self::default())
            }
            Err(e) => {
                return Err(ModelError::File {
                    path,
                    message: format!("cannot read: {e}"),
                })
            }
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::File {
            path: path.clone(),
            message: format!("not JSON: {e}"),
        })?;
        Ok(Self {
            eos_token_ids: ids(&v.get("eos_token_id").cloned()),
        })
    }
}

#[cfg(test)]
mod generation_tests {
    use super::*;

    #[test]
    fn generation_config_eos_list_and_missing_file() {
        let dir = std::env::temp_dir().join(format!("rtune-gencfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(GenerationConfig::load(&dir)
            .unwrap()
            .eos_token_ids
            .is_empty());
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"eos_token_id": [2, 7], "do_sample": false}"#,
        )
        .unwrap();
        assert_eq!(
            GenerationConfig::load(&dir).unwrap().eos_token_ids,
            vec![2, 7]
        );
        std::fs::write(dir.join("generation_config.json"), "{").unwrap();
        assert!(GenerationConfig::load(&dir)
            .unwrap_err()
            .to_string()
            .contains("generation_config.json"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
