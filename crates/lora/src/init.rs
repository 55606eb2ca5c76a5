//! How a fresh adapter starts: PEFT's `init_lora_weights` (peft 0.21.2, `tuners/lora/layer.py`).
//!
//! | `[lora] init` | A `(r, in)` | B `(out, r)` | frozen base |
//! |---|---|---|---|
//! | `default` | kaiming-uniform(a=√5) = U(−1/√in, 1/√in) | 0 | W |
//! | `gaussian` | N(0, (1/r)²) | 0 | W |
//! | `pissa` | diag(√(S_r/s))·V_rᵀ | U_r·diag(√(S_r/s)) | W − s·B·A |
//! | `pissa_niter_N` | the same from a randomized SVD (N subspace iterations) | | W − s·B·A |
//! | `olora` | `R[:r]` of W = Q·R | `Q[:, :r]` | W − s·B·A |
//!
//! `s` is the adapter's scaling; W is taken in f32 (PEFT's `weight.to(torch.float32)`), the
//! factorisations run in f64 and their factors are rounded to f32 before the residual is formed.
//! PiSSA (Meng et al. 2024) uses the top-r SVD `W = U·diag(S)·Vᵀ` (nalgebra's, sorted descending);
//! `pissa_niter_N` is torch's `svd_lowrank(W, q=r, niter=N)` (Halko et al. 2009, Algorithm 4.4 and
//! 5.1) with the Gaussian test matrix drawn from the run's seed — torch's own random stream cannot be
//! reproduced, so the result equals PEFT's where the top-r subspace is determined (a gap after σ_r)
//! and differs by the randomness otherwise. Singular vectors' signs are arbitrary (LAPACK's and
//! nalgebra's differ); B·A does not depend on them. OLoRA (Büyükakyüz 2024) uses the QR
//! decomposition by Householder reflections with LAPACK's sign convention (`dgeqrf`/`dorgqr`: the
//! diagonal of R has the sign opposite to the pivot it replaces), so A and B equal torch's.
//!
//! PiSSA and OLoRA change the frozen base; an adapter trained on it is saved against the original
//! base as PEFT's `path_initial_model_for_weight_conversion` does ([`converted`]): rank 2r,
//! `A' = [A; A₀]`, `B' = [B, −B₀]`, so `s'·B'·A' = s·(B·A − B₀·A₀)` with `s' = s`.

use candle_core::{Device, Tensor};
use nalgebra::DMatrix;
use rand::{Rng, SeedableRng};
use std::fmt;
use std::str::FromStr;

use crate::{cerr, Adapter, LoraError, LoraPair, LoraSpec, ModuleShape, Result};

/// `[lora] init`: how a fresh adapter starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// PEFT's `init_lora_weights=True`.
    Default,
    Gaussian,
    /// `pissa` (exact SVD, `niter: None`) or `pissa_niter_N` (randomized SVD).
    Pissa {
        niter: Option<usize>,
    },
    Olora,
}

/// The values `[lora] init` accepts, for error messages.
pub const INIT_NAMES: [&str; 5] = ["default", "gaussian", "pissa", "pissa_niter_N", "olora"];

impl FromStr for Init {
    type Err = ();

    fn from_str(s: &str) -> std::result::Result<Self, ()> {
        match s {
            "default" | "true" => Ok(Init::Default),
            "gaussian" => Ok(Init::Gaussian),
            "pissa" => Ok(Init::Pissa { niter: None }),
            "olora" => Ok(Init::Olora),
            other => match other.strip_prefix("pissa_niter_").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Init::Pissa { niter: Some(n) }),
                _ => Err(()),
            },
        }
    }
}

impl fmt::Display for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Default => f.write_str("default"),
            Init::Gaussian => f.write_str("gaussian"),
            Init::Pissa { niter: None } => f.write_str("pissa"),
            Init::Pissa { niter: Some(n) } => write!(f, "pissa_niter_{n}"),
            Init::Olora => f.write_str("olora"),
        }
    }
}

impl Init {
    /// PiSSA and OLoRA move part of W into the adapter: the frozen base becomes `W − s·B·A`.
    pub fn mutates_base(self) -> bool {
        matches!(self, Init::Pissa { .. } | Init::Olora)
    }
}

/// One weight split by [`decompose`]: `a: (r, in)`, `b: (out, r)`, `residual: (out, in)`, row-major
/// f32, with `residual + s·b·a = W` up to rounding.
#[derive(Debug, Clone)]
pub struct Decomposed {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub residual: Vec<f32>,
}

/// Splits the frozen weight `w: (out, in)` (row-major) as `init` does (PiSSA or OLoRA). `rng`
/// draws `pissa_niter_N`'s test matrix (one stream over the modules in model order). `name` labels
/// errors.
#[allow(clippy::too_many_arguments)]
pub fn decompose(
    init: Init,
    name: &str,
    w: &[f32],
    (out, inp): (usize, usize),
    r: usize,
    scaling: f64,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> Result<Decomposed> {
    if r > out.min(inp) {
        return Err(LoraError::File {
            path: "[lora] init".into(),
            message: format!(
                "{init} needs r <= min(out, in), but {name} is {out} × {inp} and r = {r}"
            ),
        });
    }
    let m =
        DMatrix::<f64>::from_row_slice(out, inp, &w.iter().map(|&x| x as f64).collect::<Vec<_>>());
    let (b, a): (DMatrix<f64>, DMatrix<f64>) = match init {
        Init::Pissa { niter } => {
            // W ≈ U_r·diag(S_r)·V_rᵀ; each side gets √(S_r / s).
            let (u, s, vt) = match niter {
                None => top_svd(&m, r),
                Some(n) => randomized_svd(&m, r, n, rng),
            };
            let root: Vec<f64> = s.iter().map(|&x| (x / scaling).sqrt()).collect();
            let b = DMatrix::from_fn(out, r, |i, j| u[(i, j)] * root[j]);
            let a = DMatrix::from_fn(r, inp, |i, j| root[i] * vt[(i, j)]);
            (b, a)
        }
        Init::Olora => {
            let (q, rr) = householder_qr(&m, r);
            (q, rr)
        }
        Init::Default | Init::Gaussian => {
            return Err(LoraError::File {
                path: "[lora] init".into(),
                message: format!("{init} does not split the base weight ({name})"),
            })
        }
    };
    let a: Vec<f32> = row_major(&a).into_iter().map(|x| x as f32).collect();
    let b: Vec<f32> = row_major(&b).into_iter().map(|x| x as f32).collect();
    // residual = W − s·B·A from the f32 factors, as PEFT forms it.
    let mut residual = Vec::with_capacity(out * inp);
    for i in 0..out {
        for j in 0..inp {
            let ba: f64 = (0..r)
                .map(|k| b[i * r + k] as f64 * a[k * inp + j] as f64)
                .sum();
            residual.push((w[i * inp + j] as f64 - scaling * ba) as f32);
        }
    }
    Ok(Decomposed { a, b, residual })
}

fn row_major(m: &DMatrix<f64>) -> Vec<f64> {
    let (rows, cols) = m.shape();
    (0..rows)
        .flat_map(|i| (0..cols).map(move |j| (i, j)))
        .map(|(i, j)| m[(i, j)])
        .collect()
}

/// The top-`r` singular triplets of `m`: `U_r (out, r)`, `S_r`, `V_rᵀ (r, in)`, descending.
fn top_svd(m: &DMatrix<f64>, r: usize) -> (DMatrix<f64>, Vec<f64>, DMatrix<f64>) {
    let svd = m.clone().svd(true, true);
    let u = svd.u.expect("asked for U");
    let vt = svd.v_t.expect("asked for Vᵀ");
    let s = svd.singular_values;
    // nalgebra's `svd` sorts descending; sort the indices anyway so the order is explicit here.
    let mut idx: Vec<usize> = (0..s.len()).collect();
    idx.sort_by(|&x, &y| s[y].total_cmp(&s[x]));
    let idx = &idx[..r];
    let u_r = DMatrix::from_fn(u.nrows(), r, |i, j| u[(i, idx[j])]);
    let vt_r = DMatrix::from_fn(r, vt.ncols(), |i, j| vt[(idx[i], j)]);
    (u_r, idx.iter().map(|&k| s[k]).collect(), vt_r)
}

/// torch's `svd_lowrank(A, q=r, niter)`: the approximate basis of A's range by `niter` subspace
/// iterations from a Gaussian test matrix (each step re-orthonormalised by QR), then the SVD of
/// `Qᵀ·A`. A wide matrix is handled as its transpose, as torch does.
fn randomized_svd(
    m: &DMatrix<f64>,
    r: usize,
    niter: usize,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> (DMatrix<f64>, Vec<f64>, DMatrix<f64>) {
    let wide = m.nrows() < m.ncols();
    let a = if wide { m.transpose() } else { m.clone() };
    let omega = DMatrix::from_fn(a.ncols(), r, |_, _| normal(rng));
    let basis = |x: DMatrix<f64>| x.qr().q();
    let mut q = basis(&a * omega);
    for _ in 0..niter {
        q = basis(a.transpose() * &q);
        q = basis(&a * &q);
    }
    let small = q.transpose() * &a; // (r, n)
    let (ub, s, vt) = top_svd(&small, r);
    let u = &q * ub; // (m, r)
    if wide {
        // A = Wᵀ = U·S·Vᵀ, so W = V·S·Uᵀ.
        (vt.transpose(), s, u.transpose())
    } else {
        (u, s, vt)
    }
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut rand_chacha::ChaCha8Rng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// The first `r` columns of Q and rows of R of `m = Q·R` (`m: (rows, cols)`, r ≤ min), by
/// Householder reflections as LAPACK's `dgeqr2`/`dlarfg` and `dorg2r` compute them: reflector i
/// maps the pivot column to `β·e_i` with `β = −sign(α)·‖x‖` (α the pivot; `sign(0) = +`) and is the
/// identity when the column below the pivot is already zero. Later reflectors leave rows < r of R
/// and columns < r of Q unchanged, so r reflectors suffice: O(rows·cols·r).
fn householder_qr(m: &DMatrix<f64>, r: usize) -> (DMatrix<f64>, DMatrix<f64>) {
    let (rows, cols) = m.shape();
    let mut a = m.clone();
    let mut reflectors: Vec<(Vec<f64>, f64)> = Vec::with_capacity(r);
    for i in 0..r {
        let alpha = a[(i, i)];
        let xnorm = (i + 1..rows)
            .map(|j| a[(j, i)] * a[(j, i)])
            .sum::<f64>()
            .sqrt();
        let mut v = vec![0.0; rows];
        v[i] = 1.0;
        if xnorm == 0.0 {
            reflectors.push((v, 0.0));
            continue;
        }
        let norm = alpha.hypot(xnorm);
        let beta = if alpha >= 0.0 { -norm } else { norm };
        let tau = (beta - alpha) / beta;
        let scale = 1.0 / (alpha - beta);
        for j in i + 1..rows {
            v[j] = a[(j, i)] * scale;
            a[(j, i)] = 0.0;
        }
        a[(i, i)] = beta;
        for c in i + 1..cols {
            let dot: f64 = (i..rows).map(|j| v[j] * a[(j, c)]).sum();
            for j in i..rows {
                a[(j, c)] -= tau * v[j] * dot;
            }
        }
        reflectors.push((v, tau));
    }
    let rr = DMatrix::from_fn(r, cols, |i, j| if j >= i { a[(i, j)] } else { 0.0 });
    // Q[:, :r] = H_0·H_1·…·H_{r−1}·I[:, :r], applied from the last reflector.
    let mut q = DMatrix::from_fn(rows, r, |i, j| if i == j { 1.0 } else { 0.0 });
    for (i, (v, tau)) in reflectors.iter().enumerate().rev() {
        for c in 0..r {
            let dot: f64 = (i..rows).map(|j| v[j] * q[(j, c)]).sum();
            for j in i..rows {
                q[(j, c)] -= tau * v[j] * dot;
            }
        }
    }
    (q, rr)
}

/// PEFT's `init_lora_weights="gaussian"`: A ~ N(0, (1/r)²), B = 0.
pub fn gaussian(
    spec: LoraSpec,
    modules: &[ModuleShape],
    seed: u64,
    device: &Device,
) -> Result<Adapter> {
    let std = 1.0 / spec.r as f64;
    fresh(spec, modules, seed, device, |rng, _| {
        (normal(rng) * std) as f32
    })
}

/// A fresh adapter of the default and gaussian inits: every A drawn from one ChaCha8 stream seeded
/// with `seed` — `draw(rng, module)` for each element, module by module, row-major — and B = 0.
pub(crate) fn fresh(
    spec: LoraSpec,
    modules: &[ModuleShape],
    seed: u64,
    device: &Device,
    mut draw: impl FnMut(&mut rand_chacha::ChaCha8Rng, &ModuleShape) -> f32,
) -> Result<Adapter> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut pairs = Vec::with_capacity(modules.len());
    for m in modules {
        // An expert stack's pair has rank r per expert (PEFT's ParamWrapper: `A: (E·r, in)`,
        // `B: (out, r·E)`), drawn alike.
        let r = spec.r * m.experts;
        let a: Vec<f32> = (0..r * m.in_features).map(|_| draw(&mut rng, m)).collect();
        let a = Tensor::from_vec(a, (r, m.in_features), device).map_err(cerr("init A"))?;
        let b = Tensor::zeros((m.out_features, r), candle_core::DType::F32, device)
            .map_err(cerr("init B"))?;
        pairs.push(LoraPair { a, b, m: None });
    }
    let names = modules.iter().map(|m| m.name.clone()).collect();
    Ok(Adapter {
        spec,
        names,
        pairs,
        tokens: None,
    })
}

/// The adapter as a plain LoRA against the original base (PEFT's
/// `path_initial_model_for_weight_conversion`): `init` holds each module's `(A₀, B₀)` from
/// [`decompose`]; rank 2r, `A' = [A; A₀]`, `B' = [B, −B₀]`, alpha doubled (×√2 with rsLoRA) so the
/// scaling is unchanged.
pub fn converted(adapter: &Adapter, init: &[LoraPair]) -> Result<Adapter> {
    let mut spec = adapter.spec.clone();
    spec.r *= 2;
    spec.alpha *= if spec.rslora { 2f64.sqrt() } else { 2.0 };
    let mut pairs = Vec::with_capacity(adapter.pairs.len());
    for (p, p0) in adapter.pairs.iter().zip(init) {
        let a = Tensor::cat(&[&p.a, &p0.a], 0).map_err(cerr("convert A"))?;
        let neg_b0 = p0.b.neg().map_err(cerr("convert B"))?;
        let b = Tensor::cat(&[&p.b, &neg_b0], 1).map_err(cerr("convert B"))?;
        pairs.push(LoraPair { a, b, m: None });
    }
    Ok(Adapter {
        spec,
        names: adapter.names.clone(),
        pairs,
        tokens: adapter.tokens.clone(),
    })
}

#[cfg(test)]
mod tests;
