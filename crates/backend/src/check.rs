//! What every kernel check shares: the references' rounding ([`Precision`]), each op's tolerance
//! ([`tolerance`]), the comparison of a kernel's output with its reference ([`compare`]), seeded
//! inputs ([`Rng`]) and, with the `kernels` feature, copies to and from the device and the result
//! of one check ([`CheckResult`]). Each op's `check.rs` (in `rtune-ops`, and [`crate::cast`]'s
//! here) runs its kernels against its reference with these.

#[cfg(feature = "kernels")]
use cudarc::driver::{CudaSlice, CudaStream};
#[cfg(feature = "kernels")]
use std::sync::Arc;

#[cfg(feature = "kernels")]
use crate::launch::FusedFloat;
pub use crate::precision::Precision;
#[cfg(feature = "kernels")]
use crate::{drv, Result};

#[cfg(test)]
mod tests;

// ---------------------------------------------------------------------------------------------
// Comparison

/// A checked kernel, for naming results and choosing tolerances ([`tolerance`]). Each op's
/// `check.rs` defines its own (`Op::typed("rms_norm_fwd")`): no central list names them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Op {
    name: &'static str,
    output: Output,
    /// `(rtol, atol)` of [`Tolerance`].
    tol: (f32, f32),
}

/// What a kernel writes, for its tolerance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    /// The inputs' type.
    Typed,
    /// f32 whatever the inputs' type (`ce_fwd`, `attn_softmax_fwd`).
    F32,
    /// Exactly the reference's values (`widen`).
    Exact,
}

impl Op {
    /// A kernel writing the inputs' type: `rtol 1e-5`, `atol 1e-5` (see [`tolerance`]).
    pub const fn typed(name: &'static str) -> Op {
        Op {
            name,
            output: Output::Typed,
            tol: (1e-5, 1e-5),
        }
    }

    /// A kernel writing f32 whatever the inputs' type.
    pub const fn f32_out(name: &'static str) -> Op {
        Op {
            output: Output::F32,
            ..Op::typed(name)
        }
    }

    /// A kernel whose output must equal the reference's exactly.
    pub const fn exact(name: &'static str) -> Op {
        Op {
            output: Output::Exact,
            tol: (0.0, 0.0),
            ..Op::typed(name)
        }
    }

    /// This kernel with another f32 `(rtol, atol)` (RoPE's `1e-6`: see [`tolerance`]).
    pub const fn with_tol(self, rtol: f32, atol: f32) -> Op {
        Op {
            tol: (rtol, atol),
            ..self
        }
    }

    pub fn name(self) -> &'static str {
        self.name
    }

    /// Whether the output is f32 whatever the inputs' type (`ce_fwd`, `attn_softmax_fwd`,
    /// `widen`).
    pub fn f32_output(self) -> bool {
        self.output != Output::Typed
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
    if op.output == Output::Exact {
        // Exact: a widened value is the input's own value.
        return Tolerance {
            ulps: 0.0,
            rtol: 0.0,
            atol: 0.0,
        };
    }
    let out = if op.f32_output() { Precision::F32 } else { p };
    let (rtol, atol) = op.tol;
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
/// `rtune_ops::selftest` needs no dependency beyond this crate.
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

#[cfg(feature = "kernels")]
/// One kernel's comparison with its reference.
#[derive(Debug, Clone)]
pub struct CheckResult {
    /// `<op>_<type> <shape>`, e.g. `rms_norm_fwd_bf16 (64, 4096)`.
    pub name: String,
    pub cmp: Comparison,
}

#[cfg(feature = "kernels")]
impl CheckResult {
    pub fn new<T: FusedFloat>(op: Op, shape: String, got: &[f32], want: &[f32]) -> Self {
        let p = if op.f32_output() {
            Precision::F32
        } else {
            T::PRECISION
        };
        let tol = tolerance(op, T::PRECISION);
        CheckResult {
            name: format!("{}_{} {shape}", op.name(), T::SUFFIX),
            cmp: compare(got, want, p, tol),
        }
    }

    /// One line: name, max relative error, PASS/FAIL and the worst element.
    pub fn line(&self) -> String {
        let c = &self.cmp;
        format!(
            "{:<40} max rel err {:.3e}  {}  (worst [{}]: got {:e}, want {:e})",
            self.name,
            c.max_rel_err,
            if c.pass { "PASS" } else { "FAIL" },
            c.worst,
            c.got,
            c.want
        )
    }
}

#[cfg(feature = "kernels")]
/// `v` as `T` on the GPU, `offset` zeros first.
pub fn up<T: FusedFloat>(s: &Arc<CudaStream>, v: &[f32], offset: usize) -> Result<CudaSlice<T>> {
    let host: Vec<T> = std::iter::repeat_n(0.0, offset)
        .chain(v.iter().copied())
        .map(T::from_f32)
        .collect();
    s.clone_htod(&host).map_err(drv("check upload"))
}

#[cfg(feature = "kernels")]
/// A zeroed output of `n` elements after `offset`.
pub fn out<T: FusedFloat>(s: &Arc<CudaStream>, n: usize, offset: usize) -> Result<CudaSlice<T>> {
    s.alloc_zeros::<T>(offset + n).map_err(drv("check alloc"))
}

#[cfg(feature = "kernels")]
/// Elements `offset..` of `buf`, as f32 (synchronizes the stream).
pub fn down<T: FusedFloat>(
    s: &Arc<CudaStream>,
    buf: &CudaSlice<T>,
    offset: usize,
) -> Result<Vec<f32>> {
    let v = s
        .clone_dtoh(&buf.slice(offset..))
        .map_err(drv("check download"))?;
    Ok(v.into_iter().map(T::to_f32).collect())
}

#[cfg(feature = "kernels")]
pub fn at(offset: usize) -> String {
    if offset == 0 {
        String::new()
    } else {
        format!(" +{offset}")
    }
}

#[cfg(feature = "kernels")]
/// An op's `rtune selftest` groups (each op folder's `check.rs` has a `self_test_groups` that
/// returns them): a label (kernel, type, shape) and the checks' results, or the error that stopped
/// them.
pub type CheckGroups = Vec<(String, Result<Vec<CheckResult>>)>;

#[cfg(feature = "kernels")]
/// One group of [`self_test_seeded`]: its label and what it measured, or the error that stopped it.
pub type SelfTestGroup = (String, Result<Vec<(String, f64, bool)>>);
