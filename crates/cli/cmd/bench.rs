//! `rtune bench`: throughput and peak memory on a random model (see `rtune_diag::bench`).

use anyhow::{bail, Context, Result};
use std::path::PathBuf;

use rtune_diag::bench::BenchOptions;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// The shape: bench-small (h512 L8 H8/2 I1376 V32000, seq 512, batch 4) or llama3-8b (h4096
    /// L32 H32/8 I14336 V128256, seq 2048, batch 1). The flags below override its values.
    #[arg(long, default_value = "bench-small", value_parser = parse_preset)]
    preset: String,
    #[arg(long, default_value_t = 10)]
    steps: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long)]
    hidden: Option<usize>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    intermediate: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    #[arg(long)]
    seq: Option<usize>,
    #[arg(long)]
    batch: Option<usize>,
    #[arg(long, default_value_t = 16)]
    r: usize,
    /// Recompute each decoder layer in backward instead of keeping its activations.
    #[arg(long)]
    gradient_checkpointing: bool,
    /// cpu or cuda:N (CUDA needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute dtype: f32, bf16, f16 or bf16-autocast (f32 with bf16 products, as torch.autocast;
    /// LoRA weights and AdamW stay f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// The frozen linear layers: none, nf4 or nf4-dq (QLoRA, double-quantized scales).
    #[arg(long, default_value = "none")]
    quantize: String,
    /// DoRA (`[lora] dora = true`) instead of plain LoRA.
    #[arg(long)]
    dora: bool,
    /// Skip the GEMM-ceiling probe (the best matmul rate on the bench's own shapes).
    #[arg(long)]
    no_ceiling: bool,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

/// `--preset`: a shape `BenchOptions::preset` knows; checked by clap (a usage error, exit 2).
fn parse_preset(s: &str) -> std::result::Result<String, String> {
    match BenchOptions::preset(s) {
        Some(_) => Ok(s.to_string()),
        None => Err(format!("`{s}`: one of bench-small, llama3-8b")),
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    let Some(base) = BenchOptions::preset(&a.preset) else {
        bail!("--preset {}: one of bench-small, llama3-8b", a.preset);
    };
    let o = BenchOptions {
        hidden: a.hidden.unwrap_or(base.hidden),
        layers: a.layers.unwrap_or(base.layers),
        heads: a.heads.unwrap_or(base.heads),
        kv_heads: a.kv_heads.unwrap_or(base.kv_heads),
        intermediate: a.intermediate.unwrap_or(base.intermediate),
        vocab: a.vocab.unwrap_or(base.vocab),
        seq: a.seq.unwrap_or(base.seq),
        batch: a.batch.unwrap_or(base.batch),
        r: a.r,
        alpha: 2.0 * a.r as f64,
        steps: a.steps,
        warmup: a.warmup,
        gradient_checkpointing: a.gradient_checkpointing,
        device: a.device,
        dtype: a.dtype,
        quantize: a.quantize,
        dora: a.dora,
        ceiling: !a.no_ceiling,
    };
    // An unknown `RTUNE_UNFUSED` switch is refused first (benches/gpu/run.sh's toggles probe the
    // binary's names with `--steps 0` and read this message).
    rtune_ops::fused::check_env()?;
    // Contradicting or empty shapes are usage errors (exit 2), found before anything is built.
    rtune_diag::bench::check_shape(&o)?;
    let res = rtune_diag::bench::run(&o, &mut |i, dt, timed| {
        eprintln!(
            "step {i:2} {} {dt:7.3}s",
            if timed { "timed " } else { "warmup" }
        );
    })?;
    if let Some(c) = &res.ceiling {
        // f32, then bf16 (the compute dtype's for an f16 bench too).
        let other = if o.dtype == "f16" {
            &c.compute
        } else {
            &c.bf16
        };
        for g in c.f32.iter().chain(other) {
            println!(
                "gemm ceiling: {:<9} {}×{}·{}×{} {:<4} {:7.1} GFLOP/s  {}",
                g.what, g.m, g.k, g.k, g.n, g.dtype, g.gflops, g.engine
            );
        }
        println!(
            "gemm ceilings: f32 {:.1} GFLOP/s, bf16 {:.1} GFLOP/s",
            c.f32_best_gflops, c.bf16_best_gflops
        );
    }
    for s in &res.served {
        println!(
            "served: {:<9} {:5.1}% of its FLOPs ({} calls)  {}",
            s.class,
            100.0 * s.share,
            s.calls,
            s.engine
        );
    }
    let ceiling = match &res.ceiling {
        Some(c) => format!(
            ", {:.1}% of the GEMM ceiling ({:.1} GFLOP/s)",
            100.0 * c.fraction,
            c.best_gflops
        ),
        None => String::new(),
    };
    let what = if o.device == "cpu" {
        "RSS"
    } else {
        "device memory"
    };
    // Where the matmuls ran: the CPU's threads and CBLAS, or the card.
    let ran_on = if o.device == "cpu" {
        format!(
            "{} threads, BLAS: {}",
            res.threads,
            res.blas.as_deref().unwrap_or("none (candle's gemm)")
        )
    } else {
        res.device.clone()
    };
    println!(
        "rtune bench: {:.1} tokens/s (median step {:.3}s over {} steps), {ran_on}",
        res.tokens_per_s,
        res.step_s_median,
        res.step_s.len(),
    );
    println!(
        "rtune bench: {:.1} GFLOP/s achieved ({:.1} MFLOP/token){ceiling}",
        res.achieved_gflops,
        res.flops_per_token / 1e6
    );
    println!(
        "memory: {what} before the first step {:.1} MB, peak during the steps {:.1} MB{}",
        res.memory_before_steps_bytes as f64 / 1e6,
        res.peak_memory_bytes as f64 / 1e6,
        if res.peak_reset {
            ""
        } else {
            " (peak not restarted after the build: it includes it)"
        }
    );
    if let Some(est) = res.estimated_peak_bytes {
        println!(
            "memory: estimated peak {:.1} MB, measured {:.1} MB (estimate/measured {:.3})",
            est as f64 / 1e6,
            res.peak_memory_bytes as f64 / 1e6,
            est as f64 / res.peak_memory_bytes.max(1) as f64
        );
    }
    if let Some(p) = a.json_out {
        let bytes = serde_json::to_vec_pretty(&res)?;
        rtune_fsio::write_atomic(&p, &bytes, rtune_fsio::Privacy::SHARED)
            .with_context(|| format!("{}", p.display()))?;
    }
    Ok(())
}
