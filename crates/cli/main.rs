//! `rtune`: LoRA fine-tuning of Llama-family models. The command line only parses arguments, calls
//! the libraries and prints; every error reaches `main` and is printed once, as one line per cause.
//!
//! One file per subcommand under `cmd/`, each holding its arguments (`clap::Args`) and its `run`;
//! `resolve.rs` turns a model path (directory, `.gguf`, hub id) into a local directory;
//! `progress.rs` draws the training progress. This file: the subcommand list, dispatch, the exit
//! status.

// The doc comments of the clap types are the commands' help texts, which name config sections as
// `[output] dir`: not links.
#![allow(rustdoc::broken_intra_doc_links)]

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod cmd {
    pub mod bench;
    pub mod check;
    pub mod convert;
    pub mod data;
    pub mod estimate;
    pub mod export;
    pub mod generate;
    pub mod selftest;
    pub mod train;
}
// The MPI transport lives with the rest of data parallelism in crates/dist but is compiled into
// this binary only (not into rtune-dist): turning on `mpi` then rebuilds the binary and its tests,
// not the libraries (crates/dist/src/mpi.rs says why).
mod alloc;
#[cfg(feature = "mpi")]
#[path = "../dist/src/mpi.rs"]
mod mpi;
mod progress;
mod resolve;

/// The data-parallel world of this process: over MPI when built with the `mpi` feature and
/// started by a launcher (`mpirun`, `srun`), else a single process. A build without the feature
/// started as one of several ranks is refused: each rank would train alone into the same directory.
fn world() -> Result<rtune_dist::World> {
    #[cfg(feature = "mpi")]
    return mpi::init();
    #[cfg(not(feature = "mpi"))]
    match rtune_dist::launched_size() {
        Some(n) if n > 1 => anyhow::bail!(
            "started by an MPI launcher as one of {n} ranks, but this rtune was built without the \
             `mpi` feature; build it with `cargo build --release --features mpi` (README: Many \
             processes and machines)"
        ),
        _ => Ok(rtune_dist::World::single()),
    }
}

#[global_allocator]
static ALLOC: alloc::Thp = alloc::Thp;

/// `rtune --version`: the crate version and the compute features built in (`cpu`, or `cuda`; `mpi`
/// when data parallelism over MPI is in), so a bug report or a pip-installed wheel names its build.
const VERSION: &str = match (cfg!(feature = "cuda"), cfg!(feature = "mpi")) {
    (false, false) => concat!(env!("CARGO_PKG_VERSION"), " (cpu)"),
    (false, true) => concat!(env!("CARGO_PKG_VERSION"), " (cpu, mpi)"),
    (true, false) => concat!(env!("CARGO_PKG_VERSION"), " (cuda)"),
    (true, true) => concat!(env!("CARGO_PKG_VERSION"), " (cuda, mpi)"),
};

#[derive(Parser)]
#[command(
    name = "rtune",
    version = VERSION,
    about = "LoRA fine-tuning for Llama-family models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fine-tune with LoRA as a TOML config says; writes a PEFT adapter into [output] dir.
    Train(cmd::train::TrainArgs),
    /// Continue a prompt with a model and optionally a PEFT adapter.
    Generate(cmd::generate::GenerateArgs),
    /// Pre-flight before a long run: device, disk, data masks, one step's memory, overfitting 4
    /// samples, checkpoint/resume/generate, sustained throughput. Exits 1 if any check fails.
    Check(cmd::check::CheckArgs),
    /// Data tools.
    Data {
        #[command(subcommand)]
        command: cmd::data::DataCommand,
    },
    /// Training throughput and peak memory on a random model (default shape: bench-small).
    Bench(cmd::bench::BenchArgs),
    /// Check the CUDA path against the CPU: every kernel, NF4 dequantization, and training steps
    /// (f32, bf16, bf16 over NF4) on fresh random inputs; NF4 bandwidth vs the card's copy.
    Selftest(cmd::selftest::SelftestArgs),
    /// Predict a run's peak memory before loading anything: the breakdown, and the largest
    /// micro_batch_size and max_seq_len that fit a budget (default: the available RAM).
    Estimate(cmd::estimate::EstimateArgs),
    /// Export a run's adapter: PEFT directory, merged Hugging Face model, or GGUF LoRA (llama.cpp).
    Export(cmd::export::ExportArgs),
    /// Convert a model into a Hugging Face directory (a llama or Gemma 3 GGUF → safetensors + tokenizer files).
    Convert {
        #[command(subcommand)]
        command: cmd::convert::ConvertCommand,
    },
}

fn main() -> ExitCode {
    alloc::tune();
    let cli = Cli::parse();
    // A resume keeps the CBLAS and the oneDNN its run recorded (bit-for-bit continuation), so
    // they are pinned before they load: from the local run.json, or the store's when the
    // checkpoints are only there (read on a runtime whose threads end before `blas::init`).
    if let Command::Train(a) = &cli.command {
        if let Some(r) = cmd::train::recorded_engines(a) {
            rtune_backend::pin::set(r);
        }
    }
    // Before any thread exists: loading the optional CBLAS may set OPENBLAS_CORETYPE, and
    // oneDNN's OpenMP threads are told to sleep when idle.
    rtune_backend::blas::init();
    rtune_backend::onednn::init_env();
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
    // A CBLAS the user named that did not load (said now that the log is set up).
    if let Some(n) = rtune_backend::blas::notice() {
        tracing::warn!("{n}");
    }
    // A user's variable overriding a resumed run's record, a recorded library missing.
    for n in rtune_backend::pin::take_notices() {
        tracing::warn!("{n}");
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            print_error(&one_line(&e));
            // A conversion that held a signal back and removed its temporary ends by that signal
            // here too, whether or not the signal thread (woken by the same signal raised again)
            // got there first: the status was 1 when this thread returned before it (CI, stop 50).
            if let Some(rtune_gguf::GgufError::Interrupted { signal, .. }) = e.downcast_ref() {
                rtune_fsio::end_by_signal(*signal);
            }
            ExitCode::from(exit_code(&e))
        }
    }
}

/// `error: {line}` on stderr in one write: the ranks of a distributed run share the launcher's
/// stderr, and `eprintln!` writes its pieces one by one, which interleave between processes.
pub(crate) fn print_error(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("error: {line}\n").as_bytes());
}

/// The error and its causes on one line, `: ` between them, as `{e:#}` prints them but without a
/// cause whose text the line already holds: the libraries' errors print their source in their own
/// message (`{path}: {op}: {source}`, so that `to_string()` alone is complete) and also return it
/// as `source()`, which printed the OS error twice (issue 35).
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn run(cli: Cli) -> Result<()> {
    // Training handles its own signals (a clean stop at the next step); every other command that
    // may build something beside its final place (an export, `check`'s scratch runs) removes it
    // when a signal stops it. (A GGUF conversion holds the signals back and removes its own
    // temporary: `rtune_fsio::Deferred`.)
    if !matches!(cli.command, Command::Train(_)) {
        remove_staged_on_signal()?;
    }
    match cli.command {
        Command::Train(a) => cmd::train::run(a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::Check(a) => cmd::check::run(a),
        Command::Data { command } => cmd::data::run(command),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Selftest(a) => cmd::selftest::run(a),
        Command::Estimate(a) => cmd::estimate::run(a),
        Command::Export(a) => cmd::export::run(a),
        Command::Convert { command } => cmd::convert::run(command),
    }
}

/// A thread that, on SIGINT or SIGTERM, removes what is being staged ([`rtune_fsio::Staging`])
/// and then ends the process by the signal's default action (a shell sees 130, 143): an
/// interrupted export left `.NAME.tmp-PID/` directories of hundreds of MB that nothing removed
/// (issue 46).
fn remove_staged_on_signal() -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])?;
    std::thread::Builder::new()
        .name("rtune-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                rtune_fsio::end_by_signal(sig);
            }
        })?;
    Ok(())
}

/// 2: the input is wrong (config, model, data, adapter, output dir, device, option); 1: the run
/// failed. Each library error says which it is; errors of the CLI itself (`bail!`) are 1.
fn exit_code(e: &anyhow::Error) -> u8 {
    // A stop request before the first step ends the run as a second signal does (128 + SIGINT).
    if let Some(rtune_train::TrainError::Interrupted { .. }) = e.downcast_ref() {
        return 130;
    }
    let input = if let Some(t) = e.downcast_ref::<rtune_train::TrainError>() {
        t.is_input_error()
    } else if let Some(i) = e.downcast_ref::<rtune_infer::InferError>() {
        i.is_input_error()
    } else if let Some(d) = e.downcast_ref::<rtune_diag::DiagError>() {
        d.is_input_error()
    } else if let Some(h) = e.downcast_ref::<rtune_hub::HubError>() {
        h.is_input_error()
    } else if let Some(x) = e.downcast_ref::<rtune_export::ExportError>() {
        x.is_input_error()
    } else if let Some(g) = e.downcast_ref::<rtune_gguf::GgufError>() {
        g.is_input_error()
    } else if let Some(r) = e.downcast_ref::<rtune_remote::RemoteError>() {
        r.is_input_error()
    } else if let Some(c) = e.downcast_ref::<rtune_config::ConfigError>() {
        c.is_input_error()
    } else {
        e.downcast_ref::<rtune_data::DataError>().is_some()
    };
    if input {
        2
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    /// Issue 35: an error whose message holds its source's text printed that text twice.
    #[test]
    fn one_line_prints_each_cause_once() {
        let os = std::io::Error::from_raw_os_error(2);
        let e = rtune_config::ConfigError::Read {
            path: "x.toml".into(),
            source: os,
        };
        let e = anyhow::Error::from(e);
        let line = super::one_line(&e);
        assert_eq!(line.matches("(os error 2)").count(), 1, "{line}");
        assert!(line.starts_with("x.toml: cannot read config: "), "{line}");
        // Causes not in the message are still printed, after it.
        let e =
            anyhow::Error::from(std::io::Error::from_raw_os_error(2)).context("model.safetensors");
        let line = super::one_line(&e);
        assert!(line.starts_with("model.safetensors: "), "{line}");
        assert!(line.ends_with("(os error 2)"), "{line}");
    }
}
