//! `rtune convert gguf IN OUT`: a llama or Gemma 3 GGUF into a Hugging Face model directory (see
//! `rtune_gguf`). Commands that take a model path convert a GGUF on the fly instead
//! (`crate::resolve`).

use anyhow::Result;
use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum ConvertCommand {
    /// A llama or Gemma 3 GGUF (llama.cpp) → a Hugging Face model directory: config.json,
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
                "wrote {}: {} tensors ({}) dequantized into {:.1} MB of safetensors; tokenizer: {}{}{} \
                 in {:.1}s",
                c.dir.display(),
                c.tensors,
                types.join(", "),
                c.bytes as f64 / 1e6,
                c.tokenizer,
                if c.chat_template { ", chat template" } else { "" },
                if c.tied_embeddings { ", tied embeddings" } else { "" },
                t0.elapsed().as_secs_f64()
            );
            Ok(())
        }
    }
}
