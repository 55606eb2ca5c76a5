//! The CPU loops of GeGLU (`op.rs`'s `cpu_fwd`): one pass, parallel over chunks, arithmetic in f32
//! whatever the storage type, compiled for AVX-512F / AVX2 where the CPU has it
//! (`rtune_backend::cpu`). Each f32 step is the candle op chain's (`reference::geglu_chain`) in its
//! order — `x³ = (x·x)·x`, `t = tanh((x + C·x³)·K)`, `act = (x·0.5)·(t + 1)` — so the results are
//! the chain's bit for bit; only the passes over memory are gone.

use std::mem::MaybeUninit;

use rayon::prelude::*;
use rtune_backend::cpu::{dispatch, filled, par_rows, rt, Elem, Kernel, TASK};

use super::{C, K};

/// `tanh((x + C·x³)·K)` in f32, as the chain computes it (`x.sqr().mul(x)`, then candle's affines
/// `v·m + a`, whose `+ 0.0` only turns a −0 into +0, then tanh).
#[inline(always)]
pub(crate) fn inner_tanh(x: f32) -> f32 {
    let x3 = (x * x) * x;
    ((x + (x3 * C as f32 + 0.0)) * K as f32 + 0.0).tanh()
}

/// `gelu_tanh(x) = (x·0.5)·(t + 1)` in f32 (the affine's `+ 0.0` kept: −0 gives +0 as the chain).
#[inline(always)]
fn act(x: f32, t: f32) -> f32 {
    (x * 0.5 + 0.0) * (t + 1.0)
}

/// `h = T(T(gelu_tanh(g))·u)`.
pub(crate) fn geglu<T: Elem>(g: &[T], u: &[T]) -> Vec<T> {
    par_rows(g.len(), 1, 1, &Geglu { g, u })
}

struct Geglu<'a, T> {
    g: &'a [T],
    u: &'a [T],
}

impl<T: Elem> Kernel for Geglu<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, i0: usize, hs: Self::Out<'_>) {
        let n = hs.len();
        let ins = self.g[i0..i0 + n].iter().zip(&self.u[i0..i0 + n]);
        for (o, (&g, &u)) in hs.iter_mut().zip(ins) {
            let x = g.f();
            o.write(T::of(rt::<T>(act(x, inner_tanh(x))) * u.f()));
        }
    }
}

/// GeGLU's backward as one `(2, n)` buffer: `dg = T((dh·u)·gelu_tanh'(g))` then
/// `du = T(dh·T(gelu_tanh(g)))`, with `gelu_tanh'(x) = (t + 1)·0.5 + ((x·K/2)·(1 − t²))·(x²·3C + 1)`.
pub(crate) fn geglu_bwd<T: Elem>(dh: &[T], g: &[T], u: &[T]) -> Vec<T> {
    let n = g.len();
    let k = GegluBwd { dh, g, u };
    filled(2 * n, |out| {
        let (dg, du) = out.split_at_mut(n);
        dg.par_chunks_mut(TASK)
            .zip(du.par_chunks_mut(TASK))
            .enumerate()
            .for_each(|(i, pair)| dispatch(&k, i * TASK, pair));
    })
}

struct GegluBwd<'a, T> {
    dh: &'a [T],
    g: &'a [T],
    u: &'a [T],
}

impl<T: Elem> Kernel for GegluBwd<'_, T> {
    type Out<'o> = (&'o mut [MaybeUninit<T>], &'o mut [MaybeUninit<T>]);
    #[inline(always)]
    fn run(&self, i0: usize, (dgs, dus): Self::Out<'_>) {
        let m = dgs.len();
        let ins = self.dh[i0..i0 + m]
            .iter()
            .zip(&self.g[i0..i0 + m])
            .zip(&self.u[i0..i0 + m]);
        for ((og, ou), ((&dh, &g), &u)) in dgs.iter_mut().zip(dus.iter_mut()).zip(ins) {
            let (dh, x) = (dh.f(), g.f());
            let t = inner_tanh(x);
            ou.write(T::of(dh * rt::<T>(act(x, t))));
            og.write(T::of((dh * u.f()) * deriv(x, t)));
        }
    }
}

/// `gelu_tanh'(x)` given `t = tanh((x + C·x³)·K)`, in the chain's order:
/// `(t + 1)·0.5 + ((x·(K/2))·(1 − t²))·(x²·3C + 1)`.
#[inline(always)]
pub(crate) fn deriv(x: f32, t: f32) -> f32 {
    // The chain's `1 − t²` is `t²·(−1) + 1`: the same bits (negation is exact).
    let one_minus_t2 = 1.0 - t * t;
    let poly = (x * x) * (3.0 * C) as f32 + 1.0;
    (t + 1.0) * 0.5 + ((x * (0.5 * K) as f32) * one_minus_t2) * poly
}
