//! Rotary position embeddings (Su et al. 2021, "RoFormer"), in the "rotate half" layout of
//! transformers' Llama: `y = x·cos + rotate_half(x)·sin`, `rotate_half([x1, x2]) = [-x2, x1]`.
//! Frequencies and angles are computed in f32 as transformers does, so tables agree to the last bit
//! that f32 cos/sin can give.

use candle_core::{DType, Device, Result, Tensor, D};

use crate::config::{ModelConfig, RopeScaling};

/// `inv_freq: (head_dim / 2)` after the config's scaling rule.
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let base = cfg.rope_theta as f32;
    let raw: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1.0 / base.powf(i as f32 / d as f32))
        .collect();
    match cfg.rope_scaling {
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

/// `cos, sin: (B, 1, T, head_dim)` in `dtype` for positions `(B, T)`.
pub fn tables(
    inv_freq: &[f32],
    positions: &[u32],
    b: usize,
    t: usize,
    dtype: DType,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(positions.len() * half * 2);
    let mut sin = Vec::with_capacity(positions.len() * half * 2);
    for &p in positions {
        let start = cos.len();
        for &f in inv_freq {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
        // emb = cat(freqs, freqs)
        cos.extend_from_within(start..start + half);
        sin.extend_from_within(start..start + half);
    }
    let shape = (b, 1, t, half * 2);
    let cos = Tensor::from_vec(cos, shape, dev)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, shape, dev)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

fn halves(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let d = x.dim(D::Minus1)?;
    Ok((
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    ))
}

/// `x: (B, H, T, Dh)` → rotated, same shape; `cos, sin: (B or 1, 1, T, Dh)`. Fused
/// ([`crate::fused::rope`]); [`apply_reference`] is the plain formulation.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    crate::fused::rope(x, cos, sin)
}

/// Backward of [`apply`] (fused: [`crate::fused::rope_bwd`]).
pub fn apply_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    crate::fused::rope_bwd(dy, cos, sin)
}

/// [`apply`] as candle ops: the reference for the fused op (and differentiable by autograd).
pub fn apply_reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (x1, x2) = halves(x)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(cos)? + rot.broadcast_mul(sin)?
}

/// Backward of [`apply_reference`]: the rotation's transpose, `dx = dy·cos + rotate_halfᵀ(dy·sin)`
/// with `rotate_halfᵀ([z1, z2]) = [z2, -z1]`.
pub fn apply_backward_reference(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let z = dy.broadcast_mul(sin)?;
    let (z1, z2) = halves(&z)?;
    let rot_t = Tensor::cat(&[&z2, &z1.neg()?], D::Minus1)?;
    dy.broadcast_mul(cos)? + rot_t
}
