//! `rtune bench`: training throughput and peak memory on a random model of a given shape (default:
//! "bench-small", the shape `bench_peft_cpu.py` uses for the PEFT baseline; `llama3-8b` for the GPU
//! benchmark in `benches/gpu/`), so rtune and PEFT can be run side by side. Each step is forward +
//! backward + AdamW, as in training.
//!
//! Memory is measured over the steps, not the build: once the model, adapter and optimizer exist,
//! the figure "before the first step" is taken and the peak restarted (CUDA: the pool's
//! high-water mark, `rtune_backend::memory::reset_peak`; CPU: Linux's `VmHWM`, restarted by
//! writing 5 to /proc/self/clear_refs — where that is refused the peak is the process's and
//! `peak_reset` says so). The random weights are drawn in their final dtype and the embedding
//! table is made in host memory (`weights`), so the build leaves nothing behind on the device.
//!
//! The GEMM ceiling ([`gemm_rates`], after the steps): the best rate the training path's matmul
//! (`rtune_backend::blas::matmul`) reaches on the bench's own GEMM shapes, in f32 and in the compute
//! dtype; the step's achieved rate (`tokens/s × flops_per_token`) is reported as a fraction of it.
//! Both ceilings are always measured (f32, and bf16 whatever the bench's dtype), each shape with the
//! engine that served it; a bf16 probe's weight is packed for oneDNN as the model's are
//! (`rtune_backend::onednn::pack`), so the probe runs the path the step runs.
//!
//! Which engine served each class of product in the timed steps (`served`): the engines' tally
//! ([`rtune_backend::served`]), its shapes sorted into the frozen weights' products (forward and
//! input gradient of each projection and the lm_head: the shape's `(k, n)` is a weight's `(in,
//! out)` or `(out, in)`), LoRA's (a dim of `r`, `2r` or `3r`: one member's or a fused group's
//! stacked ranks), and attention's (the tiled kernel, or the plain path's batched products).

use candle_core::DType;
use serde::Serialize;
use std::time::Instant;

use rtune_lora::{Adapter, LoraSpec};
use rtune_model::{Grads, Inputs, LoraCtx, Model, ModelConfig, ModelError, Quantize, RopeScaling};
use rtune_train::memory;
use rtune_train::optim::LoraOptimizer;

use crate::weights::{Draw, RandomWeights};
use crate::DiagError;

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
    /// `cpu` or `cuda:N` (as `[train] device`).
    pub device: String,
    /// `f32 | bf16 | f16 | bf16-autocast`: the compute dtype (LoRA weights and optimizer stay
    /// f32); `bf16-autocast`: an f32 model with bf16 frozen weights and every product on
    /// bf16-rounded operands (`Model::set_autocast`).
    pub dtype: String,
    /// `none | nf4 | nf4-dq`: the frozen linear layers as QLoRA holds them.
    pub quantize: String,
    /// DoRA on every adapted layer (magnitudes trained, the norm computed once per step).
    pub dora: bool,
    /// Measure the GEMM ceiling ([`gemm_rates`]) after the steps.
    pub ceiling: bool,
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
            device: "cpu".into(),
            dtype: "f32".into(),
            quantize: "none".into(),
            dora: false,
            ceiling: true,
        }
    }
}

impl BenchOptions {
    /// A named shape: `bench-small` (the default) or `llama3-8b` (Llama 3 8B: hidden 4096, 32
    /// layers, 32/8 heads, intermediate 14336, vocab 128256; seq 2048, batch 1).
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "bench-small" => Some(Self::default()),
            "llama3-8b" => Some(Self {
                hidden: 4096,
                layers: 32,
                heads: 32,
                kv_heads: 8,
                intermediate: 14336,
                vocab: 128_256,
                seq: 2048,
                batch: 1,
                ..Self::default()
            }),
            _ => None,
        }
    }

    /// Parameters in matmuls (the seven linears of every layer and lm_head): the N of 6N.
    pub fn matmul_params(&self) -> u64 {
        let c = model_config(self);
        let (d, i) = (c.hidden_size as u64, c.intermediate_size as u64);
        let (q, kv) = (
            (c.num_heads * c.head_dim) as u64,
            (c.num_kv_heads * c.head_dim) as u64,
        );
        let layer = d * q + 2 * d * kv + q * d + 3 * d * i;
        c.num_layers as u64 * layer + c.vocab_size as u64 * d
    }

    /// Training FLOPs per token as PaLM's MFU counts them (Chowdhery et al. 2022, app. B): `6N`
    /// for the matmuls (forward, input and weight gradients) plus `12·L·T·d` for attention (scores
    /// and values, non-causal, forward + twice as much backward). Recomputation is not counted.
    /// benches/gpu/bench_peft_gpu.py counts the same.
    pub fn flops_per_token(&self) -> f64 {
        6.0 * self.matmul_params() as f64
            + 12.0 * (self.layers * self.seq * self.heads * (self.hidden / self.heads)) as f64
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchResult {
    pub options: BenchOptions,
    /// batch·seq / median step time.
    pub tokens_per_s: f64,
    pub step_s_median: f64,
    pub step_s: Vec<f64>,
    /// Peak memory during the steps: host RSS on the CPU, the device pool's high-water mark on
    /// CUDA (both restarted after the build; see `peak_reset`).
    pub peak_memory_bytes: u64,
    /// The same measure just before the first step: the model, adapter and optimizer (CPU: the
    /// resident set; CUDA: the pool's bytes in use).
    pub memory_before_steps_bytes: u64,
    /// Whether the peak was restarted after the build (false: it includes the build).
    pub peak_reset: bool,
    /// Peak resident set (host memory, also on CUDA): on the CPU since the restart, as
    /// `peak_memory_bytes`; on CUDA the whole process's.
    pub peak_rss_bytes: u64,
    /// What `rtune estimate` predicts for this shape (CPU, f32, unquantized only).
    pub estimated_peak_bytes: Option<u64>,
    pub rss_after_model_bytes: u64,
    pub threads: usize,
    pub matmul_params: u64,
    pub flops_per_token: f64,
    /// The CBLAS the CPU matmuls went through, if one was loaded.
    pub blas: Option<String>,
    /// The device in words: `cpu`, or on CUDA the card's name, compute capability and memory.
    pub device: String,
    pub final_loss: f64,
    /// `tokens_per_s · flops_per_token`, in GFLOP/s.
    pub achieved_gflops: f64,
    /// The GEMM rates on this shape's own matmuls (`None` with `--no-ceiling`).
    pub ceiling: Option<Ceiling>,
    /// Which engine served each class of the timed steps' products, by class, largest share
    /// first.
    pub served: Vec<Served>,
}

/// The GEMM ceiling: the best rate the matmul path reaches on the bench's own GEMM shapes, for
/// f32 and for the compute dtype (what "near the hardware's speed" is measured against).
#[derive(Debug, Clone, Serialize)]
pub struct Ceiling {
    /// Each shape's best rate, f32.
    pub f32: Vec<GemmRate>,
    /// The same in the compute dtype when it is not f32.
    pub compute: Vec<GemmRate>,
    /// The same in bf16 (`compute`'s rates for a bf16 or autocast bench).
    pub bf16: Vec<GemmRate>,
    /// The best of `f32` and of `bf16`, GFLOP/s.
    pub f32_best_gflops: f64,
    pub bf16_best_gflops: f64,
    /// The best of `compute` (of `f32` for an f32 bench), GFLOP/s.
    pub best_gflops: f64,
    /// `achieved_gflops / best_gflops`.
    pub fraction: f64,
}

/// One GEMM shape `(m, k)·(k, n)` and the best of its timed repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct GemmRate {
    pub what: &'static str,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub dtype: String,
    pub gflops: f64,
    /// What served it (`oneDNN (brg:avx512_core_bf16, packed B)`, the CBLAS's name, ...).
    pub engine: String,
}

/// One class of the step's products and an engine that served part of it.
#[derive(Debug, Clone, Serialize)]
pub struct Served {
    /// `frozen`, `LoRA`, `attention` or `other` (see the module note).
    pub class: &'static str,
    pub engine: String,
    pub calls: u64,
    /// This engine's share of the class's FLOPs.
    pub share: f64,
    /// GFLOP it ran over the timed steps.
    pub gflop: f64,
}

/// The forward GEMMs of a bench step as the model runs them (`N = batch·seq` rows): fused q/k/v,
/// o_proj, fused gate/up, down_proj, lm_head. The backward's are these shapes transposed.
pub fn gemm_shapes(o: &BenchOptions) -> Vec<(&'static str, usize, usize, usize)> {
    let c = model_config(o);
    let n = o.batch * o.seq;
    let (d, i) = (c.hidden_size, c.intermediate_size);
    let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    vec![
        ("q/k/v", n, d, q + 2 * kv),
        ("o_proj", n, q, d),
        ("gate/up", n, d, 2 * i),
        ("down_proj", n, i, d),
        ("lm_head", n, d, c.vocab_size),
    ]
}

/// Times `rtune_backend::blas::matmul` (the training path's GEMM) on each shape in `dtype`: one
/// untimed call, then the best of up to 5 calls within about a quarter second per shape.
pub fn gemm_rates(
    o: &BenchOptions,
    dev: &candle_core::Device,
    dtype: DType,
) -> Result<Vec<GemmRate>, DiagError> {
    let ce = |e| ModelError::candle("gemm ceiling", e);
    let mut out = Vec::new();
    for (what, m, k, n) in gemm_shapes(o) {
        let a = candle_core::Tensor::randn(0f32, 1.0, (m, k), dev)
            .and_then(|t| t.to_dtype(dtype))
            .map_err(ce)?;
        // (k, n) as the model passes a weight: the transpose of a packed (n, k).
        let w = candle_core::Tensor::randn(0f32, 1.0, (n, k), dev)
            .and_then(|t| t.to_dtype(dtype))
            .map_err(ce)?;
        // Packed for oneDNN whatever `RTUNE_ONEDNN_PACK` says (nothing happens in other dtypes):
        // the ceiling is the best rate the engine reaches, which the model reaches with packing on.
        let _packed = rtune_backend::onednn::register(&w);
        let tally = rtune_backend::served::start();
        let run = || -> Result<f64, DiagError> {
            let t0 = Instant::now();
            let y = rtune_backend::blas::matmul(&a, &w.t().map_err(ce)?).map_err(ce)?;
            dev.synchronize().map_err(ce)?;
            drop(y);
            Ok(t0.elapsed().as_secs_f64())
        };
        run()?;
        // The engine of the untimed call (the timed ones take the same path).
        let engine = tally
            .rows()
            .into_iter()
            .find(|r| (r.m, r.k, r.n) == (m, k, n))
            .map_or_else(|| "unknown".to_string(), |r| r.engine);
        drop(tally);
        let (mut best, mut spent) = (f64::INFINITY, 0.0);
        for _ in 0..5 {
            let dt = run()?;
            best = best.min(dt);
            spent += dt;
            if spent > 0.25 {
                break;
            }
        }
        out.push(GemmRate {
            what,
            m,
            k,
            n,
            dtype: format!("{dtype:?}").to_lowercase(),
            gflops: 2.0 * (m * k * n) as f64 / best / 1e9,
            engine,
        });
    }
    Ok(out)
}

/// The bench's random Llama: the options' shape, untied lm_head, no biases.
pub fn model_config(o: &BenchOptions) -> ModelConfig {
    ModelConfig {
        arch: &rtune_model::family::LLAMA,
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
        variant: Default::default(),
        moe: None,
    }
}

/// The memory in use now and whether the peak could be restarted from it (see the module doc).
fn restart_peak(dev: &candle_core::Device) -> (u64, bool) {
    match dev.location() {
        #[cfg(feature = "cuda")]
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            let used = rtune_backend::memory::used_bytes(gpu_id).unwrap_or(0);
            (used, rtune_backend::memory::reset_peak(gpu_id).is_ok())
        }
        _ => {
            let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
            (memory::current_rss_bytes(), reset)
        }
    }
}

/// The memory estimate for the bench's shape (f32, LoRA on all linear layers, full rows).
pub fn estimate(o: &BenchOptions) -> rtune_estimate::Estimate {
    let s = rtune_estimate::Settings::new(o.r, o.batch, o.seq, o.gradient_checkpointing);
    rtune_estimate::estimate(&model_config(o), &s)
}

/// The flags' shape, checked before anything is built: every size at least 1 (0 panicked or
/// hung), heads a multiple of kv_heads, hidden a multiple of heads with an even head size (rotary
/// embeddings), and no size past what any model has.
pub fn check_shape(o: &BenchOptions) -> Result<(), DiagError> {
    let bad = |m: String| Err(DiagError::BadShape(m));
    for (flag, v, max) in [
        ("--steps", o.steps, 1 << 20),
        ("--hidden", o.hidden, 1 << 20),
        ("--layers", o.layers, 4096),
        ("--heads", o.heads, 1 << 14),
        ("--kv-heads", o.kv_heads, 1 << 14),
        ("--intermediate", o.intermediate, 1 << 20),
        ("--vocab", o.vocab, 1 << 24),
        ("--seq", o.seq, 1 << 24),
        ("--batch", o.batch, 1 << 16),
        ("--r", o.r, 1 << 20),
    ] {
        if v == 0 || v > max {
            return bad(format!("{flag} {v}: must be in 1..={max}"));
        }
    }
    if !o.heads.is_multiple_of(o.kv_heads) {
        return bad(format!(
            "--heads {} is not a multiple of --kv-heads {}",
            o.heads, o.kv_heads
        ));
    }
    if !o.hidden.is_multiple_of(o.heads) {
        return bad(format!(
            "--hidden {} is not a multiple of --heads {}",
            o.hidden, o.heads
        ));
    }
    if !(o.hidden / o.heads).is_multiple_of(2) {
        return bad(format!(
            "--hidden {} / --heads {} = head size {}, which must be even (rotary embeddings)",
            o.hidden,
            o.heads,
            o.hidden / o.heads
        ));
    }
    Ok(())
}

pub fn run(
    o: &BenchOptions,
    on_step: &mut dyn FnMut(usize, f64, bool),
) -> Result<BenchResult, DiagError> {
    check_shape(o)?;
    let bad = |option, value: &str, expected| DiagError::BadOption {
        command: "bench",
        option,
        value: value.to_string(),
        expected,
    };
    let device = rtune_config::parse_device(&o.device)
        .map_err(|_| bad("--device", &o.device, "auto, cpu, cuda, cuda:N"))?;
    let dev = rtune_train::device(device)?;
    let (dtype, autocast) = match o.dtype.as_str() {
        "f32" => (DType::F32, false),
        "bf16" => (DType::BF16, false),
        "f16" => (DType::F16, false),
        "bf16-autocast" => (DType::F32, true),
        other => return Err(bad("--dtype", other, "f32, bf16, f16, bf16-autocast")),
    };
    let quantize: Quantize = o
        .quantize
        .parse()
        .map_err(|_| bad("--quantize", &o.quantize, "none, nf4, nf4-dq"))?;
    let cfg = model_config(o);
    let source = RandomWeights::new(&dev, dtype, quantize, Draw::Normal);
    let mut model = Model::build_with(cfg, &source, dtype, &dev, quantize)?;
    if autocast {
        model.set_autocast()?;
    }
    let spec =
        LoraSpec::new(o.r, o.alpha, 0.0, false, &["all-linear".to_string()])?.with_dora(o.dora);
    let mut adapter = Adapter::init(spec.clone(), &model.lora_modules(&spec), 0, &dev)?;
    model.attach(&adapter);
    if o.dora {
        model.init_dora(&mut adapter)?;
    }
    let rss_after_model_bytes = memory::current_rss_bytes();
    let mut opt = LoraOptimizer::new(&adapter, (0.9, 0.999), 1e-8, 0.0)?;
    dev.synchronize()
        .map_err(|e| ModelError::candle("synchronize", e))?;
    let (memory_before_steps_bytes, peak_reset) = restart_peak(&dev);
    let n = o.batch * o.seq;
    let mut step_s = Vec::new();
    let mut final_loss = f64::NAN;
    let mut tally = None;
    for step in 0..o.warmup + o.steps {
        if step == o.warmup {
            tally = Some(rtune_backend::served::start());
        }
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
        final_loss = model.forward_backward(
            &inputs,
            &targets,
            &lc,
            1.0 / n_target,
            o.gradient_checkpointing,
            &mut grads,
        )? / n_target;
        opt.step(&mut adapter, &grads, 1e-4, 0.0, 0.0, 1.0)?;
        // CUDA runs asynchronously: the step ends when the device is done.
        dev.synchronize()
            .map_err(|e| ModelError::candle("synchronize", e))?;
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
    let tokens_per_s = n as f64 / step_s_median;
    let achieved_gflops = tokens_per_s * o.flops_per_token() / 1e9;
    // The peaks of the steps, read before the ceiling probe: its products (the lm_head's is
    // `batch·seq × vocab` f32, 1 GB at bench-small seq 2048) would otherwise be the peak.
    let (peak_memory_bytes, peak_rss_bytes) = (memory::peak_bytes(&dev), memory::peak_rss_bytes());
    let served = served_by_class(o, &tally.map(|t| t.rows()).unwrap_or_default());
    let ceiling = if o.ceiling {
        let f32 = gemm_rates(o, &dev, DType::F32)?;
        let compute = if autocast {
            gemm_rates(o, &dev, DType::BF16)?
        } else if dtype == DType::F32 {
            Vec::new()
        } else {
            gemm_rates(o, &dev, dtype)?
        };
        let bf16 = if autocast || dtype == DType::BF16 {
            compute.clone()
        } else {
            gemm_rates(o, &dev, DType::BF16)?
        };
        let top = |rs: &[GemmRate]| rs.iter().map(|r| r.gflops).fold(0.0, f64::max);
        let best = if compute.is_empty() { &f32 } else { &compute };
        let best_gflops = top(best);
        Some(Ceiling {
            fraction: achieved_gflops / best_gflops,
            f32_best_gflops: top(&f32),
            bf16_best_gflops: top(&bf16),
            f32,
            compute,
            bf16,
            best_gflops,
        })
    } else {
        None
    };
    Ok(BenchResult {
        options: o.clone(),
        tokens_per_s,
        step_s_median,
        step_s,
        peak_memory_bytes,
        peak_rss_bytes,
        estimated_peak_bytes: (dev.is_cpu()
            && dtype == DType::F32
            && !autocast
            && quantize == Quantize::None)
            .then(|| estimate(o).peak_bytes),
        memory_before_steps_bytes,
        peak_reset,
        rss_after_model_bytes,
        threads: candle_core::utils::get_num_threads(),
        matmul_params: o.matmul_params(),
        flops_per_token: o.flops_per_token(),
        blas: rtune_backend::blas::loaded().map(str::to_string),
        device: if dev.is_cpu() {
            "cpu".to_string()
        } else {
            crate::check::device_line(&dev).1
        },
        final_loss,
        achieved_gflops,
        ceiling,
        served,
    })
}

/// The class of a tallied product (see the module note): `frozen` when its `(k, n)` is a frozen
/// weight's `(in, out)` or `(out, in)`, `LoRA` when a dim is `r`, `2r` or `3r` (or rtune's
/// `lora_up` ran it), `attention` for the tiled kernel and other batched products.
fn class(o: &BenchOptions, r: &rtune_backend::served::Row) -> &'static str {
    let frozen = gemm_shapes(o)
        .into_iter()
        .any(|(_, _, k, n)| (r.k, r.n) == (k, n) || (r.k, r.n) == (n, k));
    let lora = [o.r, 2 * o.r, 3 * o.r];
    if r.engine.contains("attention") {
        "attention"
    } else if r.engine.contains("lora_up") {
        "LoRA"
    } else if r.batch == 1 && frozen {
        "frozen"
    } else if [r.m, r.k, r.n].iter().any(|d| lora.contains(d)) {
        "LoRA"
    } else if r.batch > 1 {
        "attention"
    } else {
        "other"
    }
}

/// The tally's rows summed by class and engine, each with its share of its class's FLOPs; the
/// classes in the order frozen, LoRA, attention, other, the engines by share.
fn served_by_class(o: &BenchOptions, rows: &[rtune_backend::served::Row]) -> Vec<Served> {
    let mut out: Vec<Served> = Vec::new();
    for r in rows {
        let c = class(o, r);
        match out
            .iter_mut()
            .find(|s| s.class == c && s.engine == r.engine)
        {
            Some(s) => {
                s.calls += r.calls;
                s.gflop += r.flops() / 1e9;
            }
            None => out.push(Served {
                class: c,
                engine: r.engine.clone(),
                calls: r.calls,
                share: 0.0,
                gflop: r.flops() / 1e9,
            }),
        }
    }
    let order = ["frozen", "LoRA", "attention", "other"];
    for i in 0..out.len() {
        let total: f64 = out
            .iter()
            .filter(|s| s.class == out[i].class)
            .map(|s| s.gflop)
            .sum();
        out[i].share = out[i].gflop / total.max(f64::MIN_POSITIVE);
    }
    let rank = |s: &Served| order.iter().position(|c| *c == s.class);
    out.sort_by(|a, b| rank(a).cmp(&rank(b)).then(b.share.total_cmp(&a.share)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny bench on the CPU: both memory figures present, the peak restarted after the build
    /// (Linux) and the peak over the steps at least what was resident before them.
    #[test]
    fn a_tiny_bench_measures_memory_over_the_steps() -> Result<(), DiagError> {
        let o = BenchOptions {
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate: 96,
            vocab: 256,
            seq: 32,
            batch: 2,
            r: 4,
            steps: 2,
            warmup: 1,
            dtype: "bf16".into(),
            ..BenchOptions::default()
        };
        let mut steps = 0;
        let r = run(&o, &mut |_, _, _| steps += 1)?;
        assert_eq!((steps, r.step_s.len()), (3, 2));
        assert_eq!(r.device, "cpu");
        // The ceiling: every shape timed in f32 and in the compute dtype, the fraction theirs.
        let c = r.ceiling.as_ref().expect("measured by default");
        assert_eq!((c.f32.len(), c.compute.len()), (5, 5));
        assert!(c
            .compute
            .iter()
            .all(|g| g.gflops > 0.0 && g.dtype == "bf16"));
        let best = c.compute.iter().map(|g| g.gflops).fold(0.0, f64::max);
        assert_eq!(c.best_gflops, best);
        assert!((c.fraction - r.achieved_gflops / best).abs() < 1e-12);
        assert_eq!(c.f32[4].n, 256, "lm_head: vocab columns");
        // Both ceilings, each shape with its engine.
        assert_eq!(c.bf16.len(), 5);
        assert_eq!(c.bf16_best_gflops, best);
        let f32_best = c.f32.iter().map(|g| g.gflops).fold(0.0, f64::max);
        assert_eq!(c.f32_best_gflops, f32_best);
        assert!(c.f32.iter().chain(&c.bf16).all(|g| g.engine != "unknown"));
        // The step's products by class: frozen, LoRA and attention all tallied, each class's
        // shares summing to 1; with oneDNN in use frozen products go through it (packed only with
        // `RTUNE_ONEDNN_PACK=on`; the tally is the process's, so a test beside this one adds rows).
        for class in ["frozen", "LoRA", "attention"] {
            let rows: Vec<_> = r.served.iter().filter(|s| s.class == class).collect();
            assert!(!rows.is_empty(), "{class}: {:?}", r.served);
            let total: f64 = rows.iter().map(|s| s.share).sum();
            assert!((total - 1.0).abs() < 1e-9, "{class}: {total}");
        }
        let frozen = r
            .served
            .iter()
            .find(|s| s.class == "frozen")
            .expect("tallied");
        assert!(frozen.gflop > 0.0 && frozen.calls > 0);
        if rtune_backend::onednn::get().is_ok() {
            assert!(
                r.served
                    .iter()
                    .any(|s| s.class == "frozen" && s.engine.starts_with("oneDNN")),
                "{:?}",
                r.served
            );
        }
        assert!(r.final_loss.is_finite() && r.tokens_per_s > 0.0);
        if cfg!(target_os = "linux") {
            assert!(r.peak_reset, "VmHWM restarted via /proc/self/clear_refs");
            assert!(r.memory_before_steps_bytes > 0);
            assert!(
                r.peak_memory_bytes >= r.memory_before_steps_bytes / 2,
                "{r:?}"
            );
        }
        Ok(())
    }

    /// A QLoRA bench's ceiling is its compute dtype's: the dequantized weights meet the
    /// activations in bf16 products. (It was f32's, which made the CUDA bf16 + NF4 bench report
    /// 292% of its "ceiling" on an H200.)
    #[test]
    fn a_quantized_bench_measures_the_compute_dtype_ceiling() -> Result<(), DiagError> {
        let o = BenchOptions {
            hidden: 64,
            layers: 1,
            heads: 4,
            kv_heads: 2,
            intermediate: 128,
            vocab: 256,
            seq: 16,
            batch: 1,
            r: 4,
            steps: 1,
            warmup: 0,
            dtype: "bf16".into(),
            quantize: "nf4".into(),
            ..BenchOptions::default()
        };
        let r = run(&o, &mut |_, _, _| ())?;
        let c = r.ceiling.as_ref().expect("measured by default");
        assert_eq!(c.compute.len(), 5);
        assert!(c.compute.iter().all(|g| g.dtype == "bf16"));
        let best = c.compute.iter().map(|g| g.gflops).fold(0.0, f64::max);
        assert_eq!(c.best_gflops, best);
        Ok(())
    }
}
