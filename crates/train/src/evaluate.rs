//! Evaluation during a run: validation loss and perplexity over the held-out examples, and greedy
//! completions of the configured `eval_prompts`.

use serde::Serialize;

use rtune_data::{Example, MicroBatch, Tokenizer};
use rtune_lora::Adapter;
use rtune_model::{LoraCtx, Model};

use crate::generate::{complete, GenerateOptions};
use crate::TrainError;

/// One `metrics.jsonl` line of an evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct EvalMetrics {
    pub step: usize,
    /// Mean next-token loss over every target token of the validation set (SFT), or the
    /// objective's mean loss over the validation pairs (preference).
    pub valid_loss: f64,
    /// `exp(valid_loss)` (SFT only: a preference loss has no perplexity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub valid_ppl: Option<f64>,
    /// Target tokens of the validation set (completion tokens of both sides for pairs).
    pub valid_tokens: usize,
    /// A preference run's metrics on the validation pairs, under TRL's `eval_` names.
    #[serde(flatten)]
    pub preference: std::collections::BTreeMap<String, f64>,
}

/// One `samples.jsonl` line.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub step: usize,
    pub prompt: String,
    pub completion: String,
}

/// The adapter as evaluation applies it: no dropout.
fn no_dropout(adapter: &Adapter) -> LoraCtx<'_> {
    LoraCtx {
        adapter,
        scaling: adapter.spec.scaling(),
        dropout: 0.0,
        seed: 0,
    }
}

/// Validation loss over `valid`, `micro_batch` rows at a time, in order (no dropout, no gradient).
pub fn validation(
    step: usize,
    model: &Model,
    adapter: &Adapter,
    valid: &[Example],
    micro_batch: usize,
    pad_id: u32,
) -> Result<Option<EvalMetrics>, TrainError> {
    let lc = no_dropout(adapter);
    let (mut sum, mut n) = (0.0, 0usize);
    for chunk in valid.chunks(micro_batch.max(1)) {
        let refs: Vec<&Example> = chunk.iter().collect();
        let mut mb = MicroBatch::from_examples(&refs, pad_id);
        n += mb.target_tokens();
        let inputs = crate::compute::take_inputs(&mut mb);
        sum += model.eval_loss(&inputs, &mb.targets, Some(&lc))?;
    }
    if n == 0 {
        return Ok(None);
    }
    let valid_loss = sum / n as f64;
    Ok(Some(EvalMetrics {
        step,
        valid_loss,
        valid_ppl: Some(valid_loss.exp()),
        valid_tokens: n,
        preference: Default::default(),
    }))
}

/// The preference objective over the validation `pairs` (their reference log-probs filled in),
/// `micro_batch` pairs at a time, no dropout, no gradient: the mean loss and TRL's metrics.
pub fn validation_pairs(
    step: usize,
    model: &Model,
    adapter: &Adapter,
    objective: rtune_config::Objective,
    pairs: &[rtune_data::Pair],
    micro_batch: usize,
    pad_id: u32,
) -> Result<Option<EvalMetrics>, TrainError> {
    if pairs.is_empty() {
        return Ok(None);
    }
    let lc = no_dropout(adapter);
    let mut batches: Vec<rtune_data::PairBatch> = pairs
        .chunks(micro_batch.max(1))
        .map(|chunk| {
            let refs: Vec<&rtune_data::Pair> = chunk.iter().collect();
            let (prompt_nll, long_past) = (objective.nll_on_prompt(), model.long_rope_past());
            rtune_data::PairBatch::with_rope(&refs, pad_id, prompt_nll, long_past)
        })
        .collect();
    let totals = crate::preference::StepTotals {
        pairs: pairs.len(),
        nll_tokens: batches.iter().map(|b| b.chosen_targets()).sum(),
    };
    let (mut loss, mut sums, mut tokens) = (0.0, crate::preference::PairSums::default(), 0);
    for pb in &mut batches {
        let nll = crate::pairs::pair_nll(model, Some(&lc), pb)?;
        let (l, _, s) = crate::preference::weigh(&objective, pb, &nll, totals);
        loss += l;
        sums.add(&s);
        tokens += pb.batch.target_tokens();
    }
    Ok(Some(EvalMetrics {
        step,
        valid_loss: loss,
        valid_ppl: None,
        valid_tokens: tokens,
        preference: crate::preference::metrics(&sums, pairs.len(), objective, "eval_"),
    }))
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
