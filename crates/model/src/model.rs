//! The whole causal LM: embeddings, decoder layers, final norm, lm_head; a forward for inference and
//! a forward + backward for training that computes gradients for the LoRA weights only (and for
//! the adapter's trainable token rows, `crate::tokens`).

use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

pub use rtune_quant::Quantize;

use rtune_lora::{Adapter, LoraSpec, ModuleShape};

use crate::config::{HfConfig, ModelConfig};
use crate::gathered::LayerRef;
use crate::kept::KeptInputs;
use crate::layer::{BatchCtx, Layer};
use crate::linear::{Frozen, Grads, Linear, LoraCtx};
use crate::shard::Gather;
use crate::weights::{TensorSource, Weights};
use crate::{ModelError, Result};
use rtune_ops::{self as ops, AttnShape};

pub(crate) mod decode;
mod head;

pub struct Model {
    pub cfg: ModelConfig,
    pub dtype: DType,
    pub device: Device,
    /// `(V, D)`
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// `(V, D)`; the embedding matrix itself when tied.
    lm_head: Tensor,
    /// The rotary frequencies (LongRoPE's two sets and attention factor).
    rope: crate::rope::Freqs,
    /// The sliding layers' own (Gemma 3's local RoPE base).
    local_rope: Option<crate::rope::Freqs>,
    /// With checkpointing on a GPU: each layer's kept input goes to host memory in the forward
    /// pass and comes back one layer ahead of the backward, on a side stream (`kept.rs`).
    pub offload_checkpoints: bool,
    /// bf16 autocast ([`Model::set_autocast`]): frozen weights bf16, activations f32, every
    /// product on bf16-rounded operands with f32 accumulation ([`rtune_backend::blas::autocast`]).
    pub autocast: bool,
    /// The side stream and pinned-buffer pool of checkpoint offload: created by the first
    /// offloading step and kept for the rest of the run (`offload.rs`).
    #[cfg(feature = "cuda")]
    offloader: std::sync::Mutex<Option<Arc<rtune_backend::offload::Offloader>>>,
    /// A sharded base (`crate::shard`): the transport and the embedding's and lm_head's shards;
    /// `embed` and `lm_head` are then empty and the layers' weights are shards.
    sharded: Option<crate::gathered::Sharded>,
    /// The last training pass's load-balancing loss (before `router_aux_loss_coef`), for the
    /// `aux_loss` metric; `None` without one.
    last_aux: std::sync::Mutex<Option<f64>>,
    /// The frozen bf16 weights registered for oneDNN's packed layout ([`Model::pack_frozen`]);
    /// their packed copies live as long as these handles.
    packed: Vec<rtune_backend::onednn::Packed>,
}

/// Token ids and positions of a right-padded batch, row-major `(B, T)`.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub b: usize,
    pub t: usize,
    /// Packed rows: the sample each position belongs to, `(B, T)`; attention never crosses
    /// samples (block-diagonal causal mask). `None`: one sample a row.
    pub segments: Option<Vec<u32>>,
    /// Each row's real tokens (`B` values), its padding after them; `None`: no padding. Only the
    /// load-balancing loss reads it (transformers' attention mask leaves padding out of it).
    pub lens: Option<Vec<usize>>,
}

impl Inputs {
    /// Positions 0..T for every row.
    pub fn new(ids: Vec<u32>, b: usize, t: usize) -> Self {
        let positions = (0..b).flat_map(|_| 0..t as u32).collect();
        Self {
            ids,
            positions,
            b,
            t,
            segments: None,
            lens: None,
        }
    }

    /// `(B·T)` 1 for a real token, 0 for padding; `None` when there is no padding.
    pub fn real_tokens(&self) -> Option<Vec<f32>> {
        self.leading(self.lens.as_deref()?)
    }

    /// `(B·T)` 1 on each row's first `lens[r]` tokens, else 0.
    fn leading(&self, lens: &[usize]) -> Option<Vec<f32>> {
        Some(
            lens.iter()
                .flat_map(|&n| (0..self.t).map(move |i| if i < n { 1.0 } else { 0.0 }))
                .collect(),
        )
    }
}

/// What a training pass's head computes from the final hidden states.
pub enum HeadLoss<'a> {
    /// Next-token cross-entropy summed over the targets, its gradient scaled by `grad_scale`
    /// (SFT: 1 / target tokens of the whole optimizer step).
    Tokens { grad_scale: f64 },
    /// A loss that is a function of each position's target NLL (preference objectives: sums of
    /// them per sequence): `weigh(nll)` gets every position's `−log p(target)` (0 where there is
    /// none) and returns the loss and `dloss/dnll` per position; `aux` weighs the
    /// load-balancing loss.
    PerToken {
        weigh: PerTokenLoss<'a>,
        aux: AuxShare,
    },
    /// [`HeadLoss::PerToken`] on the logits divided by `temperature` (GRPO: TRL divides the
    /// logits by the sampling temperature before its log-softmax): `weigh` gets every position's
    /// `−log softmax(z / T)[target]` and the entropy of `softmax(z / T)` there (TRL's `entropy`
    /// metric; both 0 where there is no target).
    Tempered {
        temperature: f64,
        weigh: TemperedLoss<'a>,
        aux: AuxShare,
    },
}

/// How a [`HeadLoss::PerToken`] or [`HeadLoss::Tempered`] pass weighs a mixture-of-experts
/// model's load-balancing loss (`coef · aux`, when the config adds it; `Model::aux_loss`):
/// TRL 1.16's trainers add `coef · aux` of the policy's forward to each micro-batch's loss, which
/// is already normalised over the step, so the pass adds `coef · aux · share` to the loss it
/// returns, its gradient scaled by `grad_scale`.
#[derive(Debug, Clone, PartialEq)]
pub struct AuxShare {
    /// This micro-batch's share of the step (TRL: `1 / gradient_accumulation_steps`; 1 for a
    /// step of one micro-batch).
    pub share: f64,
    /// `share` times the objective's loss scale (the factor its `dloss/dnll` carries too).
    pub grad_scale: f64,
    /// Per row (`B` values), how many of its leading tokens the aux covers where that is not
    /// every real token (TRL's attention mask over the forward whose aux it adds): KTO's KL rows
    /// none (TRL runs them in a separate forward, whose aux it drops), a GRPO completion masked
    /// as truncated its prompt only. `None`: every real token ([`Inputs::lens`]).
    pub tokens: Option<Vec<usize>>,
}

/// [`HeadLoss::PerToken`]'s function: every position's NLL → (loss, dloss/dnll per position).
pub type PerTokenLoss<'a> = &'a mut dyn FnMut(&[f32]) -> candle_core::Result<(f64, Vec<f32>)>;

/// [`HeadLoss::Tempered`]'s function: every position's (NLL, entropy) → (loss, dloss/dnll per
/// position); the entropy is read, not differentiated.
pub type TemperedLoss<'a> =
    &'a mut dyn FnMut(&[f32], &[f32]) -> candle_core::Result<(f64, Vec<f32>)>;

/// What [`Model::forward`] returns.
pub struct Forward {
    /// `(B, T, V)` f32
    pub logits: Tensor,
    /// transformers' `hidden_states`: `[0]` embeddings, `[i]` output of layer i, `[L]` final-norm
    /// output; each `(B, T, D)`. Empty unless asked for.
    pub hidden: Vec<Tensor>,
}

impl Model {
    /// Loads a Hugging Face model directory (config.json + safetensors) in `dtype`.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        Self::load_with(dir, dtype, device, Quantize::None)
    }

    /// [`Model::load`], quantizing the frozen linear layers as asked. A bnb-4bit checkpoint's
    /// weights are used as stored whatever `quantize` says.
    pub fn load_with(
        dir: &Path,
        dtype: DType,
        device: &Device,
        quantize: Quantize,
    ) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::File {
                path: dir.to_path_buf(),
                message: "model directory not found".into(),
            });
        }
        let cfg_path = dir.join("config.json");
        let cfg = HfConfig::from_file(&cfg_path)?.into_config(&cfg_path)?;
        let w = Weights::open(dir, dtype, device)?;
        Self::build_with(cfg, &w, dtype, device, quantize)
    }

    /// Builds the model from any tensor source, names as in a Hugging Face checkpoint.
    pub fn build(
        cfg: ModelConfig,
        w: &dyn TensorSource,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::build_with(cfg, w, dtype, device, Quantize::None)
    }

    /// [`Model::build`] with the frozen linear layers quantized as asked. Each weight is quantized
    /// as it is read, so the full-precision model never exists at once; as in bitsandbytes'
    /// default, every decoder linear layer is quantized and the embeddings, norms, biases and
    /// lm_head stay in the compute dtype.
    pub fn build_with(
        cfg: ModelConfig,
        w: &dyn TensorSource,
        dtype: DType,
        device: &Device,
        quantize: Quantize,
    ) -> Result<Self> {
        Self::build_inner(cfg, w, dtype, device, quantize, None)
    }

    /// [`Model::load_with`] as one rank of a sharded base (`crate::shard`): this rank reads and
    /// keeps only its shard of every frozen weight (quantized shard by shard), through `comm`.
    pub fn load_sharded(
        dir: &Path,
        dtype: DType,
        device: &Device,
        quantize: Quantize,
        comm: Rc<dyn Gather>,
    ) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let cfg = HfConfig::from_file(&cfg_path)?.into_config(&cfg_path)?;
        let w = Weights::open(dir, dtype, device)?;
        Self::build_inner(cfg, &w, dtype, device, quantize, Some(comm))
    }

    /// [`Model::build_with`] as one rank of a sharded base over `comm`.
    pub fn build_sharded(
        cfg: ModelConfig,
        w: &dyn TensorSource,
        dtype: DType,
        device: &Device,
        quantize: Quantize,
        comm: Rc<dyn Gather>,
    ) -> Result<Self> {
        Self::build_inner(cfg, w, dtype, device, quantize, Some(comm))
    }

    fn build_inner(
        cfg: ModelConfig,
        w: &dyn TensorSource,
        dtype: DType,
        device: &Device,
        quantize: Quantize,
        comm: Option<Rc<dyn Gather>>,
    ) -> Result<Self> {
        let (d, v, i) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (qd, kvd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        // Norms applied in f32 (Gemma, OLMo 2) take their weight in f32, formed once here (read
        // in the compute dtype first, as transformers computes `w.float()` on the loaded weight);
        // Gemma's `1 + w` too.
        let (f32_norms, plus_one) = (cfg.variant.f32_norms, cfg.variant.plus_one_norms);
        let norm_w = |name: &str, n: usize| -> Result<Tensor> {
            let t = w.tensor(name, &[n])?;
            if !f32_norms {
                return Ok(t);
            }
            let t = t.to_dtype(DType::F32);
            match plus_one {
                true => t.and_then(|t| t + 1.0),
                false => t,
            }
            .map_err(|e| ModelError::candle(format!("{name}: f32 weight (1 + w: {plus_one})"), e))
        };
        let norms = cfg.arch.norms;
        // A layer's norm `name` (under `p`) if the family has it.
        let layer_norm = |p: &str, name: Option<&str>| -> Result<Option<Tensor>> {
            name.map(|n| norm_w(&format!("{p}.{n}.weight"), d))
                .transpose()
        };
        let linear = |name: String, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let wname = format!("{name}.weight");
            let quant = |q: rtune_quant::Nf4Weight| -> Result<Frozen> {
                Frozen::quant(q, dtype, device)
                    .map_err(|e| ModelError::candle(format!("upload {wname}"), e))
            };
            let shape = [out, inp];
            let wt = match (comm.as_deref(), w.quantized(&wname, &shape)?, quantize) {
                (Some(c), q, _) => {
                    let s = crate::shard::load_shard(w, c, &wname, &shape, q, quantize)?;
                    crate::gathered::sharded(s, dtype)
                }
                (None, Some(q), _) => quant(q)?,
                (None, None, Quantize::None) => Frozen::Dense(w.tensor(&wname, &shape)?),
                (None, None, Quantize::Nf4 { double_quant, .. }) => {
                    let t = w.stored(&wname, &shape)?;
                    let q = rtune_quant::quantize::quantize_tensor(&t, double_quant).map_err(
                        |source| ModelError::Quant {
                            path: wname.clone().into(),
                            source,
                        },
                    )?;
                    quant(q)?
                }
            };
            let bias = if bias {
                Some(w.tensor(&format!("{name}.bias"), &[out])?)
            } else {
                None
            };
            Ok(Linear {
                name,
                w: wt,
                bias,
                lora: None,
                dora_norm: Default::default(),
            })
        };
        if quantize.experts() && cfg.moe.is_none() {
            return Err(ModelError::File {
                path: "[model] quantize_experts".into(),
                message: format!(
                    "is true, but {} has no experts (a mixture-of-experts model's stacks only); \
                     remove the key",
                    cfg.arch.hf_name
                ),
            });
        }
        // The checkpoint must hold the last layer config.json names before any per-layer memory is
        // taken (a config that claims more layers than the weights have is an error at once).
        if let Some(last) = cfg.num_layers.checked_sub(1) {
            let name = format!("model.layers.{last}.{}.weight", cfg.arch.norms.first());
            w.stored(&name, &[d]).map_err(|e| match e {
                ModelError::MissingTensor { path, .. } => ModelError::File {
                    path,
                    message: format!(
                        "checkpoint has no tensor `{name}`: config.json says num_hidden_layers = \
                         {}, more layers than the checkpoint holds",
                        cfg.num_layers
                    ),
                },
                other => other,
            })?;
        }
        let mut layers = Vec::with_capacity(cfg.num_layers.min(256));
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            // The layer's modules in model order: the attention's inputs (q, k, v or qkv), o, the
            // MLP's inputs (gate, up or gate_up), down.
            // A sparse layer has no dense MLP: its experts are loaded below.
            let moe = match &cfg.moe {
                Some(mc) if mc.sparse_layers[l] => {
                    let nf4 = quantize.nf4().filter(|_| quantize.experts());
                    Some(crate::moe::MoeMlp::load(
                        w,
                        &p,
                        mc,
                        d,
                        nf4,
                        comm.as_deref(),
                    )?)
                }
                _ => None,
            };
            let mut mods = cfg
                .linears_of(l)
                .iter()
                .map(|m| {
                    let name = format!("{p}.{}", m.path);
                    linear(name, m.out_features, m.in_features, m.bias)
                })
                .collect::<Result<Vec<_>>>()?;
            let n_attn = if cfg.variant.fused_proj { 1 } else { 3 };
            let down = match moe {
                Some(_) => None,
                None => Some(mods.pop().expect("down_proj")),
            };
            let mlp_in = mods.split_off(n_attn + 1);
            let o = mods.pop().expect("o_proj");
            layers.push(Layer {
                index: l,
                input_norm: layer_norm(&p, norms.pre_attn)?,
                post_norm: layer_norm(&p, norms.pre_mlp)?,
                attn_in: mods,
                o,
                mlp_in,
                down,
                moe,
                attn_widths: [qd, kvd, kvd],
                mlp_widths: [i, i],
                // Per head over `(Dh)`, or over the whole projection (`(H·Dh)`, `(Hkv·Dh)`).
                qk_norm: if cfg.variant.qk_norm {
                    let (qn, kn) = match cfg.variant.qk_norm_whole {
                        true => (qd, kvd),
                        false => (cfg.head_dim, cfg.head_dim),
                    };
                    Some((
                        norm_w(&format!("{p}.self_attn.q_norm.weight"), qn)?,
                        norm_w(&format!("{p}.self_attn.k_norm.weight"), kn)?,
                    ))
                } else {
                    None
                },
                norm_f32: f32_norms,
                sandwich: match (norms.post_attn, norms.post_mlp) {
                    (Some(a), Some(f)) => Some((
                        norm_w(&format!("{p}.{a}.weight"), d)?,
                        norm_w(&format!("{p}.{f}.weight"), d)?,
                    )),
                    _ => None,
                },
                geglu: cfg.variant.geglu,
                eps: cfg.rms_norm_eps,
                sliding: cfg.window_layers[l],
                sinks: match cfg.variant.attn_sinks {
                    true => Some(w.tensor(&format!("{p}.self_attn.sinks"), &[cfg.num_heads])?),
                    false => None,
                },
                qkv: None,
                gate_up: None,
            });
            layers
                .last_mut()
                .expect("pushed")
                .fuse()
                .map_err(|e| ModelError::candle(format!("{p}: fusing q/k/v and gate/up"), e))?;
        }
        let norm = norm_w("model.norm.weight", d)?;
        let (embed_name, head_name) = ("model.embed_tokens.weight", "lm_head.weight");
        let (embed, lm_head, sharded) = match comm {
            Some(comm) => {
                let c = &*comm;
                let shard =
                    |name| crate::shard::load_shard(w, c, name, &[v, d], None, Quantize::None);
                let embed = shard(embed_name)?;
                let lm_head = match cfg.tie_word_embeddings {
                    true => None,
                    false => Some(shard(head_name)?),
                };
                // The tensors themselves are empty: every use gathers the shards.
                let empty = Tensor::zeros((0, d), dtype, device)
                    .map_err(|e| ModelError::candle("empty embedding", e))?;
                let sharded = crate::gathered::Sharded {
                    background: None,
                    device: None,
                    launch_ahead: false,
                    comm,
                    embed: Arc::new(embed),
                    lm_head: lm_head.map(Arc::new),
                    keep: 0,
                };
                (empty.clone(), empty, Some(sharded))
            }
            None => {
                let embed = w.tensor(embed_name, &[v, d])?;
                let lm_head = if cfg.tie_word_embeddings {
                    embed.clone()
                } else {
                    w.tensor(head_name, &[v, d])?
                };
                // On a GPU an untied embedding table is only ever gathered from: it stays in host
                // memory (Llama 3 8B: 1.05 GB of device memory saved) and each batch's rows are
                // copied over.
                let embed = if !device.is_cpu() && !cfg.tie_word_embeddings {
                    embed
                        .to_device(&Device::Cpu)
                        .map_err(|e| ModelError::candle("embedding table to host", e))?
                } else {
                    embed
                };
                (embed, lm_head, None)
            }
        };
        let rope = crate::rope::freqs(&cfg);
        let local_rope = crate::rope::local_freqs(&cfg);
        let mut model = Self {
            cfg,
            dtype,
            device: device.clone(),
            embed,
            layers,
            norm,
            lm_head,
            rope,
            local_rope,
            offload_checkpoints: false,
            autocast: false,
            #[cfg(feature = "cuda")]
            offloader: Default::default(),
            sharded,
            last_aux: Default::default(),
            packed: Vec::new(),
        };
        model.pack_frozen();
        Ok(model)
    }

    /// Registers every weight a frozen product reads as its right operand — the fused q/k/v and
    /// gate/up blocks (or the members' own weights where there is no block), o_proj, down_proj
    /// and the lm_head — for oneDNN's packed layout (`rtune_backend::onednn::pack`: bf16 on the
    /// CPU with oneDNN in use; nothing otherwise). Each is reordered once, on its first product in
    /// each orientation (forward `x·Wᵀ`, backward `dy·W`). Replaces the previous registrations
    /// (their copies are freed), so it is called again when the weights change.
    fn pack_frozen(&mut self) {
        self.packed.clear();
        let mut ws: Vec<&Tensor> = Vec::new();
        for layer in &self.layers {
            for (block, members) in [
                (&layer.qkv, &layer.attn_in),
                (&layer.gate_up, &layer.mlp_in),
            ] {
                match block {
                    Some(b) => ws.push(b),
                    None => ws.extend(members.iter().filter_map(|m| match &m.w {
                        Frozen::Dense(t) => Some(t),
                        _ => None,
                    })),
                }
            }
            for lin in std::iter::once(&layer.o).chain(&layer.down) {
                if let Frozen::Dense(t) = &lin.w {
                    ws.push(t);
                }
            }
        }
        if self.sharded.is_none() {
            ws.push(&self.lm_head);
        }
        self.packed = ws
            .into_iter()
            .filter_map(rtune_backend::onednn::pack)
            .collect();
    }

    /// Switches an f32 model to bf16 autocast (`[model] dtype = "bf16-autocast"`, PEFT under
    /// `torch.autocast('cpu', dtype=torch.bfloat16)`): the frozen linear weights (re-fused into
    /// their q/k/v and gate/up blocks) and the lm_head are rounded to bf16 once, here; the
    /// embedding table, norms, biases and everything computed stay f32, and every forward and
    /// backward runs its products in autocast ([`rtune_backend::blas::autocast`]). A tied lm_head becomes
    /// a bf16 copy of the f32 embedding table. NF4 layers dequantize into bf16.
    pub fn set_autocast(&mut self) -> Result<()> {
        if self.dtype != DType::F32 {
            return Err(ModelError::candle(
                "set_autocast",
                candle_core::Error::Msg(format!(
                    "bf16 autocast needs an f32 model, this one is {:?}",
                    self.dtype
                )),
            ));
        }
        let bf16 = |what: &str, t: &Tensor| {
            t.to_dtype(DType::BF16)
                .map_err(|e| ModelError::candle(format!("{what} to bf16"), e))
        };
        for layer in &mut self.layers {
            // The blocks are rebuilt from the members' rounded weights (the f32 block is freed
            // once its row views are replaced).
            layer.qkv = None;
            layer.gate_up = None;
            for lin in layer.linears_mut() {
                match &mut lin.w {
                    Frozen::Dense(t) => *t = bf16(&lin.name, t)?,
                    Frozen::Quant { dtype, .. } => *dtype = DType::BF16,
                    Frozen::Sharded { shard, dtype } => {
                        *shard =
                            Arc::new(shard.to_dtype(DType::BF16).map_err(|e| {
                                ModelError::candle(format!("{} to bf16", lin.name), e)
                            })?);
                        *dtype = DType::BF16;
                    }
                }
            }
            // A sparse layer's router and experts stay f32: the router's GEMM rounds its
            // operands per product (`MoeMlp::logits_dtype`), and the experts compute in f32, as
            // transformers' `grouped_mm` experts do under torch's autocast.
            let index = layer.index;
            layer.fuse().map_err(|e| {
                ModelError::candle(format!("layer {index}: fusing q/k/v and gate/up"), e)
            })?;
        }
        match &mut self.sharded {
            // A tied lm_head's bf16 copy is a shard of its own beside the f32 embedding's.
            Some(s) => {
                let head = s.lm_head.as_ref().unwrap_or(&s.embed);
                let head = head
                    .to_dtype(DType::BF16)
                    .map_err(|e| ModelError::candle("lm_head to bf16", e))?;
                s.lm_head = Some(Arc::new(head));
            }
            None => self.lm_head = bf16("lm_head", &self.lm_head)?,
        }
        self.autocast = true;
        self.pack_frozen();
        Ok(())
    }

    /// Checks `[lora] targets` against this model's modules: a named module it does not have
    /// (`q_proj` on Phi-3) is an error naming the ones it has.
    pub fn check_targets(
        &self,
        spec: &LoraSpec,
    ) -> std::result::Result<(), Box<rtune_lora::LoraError>> {
        let arch = self.cfg.arch;
        if let Some(p) = spec.target_parameters.first() {
            if self.cfg.moe.is_none() {
                return Err(Box::new(rtune_lora::LoraError::File {
                    path: "[lora] target_parameters".into(),
                    message: format!(
                        "names `{p}`, but {} has no experts (a mixture-of-experts model's \
                         stacks only); remove the key",
                        arch.hf_name
                    ),
                }));
            }
        }
        spec.check_for(arch.hf_name, arch.linear_modules)
            .map_err(Box::new)
    }

    /// The modules a LoRA spec targets, in model order (layer 0's q, k, v, o, gate, up, down or
    /// its expert stacks (`target_parameters`), ...).
    pub fn lora_modules(&self, spec: &LoraSpec) -> Vec<ModuleShape> {
        let mut out = Vec::new();
        for layer in &self.layers {
            for lin in layer.linears() {
                let short = lin.name.rsplit('.').next().unwrap_or_default();
                if spec.targets_module(short) {
                    out.push(ModuleShape {
                        name: lin.name.clone(),
                        in_features: lin.in_features(),
                        out_features: lin.out_features(),
                        experts: 1,
                    });
                }
            }
            let experts = crate::moe::expert_modules(&self.cfg, layer.index, spec);
            out.extend(experts.into_iter().map(|(m, _)| m));
        }
        out
    }

    /// DoRA: sets each attached pair's magnitude to PEFT's init, the row norms `‖W + s·B·A‖`
    /// (an NF4 `W` dequantized first, one layer at a time). Call after [`Model::attach`].
    pub fn init_dora(&self, adapter: &mut Adapter) -> Result<()> {
        let s = adapter.spec.scaling();
        let mut feed = self.feed(0..self.layers.len(), Vec::new());
        let gathered = |e| ModelError::candle("DoRA magnitudes: a layer's weights", e);
        while let Some((_, layer)) = feed.next().map_err(gathered)? {
            for lin in layer.linears() {
                let Some(i) = lin.lora else { continue };
                let p = &mut adapter.pairs[i];
                let m = lin
                    .w
                    .dense()
                    .and_then(|w| crate::dora::weight_norm(&w, &p.a, &p.b, s))
                    .map_err(|e| {
                        ModelError::candle(format!("DoRA magnitude of {}", lin.name), e)
                    })?;
                p.m = Some(m);
            }
        }
        Ok(())
    }

    /// Routes each targeted linear layer to its pair in `adapter` (by name).
    pub fn attach(&mut self, adapter: &Adapter) {
        for layer in &mut self.layers {
            for lin in layer.linears_mut() {
                lin.lora = adapter.index_of(&lin.name);
            }
            let experts = crate::moe::expert_modules(&self.cfg, layer.index, &adapter.spec);
            if let Some(moe) = &mut layer.moe {
                (moe.lora_gate_up, moe.lora_down) = (None, None);
                for (m, stack) in experts {
                    let slot = adapter.index_of(&m.name);
                    match stack {
                        0 => moe.lora_gate_up = slot,
                        _ => moe.lora_down = slot,
                    }
                }
            }
        }
    }

    /// The attention's shape for `b` rows of `t` tokens: the family's score scale and soft cap.
    pub(crate) fn attn_shape(&self, b: usize, t: usize) -> AttnShape {
        let c = &self.cfg;
        let mut s = AttnShape::new(b, t, c.num_heads, c.num_kv_heads, c.head_dim);
        if let Some(scale) = c.variant.attn_scale {
            s.scale = scale;
        }
        s.softcap = c.variant.attn_softcap;
        s
    }

    fn batch_ctx(&self, inp: &Inputs) -> candle_core::Result<BatchCtx> {
        let mask_of = |window| {
            ops::AttnMask::new(inp.segments.as_deref(), inp.b, inp.t, window, &self.device)
        };
        self.ctx_with(inp.b, inp.t, &inp.positions, inp.t, mask_of)
    }

    /// The context of `b` rows of `t` tokens at `positions` (`(b, t)`) seeing `keys` keys a row
    /// (`t`, or more when decoding after cached tokens): RoPE tables, `mask_of(window)`'s masks
    /// (the sliding one when the window is shorter than `keys`), the attention path.
    pub(crate) fn ctx_with(
        &self,
        b: usize,
        t: usize,
        positions: &[u32],
        keys: usize,
        mask_of: impl Fn(Option<usize>) -> candle_core::Result<ops::AttnMask>,
    ) -> candle_core::Result<BatchCtx> {
        let shape = self.attn_shape(b, t);
        // f32 tables rotate a bf16 model's q/k in f32 (`rtune_ops::rope::apply`): OLMo 2.
        let rope_dtype = match self.cfg.variant.f32_rope {
            true => candle_core::DType::F32,
            false => self.dtype,
        };
        let tables = |f: &crate::rope::Freqs| f.tables(positions, b, t, rope_dtype, &self.device);
        let (cos, sin) = tables(&self.rope)?;
        let local_rope = self.local_rope.as_ref().map(tables).transpose()?;
        let mask = mask_of(None)?;
        let sliding = match self.cfg.sliding_window {
            Some(w) if w < keys => Some(mask_of(Some(w))?),
            _ => None,
        };
        Ok(BatchCtx {
            cos,
            sin,
            mask,
            sliding,
            // Soft-capped scores: the CPU's tiled kernels cap them, the CUDA flash kernel does not
            // (the plain path there).
            path: match shape.softcap {
                Some(_) if !self.device.is_cpu() => ops::AttnPath::Plain,
                _ => ops::AttnPath::for_shape(&self.device, t, Some(self.cfg.head_dim))?,
            },
            shape,
            local_rope,
        })
    }

    /// The final norm of `x: (N, D)` (Gemma's `1 + w` form for its families).
    fn final_norm(&self, x: &Tensor) -> candle_core::Result<(Tensor, ops::NormCache)> {
        let f32_norms = self.cfg.variant.f32_norms;
        crate::layer::norm(f32_norms, x, &self.norm, self.cfg.rms_norm_eps)
    }

    fn final_norm_backward(&self, dy: &Tensor, c: &ops::NormCache) -> candle_core::Result<Tensor> {
        crate::layer::norm_backward(self.cfg.variant.f32_norms, dy, &self.norm, c)
    }

    /// Gemma's embedding scale (√hidden, rounded to the activations' dtype by the product) of
    /// `x: (N, D)`; `x` as given for the other families.
    fn scale_embeddings(&self, x: Tensor) -> candle_core::Result<Tensor> {
        match self.cfg.variant.embed_scale {
            Some(s) => x.affine(s, 0.0),
            None => Ok(x),
        }
    }

    /// `(N, D)`: the embedding rows of `ids`, on the compute device.
    fn embed_ids(&self, ids: &[u32]) -> candle_core::Result<Tensor> {
        let table = match &self.sharded {
            Some(s) => std::borrow::Cow::Owned(s.embed(&self.device)?),
            None => std::borrow::Cow::Borrowed(&self.embed),
        };
        let ids = Tensor::new(ids, table.device())?;
        table.index_select(&ids, 0)?.to_device(&self.device)
    }

    /// The lm_head `(V, D)`: the model's own, or gathered in a sharded base.
    pub(crate) fn lm_head(&self) -> candle_core::Result<std::borrow::Cow<'_, Tensor>> {
        match &self.sharded {
            Some(s) => Ok(std::borrow::Cow::Owned(s.lm_head(&self.device)?)),
            None => Ok(std::borrow::Cow::Borrowed(&self.lm_head)),
        }
    }

    /// A sharded base: the last `layers` layers a training pass's forward gathers stay gathered
    /// for its backward (which needs them first) instead of being gathered again; each costs one
    /// layer's frozen weights at full size until its backward is done. Every rank must keep the
    /// same number (the gathers must pair up). No effect on a whole base.
    pub fn set_keep_gathered(&mut self, layers: usize) {
        if let Some(s) = &mut self.sharded {
            s.keep = layers;
        }
    }

    /// A sharded base: whether a pass gathers the next layer on another thread while it computes
    /// this one, where the transport can ([`Gather::background`]); one more gathered layer is
    /// then alive. Off by default: every gather runs in turn on the pass's thread. Ranks may
    /// choose differently (the gathers and their order are the same). No effect on a whole base.
    /// Returns whether the next layer is now prefetched.
    pub fn set_prefetch(&mut self, on: bool) -> bool {
        let Some(s) = &mut self.sharded else {
            return false;
        };
        if s.device.is_some() {
            s.launch_ahead = on;
            return on;
        }
        s.background = if on { s.comm.background() } else { None };
        s.background.is_some()
    }

    /// A sharded base on a CUDA rank: every shard moves to the model's device (its host copy
    /// emptied) and every gather goes through `transport` from then on, between device buffers
    /// (`crate::device_gather`); `prefetch` then launches the next layer's gathers ahead on the
    /// pass's thread. Collective in effect: every rank must make the same choice (the gathers
    /// pair up). Returns whether the base is sharded (a whole base: nothing to do).
    pub fn set_device_gather(
        &mut self,
        transport: std::rc::Rc<dyn crate::device_gather::DeviceGather>,
    ) -> candle_core::Result<bool> {
        let Some(s) = &mut self.sharded else {
            return Ok(false);
        };
        s.use_device(&mut self.layers, transport, &self.device)?;
        Ok(true)
    }

    /// A sharded base's layer `i` gathered as a pass gathers it (`None`: a whole base, or no
    /// such layer): for checks of the gather itself (`rtune selftest`).
    pub fn gathered_layer(&self, i: usize) -> candle_core::Result<Option<Layer>> {
        match (&self.sharded, self.layers.get(i)) {
            (Some(s), Some(l)) => s.gather_layer(l, &self.device).map(Some),
            _ => Ok(None),
        }
    }

    /// Layer `i` as the model holds it (a sharded base's: its shards).
    pub fn layer(&self, i: usize) -> Option<&Layer> {
        self.layers.get(i)
    }

    /// The layers `order` (and `ready`, kept from an earlier pass, as they are) in that order:
    /// see [`Feed`](crate::feed::Feed).
    pub(crate) fn feed<'m>(
        &'m self,
        order: impl IntoIterator<Item = usize>,
        ready: Vec<(usize, LayerRef<'m>)>,
    ) -> crate::feed::Feed<'m> {
        let order = order.into_iter().collect();
        crate::feed::Feed::new(
            &self.layers,
            self.sharded.as_ref(),
            &self.device,
            order,
            ready,
        )
    }

    /// LongRoPE: the batch length past which the global layers take their long factors (one
    /// choice for a whole batch: `rope::Freqs::for_positions`); `None` without LongRoPE.
    pub fn long_rope_past(&self) -> Option<usize> {
        self.rope.long.as_ref().map(|(_, past)| *past)
    }

    /// Whether the frozen base is sharded across ranks, and over how many.
    pub fn shard_world(&self) -> Option<usize> {
        self.sharded.as_ref().map(|s| s.comm.size())
    }

    /// The embedding of `ids` with the adapter's trainable token rows in place (`crate::tokens`),
    /// and where they were used (for their backward).
    fn embed_tokens(
        &self,
        ids: &[u32],
        lora: Option<&LoraCtx>,
    ) -> candle_core::Result<(Tensor, Option<crate::tokens::TokenHits>)> {
        let x = self.embed_ids(ids)?;
        let Some(t) = lora.and_then(|l| l.adapter.tokens.as_ref()) else {
            return Ok((self.scale_embeddings(x)?, None));
        };
        match crate::tokens::hits(ids, &t.ids, &self.device)? {
            Some(h) => Ok((
                self.scale_embeddings(crate::tokens::embed(&x, &h, &t.rows)?)?,
                Some(h),
            )),
            None => Ok((self.scale_embeddings(x)?, None)),
        }
    }

    /// The trainable token rows as the lm_head sees them: only a tied lm_head is adapted (PEFT
    /// wraps the modules tied to the embedding; an untied lm_head stays as stored).
    fn head_rows(&self, lora: Option<&LoraCtx>) -> candle_core::Result<Option<ops::HeadRows>> {
        match lora.and_then(|l| l.adapter.tokens.as_ref()) {
            Some(t) if self.cfg.tie_word_embeddings => {
                Ok(Some(ops::HeadRows::new(&t.ids, &t.rows, self.dtype)?))
            }
            _ => Ok(None),
        }
    }

    /// `h: (n, D)` → logits `(n, V)` in the compute dtype, through the (token-adapted) lm_head.
    pub(crate) fn lm_logits(
        &self,
        h: &Tensor,
        head: Option<&ops::HeadRows>,
    ) -> candle_core::Result<Tensor> {
        let logits = self.head(h)?;
        let logits = match head {
            Some(hr) => hr.fix_logits(logits, h)?,
            None => logits,
        };
        match self.cfg.variant.final_softcap {
            Some(cap) => ops::softcap_logits(&logits, cap),
            None => Ok(logits),
        }
    }

    /// The trainable token rows' starting values, PEFT's `init_weights=True`: a copy of the
    /// embedding's rows `ids`, f32 `(n, D)` on the compute device. An id outside the vocabulary
    /// is an error naming it.
    pub fn token_rows(&self, ids: &[u32]) -> Result<Tensor> {
        let v = self.cfg.vocab_size;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= v) {
            return Err(ModelError::candle(
                "trainable tokens",
                candle_core::Error::Msg(format!(
                    "token id {bad} is outside the embedding's {v} rows (ids 0..{v})"
                )),
            ));
        }
        self.embed_ids(ids)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(|e| ModelError::candle("trainable token rows", e))
    }

    /// Inference forward: logits for every position (and the hidden states if `keep_hidden`).
    pub fn forward(
        &self,
        inp: &Inputs,
        lora: Option<&LoraCtx>,
        keep_hidden: bool,
    ) -> Result<Forward> {
        let _autocast = rtune_backend::blas::autocast::scope(self.autocast);
        let run = || -> candle_core::Result<Forward> {
            let (b, t, d) = (inp.b, inp.t, self.cfg.hidden_size);
            let ctx = self.batch_ctx(inp)?;
            let mut x = self.embed_tokens(&inp.ids, lora)?.0;
            let mut hidden = Vec::new();
            let mut feed = self.feed(0..self.layers.len(), Vec::new());
            while let Some((_, layer)) = feed.next()? {
                if keep_hidden {
                    hidden.push(x.reshape((b, t, d))?.to_dtype(DType::F32)?);
                }
                x = layer.forward(&x, &ctx, lora)?.0;
            }
            let (h, _) = self.final_norm(&x)?;
            if keep_hidden {
                hidden.push(h.reshape((b, t, d))?.to_dtype(DType::F32)?);
            }
            let head = self.head_rows(lora)?;
            let logits = self
                .lm_logits(&h, head.as_ref())?
                .to_dtype(DType::F32)?
                .reshape((b, t, self.cfg.vocab_size))?;
            Ok(Forward { logits, hidden })
        };
        run().map_err(|e| ModelError::candle("forward", e))
    }

    /// The run's checkpoint offloader (CUDA): made on first use, then the same side stream and
    /// pinned-buffer pool for every later micro-batch.
    #[cfg(feature = "cuda")]
    fn offloader(&self) -> candle_core::Result<Arc<rtune_backend::offload::Offloader>> {
        let mut slot = self.offloader.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = &*slot {
            return Ok(o.clone());
        }
        let o = Arc::new(rtune_backend::offload::Offloader::new(&self.device)?);
        *slot = Some(o.clone());
        Ok(o)
    }

    /// What checkpoint offload's pinned-buffer pool has done so far (`None`: nothing offloaded).
    #[cfg(feature = "cuda")]
    pub fn offload_pool_stats(&self) -> Option<rtune_backend::host_pool::PoolStats> {
        let slot = self.offloader.lock().unwrap_or_else(|e| e.into_inner());
        slot.as_ref().map(|o| o.pool_stats())
    }

    /// One micro-batch of training: forward, chunked cross-entropy against `targets` (the next-token
    /// id per position, already shifted; `None` = no loss), backward into `grads` scaled by
    /// `grad_scale` (1 / target tokens of the whole optimizer step). Returns the summed loss.
    ///
    /// With `checkpoint`, only each layer's input (and on the tiled attention path its attention's
    /// output and log-sum-exp) is kept during the forward pass; each layer is recomputed from it
    /// just before its backward ([`crate::layer::Layer::recompute`]: no attention, no down
    /// projection), so one layer's activations are alive at a time.
    pub fn forward_backward(
        &self,
        inp: &Inputs,
        targets: &[Option<u32>],
        lora: &LoraCtx,
        grad_scale: f64,
        checkpoint: bool,
        grads: &mut Grads,
    ) -> Result<f64> {
        let mut none = |_: usize, _: &Grads| Ok(());
        self.forward_backward_layers(inp, targets, lora, grad_scale, checkpoint, grads, &mut none)
    }

    /// [`forward_backward`](Self::forward_backward), calling `after_layer(i, grads)` as soon as
    /// layer i's backward has added its LoRA gradients (layers in reverse order; a layer whose
    /// backward ends the pass early is not reported, see [`layer_slots`](Self::layer_slots)).
    /// Data parallelism launches layer i's gradient all-reduce there, on another stream, while
    /// the backward of layer i − 1 runs.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_layers(
        &self,
        inp: &Inputs,
        targets: &[Option<u32>],
        lora: &LoraCtx,
        grad_scale: f64,
        checkpoint: bool,
        grads: &mut Grads,
        after_layer: &mut dyn FnMut(usize, &Grads) -> candle_core::Result<()>,
    ) -> Result<f64> {
        let head = HeadLoss::Tokens { grad_scale };
        self.train_pass(inp, targets, lora, head, checkpoint, grads, after_layer)
    }

    /// One micro-batch of training under any [`HeadLoss`]: the forward, the head's loss and its
    /// gradient, the backward into `grads` (calling `after_layer` as
    /// [`forward_backward_layers`](Self::forward_backward_layers) does). Returns the loss.
    #[allow(clippy::too_many_arguments)]
    pub fn train_pass(
        &self,
        inp: &Inputs,
        targets: &[Option<u32>],
        lora: &LoraCtx,
        mut objective: HeadLoss,
        checkpoint: bool,
        grads: &mut Grads,
        after_layer: &mut dyn FnMut(usize, &Grads) -> candle_core::Result<()>,
    ) -> Result<f64> {
        let _autocast = rtune_backend::blas::autocast::scope(self.autocast);
        let mut run = || -> candle_core::Result<f64> {
            let ctx = self.batch_ctx(inp)?;
            let mut caches = Vec::with_capacity(self.layers.len());
            let (mut x, hits) = self.embed_tokens(&inp.ids, Some(lora))?;
            let mut inputs = KeptInputs::new(self.layers.len());
            // With checkpointing each layer also keeps its tiled attention's output and
            // log-sum-exp (one more (N, H·Dh) tensor and a (B, T, H) one), so the recompute
            // skips the attention (O(T²) compute); not when the inputs go to host memory, whose
            // point is the least device memory.
            let offload = checkpoint && self.offload_checkpoints && self.device.is_cuda();
            #[cfg(feature = "cuda")]
            if offload {
                inputs.offload_to(self.offloader()?);
            }
            let keep_attention = !offload;
            let mut kept_attn = Vec::with_capacity(self.layers.len());
            let last = self.layers.len().saturating_sub(1);
            // A sharded base's last `keep` gathered layers, kept for the backward (a whole
            // base's layers are borrowed: keeping them costs nothing).
            let keep = self.sharded.as_ref().map_or(self.layers.len(), |s| s.keep);
            let keep_from = self.layers.len().saturating_sub(keep);
            let mut kept_layers = Vec::with_capacity(self.layers.len() - keep_from);
            // Each sparse layer's router logits (`T × E` f32), for the load-balancing loss.
            let mut router_logits: Vec<Vec<f32>> = Vec::new();
            let mut logits_dtype = DType::F32;
            let mut feed = self.feed(0..self.layers.len(), Vec::new());
            while let Some((i, layer)) = feed.next()? {
                let (out, mut cache) = layer.forward(&x, &ctx, Some(lora))?;
                if let Some(m) = cache.moe_mut() {
                    router_logits.push(std::mem::take(&mut m.logits));
                    logits_dtype = m.logits_dtype;
                }
                if i >= keep_from {
                    kept_layers.push((i, layer));
                }
                // A layer keeps either its activations or (checkpointing) only its input. The last
                // layer's activations are the first the backward needs: they are kept rather than
                // recomputed at once (L−1 recomputes).
                if !checkpoint || i == last {
                    caches.push(cache);
                } else {
                    kept_attn.push(cache.kept_attention().filter(|_| keep_attention));
                    inputs.push(x)?;
                }
                x = out;
            }
            let (h, norm_cache) = self.final_norm(&x)?;
            drop(x);
            // The load-balancing loss's share of the step. SFT: the head's loss is a sum over the
            // target tokens (the trainer divides by the step's), so the term is weighed by this
            // micro-batch's target tokens; the others: see `AuxShare`.
            let aux = match &objective {
                HeadLoss::Tokens { grad_scale } => {
                    let n_targets = targets.iter().filter(|t| t.is_some()).count() as f64;
                    AuxShare {
                        share: n_targets,
                        grad_scale: grad_scale * n_targets,
                        tokens: None,
                    }
                }
                HeadLoss::PerToken { aux, .. } | HeadLoss::Tempered { aux, .. } => aux.clone(),
            };
            let (mut loss, dh) = self.head_loss(&h, targets, lora, &mut objective, grads)?;
            let real = match &aux.tokens {
                Some(lens) if lens.len() == inp.b => inp.leading(lens),
                Some(lens) => candle_core::bail!(
                    "the load-balancing loss's token counts: {} rows for a batch of {}",
                    lens.len(),
                    inp.b
                ),
                None => inp.real_tokens(),
            };
            let mut aux_grads = match self.aux_loss(
                &router_logits,
                logits_dtype,
                real.as_deref(),
                aux.grad_scale,
                aux.share,
            ) {
                Some((aux, term, g)) => {
                    *self.last_aux.lock().unwrap_or_else(|e| e.into_inner()) = Some(aux);
                    loss += term;
                    g
                }
                None => Vec::new(),
            };
            drop(h);
            let mut dx = self.final_norm_backward(&dh, &norm_cache)?;
            // Each layer kept from the forward, or gathered once for the recompute and the
            // backward.
            let mut feed = self.feed((0..self.layers.len()).rev(), kept_layers);
            while let Some((i, layer)) = feed.next()? {
                let mut cache = match caches.pop() {
                    Some(c) => c,
                    None => {
                        let kept = kept_attn.pop().flatten();
                        layer.recompute(&inputs.pop()?, &ctx, Some(lora), kept)?
                    }
                };
                if let Some(m) = cache.moe_mut() {
                    // The sparse layers' aux gradients were made in forward order.
                    if let Some(g) = aux_grads.pop() {
                        m.set_aux_grad(g);
                    }
                }
                // Layer 0's input gradient is needed only for trainable token rows.
                let need_dx = i > 0 || hits.is_some();
                let d = layer.backward(&dx, &cache, &ctx, Some(lora), grads, need_dx)?;
                after_layer(i, grads)?;
                match d {
                    Some(d) => dx = d,
                    None => break,
                }
            }
            if let (Some(hits), Some(t)) = (&hits, lora.adapter.tokens.as_ref()) {
                // Through Gemma's embedding scale (the rows were scaled after the lookup).
                let dx = self.scale_embeddings(dx)?;
                let g = crate::tokens::embed_backward(&dx, hits, t.ids.len())?;
                Grads::add(&mut grads.tokens, g)?;
            }
            Ok(loss)
        };
        run().map_err(|e| ModelError::candle("forward_backward", e))
    }

    /// transformers' load-balancing loss over the sparse layers' router logits (`T × E` each,
    /// forward order, computed in `dtype`), when the config adds it (`output_router_logits`): the
    /// loss before its coefficient, its term `coef · aux · share` in [`Model::train_pass`]'s
    /// loss, and each layer's gradient of `coef · aux · weight` (rounded to `dtype` as torch's,
    /// [`rtune_experts::route::aux_loss`]). `weight` is this micro-batch's share of the
    /// step times the objective's gradient scale (SFT: its target tokens times `grad_scale`; 1
    /// for a step of one micro-batch, where the trainer's `loss = CE + coef · aux` is
    /// transformers'). `real` (`T` values, 1 = a real token; see [`Inputs::real_tokens`])
    /// leaves padding out, as transformers' attention mask does.
    pub(super) fn aux_loss(
        &self,
        logits: &[Vec<f32>],
        dtype: DType,
        real: Option<&[f32]>,
        weight: f64,
        share: f64,
    ) -> Option<(f64, f64, Vec<Vec<f32>>)> {
        let moe = self.cfg.moe.as_ref()?;
        let coef = moe.aux_coef?;
        if logits.is_empty() {
            return None;
        }
        let layers: Vec<&[f32]> = logits.iter().map(Vec::as_slice).collect();
        let scale = (coef * weight) as f32;
        let (aux, grads) =
            rtune_experts::route::aux_loss(&layers, moe.experts, moe.top_k, real, scale, dtype);
        Some((aux as f64, coef * aux as f64 * share, grads))
    }

    /// The last training pass's load-balancing loss (before its coefficient), if the model adds
    /// one.
    pub fn last_aux_loss(&self) -> Option<f64> {
        *self.last_aux.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many decoder layers the model has.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The adapter slots (indices of `Grads::a`, `b`, `m`) of layer `i`'s LoRA modules.
    pub fn layer_slots(&self, i: usize) -> Vec<usize> {
        self.layers
            .get(i)
            .map(|l| {
                let mut slots: Vec<usize> = l.linears().iter().filter_map(|lin| lin.lora).collect();
                if let Some(m) = &l.moe {
                    slots.extend(m.lora_gate_up.into_iter().chain(m.lora_down));
                }
                slots
            })
            .unwrap_or_default()
    }

    /// Bytes held by the frozen weights (4-bit layers at their packed size).
    pub fn resident_bytes(&self) -> usize {
        let dense = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let mut n = dense(&self.embed) + dense(&self.norm);
        n += self.sharded.as_ref().map_or(0, |s| s.resident_bytes());
        // Autocast keeps a bf16 lm_head beside a tied f32 embedding table.
        if !self.cfg.tie_word_embeddings || self.autocast {
            n += dense(&self.lm_head);
        }
        for l in &self.layers {
            n += l.norms().map(dense).sum::<usize>();
            for lin in l.linears() {
                n += lin.w.resident_bytes() + lin.bias.as_ref().map_or(0, dense);
            }
            n += l.moe.as_ref().map_or(0, crate::moe::MoeMlp::resident_bytes);
        }
        n
    }

    pub fn num_params(&self) -> usize {
        // From the config: a sharded base's tables are not here whole.
        let table = self.cfg.vocab_size * self.cfg.hidden_size;
        let mut n = table + self.norm.elem_count();
        if !self.cfg.tie_word_embeddings {
            n += table;
        }
        for l in &self.layers {
            n += l.norms().map(Tensor::elem_count).sum::<usize>();
            for lin in l.linears() {
                n += lin.w.elem_count() + lin.bias.as_ref().map_or(0, |b| b.elem_count());
            }
        }
        n
    }
}
