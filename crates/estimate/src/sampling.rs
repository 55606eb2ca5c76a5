//! GRPO's generation batch (`[train] objective = "grpo"`, issue 44): what a step holds besides the
//! training pass over its completions, which the rest of the estimate counts as `B =
//! micro_batch_size` rows of `prompt + max_completion_length` tokens.
//!
//! Sampling (`rtune_train`'s `rollout::sample`, `Model::complete_rows`) runs before the step's
//! training pass, all `C = micro_batch_size × steps_per_generation` completions of a rank decoded
//! together with the key/value cache. At its last decoding step every layer holds its cache of
//! the `S − 1` slots before (`(C, Hkv, S − 1, Dh)` keys and values each) and makes the `S`-slot
//! one by concatenating (`rtune_ops::attend_after`): both are alive until the step has run every
//! layer (`Model::decode_rows` swaps the whole list), so 2 × 2 × L tensors of `C × Hkv × S × Dh`
//! elements, `S = longest prompt + max_completion_length` (the prompts left-padded to the
//! longest). Besides them the step's logits `(C, V)` f32 and their host copy. The heap the cache
//! grew stays (glibc never trims it), so the training pass after it reuses that memory: the
//! phase comes first in [`crate::estimate_on`]'s high-water mark.
//!
//! The generation batch itself lives through its `steps_per_generation × num_iterations`
//! micro-batches: each completion's prompt and tokens (u32), and per completion token the old
//! (`num_iterations > 1` or more micro-batches a generation than `grad_accum`) and reference
//! (`beta > 0`) log-probabilities (f32). Those passes (`rollout::completion_logps`) are
//! forward-only over `micro_batch_size` rows at a time, below the training pass.

use rtune_model::ModelConfig;

use crate::{elem, item, names, Item, Settings};

/// The shape of a rank's GRPO generation batch (`Settings::sampling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampling {
    /// `C`: completions a rank samples together (`micro_batch_size × steps_per_generation`).
    pub completions: usize,
    /// The longest prompt in tokens (worst case: `max_seq_len − max_completion_length`).
    pub prompt_len: usize,
    /// `max_completion_length`: every completion assumed to run to it.
    pub max_completion: usize,
    /// Old log-probs are kept (TRL: `num_iterations > 1` or `steps_per_generation > grad_accum`).
    pub keeps_old: bool,
    /// `beta > 0`: reference log-probs are kept.
    pub reference: bool,
}

impl Sampling {
    /// `S`: the cache's slots a row at the last decoding step.
    pub fn slots(&self) -> u64 {
        (self.prompt_len + self.max_completion) as u64
    }
}

/// The KV cache's bytes per completion and slot: keys and values of every layer.
pub fn kv_bytes_per_slot(c: &ModelConfig, s: &Settings) -> u64 {
    2 * c.num_layers as u64 * (c.num_kv_heads * c.head_dim) as u64 * elem(s.dtype)
}

/// The tensors alive at the last decoding step (module docs); empty unless `s.sampling`.
pub(crate) fn sampling_items(c: &ModelConfig, s: &Settings) -> Vec<Item> {
    let Some(g) = s.sampling else {
        return Vec::new();
    };
    let (cs, l) = (g.completions as u64, c.num_layers as u64);
    // One layer's keys (or values): (C, Hkv, S, Dh).
    let one = cs * g.slots() * (c.num_kv_heads * c.head_dim) as u64 * elem(s.dtype);
    let logits = cs * c.vocab_size as u64 * 4;
    vec![
        // The cache before the step and the one it makes: keys and values of every layer.
        item(names::KV_CACHE, one, 2 * 2 * l),
        // The step's logits (C, V) f32 and their rows on the host.
        item(names::SAMPLING_LOGITS, logits, 2),
    ]
}

/// The generation batch kept through its micro-batches (module docs): alive the whole step.
pub(crate) fn generation_items(s: &Settings) -> Vec<Item> {
    let Some(g) = s.sampling else {
        return Vec::new();
    };
    let cs = g.completions as u64;
    let ids = cs * g.slots() * 4;
    let logps = cs * g.max_completion as u64 * 4 * (g.keeps_old as u64 + g.reference as u64);
    vec![item(names::GENERATION, ids + logps, 1)]
}

/// GRPO's settings from the run config: `None` for another objective. `prompt_len` is the worst
/// case until `fit_to_data` narrows it to the longest prompt.
pub fn for_config(cfg: &rtune_config::RunConfig) -> Option<Sampling> {
    let rtune_config::Objective::Grpo(g) = &cfg.train.objective else {
        return None;
    };
    Some(Sampling {
        completions: cfg.train.micro_batch_size * g.steps_per_generation,
        prompt_len: cfg.data.max_seq_len.saturating_sub(g.max_completion_length),
        max_completion: g.max_completion_length,
        keeps_old: g.num_iterations > 1 || g.steps_per_generation > cfg.train.grad_accum,
        reference: g.beta > 0.0,
    })
}
