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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{estimate, fit_to_data, Phase};
    use rtune_model::HfConfig;

    /// Llama: hidden 8, 2 heads of 4 (2 kv heads), intermediate 16, vocab 32, 2 layers.
    fn tiny() -> ModelConfig {
        let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":2,"vocab_size":32}"#;
        serde_json::from_str::<HfConfig>(text)
            .unwrap()
            .into_config(std::path::Path::new("config.json"))
            .unwrap()
    }

    /// 2 completion rows a micro-batch from a generation batch of `completions`.
    fn grpo(completions: usize, prompt_len: usize, max_completion: usize) -> Settings {
        let mut s = Settings::new(2, 2, prompt_len + max_completion, false);
        s.sampling = Some(Sampling {
            completions,
            prompt_len,
            max_completion,
            keeps_old: true,
            reference: true,
        });
        s
    }

    /// Where sampling is the peak (64 completions decoded together, 2 trained at a time), one
    /// more completion token adds the KV cache's two copies of one slot of every completion,
    /// `2·C·kv_bytes_per_slot`, and the kept batch's id and two log-probs, `3·4·C`: exactly,
    /// since the heap's high-water mark is the sampling phase's. Dropping the cache or the kept
    /// batch changes the difference.
    #[test]
    fn sampling_grows_by_the_cache_and_the_kept_batch_per_completion_token() {
        let c = tiny();
        let (cs, prompt) = (64u64, 20);
        let at = |n: usize| estimate(&c, &grpo(cs as usize, prompt, n));
        let (a, b) = (at(100), at(101));
        assert_eq!(a.phase, Phase::Sampling.name());
        assert_eq!(b.phase, Phase::Sampling.name());
        // 2 layers × (k, v) × 2 kv heads × 4 dims × 4 bytes.
        let per_slot = kv_bytes_per_slot(&c, &grpo(1, 1, 1));
        assert_eq!(per_slot, 2 * 2 * 2 * 4 * 4);
        assert_eq!(a.get(names::KV_CACHE), 2 * cs * 120 * per_slot);
        assert_eq!(b.peak_bytes - a.peak_bytes, 2 * cs * per_slot + 3 * 4 * cs);
        // The training pass alone (no generation batch) is lower.
        let mut plain = grpo(cs as usize, prompt, 100);
        plain.sampling = None;
        let p = estimate(&c, &plain);
        assert!(
            p.peak_bytes < a.peak_bytes,
            "{} vs {}",
            p.peak_bytes,
            a.peak_bytes
        );
        assert_eq!(p.get(names::KV_CACHE) + p.get(names::GENERATION), 0);
    }

    /// The training pass of a GRPO step is the longest prompt plus a whole completion, every
    /// completion token a target (the prompts are data, not targets); the cache's prompt is the
    /// longest prompt.
    #[test]
    fn grpo_rows_are_the_longest_prompt_and_a_whole_completion() {
        let prompt = |n: usize| rtune_data::Example {
            input_ids: vec![1; n],
            labels: vec![rtune_data::IGNORE; n],
        };
        let mut s = grpo(16, 90, 32);
        fit_to_data(&mut s, &[prompt(7), prompt(12), prompt(9)], 128);
        assert_eq!(s.seq_len, 12 + 32);
        assert_eq!(s.target_rows, Some(2 * 32));
        assert_eq!(s.sampling.unwrap().prompt_len, 12);
        assert_eq!(s.sampling.unwrap().slots(), 44);
    }
}
