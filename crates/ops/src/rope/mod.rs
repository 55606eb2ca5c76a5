//! Rotary position embedding, rotate-half form (transformers' `apply_rotary_pos_emb`):
//! `y = x·cos + rotate_half(x)·sin`; its backward is the transpose, `dx = dy·cos − rotate_half(dy·sin)`.
//! [`tables`] makes cos/sin from the frequencies (`rtune_model::rope::inv_freq`, the config's
//! scaling rule) and the positions.
//!
//! The op's files: this one (what the model calls), `op.rs` (the candle ops), `cpu.rs` (the loops),
//! `reference.rs` (plain formulations), `cuda.rs` (launchers of `kernels/rope.cuh`), `check.rs`
//! (for `rtune selftest`), `tests.rs`.

#[cfg(feature = "kernels")]
pub mod check;
pub(crate) mod cpu;
#[cfg(feature = "kernels")]
pub mod cuda;
pub mod op;
pub mod reference;
#[cfg(test)]
mod tests;

use candle_core::{DType, Device, Result, Tensor, D};

pub use reference::{apply_backward_reference, apply_reference};

fn halves(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let d = x.dim(D::Minus1)?;
    Ok((
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    ))
}

/// `x: (B, H, T, Dh)` → rotated, same shape; `cos, sin: (B or 1, 1, T, Dh)`. Fused
/// ([`crate::rope::op::rope`]); [`apply_reference`] is the plain formulation.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    crate::rope::op::rope(x, cos, sin)
}

/// Backward of [`apply`] (fused: [`crate::rope::op::rope_bwd`]).
pub fn apply_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    crate::rope::op::rope_bwd(dy, cos, sin)
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
