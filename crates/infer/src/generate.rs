//! Text generation to check what a run learned: greedy by default, or temperature + top-p sampling,
//! with a key/value cache (the prompt runs once, then one token at a time).

use candle_core::Device;
use rand::{Rng, SeedableRng};
use std::path::Path;

use rtune_data::Tokenizer;
use rtune_lora::{Adapter, LoraSpec};
use rtune_model::{Inputs, LoraCtx, Model};

// The crate's error under the name this file was written with (it moved from rtune-train).
use crate::InferError as TrainError;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    pub top_p: f64,
    pub seed: u64,
    /// Also write the prompt's `input_ids` (1, T) and `logits` (1, T, V) to this safetensors file, in
    /// the layout of the parity goldens, to compare with another implementation.
    pub dump_logits: Option<std::path::PathBuf>,
    /// Base weights as in training: `Quantize::Nf4` for an adapter trained with QLoRA.
    pub quantize: rtune_model::Quantize,
}

/// The model (with the adapter attached), its tokenizer, the adapter, the stop tokens, and the
/// model's context in tokens (config.json's `max_position_embeddings`, when it gives one).
type Loaded = (Model, Tokenizer, Option<Adapter>, Vec<u32>, Option<usize>);

fn load(
    model_dir: &Path,
    adapter_dir: Option<&Path>,
    opt: &GenerateOptions,
) -> Result<Loaded, TrainError> {
    let dev = Device::Cpu;
    let mut model = Model::load_with(model_dir, candle_core::DType::F32, &dev, opt.quantize)?;
    let context = rtune_model::config::HfConfig::from_file(&model_dir.join("config.json"))?
        .max_position_embeddings;
    let tok = Tokenizer::load(model_dir, model.cfg.eos_token_ids.first().copied())?;
    let adapter = match adapter_dir {
        Some(dir) => {
            let c = rtune_lora::read_adapter_config(dir)?;
            let targets: Vec<String> = match &c.target_modules {
                serde_json::Value::String(s) => vec![s.clone()],
                serde_json::Value::Array(a) => a
                    .iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect(),
                _ => Vec::new(),
            };
            let spec = LoraSpec::new(c.r, c.lora_alpha, 0.0, c.use_rslora, &targets)?
                .with_dora(c.use_dora);
            let modules = model.lora_modules(&spec);
            Some(Adapter::load_peft(dir, &spec, &modules, &dev)?)
        }
        None => None,
    };
    if let Some(a) = &adapter {
        model.attach(a);
    }
    // Stop at any end token config.json, generation_config.json or the tokenizer names.
    let mut stop: Vec<u32> = model.cfg.eos_token_ids.clone();
    stop.extend(rtune_model::config::GenerationConfig::load(model_dir)?.eos_token_ids);
    stop.extend(tok.eos_id);
    Ok((model, tok, adapter, stop, context))
}

/// The prompt's `prompt_tokens` plus `opt.max_new_tokens` must fit the model's context
/// (`max_position_embeddings`, when config.json gives one): past it a model's positions are
/// untrained, and the prompt's attention grows with its square (issue 35: 100k characters were
/// killed for memory). Checked before any forward pass.
fn check_context(
    context: Option<usize>,
    what: &'static str,
    prompt_tokens: usize,
    opt: &GenerateOptions,
) -> Result<(), TrainError> {
    match context {
        Some(limit) if prompt_tokens.saturating_add(opt.max_new_tokens) > limit => {
            Err(TrainError::ContextTooLong {
                what,
                prompt_tokens,
                max_new_tokens: opt.max_new_tokens,
                limit,
            })
        }
        _ => Ok(()),
    }
}

fn ctx(adapter: &Option<Adapter>) -> Option<LoraCtx<'_>> {
    adapter.as_ref().map(|a| LoraCtx {
        adapter: a,
        scaling: a.spec.scaling(),
        dropout: 0.0,
        seed: 0,
    })
}

/// A conversation with the model's chat template: each of `turns` is a user message; each reply
/// (rendered with `add_generation_prompt`, as in training) goes to `on_reply` and into the history.
/// `vars` are passed to every render as transformers' `apply_chat_template(**kwargs)` passes them
/// (e.g. Qwen3's `enable_thinking`, as `[data] chat_template_kwargs` gave them in training).
pub fn chat(
    model_dir: &Path,
    adapter_dir: Option<&Path>,
    turns: &mut dyn Iterator<Item = String>,
    opt: &GenerateOptions,
    vars: &[(String, serde_json::Value)],
    on_reply: &mut dyn FnMut(&str),
) -> Result<(), TrainError> {
    let (model, tok, adapter, stop, context) = load(model_dir, adapter_dir, opt)?;
    let lc = ctx(&adapter);
    let template = chat_template(model_dir, &tok, vars)?;
    let mut history: Vec<serde_json::Value> = Vec::new();
    for user in turns {
        history.push(serde_json::json!({"role": "user", "content": user}));
        let text = chat_prompt(&template, &history)?;
        // The template writes BOS itself when it wants one; never add a second.
        let has_bos = template.bos_token().is_some_and(|b| text.starts_with(b));
        let ids = tok.encode(&text, !has_bos)?;
        check_context(context, "the conversation", ids.len(), opt)?;
        let new = complete(&model, lc.as_ref(), ids, &stop, opt)?;
        let reply = tok.decode(&new, true)?;
        on_reply(&reply);
        history.push(serde_json::json!({"role": "assistant", "content": reply}));
    }
    Ok(())
}

/// The tokenizer's chat template with `vars` set for every render; an error naming
/// `tokenizer_config.json` when the model has none.
pub fn chat_template(
    model_dir: &Path,
    tok: &Tokenizer,
    vars: &[(String, serde_json::Value)],
) -> Result<rtune_data::ChatTemplate, TrainError> {
    let template = rtune_data::ChatTemplate::from_tokenizer(tok)?.ok_or_else(|| {
        TrainError::Data(Box::new(rtune_data::DataError::File {
            path: model_dir.join("tokenizer_config.json"),
            message: "has no chat_template: --chat needs one (a base model? use --prompt)".into(),
        }))
    })?;
    Ok(vars
        .iter()
        .fold(template, |t, (name, value)| t.with_var(name, value)))
}

/// The text a chat turn is generated from: `history` (`{"role", "content"}` messages, the last a
/// user's) rendered with the generation prompt, as in training.
pub fn chat_prompt(
    template: &rtune_data::ChatTemplate,
    history: &[serde_json::Value],
) -> Result<String, TrainError> {
    let row = serde_json::json!({ "messages": history }).to_string();
    let conv = rtune_data::Conversation::from_json(&row).map_err(|m| {
        TrainError::Data(Box::new(rtune_data::DataError::File {
            path: "<stdin>".into(),
            message: m,
        }))
    })?;
    conv.render(template, conv.len(), true)
        .map_err(|e| TrainError::Data(Box::new(e.into())))
}

/// Loads `model_dir` (and the PEFT adapter in `adapter_dir`), continues `prompt`, returns the new text.
pub fn generate(
    model_dir: &Path,
    adapter_dir: Option<&Path>,
    prompt: &str,
    opt: &GenerateOptions,
) -> Result<String, TrainError> {
    let (model, tok, adapter, stop, context) = load(model_dir, adapter_dir, opt)?;
    let lc = ctx(&adapter);
    let dev = Device::Cpu;
    let ids = tok.encode(prompt, true)?;
    check_context(context, "the prompt", ids.len(), opt)?;
    if let Some(path) = &opt.dump_logits {
        let out = model.forward(&Inputs::new(ids.clone(), 1, ids.len()), lc.as_ref(), false)?;
        let ids64: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let ids_t = candle_core::Tensor::from_vec(ids64, (1, ids.len()), &dev)
            .map_err(TrainError::candle("ids"))?;
        let tensors = std::collections::HashMap::from([
            ("input_ids".to_string(), ids_t),
            ("logits".to_string(), out.logits),
        ]);
        candle_core::safetensors::save(&tensors, path)
            .map_err(TrainError::candle("write logits"))?;
    }
    let new = complete(&model, lc.as_ref(), ids, &stop, opt)?;
    Ok(tok.decode(&new, true)?)
}

/// Continues `ids` (a tokenised prompt) until a `stop` token or `opt.max_new_tokens`; returns the
/// new tokens. The prompt runs once, then one token at a time against the key/value cache.
pub fn complete(
    model: &Model,
    lc: Option<&LoraCtx>,
    ids: Vec<u32>,
    stop: &[u32],
    opt: &GenerateOptions,
) -> Result<Vec<u32>, TrainError> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(opt.seed);
    let mut choose = |_: usize, logits: &[f32]| pick(logits, opt, &mut rng);
    let mut out = model.complete_rows(&[ids], 1, opt.max_new_tokens, stop, lc, &mut choose)?;
    Ok(out.pop().map(|c| c.tokens).unwrap_or_default())
}

fn pick(logits: &[f32], opt: &GenerateOptions, rng: &mut impl Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i as u32)
    };
    if opt.temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / opt.temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= total);
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    // Nucleus: the smallest prefix whose mass reaches top_p.
    let mut mass = 0.0;
    let mut keep = probs.len();
    for (k, p) in probs.iter().enumerate() {
        mass += p.1;
        if mass >= opt.top_p {
            keep = k + 1;
            break;
        }
    }
    let probs = &probs[..keep];
    let mut x = rng.random::<f64>() * probs.iter().map(|p| p.1).sum::<f64>();
    for p in probs {
        x -= p.1;
        if x <= 0.0 {
            return p.0 as u32;
        }
    }
    probs[0].0 as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--template-var enable_thinking=false` reaches Qwen3's real template: the generation
    /// prompt then holds the empty think block, as transformers renders it; unset, it does not.
    #[test]
    fn template_vars_reach_the_generation_prompt() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-chat");
        let tok = Tokenizer::load(&dir, None).unwrap();
        let history = [serde_json::json!({"role": "user", "content": "Hi"})];
        let off = [("enable_thinking".to_string(), serde_json::json!(false))];
        let plain = chat_prompt(&chat_template(&dir, &tok, &[]).unwrap(), &history).unwrap();
        let thinking_off =
            chat_prompt(&chat_template(&dir, &tok, &off).unwrap(), &history).unwrap();
        let head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(plain, head);
        assert_eq!(thinking_off, format!("{head}<think>\n\n</think>\n\n"));
    }

    #[test]
    fn greedy_and_nucleus() {
        let logits = [0.0f32, 5.0, 4.9, -3.0];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        let greedy = GenerateOptions {
            max_new_tokens: 1,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            dump_logits: None,
            quantize: rtune_model::Quantize::None,
        };
        assert_eq!(pick(&logits, &greedy, &mut rng), 1);
        // top_p small enough keeps only the best token.
        let narrow = GenerateOptions {
            temperature: 1.0,
            top_p: 0.1,
            ..greedy.clone()
        };
        assert!((0..50).all(|_| pick(&logits, &narrow, &mut rng) == 1));
        // With the two near-tied tokens in the nucleus both appear.
        let wide = GenerateOptions {
            temperature: 1.0,
            top_p: 0.9,
            ..greedy
        };
        let seen: std::collections::HashSet<u32> =
            (0..200).map(|_| pick(&logits, &wide, &mut rng)).collect();
        assert!(
            seen.contains(&1) && seen.contains(&2) && !seen.contains(&3),
            "{seen:?}"
        );
    }
}
