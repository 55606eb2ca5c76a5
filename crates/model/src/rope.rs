//! Rotary position embeddings (Su et al. 2021, "RoFormer"), in the "rotate half" layout of
//! transformers' Llama: `y = x·cos + rotate_half(x)·sin`, `rotate_half([x1, x2]) = [-x2, x1]`.
//! Frequencies and angles are computed in f32 as transformers does, so tables agree to the last bit
//! that f32 cos/sin can give.

use crate::config::{ModelConfig, RopeScaling};

/// `inv_freq: (head_dim / 2)` after the config's scaling rule.
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    inv_freq_for(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling)
}

/// The sliding-window layers' `inv_freq` when they have their own RoPE (Gemma 3's local base).
pub fn local_inv_freq(cfg: &ModelConfig) -> Option<Vec<f32>> {
    let (theta, scaling) = cfg.variant.local_rope.as_ref()?;
    Some(inv_freq_for(cfg.head_dim, *theta, scaling))
}

/// `inv_freq: (d / 2)` of base `theta` after `scaling`.
fn inv_freq_for(d: usize, theta: f64, scaling: &RopeScaling) -> Vec<f32> {
    let base = theta as f32;
    let raw: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1.0 / base.powf(i as f32 / d as f32))
        .collect();
    match *scaling {
        RopeScaling::None => raw,
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
