//! `rtune`: LoRA fine-tuning of Llama-family models. The command line only parses arguments, calls
//! the libraries and prints; every error reaches `main` and is printed once, as one line per cause.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

mod bench_cmd;
mod check_cmd;
mod convert;
mod data_cmd;
mod estimate_cmd;
mod progress;
mod selftest_cmd;

use rtune_train::generate::GenerateOptions;
use rtune_train::{Event, Outcome, RunOptions};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

mod export;

// Training allocates and frees the same large activation buffers every step. By default glibc
// serves blocks above a moving threshold with mmap and hands them back to the kernel when freed,
// and trims the heap top, so each step paid again for fresh zeroed pages (~25% of a bench-small
// step in page faults). With the mmap threshold fixed at its maximum (32 MiB; rtune keeps its big
// buffers below it: attention scores per batch row, 24 MiB logits chunks) and no trimming, freed
// memory stays in the heap and is reused: bench-small 509 -> ~790 tokens/s, peak RSS 1.41 -> 1.22 GB.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator() {
    // SAFETY: mallopt only sets allocator parameters; no other thread exists yet.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

#[derive(Parser)]
#[command(
    name = "rtune",
    version,
    about = "LoRA fine-tuning for Llama-family models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fine-tune with LoRA as a TOML config says; writes a PEFT adapter into [output] dir.
    Train {
        #[arg(long)]
        config: PathBuf,
        /// Override a config value: --set train.lr=1e-4 (repeatable).
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
        /// Continue from the newest complete checkpoint in [output] dir.
        #[arg(long)]
        resume: bool,
        /// Resume even if settings changed since the checkpoint (the result then differs from an
        /// uninterrupted run).
        #[arg(long)]
        force: bool,
    },
    /// Continue a prompt with a model and optionally a PEFT adapter.
    Generate {
        /// Hugging Face model directory, llama .gguf file, or hub id (org/name).
        #[arg(long)]
        model: PathBuf,
        /// Hub models: branch, tag or commit.
        #[arg(long, default_value = "main")]
        revision: String,
        /// PEFT adapter directory (e.g. a run's output dir).
        #[arg(long)]
        adapter: Option<PathBuf>,
        /// The text to continue; with --chat, the (single) user message.
        #[arg(long, required_unless_present = "chat")]
        prompt: Option<String>,
        /// Apply the model's chat template: the prompt (or, without --prompt, each line of stdin,
        /// turn after turn) is a user message; replies are kept in the conversation.
        #[arg(long)]
        chat: bool,
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// 0 = greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long, default_value_t = 1.0)]
        top_p: f64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write the prompt's input_ids and logits to this safetensors file (to compare with PEFT).
        #[arg(long)]
        dump_logits: Option<PathBuf>,
        /// Base weights as trained: `nf4` (or `nf4-dq`) for a QLoRA adapter.
        #[arg(long, default_value = "none", value_parser = ["none", "nf4", "nf4-dq"])]
        quantize: String,
    },
    /// Pre-flight before a long run: device, disk, data masks, one step's memory, overfitting 4
    /// samples, checkpoint/resume/generate, sustained throughput. Exits 1 if any check fails.
    Check {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Data tools.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Training throughput and peak memory on a random model (default shape: bench-small).
    Bench(bench_cmd::BenchArgs),
    /// Check the CUDA path against the CPU: every kernel, NF4 dequantization, and training steps
    /// (f32, bf16, bf16 over NF4) on fresh random inputs; NF4 bandwidth vs the card's copy.
    Selftest(selftest_cmd::SelftestArgs),
    /// Predict a run's peak memory before loading anything: the breakdown, and the largest
    /// micro_batch_size and max_seq_len that fit a budget (default: the available RAM).
    Estimate(estimate_cmd::EstimateArgs),
    /// Export a run's adapter: PEFT directory, merged Hugging Face model, or GGUF LoRA (llama.cpp).
    Export(export::ExportArgs),
    /// Convert a model into a Hugging Face directory (a llama GGUF → safetensors + tokenizer files).
    Convert {
        #[command(subcommand)]
        command: convert::ConvertCommand,
    },
}

#[derive(Subcommand)]
enum DataCommand {
    /// Report likely secrets and personal data in the config's training data as `file:line: kind`
    /// (the matched text is never printed). Exits 1 when anything is found.
    Scan {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Tokenise the config's data files into the cache (in parallel, memory bounded), so training
    /// starts at once; prints tokens/s.
    Prepare {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Print the first formatted samples with their loss masks (trained tokens marked), the row
    /// counts and a length histogram: check template, BOS/EOS and masking before a long run.
    Inspect {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
        /// How many samples to print.
        #[arg(short = 'n', long = "samples", default_value_t = 3)]
        n: usize,
        /// One JSON object per sample (`text`, `input_ids`, `labels` with -100 where masked).
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    tune_allocator();
    // Before any thread exists: loading the optional CBLAS may set OPENBLAS_CORETYPE.
    rtune_model::blas::init();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RTUNE_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .with_target(false)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(exit_code(&e))
        }
    }
}

/// 2: the input is wrong (config, model, data, adapter, output dir); 1: the run failed.
fn exit_code(e: &anyhow::Error) -> u8 {
    use rtune_train::TrainError;
    if let Some(code) = convert::exit_code(e) {
        return code;
    }
    if let Some(code) = export::exit_code(e) {
        return code;
    }
    if e.downcast_ref::<rtune_config::ConfigError>().is_some() {
        return 2;
    }
    match e.downcast_ref::<TrainError>() {
        Some(TrainError::Model(m)) if matches!(**m, rtune_model::ModelError::Candle { .. }) => 1,
        Some(TrainError::Lora(l)) if matches!(**l, rtune_lora::LoraError::Candle { .. }) => 1,
        Some(
            TrainError::Config(_)
            | TrainError::Model(_)
            | TrainError::Lora(_)
            | TrainError::Data(_),
        ) => 2,
        Some(TrainError::OutputDir { .. } | TrainError::Device(_) | TrainError::Resume(_)) => 2,
        _ => 1,
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train {
            config,
            set,
            resume,
            force,
        } => train(config, set, resume, force),
        Command::Check { config, set } => check_cmd::run(config, set),
        Command::Data {
            command: DataCommand::Scan { config, set },
        } => scan(config, set),
        Command::Data {
            command:
                DataCommand::Inspect {
                    config,
                    set,
                    n,
                    json,
                },
        } => data_cmd::inspect(config, set, n, json),
        Command::Data {
            command: DataCommand::Prepare { config, set },
        } => data_cmd::prepare(config, set),
        Command::Generate {
            model,
            revision,
            adapter,
            prompt,
            chat,
            max_new_tokens,
            temperature,
            top_p,
            seed,
            dump_logits,
            quantize,
        } => {
            if !(0.0..=1.0).contains(&top_p) || top_p == 0.0 {
                bail!("--top-p must be in (0, 1], got {top_p}");
            }
            let opt = GenerateOptions {
                max_new_tokens,
                temperature,
                top_p,
                seed,
                dump_logits,
                quantize: match quantize.as_str() {
                    "nf4" => rtune_model::Quantize::Nf4 {
                        double_quant: false,
                    },
                    "nf4-dq" => rtune_model::Quantize::Nf4 { double_quant: true },
                    _ => rtune_model::Quantize::None,
                },
            };
            let model = convert::resolve_model_path(&model, &revision)?;
            if chat {
                let stdin = std::io::stdin();
                let mut turns: Box<dyn Iterator<Item = String>> = match prompt {
                    Some(p) => Box::new(std::iter::once(p)),
                    None => Box::new(
                        std::io::BufRead::lines(stdin.lock())
                            .map_while(|l| l.ok())
                            .filter(|l| !l.trim().is_empty()),
                    ),
                };
                rtune_train::generate::chat(
                    &model,
                    adapter.as_deref(),
                    &mut turns,
                    &opt,
                    &mut |r| println!("{r}"),
                )?;
                return Ok(());
            }
            let prompt = prompt.unwrap_or_default();
            let text = rtune_train::generate::generate(&model, adapter.as_deref(), &prompt, &opt)?;
            println!("{text}");
            Ok(())
        }
        Command::Export(a) => export::run(a),
        Command::Convert { command } => convert::run(command),
        Command::Estimate(a) => estimate_cmd::run(a),
        Command::Bench(a) => bench_cmd::run(a),
        Command::Selftest(a) => selftest_cmd::run(a),
    }
}

fn scan(config: PathBuf, set: Vec<String>) -> Result<()> {
    let cfg = rtune_config::load(&config, &set)?;
    let d = &cfg.data;
    let mut flagged = Vec::new();
    for path in d.train.iter().map(|f| &f.path).chain(&d.valid) {
        let findings = rtune_train::scan::scan_file(path)
            .with_context(|| format!("{}: cannot read data", path.display()))?;
        for f in &findings {
            println!("{f}");
        }
        let lines: std::collections::BTreeSet<usize> = findings.iter().map(|f| f.line).collect();
        eprintln!(
            "{}: {} finding(s) on {} line(s)",
            path.display(),
            findings.len(),
            lines.len()
        );
        if !findings.is_empty() {
            flagged.push(path.display().to_string());
        }
    }
    if flagged.is_empty() {
        Ok(())
    } else {
        bail!(
            "likely secrets or personal data in {}; review the lines above",
            flagged.join(", ")
        )
    }
}

fn train(config: PathBuf, set: Vec<String>, resume: bool, force: bool) -> Result<()> {
    let mut cfg = rtune_config::load(&config, &set)?;
    convert::resolve_model(&mut cfg)?;
    // First SIGINT/SIGTERM: finish the step, write a checkpoint, exit 0. Second: exit at once (all
    // writes are atomic, so nothing is left half-written).
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(sig, 130, Arc::clone(&stop))?;
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    let every = cfg.log_every;
    let steps = cfg.steps;
    eprintln!(
        "rtune: loading {} ({})",
        cfg.model_path.display(),
        cfg.dtype.as_str()
    );
    let opts = RunOptions {
        resume,
        force,
        stop: Some(&stop),
    };
    let bar = progress::Progress::new(steps, every);
    let outcome = rtune_train::train(&cfg, &opts, &mut |ev| match ev {
        Event::Start {
            examples,
            valid_examples,
            counts,
            files,
            warnings,
            lora_params,
            model_params,
            model_bytes,
            start_step,
        } => {
            if start_step > 0 {
                eprintln!("rtune: resuming at step {start_step}");
                bar.start_at(start_step);
            }
            for f in files {
                let how = if f.reused_cache {
                    "from cache".to_string()
                } else {
                    format!("tokenised at {:.0} tokens/s", f.tokens_per_s)
                };
                eprintln!(
                    "rtune: {}: {} examples, {} tokens ({how})",
                    f.path.display(),
                    f.examples,
                    f.tokens
                );
            }
            eprintln!(
                "rtune: {examples} training / {valid_examples} validation examples ({} rows: {} truncated, \
                 {} dropped, {} skipped); {lora_params} LoRA parameters on a {model_params}-parameter model ({:.1} MB resident)",
                counts.rows,
                counts.truncated,
                counts.dropped,
                counts.skipped,
                model_bytes as f64 / 1e6
            );
            for w in warnings {
                tracing::warn!("{w}");
            }
        }
        Event::Step(m) => bar.step(m),
        Event::Checkpoint { step, path } => {
            if step % every == 0 || step == steps {
                bar.line(&format!(
                    "step {step:>5}/{steps}  checkpoint {}",
                    path.display()
                ));
            }
        }
        Event::Eval(e) => bar.line(&format!(
            "step {:>5}/{steps}  validation loss {:.4}  perplexity {:.2}  ({} tokens)",
            e.step, e.valid_loss, e.valid_ppl, e.valid_tokens
        )),
        Event::Warning(w) => bar.line(&format!("warning: {w}")),
    });
    bar.finish();
    let outcome = outcome?;
    match outcome {
        Outcome::Completed(summary) => println!(
            "done: {} steps, final loss {:.4}, {:.0} tokens/s, peak memory {:.1} MB{}, {:.1}s; adapter in {}",
            summary.steps,
            summary.final_loss,
            summary.tokens_per_s,
            summary.peak_memory_bytes as f64 / 1e6,
            summary
                .estimated_peak_bytes
                .map(|e| format!(" (estimated {:.1} MB)", e as f64 / 1e6))
                .unwrap_or_default(),
            summary.wall_s,
            summary.output_dir.display()
        ),
        Outcome::Stopped { step, checkpoint } => println!(
            "stopped after step {step}; checkpoint {} (continue with: rtune train --config {} --resume)",
            checkpoint.display(),
            config.display()
        ),
    }
    Ok(())
}
