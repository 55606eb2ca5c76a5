//! Rotary position embeddings (Su et al. 2021, "RoFormer") of a model: its frequencies from its
//! config. The frequency tables, every scaling rule (linear, llama3, longrope, YaRN) and the
//! rotation itself are the RoPE op's ([`rtune_ops::rope`]); this file only picks the config's
//! base, width and rule.

pub use rtune_ops::rope::Freqs;

use crate::config::ModelConfig;

/// The global layers' frequencies after the config's scaling rule.
pub fn freqs(cfg: &ModelConfig) -> Freqs {
    Freqs::new(cfg.rotary_dim(), cfg.rope_theta, &cfg.rope_scaling)
}

/// The sliding-window layers' frequencies when they have their own RoPE (Gemma 3's local base).
pub fn local_freqs(cfg: &ModelConfig) -> Option<Freqs> {
    let (theta, scaling) = cfg.variant.local_rope.as_ref()?;
    Some(Freqs::new(cfg.rotary_dim(), *theta, scaling))
}
