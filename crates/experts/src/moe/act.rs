//! The experts' gate: how the `(n, 2I)` output of `gate_up` becomes the `(n, I)` input of `down`,
//! forward and backward.
//!
//! - [`ExpertAct::SwiGlu`] (Qwen3-MoE, Mixtral): columns `0..I` gate `g`, `I..2I` up `u`;
//!   `silu(g)·u` ([`rtune_ops::swiglu()`]).
//! - [`ExpertAct::Clamped`] (gpt-oss, transformers 5.24's `GptOssExperts._apply_gate`): gate and up
//!   interleaved, column `2j` gate `j`, `2j + 1` up `j`; `g' = min(g, limit)`,
//!   `u' = clamp(u, −limit, limit)`, `out = (u' + 1)·g'·σ(α·g')`. Backward, with `s = σ(α·g')`:
//!   `dg = dout·(u' + 1)·(s + α·g'·s·(1 − s))·[g < limit]`, `du = dout·g'·s·[|u| < limit]`: torch
//!   2.15's clamp by a scalar passes the gradient only strictly inside the range, none at a bound
//!   itself. In bf16 a gate or up value lands exactly on the limit often enough to matter
//!   (`tiny-gpt-oss`: 3 gate and 7 up values at ±1.0 in layer 1); passing the gradient there put
//!   gpt-oss's bf16 gate_up `lora_B` gradient 0.36 of its largest entry off PEFT's.

use candle_core::{DType, Device, Result, Tensor};
use rtune_backend::cpu::{dispatch, Kernel};
use rtune_ops::glu::Activation;
use rtune_ops::swiglu::Silu;

/// Which gate the experts apply.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertAct {
    SwiGlu,
    /// `alpha`: `swiglu_alpha` (1.702); `limit`: `swiglu_limit` (7.0).
    Clamped {
        alpha: f64,
        limit: f64,
    },
}

/// `(g, u)` of `gu: (n, 2I)` laid out as `act` says, each `(n, I)`.
fn split(gu: &Tensor, act: ExpertAct) -> Result<(Tensor, Tensor)> {
    let (n, i2) = gu.dims2()?;
    let i = i2 / 2;
    match act {
        ExpertAct::SwiGlu => Ok((gu.narrow(1, 0, i)?, gu.narrow(1, i, i)?)),
        ExpertAct::Clamped { .. } => {
            let p = gu.reshape((n, i, 2))?;
            Ok((
                p.narrow(2, 0, 1)?.squeeze(2)?,
                p.narrow(2, 1, 1)?.squeeze(2)?,
            ))
        }
    }
}

/// `σ(x) = 1 / (1 + e^{−x})`.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// `σ(α·g)` as torch forms it in `g`'s dtype: `α·g` in f32 (α not rounded) and rounded, then
/// the sigmoid in f32 and rounded once (in f32 both roundings are no-ops).
fn gate_sigmoid(g: &Tensor, alpha: f64) -> Result<Tensor> {
    let dt = g.dtype();
    let x = (g.to_dtype(DType::F32)? * alpha)?.to_dtype(dt)?;
    sigmoid(&x.to_dtype(DType::F32)?)?.to_dtype(dt)
}

/// `gu: (n, 2I)` → `(n, I)`.
pub fn act_forward(gu: &Tensor, act: ExpertAct) -> Result<Tensor> {
    let (g, u) = split(gu, act)?;
    match act {
        ExpertAct::SwiGlu => rtune_ops::swiglu(&g, &u),
        ExpertAct::Clamped { alpha, limit } => {
            let g = g.minimum(limit)?;
            let u = u.clamp(-limit, limit)?;
            let glu = (&g * gate_sigmoid(&g, alpha)?)?;
            (u + 1.0)? * glu
        }
    }
}

/// The backward of [`act_forward`]: `dm: (n, I)`, `gu` the forward's input → `dgu: (n, 2I)` in
/// `gu`'s layout.
pub fn act_backward(dm: &Tensor, gu: &Tensor, act: ExpertAct) -> Result<Tensor> {
    let (g, u) = split(gu, act)?;
    match act {
        ExpertAct::SwiGlu => {
            let (dg, du) = rtune_ops::swiglu_backward(dm, &g, &u)?;
            Tensor::cat(&[dg, du], 1)
        }
        ExpertAct::Clamped { alpha, limit } => {
            let dt = gu.dtype();
            // No gradient at the bounds themselves, as torch's scalar clamp (module doc).
            let g_in = g.lt(limit)?.to_dtype(dt)?;
            let u_in = (u.gt(-limit)?.to_dtype(dt)? * u.lt(limit)?.to_dtype(dt)?)?;
            let gc = g.minimum(limit)?;
            let uc = u.clamp(-limit, limit)?;
            let s = gate_sigmoid(&gc, alpha)?;
            // torch's autograd through `(u' + 1)·(g'·σ(α·g'))`, each product rounded to `dt`:
            // d_glu = dout·(u' + 1); du' = dout·glu; dg' = d_glu·s + α·R(d_glu·g'·s·(1 − s)),
            // sigmoid's backward in f32 rounded once, the two terms summed in `dt`.
            let d_glu = (dm * (uc + 1.0)?)?;
            let du = ((dm * (&gc * &s)?)? * u_in)?;
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            let sf = f(&s)?;
            let dx = (f(&(&d_glu * &gc)?)? * (&sf * sf.affine(-1.0, 1.0)?)?)?.to_dtype(dt)?;
            let dg = ((&d_glu * &s)? + (f(&dx)? * alpha)?.to_dtype(dt)?)?.mul(&g_in)?;
            let (n, i) = dg.dims2()?;
            Tensor::stack(&[dg, du], 2)?.reshape((n, 2 * i))
        }
    }
}

/// SwiGLU over an expert's rows in place of [`act_forward`]'s tensors (the grouped path, f32):
/// `gu (n, 2I)` row by row (gate `0..I`, up `I..2I`) → `m (n, I)`, `silu(g)·u` with the op's
/// own activation ([`rtune_ops::swiglu::Silu`], the same expression as its CPU loop: the same
/// bits), compiled for AVX-512F / AVX2 ([`rtune_backend::cpu::dispatch`]).
struct SwiGluRows<'a> {
    gu: &'a [f32],
    i: usize,
}

impl Kernel for SwiGluRows<'_> {
    type Out<'o> = &'o mut [f32];
    #[inline(always)]
    fn run(&self, _: usize, m: &mut [f32]) {
        let i = self.i;
        for (row, mr) in self.gu.chunks_exact(2 * i).zip(m.chunks_exact_mut(i)) {
            let (g, u) = row.split_at(i);
            for ((o, &g), &u) in mr.iter_mut().zip(g).zip(u) {
                *o = Silu::fwd(g) * u;
            }
        }
    }
}

/// The backward of [`SwiGluRows`]: `dm (n, I)` and `gu (n, 2I)` → `dgu (n, 2I)` row by row,
/// `dg = dm·u·silu'(g)`, `du = dm·silu(g)` (the op's backward loop's expressions).
struct SwiGluRowsBwd<'a> {
    dm: &'a [f32],
    gu: &'a [f32],
    i: usize,
}

impl Kernel for SwiGluRowsBwd<'_> {
    type Out<'o> = &'o mut [f32];
    #[inline(always)]
    fn run(&self, _: usize, dgu: &mut [f32]) {
        let i = self.i;
        let rows = self.gu.chunks_exact(2 * i).zip(self.dm.chunks_exact(i));
        for ((row, dmr), out) in rows.zip(dgu.chunks_exact_mut(2 * i)) {
            let (g, u) = row.split_at(i);
            let (dg, du) = out.split_at_mut(i);
            let ins = dmr.iter().zip(g).zip(u);
            for ((og, ou), ((&dh, &g), &u)) in dg.iter_mut().zip(du.iter_mut()).zip(ins) {
                let (a, da) = Silu::bwd(g);
                *ou = dh * a;
                *og = dh * u * da;
            }
        }
    }
}

/// The element count `n·I` of `m (n, I)` against `gu (n, 2I)` (rows of `i`), or an error naming
/// `what`.
fn rows_width(gu: &[f32], m: &[f32], i: usize, what: &str) -> Result<usize> {
    let n2i = gu.len();
    if m.is_empty() && n2i == 0 {
        return Ok(0);
    }
    if n2i != 2 * m.len() || i == 0 || !m.len().is_multiple_of(i) {
        candle_core::bail!(
            "moe {what}: gate/up rows of {n2i} elements against {} activations (want 2:1, \
             rows of {i})",
            m.len()
        );
    }
    Ok(m.len())
}

/// [`act_forward`] on one expert's rows, f32 slices: `gu (n, 2I)` → `m (n, I)`. SwiGLU in
/// place ([`SwiGluRows`]); the clamped gate through [`act_forward`] on a copy.
pub(crate) fn rows_forward(gu: &[f32], m: &mut [f32], act: ExpertAct, i: usize) -> Result<()> {
    let total = rows_width(gu, m, i, "activation")?;
    if total == 0 {
        return Ok(());
    }
    let n = total / i;
    match act {
        ExpertAct::SwiGlu => {
            dispatch(&SwiGluRows { gu, i }, 0, m);
            Ok(())
        }
        ExpertAct::Clamped { .. } => {
            let t = Tensor::from_slice(gu, (n, 2 * i), &Device::Cpu)?;
            let v = act_forward(&t, act)?.flatten_all()?.to_vec1::<f32>()?;
            m.copy_from_slice(&v);
            Ok(())
        }
    }
}

/// [`act_backward`] on one expert's rows: `dm (n, I)`, `gu (n, 2I)` → `dgu (n, 2I)`.
pub(crate) fn rows_backward(
    dm: &[f32],
    gu: &[f32],
    dgu: &mut [f32],
    act: ExpertAct,
    i: usize,
) -> Result<()> {
    let total = rows_width(gu, dm, i, "activation backward")?;
    if dgu.len() != gu.len() {
        candle_core::bail!(
            "moe activation backward: {} gradients for {} gate/up values",
            dgu.len(),
            gu.len()
        );
    }
    if total == 0 {
        return Ok(());
    }
    let n = total / i;
    match act {
        ExpertAct::SwiGlu => {
            dispatch(&SwiGluRowsBwd { dm, gu, i }, 0, dgu);
            Ok(())
        }
        ExpertAct::Clamped { .. } => {
            let t = Tensor::from_slice(gu, (n, 2 * i), &Device::Cpu)?;
            let d = Tensor::from_slice(dm, (n, i), &Device::Cpu)?;
            let v = act_backward(&d, &t, act)?.flatten_all()?.to_vec1::<f32>()?;
            dgu.copy_from_slice(&v);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtune_ops::test_util::{flat, randn};

    /// The grouped path's row kernels ([`rows_forward`], [`rows_backward`]) against the tensor
    /// functions ([`act_forward`], [`act_backward`]: `rtune_ops::swiglu` and the clamp's candle
    /// chain) on fresh inputs whose width is not a multiple of a vector (`I` 37, 5 rows, values
    /// up to ±8 so the clamp at 0.6 cuts): SwiGLU bit for bit (the same expressions), the clamp
    /// bit for bit (it runs those very functions). A wrong half, row stride or derivative moves
    /// an element by O(1).
    #[test]
    fn row_kernels_are_the_tensor_activation() {
        let (n, i) = (5, 37);
        let gu = randn(&[n, 2 * i], 11, 4.0);
        let dm = randn(&[n, i], 12, 1.0);
        let clamped = ExpertAct::Clamped {
            alpha: 1.702,
            limit: 0.6,
        };
        for act in [ExpertAct::SwiGlu, clamped] {
            let (guv, dmv) = (flat(&gu), flat(&dm));
            let mut m = vec![f32::NAN; n * i];
            rows_forward(&guv, &mut m, act, i).unwrap();
            let want = flat(&act_forward(&gu, act).unwrap());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&m), bits(&want), "{act:?} forward");
            let mut dgu = vec![f32::NAN; n * 2 * i];
            rows_backward(&dmv, &guv, &mut dgu, act, i).unwrap();
            let want = flat(&act_backward(&dm, &gu, act).unwrap());
            assert_eq!(bits(&dgu), bits(&want), "{act:?} backward");
        }
        // Mismatched buffers are errors, not panics.
        let mut short = vec![0f32; 3];
        assert!(rows_forward(&[0.0; 10], &mut short, ExpertAct::SwiGlu, 5).is_err());
        assert!(rows_backward(&[0.0; 5], &[0.0; 10], &mut short, ExpertAct::SwiGlu, 5).is_err());
    }
}
