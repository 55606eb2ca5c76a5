//! `rtune generate`: continue a prompt (or hold a chat on stdin) with a model and optionally a
//! PEFT adapter (see `rtune_train::generate`).

use anyhow::Result;
use std::path::PathBuf;

use rtune_train::generate::GenerateOptions;

#[derive(clap::Args)]
pub struct GenerateArgs {
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
    #[arg(long, default_value_t = 0.0, value_parser = parse_temperature, allow_negative_numbers = true)]
    temperature: f64,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches P, in (0, 1].
    #[arg(long, default_value_t = 1.0, value_parser = parse_top_p)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the prompt's input_ids and logits to this safetensors file (to compare with PEFT).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Base weights as trained: `nf4` (or `nf4-dq`) for a QLoRA adapter.
    #[arg(long, default_value = "none")]
    quantize: rtune_model::Quantize,
}

/// `--top-p`: a number in (0, 1]. Checked by clap, so a bad value is a usage error (exit 2)
/// before the model is resolved or anything written.
fn parse_top_p(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("`{s}`: must be a number in (0, 1]")),
    }
}

/// `--temperature`: a finite number ≥ 0 (0 = greedy).
fn parse_temperature(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err(format!("`{s}`: must be a finite number ≥ 0 (0 = greedy)")),
    }
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let GenerateArgs {
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
    } = a;
    let opt = GenerateOptions {
        max_new_tokens,
        temperature,
        top_p,
        seed,
        dump_logits,
        quantize,
    };
    let model = crate::resolve::resolve_model_path(&model, &revision)?;
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
        rtune_train::generate::chat(&model, adapter.as_deref(), &mut turns, &opt, &mut |r| {
            println!("{r}")
        })?;
        return Ok(());
    }
    let prompt = prompt.unwrap_or_default();
    let text = rtune_train::generate::generate(&model, adapter.as_deref(), &prompt, &opt)?;
    println!("{text}");
    Ok(())
}
