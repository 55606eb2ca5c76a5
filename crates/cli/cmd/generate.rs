//! `rtune generate`: continue a prompt (or hold a chat on stdin) with a model and optionally a
//! PEFT adapter (see `rtune_infer::generate`).

use anyhow::Result;
use std::path::PathBuf;

use rtune_infer::generate::GenerateOptions;

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Hugging Face model directory, llama or Gemma 3 .gguf file, or hub id (org/name).
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
    /// With --chat: a variable for the chat template, `NAME=VALUE` (repeatable), as transformers'
    /// `apply_chat_template(**kwargs)` takes it and as `[data] chat_template_kwargs` gave it in
    /// training, e.g. `--template-var enable_thinking=false` for Qwen3. VALUE is JSON (`false`,
    /// `3`, `"text"`), else a plain string.
    #[arg(long = "template-var", value_name = "NAME=VALUE", value_parser = parse_template_var)]
    template_vars: Vec<(String, serde_json::Value)>,
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

/// `--template-var NAME=VALUE`: a template variable (VALUE as JSON, else a string). The names
/// rtune sets for every render itself are refused, as in `[data] chat_template_kwargs`.
fn parse_template_var(s: &str) -> std::result::Result<(String, serde_json::Value), String> {
    let Some((name, value)) = s.split_once('=') else {
        return Err(format!(
            "`{s}`: expected NAME=VALUE, e.g. enable_thinking=false"
        ));
    };
    let name = name.trim();
    let ident = name
        .chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_alphanumeric() || c == '_');
    if !ident {
        return Err(format!(
            "`{name}`: a template variable is a name (letters, digits, _)"
        ));
    }
    if ["messages", "tools", "documents", "add_generation_prompt"].contains(&name) {
        return Err(format!("`{name}` is set by rtune for every render"));
    }
    let value = serde_json::from_str(value.trim())
        .unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
    Ok((name.to_string(), value))
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
        template_vars,
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
    if !chat && !template_vars.is_empty() {
        // A usage error (exit 2, one line), before the model is resolved.
        let (name, value) = &template_vars[0];
        clap::Error::raw(
            clap::error::ErrorKind::MissingRequiredArgument,
            format!(
                "--template-var {name}={value} sets a chat-template variable: it needs --chat\n"
            ),
        )
        .exit();
    }
    let model = crate::resolve::resolve_model_path(&model, &revision)?;
    if chat {
        let stdin = std::io::stdin();
        // A stdin line past MAX_LINE_BYTES ends the turns and is reported after the replies
        // before it (it is never tokenised, so an endless line cannot take the memory).
        let too_long = std::cell::Cell::new(false);
        let mut turns: Box<dyn Iterator<Item = String> + '_> = match prompt {
            Some(p) => Box::new(std::iter::once(p)),
            None => {
                let mut lines = stdin.lock();
                Box::new(
                    std::iter::from_fn(move || read_line(&mut lines))
                        .map_while(|l| match l {
                            Line::Text(t) => Some(t),
                            Line::TooLong => {
                                too_long.set(true);
                                None
                            }
                        })
                        .filter(|l| !l.trim().is_empty()),
                )
            }
        };
        rtune_infer::generate::chat(
            &model,
            adapter.as_deref(),
            &mut turns,
            &opt,
            &template_vars,
            &mut |r| println!("{r}"),
        )?;
        drop(turns);
        if too_long.get() {
            return Err(
                rtune_train::TrainError::Data(Box::new(rtune_data::DataError::File {
                    path: "<stdin>".into(),
                    message: format!(
                        "a line is longer than {} MiB: a chat turn must be one line that fits the \
                         model's context; shorten it",
                        MAX_LINE_BYTES >> 20
                    ),
                }))
                .into(),
            );
        }
        return Ok(());
    }
    let prompt = prompt.unwrap_or_default();
    let text = rtune_infer::generate::generate(&model, adapter.as_deref(), &prompt, &opt)?;
    println!("{text}");
    Ok(())
}

/// The longest stdin line `--chat` reads as one turn (far past any model's context in tokens;
/// the token count is checked against the context before the forward pass).
const MAX_LINE_BYTES: u64 = 16 << 20;

enum Line {
    Text(String),
    TooLong,
}

/// The next line of `r` without its line ending, at most `MAX_LINE_BYTES` read; `None` at the end
/// (or on a read error, as `lines().map_while(ok)` did).
fn read_line(r: &mut impl std::io::BufRead) -> Option<Line> {
    use std::io::{BufRead, Read};
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(MAX_LINE_BYTES + 1)
        .read_until(b'\n', &mut buf)
        .ok()?;
    if n == 0 {
        return None;
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
    } else if n as u64 > MAX_LINE_BYTES {
        return Some(Line::TooLong);
    }
    String::from_utf8(buf).ok().map(Line::Text)
}
