//! Plain formulations of GeGLU: in f64 on slices (what the op is tested against for accuracy,
//! `tests.rs`), as the chain of candle ops the model ran before the fused op (the op equals it bit
//! for bit), and on f32 slices with the CUDA kernels' rounding to a [`Precision`] (what `check.rs`
//! compares the kernels with).

use candle_core::{DType, Result, Tensor};
use rtune_backend::Precision;

use super::{GeluTanh, C, K};
use crate::glu::Activation;

/// `gelu_tanh(x) = x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
fn gelu_tanh(x: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
}

/// `gelu_tanh(g[i]) · u[i]`.
pub fn geglu_reference(g: &[f64], u: &[f64]) -> Vec<f64> {
    g.iter().zip(u).map(|(&g, &u)| gelu_tanh(g) * u).collect()
}

/// `(dg, du)`: `dg = dh·u·gelu_tanh'(g)` by a central difference of step 1e-5 (independent of
/// the closed form the op uses; error O(1e-10)), `du = dh·gelu_tanh(g)`.
pub fn geglu_backward_reference(dh: &[f64], g: &[f64], u: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let eps = 1e-5;
    let dg = dh
        .iter()
        .zip(g)
        .zip(u)
        .map(|((&d, &g), &u)| d * u * (gelu_tanh(g + eps) - gelu_tanh(g - eps)) / (2.0 * eps))
        .collect();
    let du = dh.iter().zip(g).map(|(&d, &g)| d * gelu_tanh(g)).collect();
    (dg, du)
}

/// `tanh(√(2/π)·(x + 0.044715·x³))` of an f32 tensor, as candle ops.
fn inner_tanh(x: &Tensor) -> Result<Tensor> {
    let x3 = x.sqr()?.mul(x)?;
    ((x + (x3 * C)?)? * K)?.tanh()
}

/// GeGLU as the chain of candle ops (f32 arithmetic, one rounding to the storage type for the
/// gate, one for the product): `g, u: (N, I)` of one dtype.
pub fn geglu_chain(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    let dt = g.dtype();
    let gf = g.to_dtype(DType::F32)?;
    let t = inner_tanh(&gf)?;
    // x/2·(1 + t), one rounding to the storage type as torch's gelu returns it.
    let act = ((gf * 0.5)? * (t + 1.0)?)?.to_dtype(dt)?;
    act.mul(u)
}

/// [`geglu_chain`]'s `(dg, du)` given `dh: (N, I)`, as candle ops.
pub fn geglu_backward_chain(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
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

/// `h = T(T(gelu_tanh(g))·u)` on f32 slices, each step as the kernels take it: (n).
pub fn geglu_fwd(g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
    assert_eq!(g.len(), u.len());
    g.iter()
        .zip(u)
        .map(|(&x, &u)| p.round(p.round(GeluTanh::fwd(x)) * u))
        .collect()
}

/// `(2, n)`: `dg = T((dh·u)·gelu_tanh'(g))` at `[0, n)`, `du = T(dh·T(gelu_tanh(g)))` at `[n, 2n)`.
pub fn geglu_bwd(dh: &[f32], g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
    let n = g.len();
    assert_eq!((dh.len(), u.len()), (n, n));
    let mut out = vec![0f32; 2 * n];
    let (dg, du) = out.split_at_mut(n);
    for i in 0..n {
        let (a, da) = GeluTanh::bwd(g[i]);
        du[i] = p.round(dh[i] * p.round(a));
        dg[i] = p.round((dh[i] * u[i]) * da);
    }
    out
}
