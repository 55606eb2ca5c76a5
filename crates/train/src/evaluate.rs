//! Evaluation during a run: what the validation loss reports (each objective's recipe computes it:
//! `crate::objective`), and greedy completions of the configured `eval_prompts`.

use serde::Serialize;

use rtune_data::Tokenizer;
use rtune_lora::Adapter;
use rtune_model::{LoraCtx, Model};

use crate::TrainError;
use rtune_infer::generate::{complete, GenerateOptions};

/// One `metrics.jsonl` line of an evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct EvalMetrics {
    pub step: usize,
    /// The objective's mean loss over the validation rows (SFT: over every target token).
    pub valid_loss: f64,
    /// `exp(valid_loss)` (SFT only: a preference loss has no perplexity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub valid_ppl: Option<f64>,
    /// Target tokens of the validation set (completion tokens of both sides for pairs).
    pub valid_tokens: usize,
    /// The objective's own metrics on the validation rows, under its names (a preference run's
    /// under TRL's `eval_` names).
    #[serde(flatten)]
    pub recipe: std::collections::BTreeMap<String, f64>,
}

/// One `samples.jsonl` line.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub step: usize,
    pub prompt: String,
    pub completion: String,
}

/// The adapter as evaluation applies it: no dropout.
pub(crate) fn no_dropout(adapter: &Adapter) -> LoraCtx<'_> {
    LoraCtx {
        adapter,
        scaling: adapter.spec.scaling(),
        dropout: 0.0,
        seed: 0,
    }
}

/// Greedy completions of `prompts` with the current adapter.
pub fn samples(
    step: usize,
    model: &Model,
    adapter: &Adapter,
    tok: &Tokenizer,
    prompts: &[String],
    max_new_tokens: usize,
) -> Result<Vec<Sample>, TrainError> {
    let lc = no_dropout(adapter);
    let mut stop = model.cfg.eos_token_ids.clone();
    stop.extend(tok.eos_id);
    let opt = GenerateOptions {
        max_new_tokens,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        dump_logits: None,
        quantize: rtune_model::Quantize::None,
    };
    prompts
        .iter()
        .map(|p| {
            let ids = tok.encode(p, true)?;
            let new = complete(model, Some(&lc), ids, &stop, &opt)?;
            Ok(Sample {
                step,
                prompt: p.clone(),
                completion: tok.decode(&new, true)?,
            })
        })
        .collect()
}
