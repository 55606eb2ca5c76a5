//! Plain-Rust references for the fused kernels of `kernels/fused.cu` and `kernels/attn.cu`, on
//! `&[f32]` slices, and the comparison (with its tolerances) that `tests/fused_cuda.rs` and
//! `fused_check::self_test` use. Always compiled: no CUDA needed.
//!
//! Each function restates the candle formulation of `crates/model/src/ops.rs` / `rope.rs` (the
//! attention softmax: the CPU op of `fused/attn_softmax.rs`, which restates ops.rs's chain) step
//! by step: element-wise steps in f32 in the same order, and wherever ops.rs holds an intermediate
//! as a tensor of the input type (bf16/f16), the value is rounded to that [`Precision`] at the same
//! point.
//! Reductions (sums over a row) are done in f64, so the reference is the exact sum and the kernels'
//! f32 sums are measured against it. Inputs must already be representable in the precision (round
//! them with [`Precision::round`]); outputs are rounded to it.

pub use crate::precision::Precision;

// ---------------------------------------------------------------------------------------------
// RMSNorm. x, dy: (rows, dim); w: (dim).

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

// ---------------------------------------------------------------------------------------------
// SwiGLU. g, u, dh: (n).

/// `silu(g) = g / (1 + e^-g)` (candle's silu).
fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// The widening cast: the values of `x` (already of the input type, held as f32) as f32 — the
/// identity. The kernel's check is that nothing is lost or rounded on the way.
pub fn widen(x: &[f32]) -> Vec<f32> {
    x.to_vec()
}

/// `h = T(T(silu(g))·u)`: (n).
pub fn swiglu_fwd(g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
    assert_eq!(g.len(), u.len());
    g.iter()
        .zip(u)
        .map(|(&g, &u)| p.round(p.round(silu(g)) * u))
        .collect()
}

/// `(2, n)`: `dg = T((dh·u)·silu'(g))` at `[0, n)`, `du = T(dh·silu(g))` at `[n, 2n)`, with
/// `s = 1/(e^-g + 1)`, `silu = g·s`, `silu' = s·(g·(1 − s) + 1)` (ops.rs `swiglu_backward`).
pub fn swiglu_bwd(dh: &[f32], g: &[f32], u: &[f32], p: Precision) -> Vec<f32> {
    let n = g.len();
    assert_eq!((dh.len(), u.len()), (n, n));
    let mut out = vec![0f32; 2 * n];
    let (dg, du) = out.split_at_mut(n);
    for i in 0..n {
        let s = 1.0 / ((-g[i]).exp() + 1.0);
        du[i] = p.round(dh[i] * (g[i] * s));
        let ds = s * (g[i] * (1.0 - s) + 1.0);
        dg[i] = p.round(dh[i] * u[i] * ds);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// RoPE. x, dy: (b, h, t, dh); cos, sin: (b, 1, t, dh); rotate-half pairs (d, d + dh/2).

fn rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    (b, h, t, dh): (usize, usize, usize, usize),
    p: Precision,
    backward: bool,
) -> Vec<f32> {
    assert!(dh % 2 == 0, "head_dim {dh} is odd");
    assert_eq!(
        (x.len(), cos.len(), sin.len()),
        (b * h * t * dh, b * t * dh, b * t * dh)
    );
    let half = dh / 2;
    let mut y = vec![0f32; x.len()];
    for row in 0..b * h * t {
        let (bi, ti) = (row / (h * t), row % t);
        let (xo, co) = (row * dh, (bi * t + ti) * dh);
        for c in 0..half {
            let (a1, a2) = (x[xo + c], x[xo + half + c]);
            let (c1, c2) = (cos[co + c], cos[co + half + c]);
            let (s1, s2) = (sin[co + c], sin[co + half + c]);
            let r = |v: f32| p.round(v);
            let (o1, o2) = if backward {
                // dx = dy·cos + [z2, −z1], z = T(dy·sin)
                let (z1, z2) = (r(a1 * s1), r(a2 * s2));
                (r(a1 * c1) + z2, r(a2 * c2) - z1)
            } else {
                // y = x·cos + [−x2, x1]·sin
                (r(a1 * c1) + r(-a2 * s1), r(a2 * c2) + r(a1 * s2))
            };
            y[xo + c] = r(o1);
            y[xo + half + c] = r(o2);
        }
    }
    y
}

/// `y = T(T(x·cos) + T(rotate_half(x)·sin))`, `rotate_half([x1, x2]) = [−x2, x1]`: (b, h, t, dh).
pub fn rope_fwd(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    shape: (usize, usize, usize, usize),
    p: Precision,
) -> Vec<f32> {
    rope(x, cos, sin, shape, p, false)
}

/// `dx = T(T(dy·cos) + rotate_halfᵀ(T(dy·sin)))`, `rotate_halfᵀ([z1, z2]) = [z2, −z1]` (rope.rs
/// `apply_backward`): (b, h, t, dh).
pub fn rope_bwd(
    dy: &[f32],
    cos: &[f32],
    sin: &[f32],
    shape: (usize, usize, usize, usize),
    p: Precision,
) -> Vec<f32> {
    rope(dy, cos, sin, shape, p, true)
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy. logits: (n, v); targets: (n).

/// `(n, 2)` f32: `[lse, lse − logit[target]]` per row, `lse = max + ln(Σ exp(x − max))` in f64;
/// NaN loss for a target `>= v`.
pub fn ce_fwd(logits: &[f32], targets: &[u32], n: usize, v: usize) -> Vec<f32> {
    assert_eq!((logits.len(), targets.len()), (n * v, n));
    let mut out = Vec::with_capacity(2 * n);
    for (row, &tg) in logits.chunks_exact(v.max(1)).zip(targets).take(n) {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let s: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
        let lse = m + s.ln();
        let picked = row.get(tg as usize).map_or(f64::NAN, |&x| x as f64);
        out.push(lse as f32);
        out.push((lse - picked) as f32);
    }
    out
}

/// `dlogits = T((exp(x − lse) − [i = target])·scale)`: (n, v).
pub fn ce_bwd(
    logits: &[f32],
    targets: &[u32],
    lse: &[f32],
    scale: f32,
    n: usize,
    v: usize,
    p: Precision,
) -> Vec<f32> {
    assert_eq!((logits.len(), targets.len(), lse.len()), (n * v, n, n));
    let mut d = Vec::with_capacity(n * v);
    for (i, row) in logits.chunks_exact(v.max(1)).take(n).enumerate() {
        let l = lse[i] as f64;
        d.extend(row.iter().enumerate().map(|(j, &x)| {
            let onehot = if j == targets[i] as usize { 1.0 } else { 0.0 };
            p.round((((x as f64 - l).exp() - onehot) * scale as f64) as f32)
        }));
    }
    d
}

// ---------------------------------------------------------------------------------------------
// Attention softmax (`crates/model/src/fused/attn_softmax.rs`). scores, probs, dp: (rows, t); mask:
// (mrows, t) additive f32, score row r taking mask row r % mrows.

/// `(rows, t)` f32: `p = softmax(f32(T(raw·T(scale))) + mask)` per row; the scaling rounds as
/// candle's `raw * scale` on a T tensor, the mask is added in f32, `s − max` is f32, the exps, their
/// sum and the quotient f64. A fully masked row (all `−inf`) is NaN, as the CPU op.
pub fn attn_softmax_fwd(
    scores: &[f32],
    mask: &[f32],
    t: usize,
    scale: f32,
    p: Precision,
) -> Vec<f32> {
    let t1 = t.max(1);
    let mrows = mask.len() / t1;
    assert!(mask.len() == mrows * t && mrows > 0 && scores.len().is_multiple_of(mrows * t1));
    let sc = p.round(scale);
    let mut out = Vec::with_capacity(scores.len());
    for (r, row) in scores.chunks_exact(t1).enumerate() {
        let mr = &mask[(r % mrows) * t..][..t];
        let s: Vec<f32> = row
            .iter()
            .zip(mr)
            .map(|(&a, &m)| p.round(a * sc) + m)
            .collect();
        let top = s
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        let e: Vec<f64> = s.iter().map(|&v| ((v - top) as f64).exp()).collect();
        let sum: f64 = e.iter().sum();
        out.extend(e.iter().map(|&e| (e / sum) as f32));
    }
    out
}

/// `(rows, t)`: `ds = T((p·(dp − Σ_row dp·p))·scale)`, the row sum in f64 then f32, the rest f32.
pub fn attn_softmax_bwd(probs: &[f32], dp: &[f32], t: usize, scale: f32, p: Precision) -> Vec<f32> {
    assert_eq!(probs.len(), dp.len());
    let t1 = t.max(1);
    let mut out = Vec::with_capacity(dp.len());
    for (pr, dr) in probs.chunks_exact(t1).zip(dp.chunks_exact(t1)) {
        let row = pr
            .iter()
            .zip(dr)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum::<f64>() as f32;
        out.extend(
            pr.iter()
                .zip(dr)
                .map(|(&a, &b)| p.round(a * (b - row) * scale)),
        );
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Comparison

/// The ops, for naming results and choosing tolerances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    RmsNormFwd,
    RmsNormBwd,
    SwigluFwd,
    SwigluBwd,
    RopeFwd,
    RopeBwd,
    CeFwd,
    CeBwd,
    AttnSoftmaxFwd,
    AttnSoftmaxBwd,
    Widen,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::RmsNormFwd => "rms_norm_fwd",
            Op::RmsNormBwd => "rms_norm_bwd",
            Op::SwigluFwd => "swiglu_fwd",
            Op::SwigluBwd => "swiglu_bwd",
            Op::RopeFwd => "rope_fwd",
            Op::RopeBwd => "rope_bwd",
            Op::CeFwd => "ce_fwd",
            Op::CeBwd => "ce_bwd",
            Op::AttnSoftmaxFwd => "attn_softmax_fwd",
            Op::AttnSoftmaxBwd => "attn_softmax_bwd",
            Op::Widen => "widen",
        }
    }

    /// Whether the output is f32 whatever the inputs' type (`ce_fwd`, `attn_softmax_fwd`,
    /// `widen`).
    pub fn f32_output(self) -> bool {
        matches!(self, Op::CeFwd | Op::AttnSoftmaxFwd | Op::Widen)
    }
}

/// An element passes when `|got − want| ≤ ulps·ulp(want) + rtol·|want| + atol·max|want|`, ulp in
/// the output's precision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    pub ulps: f32,
    pub rtol: f32,
    /// A fraction of the largest `|want|` of the whole output: the floor for elements that are a
    /// difference of larger terms (rms_norm_bwd, swiglu_bwd, ce's `p − 1`, a small loss).
    pub atol: f32,
}

/// The tolerance of `op` run in precision `p`, and why.
///
/// - f32 outputs: `rtol 1e-5`. The kernels' row sums are f32 in a different order from the
///   reference's exact f64 sums (~1e-6 relative for 8192 terms, 152064 for cross-entropy), and
///   CUDA's `expf` is within 2 f32 ulps of Rust's. `atol 1e-5·max`: a sum's absolute error, carried
///   into outputs that cancel (see [`Tolerance::atol`]). RoPE's products and sums are rounded
///   exactly as the reference's (`__fmul_rn`), so it gets `1e-6`.
/// - bf16/f16 outputs: 2 ulps of the output type. Kernel and reference round the same
///   intermediates to the type; when their f32 values before a rounding differ in the last f32
///   bits, the rounding can land one ulp apart, and the next product carries that into the output,
///   which then rounds once more. Plus the f32 terms above for cancelling outputs.
/// - `ce_fwd` and `attn_softmax_fwd` write f32 whatever the input's type: the f32 tolerance.
///   (The softmax's scaled scores are rounded to the type exactly alike on both sides: the product
///   of two bf16/f16 values is exact in f32.)
/// - `widen`: none (every bf16 and f16 value is an f32).
pub fn tolerance(op: Op, p: Precision) -> Tolerance {
    if op == Op::Widen {
        // Exact: a widened value is the input's own value.
        return Tolerance {
            ulps: 0.0,
            rtol: 0.0,
            atol: 0.0,
        };
    }
    let out = if op.f32_output() { Precision::F32 } else { p };
    let (rtol, atol) = match op {
        Op::RopeFwd | Op::RopeBwd => (1e-6, 1e-6),
        _ => (1e-5, 1e-5),
    };
    let ulps = if out == Precision::F32 { 0.0 } else { 2.0 };
    Tolerance { ulps, rtol, atol }
}

/// The outcome of [`compare`].
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// `max |got − want| / max(|want|, 1e-3·max|want|)`: relative error, with elements under a
    /// thousandth of the output's largest measured against that thousandth. Infinite on a NaN
    /// mismatch.
    pub max_rel_err: f64,
    pub pass: bool,
    /// The element with the largest error relative to its tolerance, and both values there.
    pub worst: usize,
    pub got: f32,
    pub want: f32,
}

/// Compares a kernel's output with the reference's under `tol` (`p`: the output's precision).
/// NaN must meet NaN.
pub fn compare(got: &[f32], want: &[f32], p: Precision, tol: Tolerance) -> Comparison {
    assert_eq!(got.len(), want.len(), "output lengths differ");
    let max = want
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f32, |a, &b| a.max(b.abs()));
    let floor = (1e-3 * max as f64).max(f64::MIN_POSITIVE);
    let (mut max_rel, mut worst, mut worst_ratio, mut pass) = (0f64, 0usize, -1f64, true);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (rel, ratio) = if g.is_nan() || w.is_nan() || g.is_infinite() || w.is_infinite() {
            let same = (g.is_nan() && w.is_nan()) || g == w;
            if same {
                (0.0, 0.0)
            } else {
                (f64::INFINITY, f64::INFINITY)
            }
        } else {
            let d = (g as f64 - w as f64).abs();
            let allowed = tol.ulps as f64 * p.ulp(w) as f64
                + tol.rtol as f64 * (w as f64).abs()
                + tol.atol as f64 * max as f64;
            let ratio = if d == 0.0 { 0.0 } else { d / allowed };
            (d / (w.abs() as f64).max(floor), ratio)
        };
        max_rel = max_rel.max(rel);
        if ratio > worst_ratio {
            (worst, worst_ratio) = (i, ratio);
        }
        pass &= ratio <= 1.0;
    }
    Comparison {
        max_rel_err: max_rel,
        pass,
        worst,
        got: got.get(worst).copied().unwrap_or(0.0),
        want: want.get(worst).copied().unwrap_or(0.0),
    }
}

// ---------------------------------------------------------------------------------------------
// Random inputs

/// A small deterministic generator (SplitMix64) for the checks' inputs, so that
/// `fused_check::self_test` needs no dependency beyond this crate.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: u32) -> u32 {
        (((self.next_u64() >> 32) * n as u64) >> 32) as u32
    }

    /// `n` values `scale·N(0, 1)` rounded to `p`.
    pub fn normals(&mut self, n: usize, scale: f32, p: Precision) -> Vec<f32> {
        (0..n).map(|_| p.round(scale * self.normal())).collect()
    }
}

#[cfg(test)]
mod tests;
