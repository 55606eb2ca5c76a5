//! The CPU loops of the attention softmax (`softmax.rs`): the masked, scaled softmax of each row of
//! scores and its backward, parallel over rows, f32 arithmetic.

use std::mem::MaybeUninit;

use rtune_backend::cpu::{exp, par_rows, rt, Elem, Kernel, LANES};

/// Rows of `tk` scores → `p = softmax(f32(T(s·scale)) + mask)` in f32, row `r` taking mask row
/// `r % (mask.len() / tk)`. The scaling rounds as torch's `scores * scaling` on a `T` tensor does
/// (transformers' eager attention): the product of the f32 score and the f32 scale, rounded to
/// `T` once (candle's affine would round the scale to `T` first: 1/√24 or 1/√128 are not `T`
/// values).
pub(crate) fn softmax_rows<T: Elem>(scores: &[T], mask: &[f32], tk: usize, scale: f32) -> Vec<f32> {
    let k = Softmax {
        scores,
        mask,
        tk,
        scale,
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
pub(crate) fn softmax_bwd_rows<T: Elem>(p: &[f32], dp: &[T], t: usize, scale: f32) -> Vec<T> {
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
