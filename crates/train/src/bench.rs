//! `rtune bench`: training throughput and peak memory on a random model of a given shape (default:
//! "bench-small", the shape `bench_peft_cpu.py` uses for the PEFT baseline), so the two can be run
//! side by side. Each step is forward + backward + AdamW, as in training.

use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use std::time::Instant;

use rtune_lora::{Adapter, LoraSpec};
use rtune_model::weights::TensorSource;
use rtune_model::{Arch, Grads, Inputs, LoraCtx, Model, ModelConfig, ModelError, RopeScaling};

use crate::optim::LoraOptimizer;
use crate::{memory, TrainError};

#[derive(Debug, Clone, Serialize)]
pub struct BenchOptions {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub seq: usize,
    pub batch: usize,
    pub r: usize,
    pub alpha: f64,
    pub steps: usize,
    pub warmup: usize,
    pub gradient_checkpointing: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            hidden: 512,
            layers: 8,
            heads: 8,
            kv_heads: 2,
            intermediate: 1376,
            vocab: 32000,
            seq: 512,
            batch: 4,
            r: 16,
            alpha: 32.0,
            steps: 10,
            warmup: 2,
            gradient_checkpointing: false,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub options: BenchOptions,
    /// batch·seq / median step time.
    pub tokens_per_s: f64,
    pub step_s_median: f64,
    pub step_s: Vec<f64>,
    pub peak_rss_bytes: u64,
    /// What `rtune estimate` predicts for this shape.
    pub estimated_peak_bytes: u64,
    pub rss_after_model_bytes: u64,
    pub threads: usize,
}

/// Weights drawn from N(0, 0.02²) (norm weights 1), as transformers initialises a Llama.
struct RandomWeights {
    dev: Device,
}

impl TensorSource for RandomWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let t = if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
            Tensor::ones(shape, DType::F32, &self.dev)
        } else {
            Tensor::randn(0f32, 0.02, shape, &self.dev)
        };
        t.map_err(|e| ModelError::candle(format!("random {name}"), e))
    }
}

/// The bench's random Llama: the options' shape, untied lm_head, no biases.
pub fn model_config(o: &BenchOptions) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        hidden_size: o.hidden,
        intermediate_size: o.intermediate,
        num_layers: o.layers,
        num_heads: o.heads,
        num_kv_heads: o.kv_heads,
        head_dim: o.hidden / o.heads,
        vocab_size: o.vocab,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_window: None,
        window_layers: vec![false; o.layers],
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        pad_token_id: None,
    }
}

/// The memory estimate for the bench's shape (f32, LoRA on all linear layers, full rows).
pub fn estimate(o: &BenchOptions) -> crate::estimate::Estimate {
    let s = crate::estimate::Settings::new(o.r, o.batch, o.seq, o.gradient_checkpointing);
    crate::estimate::estimate(&model_config(o), &s)
}

pub fn run(
    o: &BenchOptions,
    on_step: &mut dyn FnMut(usize, f64, bool),
) -> Result<BenchResult, TrainError> {
    let dev = Device::Cpu;
    let cfg = model_config(o);
    let mut model = Model::build(cfg, &RandomWeights { dev: dev.clone() }, DType::F32, &dev)?;
    let spec = LoraSpec::new(o.r, o.alpha, 0.0, false, &["all-linear".to_string()])?;
    let mut adapter = Adapter::init(spec.clone(), &model.lora_modules(&spec), 0, &dev)?;
    model.attach(&adapter);
    let rss_after_model_bytes = memory::current_rss_bytes();
    let mut opt = LoraOptimizer::new(&adapter, (0.9, 0.999), 1e-8, 0.0)?;
    let n = o.batch * o.seq;
    let mut step_s = Vec::new();
    for step in 0..o.warmup + o.steps {
        // Token ids from a fixed LCG: every position has a target, as in the PEFT bench.
        let ids: Vec<u32> = (0..n as u64)
            .map(|i| {
                ((i.wrapping_add(step as u64 * 7919)).wrapping_mul(2_654_435_761) % o.vocab as u64)
                    as u32
            })
            .collect();
        let targets: Vec<Option<u32>> = (0..n)
            .map(|i| {
                if (i + 1) % o.seq == 0 {
                    None
                } else {
                    Some(ids[i + 1])
                }
            })
            .collect();
        let t0 = Instant::now();
        let mut grads = Grads::new(adapter.pairs.len());
        let lc = LoraCtx {
            adapter: &adapter,
            scaling: spec.scaling(),
            dropout: 0.0,
            seed: 0,
        };
        let inputs = Inputs::new(ids, o.batch, o.seq);
        let n_target = targets.iter().filter(|t| t.is_some()).count() as f64;
        model.forward_backward(
            &inputs,
            &targets,
            &lc,
            1.0 / n_target,
            o.gradient_checkpointing,
            &mut grads,
        )?;
        opt.step(&mut adapter, &grads, 1e-4, 0.0, 0.0, 1.0)?;
        let dt = t0.elapsed().as_secs_f64();
        let timed = step >= o.warmup;
        if timed {
            step_s.push(dt);
        }
        on_step(step, dt, timed);
    }
    let mut sorted = step_s.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let step_s_median = sorted[sorted.len() / 2];
    Ok(BenchResult {
        options: o.clone(),
        tokens_per_s: n as f64 / step_s_median,
        step_s_median,
        step_s,
        peak_rss_bytes: memory::peak_rss_bytes(),
        estimated_peak_bytes: estimate(o).peak_bytes,
        rss_after_model_bytes,
        threads: candle_core::utils::get_num_threads(),
    })
}
