//! The fused residual add + RMSNorm restated as the two ops the layer runs, on f32 slices with the
//! kernels' rounding to a [`Precision`]: `h = T(x + res)` (`crate::add`), then RMSNorm of `h`
//! (`crate::norm::reference`'s formulation for a weight of the input's type, or
//! `crate::norm::rms_norm_plus_one`'s for an f32 weight); the backward `dh = T(dres + dn)` with
//! `dn` the norm's backward, a tensor of the input's type (`ops::add(d_out, norm_backward(dy))`).

use rtune_backend::Precision;

use crate::norm::reference as norm;

/// The norm's weight: of the input's type (Llama's RMSNorm, `y = T(T(h·r)·w)`) or f32
/// (`rms_norm_plus_one`: `y = T(h·r·w)`, no rounding before the weight).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weight {
    Typed,
    F32,
}

/// `r = 1 / sqrt(mean(h²) + eps)` of one row, the sum in f64 (as `norm::reference`).
fn rms_r(h: &[f32], eps: f32) -> f32 {
    let ss: f64 = h.iter().map(|&v| v as f64 * v as f64).sum();
    (1.0 / (ss / h.len() as f64 + eps as f64).sqrt()) as f32
}

/// `(h, y)`, each `(rows, dim)`: `h = T(x + res)`, `y` RMSNorm of `h` with weight `w: (dim)`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_fwd(
    x: &[f32],
    res: &[f32],
    w: &[f32],
    (rows, dim): (usize, usize),
    eps: f32,
    p: Precision,
    weight: Weight,
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!((x.len(), res.len(), w.len()), (rows * dim, rows * dim, dim));
    let h: Vec<f32> = x.iter().zip(res).map(|(&a, &b)| p.round(a + b)).collect();
    let y = match weight {
        // LlamaRMSNorm: the same function as the unfused norm kernel's reference.
        Weight::Typed => norm::rms_norm_fwd(&h, w, rows, dim, eps, p),
        // rms_norm_plus_one: f32(h)·r·w in f32, rounded once.
        Weight::F32 => {
            let mut y = Vec::with_capacity(rows * dim);
            for hr in h.chunks_exact(dim.max(1)).take(rows) {
                let r = rms_r(hr, eps);
                y.extend(hr.iter().zip(w).map(|(&v, &w)| p.round(v * r * w)));
            }
            y
        }
    };
    (h, y)
}

/// `dh = T(dres + T(g·r − (h·r³)·mean(g·h)))`, `g = T(dy·w)` (typed weight) or `dy·w` in f32:
/// `(rows, dim)`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_bwd(
    dy: &[f32],
    h: &[f32],
    w: &[f32],
    dres: &[f32],
    (rows, dim): (usize, usize),
    eps: f32,
    p: Precision,
    weight: Weight,
) -> Vec<f32> {
    assert_eq!(dres.len(), rows * dim);
    let dn = match weight {
        Weight::Typed => norm::rms_norm_bwd(dy, h, w, rows, dim, eps, p),
        Weight::F32 => {
            let mut dn = Vec::with_capacity(rows * dim);
            for (dr, hr) in dy.chunks_exact(dim.max(1)).zip(h.chunks_exact(dim.max(1))) {
                let r = rms_r(hr, eps);
                let g: Vec<f32> = dr.iter().zip(w).map(|(&d, &w)| d * w).collect();
                let sgh: f64 = g.iter().zip(hr).map(|(&g, &v)| g as f64 * v as f64).sum();
                let (mgh, r3) = ((sgh / dim as f64) as f32, r.powf(3.0));
                dn.extend(
                    g.iter()
                        .zip(hr)
                        .map(|(&g, &v)| p.round(g * r - v * r3 * mgh)),
                );
            }
            dn
        }
    };
    dres.iter()
        .zip(&dn)
        .map(|(&a, &b)| p.round(a + b))
        .collect()
}

/// The inputs the kernels are checked on (`check.rs`, `tests/kernels_emulated.rs`):
/// `(x, res, w, dy, dres)` for `(rows, dim)`: `x` as RMSNorm's check (a scale per row, 0.03 to
/// 30), `res` ~ N(0, 1) (the residual stream), `w` near 1 (an f32 weight is `1 + w'` with `w'`
/// small, as Gemma's), `dy, dres` ~ N(0, 1); rounded to `p` (`w` to f32 for an f32 weight).
#[allow(clippy::type_complexity)]
pub fn check_inputs(
    rng: &mut rtune_backend::check::Rng,
    (rows, dim): (usize, usize),
    p: Precision,
    weight: Weight,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (x, w, dy) = norm::check_inputs(rng, rows, dim, p);
    let w = match weight {
        Weight::Typed => w,
        Weight::F32 => w.iter().map(|&v| 1.0 + 0.1 * (v - 1.0)).collect(),
    };
    let res = rng.normals(rows * dim, 1.0, p);
    let dres = rng.normals(rows * dim, 1.0, p);
    (x, res, w, dy, dres)
}
