//! `rtune train --config X`: a LoRA run as the config says, with progress on stderr and the
//! outcome on stdout. The first SIGINT/SIGTERM ends the step and writes a checkpoint.
//!
//! Under `mpirun` (feature `mpi`) every rank runs this; rank 0 alone prints progress and the
//! outcome. SIGUSR1 is a stop request too there: Open MPI's `mpirun` forwards SIGUSR1/SIGUSR2 to
//! every rank but answers SIGTERM/SIGINT by killing the job (SIGTERM to each rank after
//! `odls_base_sigkill_timeout`, SIGKILL after as long again). An error on one rank ends the whole
//! job (`MPI_Abort`) with the error's exit status, the line naming the rank.

use anyhow::Result;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use rtune_train::{Event, Outcome, RunOptions};

use crate::progress;

#[derive(clap::Args)]
pub struct TrainArgs {
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
}

/// The libraries this invocation must keep when it resumes a run: what the run's run.json records
/// (`hardware.blas`, `hardware.bf16_gemm`; [`rtune_backend::pin`]). Only when it will resume
/// (`--resume` or `[output] resume = "auto"`) a run with no summary.json: the local run.json when
/// [output] dir holds a checkpoint, else, with `[output] remote`, the store's run.json (the one the
/// trainer then brings with the store's newest checkpoint). Reads the config and one file (or one
/// object, at most [`rtune_remote::SMALL_OBJECT_BYTES`]) and leaves no thread behind: `main` calls
/// it before the libraries load. Anything that does not load or parse pins nothing (the run then
/// reports its error).
pub fn recorded_engines(a: &TrainArgs) -> Option<rtune_backend::pin::Recorded> {
    let cfg = rtune_config::load(&a.config, &a.set).ok()?;
    let dir = &cfg.output.dir;
    if !(a.resume || cfg.output.resume) || dir.join("summary.json").exists() {
        return None;
    }
    let record = if !rtune_run::checkpoint::list(dir).is_empty() {
        rtune_run::record::RunRecord::read(dir)?
    } else {
        stored_record(cfg.output.remote.as_deref()?)?
    };
    let hw = record.hardware;
    Some(rtune_backend::pin::Recorded {
        blas: hw.blas,
        bf16_gemm: hw.bf16_gemm,
    })
}

/// The run.json the store at `url` holds, read with the cap the trainer's fetch uses. The store's
/// client runs on its own tokio runtime, whose blocking pool (DNS lookups) starts threads; dropping
/// it joins them (tokio's `BlockingPool::drop`), so none is left when `main` goes on to set the
/// environment for the CBLAS it loads.
fn stored_record(url: &str) -> Option<rtune_run::record::RunRecord> {
    let remote = rtune_remote::Remote::open(url).ok()?;
    let bytes = remote
        .get_bytes("run.json", rtune_remote::SMALL_OBJECT_BYTES)
        .ok();
    drop(remote);
    serde_json::from_slice(&bytes?).ok()
}

pub fn run(a: TrainArgs) -> Result<()> {
    let world = crate::world()?;
    let result = train_as(a, &world);
    if let (Err(e), true) = (&result, world.is_distributed()) {
        // Other ranks may be waiting for this one in a collective: end them all.
        crate::print_error(&format!("rank {} of {}: {e:#}", world.rank, world.size));
        world.abort(i32::from(crate::exit_code(e)));
    }
    result
}

fn train_as(a: TrainArgs, world: &rtune_dist::World) -> Result<()> {
    let TrainArgs {
        config,
        set,
        resume,
        force,
    } = a;
    let mut cfg = rtune_config::load(&config, &set)?;
    crate::resolve::resolve_model(&mut cfg)?;
    // A library the resumed run recorded that does not load now: refused as changed settings are.
    // oneDNN loads now (the CBLAS did in `main`), so that both pins are checked.
    let _ = rtune_backend::onednn::get();
    let lost = rtune_backend::pin::lost();
    // oneDNN's notices (it loaded just now; the CBLAS's were logged in `main`).
    for n in rtune_backend::pin::take_notices() {
        tracing::warn!("{n}");
    }
    if !lost.is_empty() && !force {
        anyhow::bail!(
            "{}; the resume would not continue the run bit for bit: make it loadable, name a \
             library in RTUNE_BLAS / RTUNE_ONEDNN, or pass --force to resume anyway",
            lost.join("; ")
        );
    }
    // First SIGINT/SIGTERM: finish the step, write a checkpoint, exit 0. Second: exit at once (all
    // writes are atomic, so nothing is left half-written). One counter for both signals, bumped with
    // one atomic `fetch_add`: two signals landing on two threads at the same instant still count as
    // two (a check-then-set pair of handlers lets both see "first").
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicUsize::new(0));
    let mut signals = vec![signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM];
    if world.is_distributed() {
        signals.push(signal_hook::consts::SIGUSR1);
    }
    for sig in signals {
        let (stop, count) = (Arc::clone(&stop), Arc::clone(&count));
        let on_signal = move || {
            if count.fetch_add(1, Ordering::SeqCst) > 0 {
                signal_hook::low_level::exit(130);
            }
            stop.store(true, Ordering::SeqCst);
        };
        // SAFETY: the handler only does async-signal-safe work: two atomic operations and
        // `low_level::exit` (which calls `_exit`); it allocates nothing and takes no lock.
        unsafe { signal_hook::low_level::register(sig, on_signal)? };
    }
    let every = cfg.train.log_every;
    let steps = cfg.train.steps;
    eprintln!(
        "rtune: loading {} ({})",
        cfg.model.path.display(),
        cfg.model.dtype.as_str()
    );
    let opts = RunOptions {
        resume,
        force,
        stop: Some(&stop),
        world: Some(world),
    };
    let root = world.is_root();
    if world.is_distributed() && root {
        eprintln!(
            "rtune: {} ranks over {}; micro-batches per step {} × {} ranks",
            world.size,
            world.describe(),
            cfg.train.grad_accum,
            world.size
        );
    }
    let bar = progress::Progress::new(steps, every);
    // What a training row is: an SFT example, a preference pair, or KTO's unpaired row.
    let unit = rtune_train::objective::about(&cfg).unit;
    let outcome = rtune_train::train(&cfg, &opts, &mut |ev| match ev {
        // Rank 0 speaks for the run.
        _ if !root => {}
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
            checkpointing,
        } => {
            eprintln!("rtune: {}", checkpointing.describe());
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
                "rtune: {examples} training / {valid_examples} validation {unit} ({} rows: {}); \
                 {lora_params} LoRA parameters on a {model_params}-parameter model ({:.1} MB resident)",
                counts.rows,
                counts.summary(),
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
        Event::Eval(e) => bar.line(
            &match (e.valid_ppl, e.recipe.get("eval_rewards/accuracies")) {
                (Some(ppl), _) => format!(
                    "step {:>5}/{steps}  validation loss {:.4}  perplexity {:.2}  ({} tokens)",
                    e.step, e.valid_loss, ppl, e.valid_tokens
                ),
                (None, acc) => format!(
                    "step {:>5}/{steps}  validation loss {:.4}  reward accuracy {:.3}  ({} tokens)",
                    e.step,
                    e.valid_loss,
                    acc.copied().unwrap_or(f64::NAN),
                    e.valid_tokens
                ),
            },
        ),
        Event::Warning(w) => bar.line(&format!("warning: {w}")),
    });
    bar.finish();
    let outcome = outcome?;
    if !root {
        return Ok(());
    }
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
