//! The training loop: check every input, then create the run directory, train, and write the adapter.
//!
//! A run directory holds `config.toml` (the config as resolved), `metrics.jsonl` (one line per
//! optimizer step, written as it goes), and — only when the run completes — the PEFT adapter
//! (`adapter_model.safetensors`, `adapter_config.json`) and `summary.json`, written last. A failed
//! run therefore never looks finished. Inputs (config, model, data, `init_from`) are all checked
//! before the directory is touched.

use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rtune_config::RunConfig;
use rtune_data::{Batcher, Dataset, MicroBatch, Tokenizer};
use rtune_lora::{Adapter, LoraSpec};
use rtune_model::{Grads, Inputs, LoraCtx, Model};

use crate::optim::{clip_factor, lr_factor, AdamW};
use crate::{memory, TrainError};

/// One line of metrics.jsonl.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub step: usize,
    /// Mean loss over all target tokens of this step's micro-batches, before the update.
    pub loss: f64,
    pub lr: f64,
    /// Global L2 norm of the LoRA gradients before clipping.
    pub grad_norm: f64,
    /// Non-padding input tokens in the step.
    pub tokens: usize,
    /// Tokens that carried a loss.
    pub target_tokens: usize,
    pub tokens_per_s: f64,
    pub elapsed_s: f64,
}

/// summary.json.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: usize,
    pub final_loss: f64,
    /// Median over steps after the first (the first includes warm-up costs).
    pub tokens_per_s: f64,
    pub peak_memory_bytes: u64,
    pub wall_s: f64,
    pub total_tokens: usize,
    pub lora_params: usize,
    pub examples: usize,
    pub epochs_started: usize,
    pub output_dir: PathBuf,
}

/// What [`train`] reports while it runs.
pub enum Event<'a> {
    /// Everything checked; training starts.
    Start {
        examples: usize,
        truncated: usize,
        skipped: usize,
        lora_params: usize,
        model_params: usize,
    },
    Step(&'a StepMetrics),
}

/// The compute device for a config value; CUDA needs a build with the `cuda` feature.
pub fn device(d: rtune_config::Device) -> Result<Device, TrainError> {
    match d {
        rtune_config::Device::Auto | rtune_config::Device::Cpu => Ok(Device::Cpu),
        rtune_config::Device::Cuda(n) => Err(TrainError::Device(format!(
            "[train] device = \"cuda:{n}\": this rtune was built without CUDA support (CPU only for now); use \"cpu\""
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

struct Prepared {
    model: Model,
    adapter: Adapter,
    data: Dataset,
    pad_id: u32,
}

fn prepare(cfg: &RunConfig, dev: &Device) -> Result<Prepared, TrainError> {
    let mut model = Model::load(&cfg.model_path, dtype(cfg.dtype), dev)?;
    let tok = if cfg.model_path.join("tokenizer.json").exists() {
        Some(Tokenizer::load(
            &cfg.model_path,
            model.cfg.eos_token_ids.first().copied(),
        )?)
    } else {
        None
    };
    let data = rtune_data::load_jsonl(
        &cfg.train_data,
        tok.as_ref(),
        cfg.max_seq_len,
        model.cfg.vocab_size,
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
        None => Adapter::init(spec, &modules, cfg.seed, dev)?,
    };
    model.attach(&adapter);
    let pad_id = tok
        .as_ref()
        .and_then(|t| t.pad_id)
        .or(model.cfg.pad_token_id)
        .unwrap_or(0);
    Ok(Prepared {
        model,
        adapter,
        data,
        pad_id,
    })
}

const RUN_FILES: [&str; 5] = [
    "summary.json",
    "adapter_model.safetensors",
    "adapter_config.json",
    "metrics.jsonl",
    "config.toml",
];

fn prepare_output(cfg: &RunConfig) -> Result<(), TrainError> {
    let dir = &cfg.output_dir;
    let out = |message: String| TrainError::Output {
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
        if finished && !cfg.overwrite {
            return Err(out(
                "already holds a finished run; choose another [output] dir or set [output] overwrite = true".into(),
            ));
        }
        for f in RUN_FILES {
            let p = dir.join(f);
            if p.exists() {
                std::fs::remove_file(&p).map_err(|e| out(format!("cannot remove old {f}: {e}")))?;
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| out(format!("cannot create: {e}")))
}

/// AdamW over an adapter's weights, kept as flat f32 vectors between steps.
pub struct LoraOptimizer {
    params: Vec<Vec<f32>>,
    sizes: Vec<usize>,
    adamw: AdamW,
}

impl LoraOptimizer {
    pub fn new(
        adapter: &Adapter,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
    ) -> Result<Self, TrainError> {
        let mut params = Vec::with_capacity(adapter.pairs.len() * 2);
        for p in &adapter.pairs {
            params.push(flat(&p.a).map_err(TrainError::candle("adapter to host"))?);
            params.push(flat(&p.b).map_err(TrainError::candle("adapter to host"))?);
        }
        let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
        let adamw = AdamW::new(&sizes, betas, eps, weight_decay);
        Ok(Self {
            params,
            sizes,
            adamw,
        })
    }

    /// Clips (`max_norm` 0 = off), lets `check` veto the step on the pre-clip norm, updates the
    /// adapter. Returns the pre-clip global gradient norm.
    pub fn step(
        &mut self,
        adapter: &mut Adapter,
        grads: &Grads,
        lr: f64,
        max_norm: f64,
        check: impl FnOnce(f64) -> Result<(), TrainError>,
    ) -> Result<f64, TrainError> {
        let mut gv: Vec<Vec<f32>> = Vec::with_capacity(self.params.len());
        for (i, size) in self.sizes.iter().enumerate() {
            let g = if i % 2 == 0 {
                &grads.a[i / 2]
            } else {
                &grads.b[i / 2]
            };
            gv.push(match g {
                Some(t) => flat(t).map_err(TrainError::candle("grad to host"))?,
                None => vec![0.0; *size],
            });
        }
        let (grad_norm, coef) = clip_factor(&gv, max_norm);
        check(grad_norm)?;
        if coef < 1.0 {
            let c = coef as f32;
            gv.iter_mut()
                .flat_map(|g| g.iter_mut())
                .for_each(|x| *x *= c);
        }
        self.adamw.update(&mut self.params, &gv, lr);
        for (i, p) in adapter.pairs.iter_mut().enumerate() {
            let dev = p.a.device().clone();
            let mk = |v: &Vec<f32>, like: &Tensor| Tensor::from_vec(v.clone(), like.shape(), &dev);
            p.a = mk(&self.params[2 * i], &p.a).map_err(TrainError::candle("adapter update"))?;
            p.b =
                mk(&self.params[2 * i + 1], &p.b).map_err(TrainError::candle("adapter update"))?;
        }
        Ok(grad_norm)
    }
}

fn flat(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// Seed of one micro-batch's dropout masks.
fn micro_seed(seed: u64, step: usize, micro: usize) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((step as u64) << 20) ^ micro as u64
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Runs a whole training job as configured.
pub fn train(cfg: &RunConfig, on_event: &mut dyn FnMut(Event)) -> Result<Summary, TrainError> {
    let started = Instant::now();
    let dev = device(cfg.device)?;
    let Prepared {
        model,
        mut adapter,
        data,
        pad_id,
    } = prepare(cfg, &dev)?;
    on_event(Event::Start {
        examples: data.examples.len(),
        truncated: data.truncated,
        skipped: data.skipped,
        lora_params: adapter.num_params(),
        model_params: model.num_params(),
    });
    prepare_output(cfg)?;
    let dir = &cfg.output_dir;
    let io = |path: PathBuf| {
        move |e: std::io::Error| TrainError::Output {
            path,
            message: e.to_string(),
        }
    };
    let resolved = toml::to_string(&cfg.file).expect("config serialises");
    std::fs::write(dir.join("config.toml"), resolved).map_err(io(dir.join("config.toml")))?;
    let metrics_path = dir.join("metrics.jsonl");
    let mut metrics = std::fs::File::create(&metrics_path).map_err(io(metrics_path.clone()))?;

    let examples = data.examples.len();
    let mut batcher = Batcher::new(data.examples, cfg.shuffle, cfg.seed, pad_id);
    let mut opt = LoraOptimizer::new(&adapter, cfg.betas, cfg.eps, cfg.weight_decay)?;
    let scaling = adapter.spec.scaling();
    let (mut speeds, mut total_tokens, mut last_loss) = (Vec::new(), 0usize, f64::NAN);

    for step in 0..cfg.steps {
        let t0 = Instant::now();
        let micro: Vec<MicroBatch> = (0..cfg.grad_accum)
            .map(|_| batcher.next_batch(cfg.micro_batch_size))
            .collect();
        let n_target: usize = micro.iter().map(MicroBatch::target_tokens).sum();
        let tokens: usize = micro.iter().map(|m| m.tokens).sum();
        let mut grads = Grads::new(adapter.pairs.len());
        let mut loss_sum = 0.0;
        for (k, mb) in micro.iter().enumerate() {
            let lc = LoraCtx {
                adapter: &adapter,
                scaling,
                dropout: cfg.dropout,
                seed: micro_seed(cfg.seed, step, k),
            };
            let inputs = Inputs {
                ids: mb.input_ids.clone(),
                positions: mb.positions.clone(),
                b: mb.b,
                t: mb.t,
            };
            // Normalised by the whole step's target tokens: accumulation equals one big batch.
            loss_sum += model.forward_backward(
                &inputs,
                &mb.targets,
                &lc,
                1.0 / n_target as f64,
                cfg.gradient_checkpointing,
                &mut grads,
            )?;
        }
        let loss = loss_sum / n_target as f64;
        let lr = cfg.lr * lr_factor(cfg.schedule, step, cfg.steps, cfg.warmup_steps);
        let grad_norm = opt.step(&mut adapter, &grads, lr, cfg.max_grad_norm, |grad_norm| {
            if loss.is_finite() && grad_norm.is_finite() {
                Ok(())
            } else {
                Err(TrainError::NonFinite {
                    step: step + 1,
                    loss,
                    grad_norm,
                })
            }
        })?;
        let secs = t0.elapsed().as_secs_f64();
        let m = StepMetrics {
            step: step + 1,
            loss,
            lr,
            grad_norm,
            tokens,
            target_tokens: n_target,
            tokens_per_s: tokens as f64 / secs.max(1e-9),
            elapsed_s: started.elapsed().as_secs_f64(),
        };
        if step > 0 || cfg.steps == 1 {
            speeds.push(m.tokens_per_s);
        }
        total_tokens += tokens;
        last_loss = loss;
        let line = serde_json::to_string(&m).expect("metrics serialise");
        writeln!(metrics, "{line}").map_err(io(metrics_path.clone()))?;
        on_event(Event::Step(&m));
    }
    metrics.sync_all().map_err(io(metrics_path.clone()))?;

    adapter.save_peft(dir, &base_model_name(&cfg.model_path))?;
    let summary = Summary {
        steps: cfg.steps,
        final_loss: last_loss,
        tokens_per_s: median(&mut speeds),
        peak_memory_bytes: memory::peak_rss_bytes(),
        wall_s: started.elapsed().as_secs_f64(),
        total_tokens,
        lora_params: adapter.num_params(),
        examples,
        epochs_started: batcher.epoch + 1,
        output_dir: dir.clone(),
    };
    let text = serde_json::to_string_pretty(&summary).expect("summary serialises");
    rtune_lora::write_atomic(&dir.join("summary.json"), text.as_bytes())?;
    Ok(summary)
}

/// What PEFT records as the base model: the path as the user gave it.
fn base_model_name(path: &Path) -> String {
    path.to_string_lossy().trim_end_matches('/').to_string()
}
