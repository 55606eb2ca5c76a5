//! The CPU loops of a gated unit (`op.rs`'s `cpu_fwd`): one pass, parallel over chunks,
//! arithmetic in f32 whatever the storage type, compiled for AVX-512F / AVX2 where the CPU has it
//! (`rtune_backend::cpu`).

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use rayon::prelude::*;
use rtune_backend::cpu::{dispatch, filled, par_rows, rt, Elem, Kernel, TASK};

use super::Activation;

/// `h = T(T(act(g))·u)`.
pub(crate) fn fwd<A: Activation, T: Elem>(g: &[T], u: &[T]) -> Vec<T> {
    par_rows(
        g.len(),
        1,
        1,
        &Fwd::<A, T> {
            g,
            u,
            a: PhantomData,
        },
    )
}

struct Fwd<'a, A, T> {
    g: &'a [T],
    u: &'a [T],
    a: PhantomData<A>,
}

impl<A: Activation, T: Elem> Kernel for Fwd<'_, A, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, i0: usize, hs: Self::Out<'_>) {
        let n = hs.len();
        let ins = self.g[i0..i0 + n].iter().zip(&self.u[i0..i0 + n]);
        for (o, (&g, &u)) in hs.iter_mut().zip(ins) {
            o.write(T::of(rt::<T>(A::fwd(g.f())) * u.f()));
        }
    }
}

/// The backward as one `(2, n)` buffer: `dg = T((dh·u)·act'(g))` then `du = T(dh·a)`, `a` the gate
/// (rounded to `T` first when [`Activation::ROUND_GATE_IN_BWD`]).
pub(crate) fn bwd<A: Activation, T: Elem>(dh: &[T], g: &[T], u: &[T]) -> Vec<T> {
    let n = g.len();
    let k = Bwd::<A, T> {
        dh,
        g,
        u,
        a: PhantomData,
    };
    filled(2 * n, |out| {
        let (dg, du) = out.split_at_mut(n);
        dg.par_chunks_mut(TASK)
            .zip(du.par_chunks_mut(TASK))
            .enumerate()
            .for_each(|(i, pair)| dispatch(&k, i * TASK, pair));
    })
}

struct Bwd<'a, A, T> {
    dh: &'a [T],
    g: &'a [T],
    u: &'a [T],
    a: PhantomData<A>,
}

impl<A: Activation, T: Elem> Kernel for Bwd<'_, A, T> {
    type Out<'o> = (&'o mut [MaybeUninit<T>], &'o mut [MaybeUninit<T>]);
    #[inline(always)]
    fn run(&self, i0: usize, (dgs, dus): Self::Out<'_>) {
        let m = dgs.len();
        let ins = self.dh[i0..i0 + m]
            .iter()
            .zip(&self.g[i0..i0 + m])
            .zip(&self.u[i0..i0 + m]);
        for ((og, ou), ((&dh, &g), &u)) in dgs.iter_mut().zip(dus.iter_mut()).zip(ins) {
            let dh = dh.f();
            let (a, da) = A::bwd(g.f());
            let a = if A::ROUND_GATE_IN_BWD { rt::<T>(a) } else { a };
            ou.write(T::of(dh * a));
            og.write(T::of(dh * u.f() * da));
        }
    }
}
