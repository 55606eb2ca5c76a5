//! The whole causal LM: embeddings, decoder layers, final norm, lm_head; a forward for inference and
//! a forward + backward for training that computes gradients for the LoRA weights only.

use candle_core::{DType, Device, Tensor};
use std::path::Path;
use std::sync::Arc;

pub use rtune_quant::Quantize;

use rtune_lora::{Adapter, LoraSpec, ModuleShape};

use crate::config::{HfConfig, ModelConfig};
use crate::kept::KeptInputs;
use crate::layer::{BatchCtx, Layer};
use crate::linear::{Frozen, Grads, Linear, LoraCtx};
use crate::ops::{self, AttnShape};
use crate::weights::{TensorSource, Weights};
use crate::{ModelError, Result};

pub(crate) mod decode;

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
    inv_freq: Vec<f32>,
    /// With checkpointing on a GPU: each layer's kept input goes to host memory in the forward
    /// pass and comes back one layer ahead of the backward, on a side stream (`kept.rs`).
    pub offload_checkpoints: bool,
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
        }
    }
}

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
        let (d, v, i) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (qd, kvd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let embed = w.tensor("model.embed_tokens.weight", &[v, d])?;
        let linear = |name: String, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            let wname = format!("{name}.weight");
            let quant = |q: rtune_quant::Nf4Weight| -> Result<Frozen> {
                #[cfg(feature = "cuda")]
                let gpu = match device {
                    Device::Cuda(_) => Some(
                        crate::cuda::upload(&q, device)
                            .map_err(|e| ModelError::candle(format!("upload {wname}"), e))?,
                    ),
                    _ => None,
                };
                Ok(Frozen::Quant {
                    q: Arc::new(q),
                    dtype,
                    device: device.clone(),
                    #[cfg(feature = "cuda")]
                    gpu,
                })
            };
            let wt = match (w.quantized(&wname, &[out, inp])?, quantize) {
                (Some(q), _) => quant(q)?,
                (None, Quantize::None) => Frozen::Dense(w.tensor(&wname, &[out, inp])?),
                (None, Quantize::Nf4 { double_quant }) => {
                    let t = w.stored(&wname, &[out, inp])?;
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
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                index: l,
                input_norm: w.tensor(&format!("{p}.input_layernorm.weight"), &[d])?,
                post_norm: w.tensor(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                q: linear(format!("{p}.self_attn.q_proj"), qd, d, cfg.qkv_bias)?,
                k: linear(format!("{p}.self_attn.k_proj"), kvd, d, cfg.qkv_bias)?,
                v: linear(format!("{p}.self_attn.v_proj"), kvd, d, cfg.qkv_bias)?,
                o: linear(format!("{p}.self_attn.o_proj"), d, qd, cfg.o_bias)?,
                gate: linear(format!("{p}.mlp.gate_proj"), i, d, cfg.mlp_bias)?,
                up: linear(format!("{p}.mlp.up_proj"), i, d, cfg.mlp_bias)?,
                down: linear(format!("{p}.mlp.down_proj"), d, i, cfg.mlp_bias)?,
                eps: cfg.rms_norm_eps,
                sliding: cfg.window_layers[l],
                qkv: None,
                gate_up: None,
            });
            layers
                .last_mut()
                .expect("pushed")
                .fuse()
                .map_err(|e| ModelError::candle(format!("{p}: fusing q/k/v and gate/up"), e))?;
        }
        let norm = w.tensor("model.norm.weight", &[d])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            w.tensor("lm_head.weight", &[v, d])?
        };
        // On a GPU an untied embedding table is only ever gathered from: it stays in host memory
        // (Llama 3 8B: 1.05 GB of device memory saved) and each batch's rows are copied over.
        let embed = if !device.is_cpu() && !cfg.tie_word_embeddings {
            embed
                .to_device(&Device::Cpu)
                .map_err(|e| ModelError::candle("embedding table to host", e))?
        } else {
            embed
        };
        let inv_freq = crate::rope::inv_freq(&cfg);
        Ok(Self {
            cfg,
            dtype,
            device: device.clone(),
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            offload_checkpoints: false,
        })
    }

    /// The modules a LoRA spec targets, in model order (layer 0's q, k, v, o, gate, up, down, ...).
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
                    });
                }
            }
        }
        out
    }

    /// DoRA: sets each attached pair's magnitude to PEFT's init, the row norms `‖W + s·B·A‖`
    /// (an NF4 `W` dequantized first, one layer at a time). Call after [`Model::attach`].
    pub fn init_dora(&self, adapter: &mut Adapter) -> Result<()> {
        let s = adapter.spec.scaling();
        for layer in &self.layers {
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
        }
    }

    fn batch_ctx(&self, inp: &Inputs) -> candle_core::Result<BatchCtx> {
        let shape = AttnShape {
            b: inp.b,
            t: inp.t,
            heads: self.cfg.num_heads,
            kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        };
        let (cos, sin) = crate::rope::tables(
            &self.inv_freq,
            &inp.positions,
            inp.b,
            inp.t,
            self.dtype,
            &self.device,
        )?;
        let mask_of = |window| {
            ops::AttnMask::new(inp.segments.as_deref(), inp.b, inp.t, window, &self.device)
        };
        let mask = mask_of(None)?;
        let sliding = match self.cfg.sliding_window {
            Some(w) if w < inp.t => Some(mask_of(Some(w))?),
            _ => None,
        };
        Ok(BatchCtx {
            shape,
            cos,
            sin,
            mask,
            sliding,
            path: ops::AttnPath::for_device(&self.device, inp.t)?,
        })
    }

    fn embed(&self, inp: &Inputs) -> candle_core::Result<Tensor> {
        let ids = Tensor::new(inp.ids.as_slice(), self.embed.device())?;
        self.embed.index_select(&ids, 0)?.to_device(&self.device) // (N, D)
    }

    /// Inference forward: logits for every position (and the hidden states if `keep_hidden`).
    pub fn forward(
        &self,
        inp: &Inputs,
        lora: Option<&LoraCtx>,
        keep_hidden: bool,
    ) -> Result<Forward> {
        let run = || -> candle_core::Result<Forward> {
            let (b, t, d) = (inp.b, inp.t, self.cfg.hidden_size);
            let ctx = self.batch_ctx(inp)?;
            let mut x = self.embed(inp)?;
            let mut hidden = Vec::new();
            for layer in &self.layers {
                if keep_hidden {
                    hidden.push(x.reshape((b, t, d))?.to_dtype(DType::F32)?);
                }
                x = layer.forward(&x, &ctx, lora)?.0;
            }
            let (h, _) = ops::rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)?;
            if keep_hidden {
                hidden.push(h.reshape((b, t, d))?.to_dtype(DType::F32)?);
            }
            let logits = h
                .matmul(&self.lm_head.t()?)?
                .to_dtype(DType::F32)?
                .reshape((b, t, self.cfg.vocab_size))?;
            Ok(Forward { logits, hidden })
        };
        run().map_err(|e| ModelError::candle("forward", e))
    }

    /// One micro-batch of training: forward, chunked cross-entropy against `targets` (the next-token
    /// id per position, already shifted; `None` = no loss), backward into `grads` scaled by
    /// `grad_scale` (1 / target tokens of the whole optimizer step). Returns the summed loss.
    ///
    /// With `checkpoint`, only each layer's input is kept during the forward pass; each layer is
    /// recomputed from it just before its backward, so one layer's activations are alive at a time.
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
        let mut run = || -> candle_core::Result<f64> {
            let ctx = self.batch_ctx(inp)?;
            let mut caches = Vec::with_capacity(self.layers.len());
            let mut x = self.embed(inp)?;
            let offload = checkpoint && self.offload_checkpoints;
            let mut inputs = KeptInputs::new(&self.device, offload, self.layers.len())?;
            let last = self.layers.len().saturating_sub(1);
            for (i, layer) in self.layers.iter().enumerate() {
                let (out, cache) = layer.forward(&x, &ctx, Some(lora))?;
                // A layer keeps either its activations or (checkpointing) only its input. The last
                // layer's activations are the first the backward needs: they are kept rather than
                // recomputed at once (L−1 recomputes).
                if !checkpoint || i == last {
                    caches.push(cache);
                } else {
                    inputs.push(x)?;
                }
                x = out;
            }
            let (h, norm_cache) = ops::rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)?;
            drop(x);
            let (loss, dh) = ops::chunked_cross_entropy(
                &h,
                &self.lm_head,
                targets,
                grad_scale,
                self.ce_chunk(),
            )?;
            drop(h);
            let mut dx = ops::rms_norm_backward(&dh, &self.norm, &norm_cache)?;
            for (i, layer) in self.layers.iter().enumerate().rev() {
                let cache = match caches.pop() {
                    Some(c) => c,
                    None => layer.forward(&inputs.pop()?, &ctx, Some(lora))?.1,
                };
                let d = layer.backward(&dx, &cache, &ctx, Some(lora), grads, i > 0)?;
                after_layer(i, grads)?;
                match d {
                    Some(d) => dx = d,
                    None => break,
                }
            }
            Ok(loss)
        };
        run().map_err(|e| ModelError::candle("forward_backward", e))
    }

    /// Summed next-token loss of a batch, no gradient (validation). Layer by layer, so only one
    /// layer's activations exist at a time.
    pub fn eval_loss(
        &self,
        inp: &Inputs,
        targets: &[Option<u32>],
        lora: Option<&LoraCtx>,
    ) -> Result<f64> {
        let run = || -> candle_core::Result<f64> {
            let ctx = self.batch_ctx(inp)?;
            let mut x = self.embed(inp)?;
            for layer in &self.layers {
                x = layer.forward(&x, &ctx, lora)?.0;
            }
            let (h, _) = ops::rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)?;
            ops::chunked_cross_entropy_loss(&h, &self.lm_head, targets, self.ce_chunk())
        };
        run().map_err(|e| ModelError::candle("eval_loss", e))
    }

    /// Rows of the logits formed at once by the cross-entropy.
    ///
    /// CPU: 6 Mi f32 logits (24 MiB) a chunk, below glibc's largest mmap threshold, so the buffer is
    /// reused from the heap instead of faulted in fresh every chunk. GPU: 1024 rows, so a step
    /// reads the lm_head a few times rather than once per ~50 rows (seq 2048: 2 chunks), while the
    /// logits and their gradient stay transient (1024 × 128256 bf16: 263 MB each).
    fn ce_chunk(&self) -> usize {
        if self.device.is_cpu() {
            ((6usize << 20) / self.cfg.vocab_size).clamp(16, 4096)
        } else {
            1024
        }
    }

    /// How many decoder layers the model has.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The adapter slots (indices of `Grads::a`, `b`, `m`) of layer `i`'s LoRA modules.
    pub fn layer_slots(&self, i: usize) -> Vec<usize> {
        self.layers
            .get(i)
            .map(|l| l.linears().iter().filter_map(|lin| lin.lora).collect())
            .unwrap_or_default()
    }

    /// Bytes held by the frozen weights (4-bit layers at their packed size).
    pub fn resident_bytes(&self) -> usize {
        let dense = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let mut n = dense(&self.embed) + dense(&self.norm);
        if !self.cfg.tie_word_embeddings {
            n += dense(&self.lm_head);
        }
        for l in &self.layers {
            n += dense(&l.input_norm) + dense(&l.post_norm);
            for lin in l.linears() {
                n += lin.w.resident_bytes() + lin.bias.as_ref().map_or(0, dense);
            }
        }
        n
    }

    pub fn num_params(&self) -> usize {
        let mut n = self.embed.elem_count() + self.norm.elem_count();
        if !self.cfg.tie_word_embeddings {
            n += self.lm_head.elem_count();
        }
        for l in &self.layers {
            n += l.input_norm.elem_count() + l.post_norm.elem_count();
            for lin in l.linears() {
                n += lin.w.elem_count() + lin.bias.as_ref().map_or(0, |b| b.elem_count());
            }
        }
        n
    }
}
