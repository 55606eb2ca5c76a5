//! GeGLU, Gemma's MLP gate: `h = T(T(gelu_tanh(g))·u)` with transformers' `gelu_pytorch_tanh`,
//! `gelu_tanh(x) = x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` computed in f32 (torch's opmath for
//! bf16/f16) and rounded to the storage type, then the product rounded again (two torch ops).
//! Backward: `dg = T(dh·u·gelu_tanh'(g))`, `du = T(dh·T(gelu_tanh(g)))` with
//! `gelu_tanh'(x) = (1 + t)/2 + x/2·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²)`, `t` the tanh above.
//!
//! A chain of candle ops (f32 arithmetic, so the CPU and CUDA run the same formulation; no fused
//! kernel yet): this file. `reference.rs` holds the f64 scalar formulation it is tested against.

pub mod reference;
#[cfg(test)]
mod tests;

use candle_core::{DType, Result, Tensor};

pub use reference::{geglu_backward_reference, geglu_reference};

/// √(2/π), torch's `M_SQRT2 * M_2_SQRTPI * 0.5`.
const K: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const C: f64 = 0.044_715;

/// `tanh(√(2/π)·(x + 0.044715·x³))` of an f32 tensor.
fn inner_tanh(x: &Tensor) -> Result<Tensor> {
    let x3 = x.sqr()?.mul(x)?;
    ((x + (x3 * C)?)? * K)?.tanh()
}

/// `gelu_tanh(g) · u` (transformers' `gelu_pytorch_tanh` gate). `g, u: (N, I)` of one dtype.
pub fn geglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    let dt = g.dtype();
    let gf = g.to_dtype(DType::F32)?;
    let t = inner_tanh(&gf)?;
    // x/2·(1 + t), one rounding to the storage type as torch's gelu returns it.
    let act = ((gf * 0.5)? * (t + 1.0)?)?.to_dtype(dt)?;
    act.mul(u)
}

/// Returns `(dg, du)` for [`geglu`] given `dh: (N, I)`.
pub fn geglu_backward(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    let dt = g.dtype();
    let gf = g.to_dtype(DType::F32)?;
    let t = inner_tanh(&gf)?;
    let act = ((&gf * 0.5)? * (&t + 1.0)?)?;
    let du = dh.mul(&act.to_dtype(dt)?)?;
    // d/dx: (1 + t)/2 + x/2·(1 − t²)·K·(1 + 3C·x²)
    let one_minus_t2 = (1.0 - t.sqr()?)?;
    let poly = ((gf.sqr()? * (3.0 * C))? + 1.0)?;
    let deriv = (((&t + 1.0)? * 0.5)? + ((&gf * (0.5 * K))? * one_minus_t2)?.mul(&poly)?)?;
    let dg = dh
        .to_dtype(DType::F32)?
        .mul(&u.to_dtype(DType::F32)?)?
        .mul(&deriv)?
        .to_dtype(dt)?;
    Ok((dg, du))
}
