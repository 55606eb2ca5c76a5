//! Fused attention softmax, forward and backward (one batch row of [`crate::ops::attention`] at a
//! time): the CPU kernels here, and with the `cuda` feature `kernels/attn.cu`'s (`fused_cuda`,
//! same semantics, restated in `rtune_kernels::fused_ref`). The plain chain they replace — scale,
//! cast to f32, add the mask, max, subtract, exp, sum, divide; and `p·(dp − Σ dp·p)·scale` — stays
//! in ops.rs as [`crate::ops::attention_probs_reference`] / [`crate::ops::attention_grad_reference`],
//! the tests' reference.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

use crate::fused::{by_dtype, float_dtype, slice};
use crate::fused_cpu::{exp, par_rows, rt, Elem, Kernel, LANES};
use std::mem::MaybeUninit;

/// `p = softmax(f32(scores·scale) + mask)` over the last dim, f32. `scores: (..., G·Tq, Tk)` f32,
/// bf16 or f16 (the product `scores·scale` rounds to that type, as candle's `scores * scale`);
/// `mask: (Tq, Tk)` additive f32 (any leading dims of 1, e.g. `(1, 1, 1, Tq, Tk)`), row `r` of the
/// scores taking mask row `r % Tq`.
pub fn attn_softmax(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    scores
        .contiguous()?
        .apply_op2_no_bwd(&mask.contiguous()?, &AttnSoftmax { scale })
}

/// [`attn_softmax`]'s backward: `ds = (p·(dp − Σ_row dp·p))·scale` in `dp`'s dtype; `p` f32,
/// `dp` of `p`'s shape (f32, bf16 or f16).
pub fn attn_softmax_bwd(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    p.contiguous()?
        .apply_op2_no_bwd(&dp.contiguous()?, &AttnSoftmaxBwd { scale })
}

/// Rows and row length of `(..., T)`.
fn rows(l: &Layout) -> (usize, usize) {
    let t = l.dims().last().copied().unwrap_or(1);
    (l.shape().elem_count() / t.max(1), t)
}

pub(crate) struct AttnSoftmax {
    pub(crate) scale: f64,
}

impl AttnSoftmax {
    /// `(rows, Tk, mask rows, dtype of the scores)`.
    pub(crate) fn check(
        &self,
        scores: (DType, &Layout),
        mask: (DType, &Layout),
    ) -> Result<(usize, usize, usize, DType)> {
        let op = self.name();
        let (ls, lm) = (scores.1, mask.1);
        let dt = float_dtype(op, &[("scores", scores.0)])?;
        if mask.0 != DType::F32 {
            bail!("{op}: `mask` must be f32, got {:?}", mask.0);
        }
        // The mask's rows repeat down the scores' second-to-last dim (the G query heads of a kv
        // head are stacked there: G·Tq rows).
        let (n, tk) = rows(ls);
        let (mrows, mk) = rows(lm);
        let stacked = ls.dims().iter().rev().nth(1).copied().unwrap_or(1);
        if mk != tk || mrows == 0 || stacked % mrows != 0 {
            bail!(
                "{op}: `mask` {:?} does not fit scores {:?} \
                 (want (Tq, {tk}) with Tq dividing {stacked})",
                lm.dims(),
                ls.dims()
            );
        }
        Ok((n, tk, mrows, dt))
    }
}

impl CustomOp2 for AttnSoftmax {
    fn name(&self) -> &'static str {
        "attn_softmax"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        ls: &Layout,
        sm: &CpuStorage,
        lm: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, tk, _, dt) = self.check((ss.dtype(), ls), (sm.dtype(), lm))?;
        let mask = slice::<f32>(op, "mask", sm, lm)?;
        let p = by_dtype!(dt, T => softmax_rows::<T>(
            slice(op, "scores", ss, ls)?,
            mask,
            tk,
            self.scale as f32,
        ));
        Ok((CpuStorage::F32(p), ls.shape().clone()))
    }

    crate::fused::cuda_fwd2!(crate::fused_cuda::attn_softmax);
}

pub(crate) struct AttnSoftmaxBwd {
    pub(crate) scale: f64,
}

impl AttnSoftmaxBwd {
    /// `(rows, T, dtype of dp)`.
    pub(crate) fn check(
        &self,
        p: (DType, &Layout),
        dp: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let op = self.name();
        if p.0 != DType::F32 {
            bail!("{op}: `p` must be f32, got {:?}", p.0);
        }
        let dt = float_dtype(op, &[("dp", dp.0)])?;
        if p.1.shape() != dp.1.shape() {
            bail!(
                "{op}: `dp` has shape {:?}, `p` {:?}",
                dp.1.dims(),
                p.1.dims()
            );
        }
        let (n, t) = rows(p.1);
        Ok((n, t, dt))
    }
}

impl CustomOp2 for AttnSoftmaxBwd {
    fn name(&self) -> &'static str {
        "attn_softmax_bwd"
    }

    fn cpu_fwd(
        &self,
        sp: &CpuStorage,
        lp: &Layout,
        sd: &CpuStorage,
        ld: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, t, dt) = self.check((sp.dtype(), lp), (sd.dtype(), ld))?;
        let p = slice::<f32>(op, "p", sp, lp)?;
        let ds = by_dtype!(dt, T => T::to_cpu_storage_owned(softmax_bwd_rows::<T>(
            p,
            slice(op, "dp", sd, ld)?,
            t,
            self.scale as f32,
        )));
        Ok((ds, lp.shape().clone()))
    }

    crate::fused::cuda_fwd2!(crate::fused_cuda::attn_softmax_bwd);
}

/// Rows of `tk` scores → `p = softmax(f32(T(s·T(scale))) + mask)` in f32, row `r` taking mask row
/// `r % (mask.len() / tk)`. The scaling rounds as candle's `scores * scale` on a `T` tensor does
/// (`affine`: the scale and the product in `T`).
fn softmax_rows<T: Elem>(scores: &[T], mask: &[f32], tk: usize, scale: f32) -> Vec<f32> {
    let k = Softmax {
        scores,
        mask,
        tk,
        scale: rt::<T>(scale),
    };
    par_rows(scores.len(), tk, 2 * tk, &k)
}

struct Softmax<'a, T> {
    scores: &'a [T],
    mask: &'a [f32],
    tk: usize,
    scale: f32,
}

impl<T: Elem> Kernel for Softmax<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<f32>];
    #[inline(always)]
    fn run(&self, r0: usize, outs: Self::Out<'_>) {
        let (tk, scale) = (self.tk, self.scale);
        let tq = self.mask.len() / tk;
        let s = |a: T, m: f32| rt::<T>(a.f() * scale) + m;
        let rows = outs
            .chunks_exact_mut(tk)
            .zip(self.scores[r0 * tk..].chunks_exact(tk));
        for (k, (o, sr)) in rows.enumerate() {
            let m0 = (r0 + k) % tq * tk;
            let mr = &self.mask[m0..m0 + tk];
            let ((cs, rs), (cm, rm)) = (sr.as_chunks::<LANES>(), mr.as_chunks::<LANES>());
            // The row's max, over LANES partial maxima.
            let mut mx = [f32::NEG_INFINITY; LANES];
            for (a, m) in cs.iter().zip(cm) {
                for i in 0..LANES {
                    let v = s(a[i], m[i]);
                    mx[i] = if v > mx[i] { v } else { mx[i] };
                }
            }
            let mut top = f32::NEG_INFINITY;
            for v in mx
                .into_iter()
                .chain(rs.iter().zip(rm).map(|(&a, &m)| s(a, m)))
            {
                top = if v > top { v } else { top };
            }
            // e = exp(s − max) into the output, and its sum.
            let mut acc = [0f32; LANES];
            let (co, ro) = o.as_chunks_mut::<LANES>();
            for ((o, a), m) in co.iter_mut().zip(cs).zip(cm) {
                for i in 0..LANES {
                    let e = exp(s(a[i], m[i]) - top);
                    o[i].write(e);
                    acc[i] += e;
                }
            }
            let mut tail = 0f32;
            for ((o, &a), &m) in ro.iter_mut().zip(rs).zip(rm) {
                let e = exp(s(a, m) - top);
                o.write(e);
                tail += e;
            }
            let sum = acc.iter().sum::<f32>() + tail;
            // SAFETY: the two loops above wrote every element of the row.
            let o = unsafe { &mut *(o as *mut [MaybeUninit<f32>] as *mut [f32]) };
            for v in o {
                *v /= sum;
            }
        }
    }
}

/// Rows of `t`: `ds = T((p·(dp − Σ dp·p))·scale)`, `p` f32, `dp` in `T`.
fn softmax_bwd_rows<T: Elem>(p: &[f32], dp: &[T], t: usize, scale: f32) -> Vec<T> {
    par_rows(p.len(), t, 2 * t, &SoftmaxBwd { p, dp, t, scale })
}

struct SoftmaxBwd<'a, T> {
    p: &'a [f32],
    dp: &'a [T],
    t: usize,
    scale: f32,
}

impl<T: Elem> Kernel for SoftmaxBwd<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, r0: usize, outs: Self::Out<'_>) {
        let t = self.t;
        let rows = self.p[r0 * t..]
            .chunks_exact(t)
            .zip(self.dp[r0 * t..].chunks_exact(t));
        for (o, (pr, dr)) in outs.chunks_exact_mut(t).zip(rows) {
            let ((cp, rp), (cd, rd)) = (pr.as_chunks::<LANES>(), dr.as_chunks::<LANES>());
            let mut acc = [0f32; LANES];
            for (a, b) in cp.iter().zip(cd) {
                for i in 0..LANES {
                    acc[i] += b[i].f() * a[i];
                }
            }
            let mut tail = 0f32;
            for (&a, &b) in rp.iter().zip(rd) {
                tail += b.f() * a;
            }
            let row = acc.iter().sum::<f32>() + tail;
            for (o, (&a, &b)) in o.iter_mut().zip(pr.iter().zip(dr)) {
                o.write(T::of(a * (b.f() - row) * self.scale));
            }
        }
    }
}
