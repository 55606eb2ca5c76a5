//! One generation batch of GRPO, as TRL 1.16's `_generate_and_score_completions` makes it:
//! `P` prompts × `num_generations` completions sampled with the live adapter over the frozen
//! base (the KV-cache decoding of the same layer code, `Model::complete_rows`), shaped by
//! transformers' logits processors ([`Warpers`]) and drawn from a seeded RNG whose state the
//! checkpoint keeps (one draw a batch; each completion its own stream from it, [`Rng::stream`]); scored by the `[[reward]]` functions; advantages over each group; the
//! old (`num_iterations > 1`) and reference (`beta > 0`, adapter off) log-probabilities of the
//! completion tokens at the sampling temperature. A completion ended by a stop token keeps it
//! (TRL's completion ids end with the EOS, counted by the completion mask).

use serde::{Deserialize, Serialize};

use rtune_data::{Example, MicroBatch};
use rtune_infer::warp::Warpers;
use rtune_model::{LoraCtx, Model};

use crate::TrainError;

/// SplitMix64: the sampler's RNG, one `u64` of state (saved by a checkpoint as is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A token drawn from the softmax of `logits` (`−∞`: removed by a warper). f64 sums, so
    /// the draw is a function of the logits and the state alone.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        let w: Vec<f64> = logits.iter().map(|l| ((l - max) as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut u = self.uniform() * total;
        let mut last = 0;
        for (i, x) in w.iter().enumerate() {
            if *x > 0.0 {
                last = i;
                if u < *x {
                    return i as u32;
                }
                u -= x;
            }
        }
        last as u32
    }
}

/// One completion of a generation batch, as a checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The prompt's index in the training file order (rollouts.jsonl's `prompt_index`).
    pub prompt_index: usize,
    pub prompt: Vec<u32>,
    /// The sampled tokens, the stop token included when one ended it.
    pub completion: Vec<u32>,
    /// Cut at `max_completion_length` (no stop token).
    pub truncated: bool,
    /// Each reward function's reward (`None`: it gave none).
    pub rewards: Vec<Option<f64>>,
    /// Σ weight · reward (TRL's nansum; `None`, TRL's NaN, when no function scored it).
    pub reward: Option<f32>,
    pub advantage: f32,
    /// Whether the std the advantage was scaled by is (close to) zero.
    pub std_zero: bool,
    /// Per completion token, `log p` under the sampling policy (`num_iterations > 1`).
    pub old: Option<Vec<f32>>,
    /// Per completion token, `log p` under the reference (`beta > 0`).
    pub reference: Option<Vec<f32>>,
}

/// `1` on the completion tokens that count in the loss (all of them, or none for a truncated
/// completion with `mask_truncated_completions`).
pub fn row_mask(r: &Row, mask_truncated: bool) -> f32 {
    if mask_truncated && r.truncated {
        0.0
    } else {
        1.0
    }
}

/// A micro-batch of completion rows as the model takes them: prompt + completion, right-padded,
/// the completion tokens the targets; and where each completion token's prediction sits.
pub struct Packed {
    pub batch: MicroBatch,
    /// The longest completion: the loss's rows are `b × t`.
    pub t: usize,
    /// `b × t`: the flat position (in `batch`'s `b × T`) whose logits predict completion token
    /// `j` of row `r`, `None` past the row's completion.
    pub pos: Vec<Option<usize>>,
}

/// Rows as one micro-batch (module docs of [`Packed`]).
pub fn pack(rows: &[&Row], pad_id: u32) -> Packed {
    let examples: Vec<Example> = rows
        .iter()
        .map(|r| {
            let mut input_ids = r.prompt.clone();
            input_ids.extend(&r.completion);
            let mut labels = vec![rtune_data::IGNORE; r.prompt.len()];
            labels.extend(r.completion.iter().map(|&c| i64::from(c)));
            Example { input_ids, labels }
        })
        .collect();
    let refs: Vec<&Example> = examples.iter().collect();
    let batch = MicroBatch::from_examples(&refs, pad_id);
    let t = rows.iter().map(|r| r.completion.len()).max().unwrap_or(0);
    let mut pos = vec![None; rows.len() * t];
    for (i, r) in rows.iter().enumerate() {
        for j in 0..r.completion.len() {
            // Position p predicts token p + 1: completion token j is at prompt.len() + j.
            pos[i * t + j] = Some(i * batch.t + r.prompt.len() + j - 1);
        }
    }
    Packed { batch, t, pos }
}

/// What sampling needs besides the model.
pub struct Sampler<'a> {
    pub warpers: Warpers,
    pub max_new: usize,
    pub stop: &'a [u32],
}

impl Rng {
    /// Completion `i`'s own stream in a generation batch whose draw was `base`: a function of
    /// the two alone, so a completion samples the same tokens whichever rank, and whichever
    /// other rows, share its batch.
    pub fn stream(base: u64, i: usize) -> Rng {
        let mut r = Rng(base ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        Rng(r.next_u64())
    }
}

/// The order a generation batch of `n` completions trains in, as TRL's `shuffle_sequence_dict`
/// shuffles it before splitting it into `steps_per_generation` micro-batches: a uniform
/// permutation (Fisher–Yates) drawn from `rng`; `order[k]` is the completion at row `k` of the
/// shuffled batch.
pub fn shuffled(n: usize, rng: &mut Rng) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        // Uniform in 0..=i: the high word of a 64 × 64-bit product (no modulo bias).
        let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    order
}

/// Samples `group` completions of every prompt (a prompt's consecutive), completion `c` drawing
/// from `rngs[c]`; returns each one's tokens (stop token kept) and whether it was cut at
/// `max_new`.
pub fn sample(
    model: &Model,
    lora: &LoraCtx,
    prompts: &[Vec<u32>],
    group: usize,
    s: &Sampler,
    rngs: &mut [Rng],
) -> Result<Vec<(Vec<u32>, bool)>, TrainError> {
    assert_eq!(rngs.len(), prompts.len() * group, "an RNG per completion");
    // Every token each completion's row holds so far (the repetition penalty's `seen`).
    let mut seen: Vec<Vec<u32>> = (0..prompts.len() * group)
        .map(|c| prompts[c / group].clone())
        .collect();
    let out = {
        let mut pick = |c: usize, logits: &[f32]| {
            let mut l = logits.to_vec();
            s.warpers.apply(&mut l, &seen[c]);
            let t = rngs[c].sample(&l);
            seen[c].push(t);
            t
        };
        model.complete_rows(prompts, group, s.max_new, s.stop, Some(lora), &mut pick)?
    };
    Ok(out
        .into_iter()
        .zip(&seen)
        .map(|(c, seen)| {
            let mut tokens = c.tokens;
            if c.stopped {
                // The stop token `pick` chose: the last token its row saw.
                tokens.extend(seen.last());
            }
            (tokens, !c.stopped)
        })
        .collect())
}

/// Per completion token of each row, `log softmax(z / T)[token]` under `lora` (`None`: the base
/// alone, the reference), `rows_at_once` rows a forward (chunked: never the whole batch's logits).
pub fn completion_logps(
    model: &Model,
    lora: Option<&LoraCtx>,
    rows: &[&Row],
    temperature: f64,
    pad_id: u32,
    rows_at_once: usize,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let mut out = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(rows_at_once.max(1)) {
        let mut p = pack(chunk, pad_id);
        let inputs = crate::compute::take_inputs(&mut p.batch);
        let nll = model.token_nll_at(&inputs, &p.batch.targets, lora, temperature)?;
        for (i, r) in chunk.iter().enumerate() {
            out.push(
                (0..r.completion.len())
                    .map(|j| -nll[p.pos[i * p.t + j].expect("inside the completion")])
                    .collect(),
            );
        }
    }
    Ok(out)
}
