//! The CPU loops of RMSNorm (`op.rs`'s `cpu_fwd`): one pass over each row, parallel over rows,
//! arithmetic in f32 whatever the storage type, compiled for AVX-512F / AVX2 where the CPU has it
//! (`rtune_backend::cpu`).

use std::mem::MaybeUninit;

use rtune_backend::cpu::{par_rows, rt, sum1, sum3, Elem, Kernel};

/// RMSNorm of rows of `w.len()`: `y = T(T(x·r)·w)`, `r = 1/sqrt(mean(x²) + eps)` in f32.
pub(crate) fn rms_norm<T: Elem>(x: &[T], w: &[T], eps: f32) -> Vec<T> {
    let d = w.len();
    // As candle's `mean_keepdim`: the sum times 1/D rounded to f32.
    let inv_d = (1.0 / d as f64) as f32;
    par_rows(x.len(), d, d, &RmsNorm { x, w, eps, inv_d })
}

struct RmsNorm<'a, T> {
    x: &'a [T],
    w: &'a [T],
    eps: f32,
    inv_d: f32,
}

impl<T: Elem> Kernel for RmsNorm<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, r0: usize, ys: Self::Out<'_>) {
        let d = self.w.len();
        for (yr, xr) in ys.chunks_exact_mut(d).zip(self.x[r0 * d..].chunks_exact(d)) {
            let r = 1.0 / (sum1(xr, |a| a * a) * self.inv_d + self.eps).sqrt();
            for (o, (&xv, &wv)) in yr.iter_mut().zip(xr.iter().zip(self.w)) {
                o.write(T::of(rt::<T>(xv.f() * r) * wv.f()));
            }
        }
    }
}

/// RMSNorm's `dx = r·g − (x·r³)·mean(g·x)`, `g = T(dy·w)`, with `r` recomputed from `x`.
pub(crate) fn rms_norm_bwd<T: Elem>(dy: &[T], x: &[T], w: &[T], eps: f32) -> Vec<T> {
    let d = w.len();
    let inv_d = (1.0 / d as f64) as f32;
    par_rows(
        x.len(),
        d,
        2 * d,
        &RmsNormBwd {
            dy,
            x,
            w,
            eps,
            inv_d,
        },
    )
}

struct RmsNormBwd<'a, T> {
    dy: &'a [T],
    x: &'a [T],
    w: &'a [T],
    eps: f32,
    inv_d: f32,
}

impl<T: Elem> Kernel for RmsNormBwd<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, r0: usize, outs: Self::Out<'_>) {
        let (d, w) = (self.w.len(), self.w);
        let rows = self.dy[r0 * d..]
            .chunks_exact(d)
            .zip(self.x[r0 * d..].chunks_exact(d));
        for (o, (dyr, xr)) in outs.chunks_exact_mut(d).zip(rows) {
            let r = 1.0 / (sum1(xr, |a| a * a) * self.inv_d + self.eps).sqrt();
            let gx = sum3(dyr, w, xr, |a, b, c| rt::<T>(a * b) * c) * self.inv_d;
            let r3 = r.powf(3.0);
            for (o, ((&a, &b), &c)) in o.iter_mut().zip(dyr.iter().zip(w).zip(xr)) {
                let g = rt::<T>(a.f() * b.f());
                o.write(T::of(g * r - c.f() * r3 * gx));
            }
        }
    }
}
