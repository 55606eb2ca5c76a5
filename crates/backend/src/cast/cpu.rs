//! The CPU loop of [`super::cast`]: element by element, in parallel, `D::of(x.f())` (the bits of
//! candle's `to_dtype`).

use half::bf16;
use std::mem::MaybeUninit;

use crate::cpu::{par_rows, rt, Elem, Kernel};

/// `x` cast to `D` element by element (`D::of(x.f())`: `to_dtype`'s bits), in parallel.
pub(crate) fn cast<S: Elem, D: Elem>(x: &[S]) -> Vec<D> {
    par_rows(x.len(), 1, 1, &Cast(x, D::of))
}

/// f32 values rounded to bf16 and back, in parallel.
pub(crate) fn round_bf16(x: &[f32]) -> Vec<f32> {
    par_rows(x.len(), 1, 1, &Cast(x, rt::<bf16>))
}

struct Cast<'a, S, F>(&'a [S], F);

impl<S: Elem, D: Elem, F: Fn(f32) -> D + Sync> Kernel for Cast<'_, S, F> {
    type Out<'o> = &'o mut [MaybeUninit<D>];
    #[inline(always)]
    fn run(&self, r0: usize, ys: Self::Out<'_>) {
        for (o, x) in ys.iter_mut().zip(&self.0[r0..]) {
            o.write((self.1)(x.f()));
        }
    }
}
