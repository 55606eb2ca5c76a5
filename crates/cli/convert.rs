//! `rtune convert gguf IN OUT`, and the model-path resolution every command that loads a model
//! shares (local directory, `.gguf` file, hub id).

use anyhow::Result;
use clap::Subcommand;
use std::path::PathBuf;

use rtune_config::RunConfig;

#[derive(Subcommand)]
pub enum ConvertCommand {
    /// A llama-architecture GGUF (llama.cpp) → a Hugging Face model directory: config.json,
    /// model.safetensors (dequantized to f32), tokenizer.json, tokenizer_config.json (with the chat
    /// template) and generation_config.json.
    Gguf {
        /// The .gguf file.
        input: PathBuf,
        /// The directory to create (must not exist, or be empty).
        output: PathBuf,
    },
}

pub fn run(c: ConvertCommand) -> Result<()> {
    match c {
        ConvertCommand::Gguf { input, output } => {
            let t0 = std::time::Instant::now();
            let c = rtune_gguf::convert(&input, &output)?;
            let types: Vec<String> = c
                .ggml_types
                .iter()
                .map(|(t, n)| format!("{n} {t}"))
                .collect();
            println!(
                "wrote {}: {} tensors ({}) dequantized into {:.1} MB of safetensors; tokenizer: byte-level BPE \
                 (pre-tokenizer {}){}{} in {:.1}s",
                c.dir.display(),
                c.tensors,
                types.join(", "),
                c.bytes as f64 / 1e6,
                c.tokenizer_pre,
                if c.chat_template { ", chat template" } else { "" },
                if c.tied_embeddings { ", tied embeddings" } else { "" },
                t0.elapsed().as_secs_f64()
            );
            Ok(())
        }
    }
}

/// Resolves the config's `[model] path` to a local model directory (see `rtune_hub`), sets
/// `cfg.model_path` to it, and says where it came from when that is not the path itself.
pub fn resolve_model(cfg: &mut RunConfig) -> Result<rtune_hub::Resolved> {
    let r = rtune_train::resolve_model(cfg)?;
    report(&r);
    Ok(r)
}

/// `--model` of `rtune generate`: the same resolution at `revision`.
pub fn resolve_model_path(path: &std::path::Path, revision: &str) -> Result<PathBuf> {
    let r = rtune_hub::resolve(&path.to_string_lossy(), revision)?;
    report(&r);
    Ok(r.dir)
}

fn report(r: &rtune_hub::Resolved) {
    if r.source != rtune_hub::Source::Local {
        eprintln!("rtune: model {r}");
    }
}

/// Exit status for model-source errors: 2 when the input is wrong, 1 when the machine or network
/// failed (see `main::exit_code`).
pub fn exit_code(e: &anyhow::Error) -> Option<u8> {
    let hub = |h: &rtune_hub::HubError| if h.is_input_error() { 2 } else { 1 };
    if let Some(h) = e.downcast_ref::<rtune_hub::HubError>() {
        return Some(hub(h));
    }
    if let Some(rtune_train::TrainError::Source(h)) = e.downcast_ref::<rtune_train::TrainError>() {
        return Some(hub(h));
    }
    e.downcast_ref::<rtune_gguf::GgufError>().map(|g| match g {
        rtune_gguf::GgufError::Io { .. } | rtune_gguf::GgufError::DiskFull { .. } => 1,
        _ => 2,
    })
}
