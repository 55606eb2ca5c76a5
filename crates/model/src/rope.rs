//! Rotary position embeddings (Su et al. 2021, "RoFormer"), in the "rotate half" layout of
//! transformers' Llama: `y = x·cos + rotate_half(x)·sin`, `rotate_half([x1, x2]) = [-x2, x1]`,
//! over the first `rotary_dim` of each head (all of it but for `partial_rotary_factor`).
//! Frequencies and angles are computed in f32 as transformers does, so tables agree to the last bit
//! that f32 cos/sin can give.

use candle_core::{DType, Device, Result, Tensor};

use crate::config::{ModelConfig, RopeScaling};

/// A model's rotary frequencies (or its sliding layers'), from which each batch's tables are made.
#[derive(Debug, Clone)]
pub struct Freqs {
    /// `inv_freq: (rotary_dim / 2)`; LongRoPE's short set.
    pub inv_freq: Vec<f32>,
    /// LongRoPE: the long set, and the pre-training length past which a batch uses it.
    pub long: Option<(Vec<f32>, usize)>,
    /// cos and sin are multiplied by this (LongRoPE's attention factor; 1 otherwise).
    pub scale: f32,
}

impl Freqs {
    /// The frequencies of a batch at `positions`: LongRoPE's long set when its length (largest
    /// position plus one) is past the pre-training length (transformers'
    /// `longrope_frequency_update`: one set for the whole batch, chosen again at every forward),
    /// the short set otherwise.
    pub fn for_positions(&self, positions: &[u32]) -> &[f32] {
        match &self.long {
            Some((long, original)) => {
                let len = positions.iter().max().map_or(0, |&p| p as usize + 1);
                if len > *original {
                    long
                } else {
                    &self.inv_freq
                }
            }
            None => &self.inv_freq,
        }
    }

    /// `cos, sin: (b, 1, t, rotary_dim)` in `dtype` for `positions: (b, t)`.
    pub fn tables(
        &self,
        positions: &[u32],
        b: usize,
        t: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let inv = self.for_positions(positions);
        rtune_ops::rope::tables_scaled(inv, self.scale, positions, b, t, dtype, dev)
    }
}

/// The global layers' frequencies after the config's scaling rule.
pub fn freqs(cfg: &ModelConfig) -> Freqs {
    freqs_for(cfg.rotary_dim(), cfg.rope_theta, &cfg.rope_scaling)
}

/// The sliding-window layers' frequencies when they have their own RoPE (Gemma 3's local base).
pub fn local_freqs(cfg: &ModelConfig) -> Option<Freqs> {
    let (theta, scaling) = cfg.variant.local_rope.as_ref()?;
    Some(freqs_for(cfg.rotary_dim(), *theta, scaling))
}

/// The frequencies of base `theta` over a rotated width `d` after `scaling`.
fn freqs_for(d: usize, theta: f64, scaling: &RopeScaling) -> Freqs {
    match scaling {
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => Freqs {
            inv_freq: longrope(d, theta, short_factor),
            long: Some((
                longrope(d, theta, long_factor),
                *original_max_position_embeddings,
            )),
            scale: *attention_factor as f32,
        },
        other => Freqs {
            inv_freq: inv_freq_for(d, theta, other),
            long: None,
            scale: 1.0,
        },
    }
}

/// `theta^(i/d)` for `i = 0, 2, …, d − 2`, in f32 as torch's `base ** (arange(0, d, 2) / d)`.
fn powers(d: usize, theta: f64) -> impl Iterator<Item = f32> {
    let base = theta as f32;
    (0..d)
        .step_by(2)
        .map(move |i| base.powf(i as f32 / d as f32))
}

/// LongRoPE's `1 / (ext[i] · theta^(2i/d))` (transformers' `_compute_longrope_parameters`; the
/// factor lists have `d / 2` entries, checked with the config).
fn longrope(d: usize, theta: f64, ext: &[f64]) -> Vec<f32> {
    powers(d, theta)
        .zip(ext)
        .map(|(p, &e)| 1.0 / (e as f32 * p))
        .collect()
}

/// `inv_freq: (d / 2)` of base `theta` after `scaling`.
fn inv_freq_for(d: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let raw: Vec<f32> = powers(d, theta).map(|p| 1.0 / p).collect();
    match *scaling {
        // LongRoPE scales by its factor lists instead ([`freqs_for`]).
        RopeScaling::None | RopeScaling::LongRope { .. } => raw,
        RopeScaling::Linear { factor } => raw.iter().map(|f| f / factor as f32).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let (factor, low, high, old) = (
                factor as f32,
                low_freq_factor as f32,
                high_freq_factor as f32,
                original_max_position_embeddings as f32,
            );
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            raw.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    // transformers: ~(wavelen < high) & ~(wavelen > low); wavelen is finite here.
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    if medium {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    }
}
