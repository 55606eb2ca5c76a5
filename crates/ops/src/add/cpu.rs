//! The CPU loop of [`super::add`]: one parallel pass in f32, one rounding.

use std::mem::MaybeUninit;

use rtune_backend::cpu::{par_rows, rt, Elem, Kernel};

/// `T(a + b')`, `b' = T(b)` when `round_b` else `b`, the sum in f32, in parallel.
pub(crate) fn add<T: Elem, U: Elem>(a: &[T], b: &[U], round_b: bool) -> Vec<T> {
    if round_b {
        par_rows(a.len(), 1, 2, &Sum(a, b, |a, b| T::of(a + rt::<T>(b))))
    } else {
        par_rows(a.len(), 1, 2, &Sum(a, b, |a, b| T::of(a + b)))
    }
}

struct Sum<'a, T, U, F>(&'a [T], &'a [U], F);

impl<T: Elem, U: Elem, F: Fn(f32, f32) -> T + Sync> Kernel for Sum<'_, T, U, F> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, r0: usize, ys: Self::Out<'_>) {
        for (o, (a, b)) in ys.iter_mut().zip(self.0[r0..].iter().zip(&self.1[r0..])) {
            o.write((self.2)(a.f(), b.f()));
        }
    }
}
