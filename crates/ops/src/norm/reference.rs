//! Plain formulations of RMSNorm: on tensors (a chain of candle ops, differentiable by candle's
//! autograd: what `op.rs` and the backward are tested against) and on f32 slices with the CUDA
//! kernels' rounding to a [`Precision`] (what `check.rs` compares the kernels with).

use candle_core::{DType, Result, Tensor, D};
use rtune_backend::Precision;

/// [`rms_norm`]'s output as a chain of candle ops: the reference for the fused op.
pub fn rms_norm_reference(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dt = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    xf.broadcast_mul(&r)?.to_dtype(dt)?.broadcast_mul(w)
}

/// [`rms_norm_backward`] as a chain of candle ops: the reference for the fused op.
pub fn rms_norm_backward_reference(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let dt = dy.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let g = dy.broadcast_mul(w)?.to_dtype(DType::F32)?;
    let gx = (&g * &xf)?.mean_keepdim(D::Minus1)?;
    let r3 = r.powf(3.0)?;
    let dx = (g.broadcast_mul(&r)? - xf.broadcast_mul(&r3)?.broadcast_mul(&gx)?)?;
    dx.to_dtype(dt)
}

/// `r = 1 / sqrt(mean(x²) + eps)` of one row (sum in f64; `eps` added as the f32 that candle's
/// affine uses).
fn rms_r(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32
}

/// `y = T(T(x·r)·w)`: (rows, dim).
pub fn rms_norm_fwd(
    x: &[f32],
    w: &[f32],
    rows: usize,
    dim: usize,
    eps: f32,
    p: Precision,
) -> Vec<f32> {
    assert_eq!((x.len(), w.len()), (rows * dim, dim));
    let mut y = Vec::with_capacity(rows * dim);
    for xr in x.chunks_exact(dim.max(1)).take(rows) {
        let r = rms_r(xr, eps);
        y.extend(xr.iter().zip(w).map(|(&v, &w)| p.round(p.round(v * r) * w)));
    }
    y
}

/// `dx = T(g·r − (x·r³)·mean(g·x))`, `g = T(dy·w)`: (rows, dim).
pub fn rms_norm_bwd(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rows: usize,
    dim: usize,
    eps: f32,
    p: Precision,
) -> Vec<f32> {
    assert_eq!((dy.len(), x.len(), w.len()), (rows * dim, rows * dim, dim));
    let mut dx = Vec::with_capacity(rows * dim);
    for (dr, xr) in dy
        .chunks_exact(dim.max(1))
        .zip(x.chunks_exact(dim.max(1)))
        .take(rows)
    {
        let r = rms_r(xr, eps);
        let g: Vec<f32> = dr.iter().zip(w).map(|(&d, &w)| p.round(d * w)).collect();
        let sgx: f64 = g.iter().zip(xr).map(|(&g, &v)| g as f64 * v as f64).sum();
        let mgx = (sgx / dim as f64) as f32;
        let r3 = r.powf(3.0);
        dx.extend(
            g.iter()
                .zip(xr)
                .map(|(&g, &v)| p.round(g * r - v * r3 * mgx)),
        );
    }
    dx
}

/// The inputs the RMSNorm kernels are checked on (`check.rs`, `tests/kernels_emulated.rs`):
/// `(x, w, dy)` for `(rows, dim)`, each row of x at its own scale (10^−1.5 to 10^1.5), w near 1,
/// dy ~ N(0, 1), rounded to `p`.
pub fn check_inputs(
    rng: &mut rtune_backend::check::Rng,
    rows: usize,
    dim: usize,
    p: Precision,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut x = Vec::with_capacity(rows * dim);
    for _ in 0..rows {
        let scale = 10f32.powf(3.0 * rng.uniform() - 1.5);
        x.extend(rng.normals(dim, scale, p));
    }
    let w: Vec<f32> = (0..dim)
        .map(|_| p.round(1.0 + 0.2 * rng.normal()))
        .collect();
    let dy = rng.normals(rows * dim, 1.0, p);
    (x, w, dy)
}
