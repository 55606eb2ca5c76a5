//! The CPU loops of the cross-entropy of a chunk (`op.rs`'s `cpu_fwd`): one pass over each row, parallel over rows,
//! arithmetic in f32 whatever the storage type, compiled for AVX-512F / AVX2 where the CPU has it
//! (`rtune_backend::cpu`).

use std::mem::MaybeUninit;

use rtune_backend::cpu::{exp, max, par_rows, sum1, Elem, Kernel};

/// Cross-entropy statistics of rows of `v` logits: `(n, 2)` f32 `[lse, lse − logit[target]]`, with
/// `lse = max + ln Σ exp(logit − max)`. Targets must be `< v` (checked by the caller).
pub(crate) fn ce_fwd<T: Elem>(logits: &[T], targets: &[u32], v: usize) -> Vec<f32> {
    par_rows(2 * targets.len(), 2, v, &CeFwd { logits, targets, v })
}

struct CeFwd<'a, T> {
    logits: &'a [T],
    targets: &'a [u32],
    v: usize,
}

impl<T: Elem> Kernel for CeFwd<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<f32>];
    #[inline(always)]
    fn run(&self, r0: usize, outs: Self::Out<'_>) {
        let v = self.v;
        let rows = outs
            .chunks_exact_mut(2)
            .zip(self.logits[r0 * v..].chunks_exact(v));
        for (k, (o, l)) in rows.enumerate() {
            let m = max(l);
            let ls = sum1(l, |a| exp(a - m)).ln();
            let picked = l[self.targets[r0 + k] as usize].f() - m;
            o[0].write(m + ls);
            o[1].write(ls - picked);
        }
    }
}

/// `dlogits = T((softmax(logits) − onehot(target))·scale)` from each row's `lse`.
pub(crate) fn ce_bwd<T: Elem>(
    logits: &[T],
    targets: &[u32],
    lse: &[f32],
    scale: f32,
    v: usize,
) -> Vec<T> {
    let k = CeBwd {
        logits,
        targets,
        lse,
        scale,
        v,
    };
    par_rows(logits.len(), v, 2 * v, &k)
}

struct CeBwd<'a, T> {
    logits: &'a [T],
    targets: &'a [u32],
    lse: &'a [f32],
    scale: f32,
    v: usize,
}

impl<T: Elem> Kernel for CeBwd<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, r0: usize, outs: Self::Out<'_>) {
        let (v, scale) = (self.v, self.scale);
        let rows = outs
            .chunks_exact_mut(v)
            .zip(self.logits[r0 * v..].chunks_exact(v));
        for (k, (o, l)) in rows.enumerate() {
            let lse = self.lse[r0 + k];
            for (o, &a) in o.iter_mut().zip(l) {
                o.write(T::of(exp(a.f() - lse) * scale));
            }
            let t = self.targets[r0 + k] as usize;
            o[t].write(T::of((exp(l[t].f() - lse) - 1.0) * scale));
        }
    }
}
