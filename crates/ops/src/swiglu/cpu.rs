//! The CPU loops of SwiGLU (`op.rs`'s `cpu_fwd`): one pass over each row, parallel over rows,
//! arithmetic in f32 whatever the storage type, compiled for AVX-512F / AVX2 where the CPU has it
//! (`rtune_backend::cpu`).

use std::mem::MaybeUninit;

use rayon::prelude::*;
use rtune_backend::cpu::{dispatch, exp, filled, par_rows, rt, Elem, Kernel, TASK};

/// `T(T(silu(g))·u)`: silu in f32 and rounded to `T`, as PyTorch's `act_fn(gate) * up`.
pub(crate) fn swiglu<T: Elem>(g: &[T], u: &[T]) -> Vec<T> {
    par_rows(g.len(), 1, 1, &Swiglu { g, u })
}

struct Swiglu<'a, T> {
    g: &'a [T],
    u: &'a [T],
}

impl<T: Elem> Kernel for Swiglu<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, i0: usize, hs: Self::Out<'_>) {
        let n = hs.len();
        let ins = self.g[i0..i0 + n].iter().zip(&self.u[i0..i0 + n]);
        for (o, (&a, &b)) in hs.iter_mut().zip(ins) {
            let a = a.f();
            o.write(T::of(rt::<T>(a / (1.0 + exp(-a))) * b.f()));
        }
    }
}

/// SwiGLU's backward as one `(2, n)` buffer: `dg = T(dh·u·σ(g)·(1 + g·(1 − σ(g))))` then
/// `du = T(dh·g·σ(g))`.
pub(crate) fn swiglu_bwd<T: Elem>(dh: &[T], g: &[T], u: &[T]) -> Vec<T> {
    let n = g.len();
    let k = SwigluBwd { dh, g, u };
    filled(2 * n, |out| {
        let (dg, du) = out.split_at_mut(n);
        dg.par_chunks_mut(TASK)
            .zip(du.par_chunks_mut(TASK))
            .enumerate()
            .for_each(|(i, pair)| dispatch(&k, i * TASK, pair));
    })
}

struct SwigluBwd<'a, T> {
    dh: &'a [T],
    g: &'a [T],
    u: &'a [T],
}

impl<T: Elem> Kernel for SwigluBwd<'_, T> {
    type Out<'o> = (&'o mut [MaybeUninit<T>], &'o mut [MaybeUninit<T>]);
    #[inline(always)]
    fn run(&self, i0: usize, (dgs, dus): Self::Out<'_>) {
        let m = dgs.len();
        let ins = self.dh[i0..i0 + m]
            .iter()
            .zip(&self.g[i0..i0 + m])
            .zip(&self.u[i0..i0 + m]);
        for ((og, ou), ((&dh, &g), &u)) in dgs.iter_mut().zip(dus.iter_mut()).zip(ins) {
            let (dh, g) = (dh.f(), g.f());
            let s = 1.0 / (exp(-g) + 1.0);
            ou.write(T::of(dh * (g * s)));
            og.write(T::of(dh * u.f() * (s * (g * (1.0 - s) + 1.0))));
        }
    }
}
