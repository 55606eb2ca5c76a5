//! RoPE's frequencies, `inv_freq[i] = 1 / theta^(2i/d)` for the `d / 2` pairs of a rotated width
//! `d`, after the config's scaling rule ([`RopeScaling`]): linear position interpolation, Llama
//! 3.1's smooth low-frequency scaling, LongRoPE's per-pair factors (two sets, chosen by a batch's
//! length) and YaRN's ramp between interpolation and extrapolation, each with the factor cos and
//! sin are multiplied by ([`Freqs::scale`]). [`Freqs::tables`] makes a batch's cos/sin
//! ([`super::tables_scaled`]).
//!
//! Reference: transformers 5.24's `modeling_rope_utils` (`_compute_default_rope_parameters`,
//! `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
//! `_compute_longrope_parameters`, `_compute_yarn_parameters`). The frequencies are f32 tensors
//! there and here, computed in the same order (`base ** (arange(0, d, 2) / d)` in f32, the rule's
//! steps in f32, its Python scalars in f64), so they agree bit for bit except where torch's
//! vectorized `pow` (Sleef's `powf_u10`, within 1 ulp) rounds `base^x` differently from Rust's
//! correctly rounded `powf`: one ulp, in a few exponents of some bases (2 of 32 at gpt-oss's
//! 150000; none at 1e4, 5e5, 1e6). `tests/parity/rope_freqs.json` (made by
//! `tests/parity/make_rope_goldens.py`) holds transformers' values, `tests.rs` compares.
//! Reading the rule from `config.json` is the model's (`rtune_model::config`).

use candle_core::{DType, Device, Result, Tensor};

/// The scaling rule of a model's rotary frequencies.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// LongRoPE (Phi-3 128k, Phi-4-mini): `inv_freq[i] = 1 / (ext[i] · theta^(2i/d))` with `ext`
    /// the long factors when a batch reaches past `original_max_position_embeddings` (its
    /// largest position + 1 is greater), the short ones otherwise; cos and sin are multiplied by
    /// `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
    /// YaRN (Peng et al. 2023; gpt-oss, Qwen's long-context configs): see [`Yarn`].
    Yarn(Yarn),
}

/// YaRN's parameters as `config.json` gives them (transformers' `rope_parameters` keys; the
/// optional ones `None` where absent, so the defaults are applied as transformers applies them).
///
/// `inv_freq[i] = interp[i]·(1 − e[i]) + extrap[i]·e[i]` with `extrap = 1 / theta^(2i/d)`,
/// `interp = 1 / (factor · theta^(2i/d))` and `e = 1 − ramp(i)`, `ramp` linear from 0 at pair
/// `low` to 1 at pair `high` (clamped), where `low`/`high` are the pairs that turn `beta_fast` /
/// `beta_slow` times over `original_max_position_embeddings` positions, floored/ceiled when
/// `truncate`. cos and sin are multiplied by `attention_factor`, or when it is not given
/// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` (both given and non-zero) or
/// `mscale(factor, 1)`, with `mscale(s, m) = 0.1·m·ln s + 1` for `s > 1`, else 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Yarn {
    /// The context extension (`factor`; the config reader puts `max_position_embeddings /
    /// original_max_position_embeddings` where it is null, as transformers does).
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    /// Default 32 (also for 0: transformers' `beta_fast or 32`).
    pub beta_fast: Option<f64>,
    /// Default 1 (also for 0).
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub attention_factor: Option<f64>,
    /// Whether the correction range is rounded outward to whole pairs (default true; gpt-oss sets
    /// false).
    pub truncate: bool,
}

/// A model's rotary frequencies (or its sliding layers'), from which each batch's tables are made.
#[derive(Debug, Clone)]
pub struct Freqs {
    /// `inv_freq: (rotary_dim / 2)`; LongRoPE's short set.
    pub inv_freq: Vec<f32>,
    /// LongRoPE: the long set, and the pre-training length past which a batch uses it.
    pub long: Option<(Vec<f32>, usize)>,
    /// cos and sin are multiplied by this (LongRoPE's and YaRN's attention factor; 1 otherwise).
    pub scale: f32,
}

impl Freqs {
    /// The frequencies of base `theta` over a rotated width `d` (even) after `scaling`.
    pub fn new(d: usize, theta: f64, scaling: &RopeScaling) -> Freqs {
        let plain = |inv_freq| Freqs {
            inv_freq,
            long: None,
            scale: 1.0,
        };
        let raw = || -> Vec<f32> { powers(d, theta).map(|p| 1.0 / p).collect() };
        match scaling {
            RopeScaling::None => plain(raw()),
            RopeScaling::Linear { factor } => {
                plain(raw().iter().map(|f| f / *factor as f32).collect())
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => plain(llama3(
                &raw(),
                *factor,
                *low_freq_factor,
                *high_freq_factor,
                *original_max_position_embeddings,
            )),
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
            RopeScaling::Yarn(y) => {
                let (inv_freq, attention_factor) = yarn(d, theta, y);
                Freqs {
                    inv_freq,
                    long: None,
                    scale: attention_factor as f32,
                }
            }
        }
    }

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
        super::tables_scaled(inv, self.scale, positions, b, t, dtype, dev)
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

/// Llama 3.1's rule on the unscaled frequencies `raw` (transformers' `_compute_llama3_parameters`).
fn llama3(raw: &[f32], factor: f64, low: f64, high: f64, old: f64) -> Vec<f32> {
    let (factor, low, high, old) = (factor as f32, low as f32, high as f32, old as f32);
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

/// YaRN's attention factor (transformers' `_compute_yarn_parameters`, in f64): the given one, else
/// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` where both are given and non-zero,
/// else `mscale(factor, 1)`; `mscale(s, m) = 0.1·m·ln s + 1` for `s > 1`, else 1.
pub fn yarn_attention_factor(y: &Yarn) -> f64 {
    let mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    match y.attention_factor {
        Some(a) => a,
        None => match (nonzero(y.mscale), nonzero(y.mscale_all_dim)) {
            (Some(m), Some(all)) => mscale(y.factor, m) / mscale(y.factor, all),
            _ => mscale(y.factor, 1.0),
        },
    }
}

/// Python's truthiness of an optional number (`x or default`): absent and 0 are both false.
fn nonzero(v: Option<f64>) -> Option<f64> {
    v.filter(|&x| x != 0.0)
}

/// transformers' `_compute_yarn_parameters`: `(inv_freq, attention_factor)`. The correction range
/// and the attention factor are Python floats (f64); the frequencies and the ramp f32 tensors, each
/// Python scalar entering a tensor op as f32.
fn yarn(d: usize, theta: f64, y: &Yarn) -> (Vec<f32>, f64) {
    let factor = y.factor;
    let attention_factor = yarn_attention_factor(y);
    // `beta_fast or 32`, `beta_slow or 1`.
    let beta_fast = nonzero(y.beta_fast).unwrap_or(32.0);
    let beta_slow = nonzero(y.beta_slow).unwrap_or(1.0);
    let orig = y.original_max_position_embeddings;
    let dim = d as f64;
    // The pair index that turns `rotations` times over the pre-training length.
    let correction_dim = |rotations: f64| {
        (dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001; // transformers: "Prevent singularity"
    }
    let (low32, span32) = (low as f32, (high - low) as f32);
    let inv_freq = powers(d, theta)
        .enumerate()
        .map(|(i, p)| {
            let extrapolation = 1.0 / p;
            let interpolation = 1.0 / (factor as f32 * p);
            let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
            let e = 1.0 - ramp;
            interpolation * (1.0 - e) + extrapolation * e
        })
        .collect();
    (inv_freq, attention_factor)
}
