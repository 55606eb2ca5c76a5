//! Rotary position embedding, rotate-half form (transformers' `apply_rotary_pos_emb`):
//! `y = x·cos + rotate_half(x)·sin`; its backward is the transpose, `dx = dy·cos − rotate_half(dy·sin)`.
//! [`tables`] makes cos/sin from the frequencies ([`Freqs`]: `freqs.rs`, the config's scaling
//! rule — linear, llama3, longrope, YaRN) and the positions.
//!
//! Partial rotary (Phi-4-mini's `partial_rotary_factor`): tables narrower than the head, `(…, R)`
//! with `R < Dh`, rotate the first `R` of each head (`rotate_half` over those `R`) and pass the
//! rest through, as transformers' Phi-3 `apply_rotary_pos_emb` does; the backward passes the
//! rest's gradient through. The fused op runs on the rotated part, copied out (one `(…, R)`
//! copy and a concatenation more than the full rotation).
//!
//! f32 tables with a lower-precision `x` (OLMo 2 in bf16: transformers' `Olmo2RotaryEmbedding`
//! keeps cos/sin in f32, so `q·cos + rotate_half(q)·sin` promotes to f32 and rounds once at the
//! end): [`apply`] and [`apply_backward`] widen `x` to f32 (exact), rotate in f32 and round the
//! result once to `x`'s type. The backward rounds once too, where torch's autograd rounds each
//! branch's gradient to bf16 before their sum (one bf16 ulp apart at most).
//!
//! The op's files: this one (what the model calls), `freqs.rs` (the frequency tables), `op.rs` (the candle ops), `cpu.rs` (the loops),
//! `reference.rs` (plain formulations), `cuda.rs` (launchers of `kernels/rope.cuh`), `check.rs`
//! (for `rtune selftest`), `tests.rs`.

#[cfg(feature = "kernels")]
pub mod check;
pub(crate) mod cpu;
#[cfg(feature = "kernels")]
pub mod cuda;
pub mod freqs;
pub mod op;
pub mod reference;
#[cfg(test)]
mod tests;

use candle_core::{DType, Device, Result, Tensor, D};

pub use freqs::{Freqs, RopeScaling, Yarn};
pub use reference::{apply_backward_reference, apply_reference};

fn halves(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let d = x.dim(D::Minus1)?;
    Ok((
        x.narrow(D::Minus1, 0, d / 2)?,
        x.narrow(D::Minus1, d / 2, d / 2)?,
    ))
}

/// `x: (B, H, T, Dh)` → rotated, same shape; `cos, sin: (B or 1, 1, T, R)`, `R ≤ Dh` even (the
/// first `R` of each head rotate). Fused ([`crate::rope::op::rope`]); [`apply_reference`] is the
/// plain formulation.
/// f32 tables with a lower-precision `x`: see the module docs.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    in_table_dtype(x, cos, |x| {
        on_rotated(x, cos, |r| crate::rope::op::rope(r, cos, sin))
    })
}

/// Backward of [`apply`] (fused: [`crate::rope::op::rope_bwd`]), f32 tables as [`apply`].
pub fn apply_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    in_table_dtype(dy, cos, |dy| {
        on_rotated(dy, cos, |r| crate::rope::op::rope_bwd(r, cos, sin))
    })
}

/// `f(x)` as it comes; with f32 tables and a lower-precision `x`, `f` of `x` widened to f32 and
/// its result rounded once back to `x`'s type. Other mixes are the op's dtype error.
fn in_table_dtype(
    x: &Tensor,
    table: &Tensor,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    match (x.dtype(), table.dtype()) {
        (DType::BF16 | DType::F16, DType::F32) => f(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype()),
        _ => f(x),
    }
}

/// `f` on the first `R` (the tables' width) of `x`'s last dim, the rest passed through; `f` on
/// `x` itself when `R` is all of it. A table wider than the head is an error naming both.
fn on_rotated(
    x: &Tensor,
    table: &Tensor,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (dh, r) = (x.dim(D::Minus1)?, table.dim(D::Minus1)?);
    if r == dh {
        return f(x);
    }
    if r > dh {
        candle_core::bail!(
            "rope: cos/sin {:?} are wider than the head of x {:?}",
            table.dims(),
            x.dims()
        );
    }
    let rotated = f(&x.narrow(D::Minus1, 0, r)?)?;
    Tensor::cat(&[&rotated, &x.narrow(D::Minus1, r, dh - r)?], D::Minus1)
}

/// `cos, sin: (B, 1, T, 2·inv_freq.len())` in `dtype` for positions `(B, T)`.
pub fn tables(
    inv_freq: &[f32],
    positions: &[u32],
    b: usize,
    t: usize,
    dtype: DType,
    dev: &Device,
) -> Result<(Tensor, Tensor)> {
    tables_scaled(inv_freq, 1.0, positions, b, t, dtype, dev)
}

/// [`tables`] with cos and sin multiplied by `scale` in f32 before the cast to `dtype`
/// (LongRoPE's attention factor, as transformers' `cos = emb.cos() * attention_scaling`).
pub fn tables_scaled(
    inv_freq: &[f32],
    scale: f32,
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
            cos.push(a.cos() * scale);
            sin.push(a.sin() * scale);
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
