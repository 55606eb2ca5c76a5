//! The CPU loops of RoPE (`op.rs`'s `cpu_fwd`): one pass over each row, parallel over rows,
//! arithmetic in f32 whatever the storage type, compiled for AVX-512F / AVX2 where the CPU has it
//! (`rtune_backend::cpu`).

use std::mem::MaybeUninit;

use rtune_backend::cpu::{par_rows, rt, Elem, Kernel};

/// Rotate-half RoPE on rows of `dh` (`x: (B, H, T, Dh)`, `cos, sin: (Bc, 1, T, Dh)` with `Bc` 1 or
/// B). Forward `y = T(T(x·cos) + T(rotate_half(x)·sin))`, `rotate_half([x1, x2]) = [−x2, x1]`;
/// backward (`bwd`) the transpose `dx = T(T(dy·cos) + rotate_halfᵀ(T(dy·sin)))`,
/// `rotate_halfᵀ([z1, z2]) = [z2, −z1]`. Each product is rounded to `T` as the plain chain rounds
/// it.
pub(crate) fn rope<T: Elem>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    (h, t, dh): (usize, usize, usize),
    bwd: bool,
) -> Vec<T> {
    let k = Rope {
        x,
        cos,
        sin,
        h,
        t,
        dh,
        one_table: cos.len() == t * dh,
        bwd,
    };
    par_rows(x.len(), dh, dh, &k)
}

struct Rope<'a, T> {
    x: &'a [T],
    cos: &'a [T],
    sin: &'a [T],
    h: usize,
    t: usize,
    dh: usize,
    /// The tables have a batch of 1 (every batch row reads it).
    one_table: bool,
    bwd: bool,
}

impl<T: Elem> Kernel for Rope<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, r0: usize, ys: Self::Out<'_>) {
        let (h, t, dh) = (self.h, self.t, self.dh);
        let half = dh / 2;
        let m = |a: T, b: T| rt::<T>(a.f() * b.f());
        let rows = ys
            .chunks_exact_mut(dh)
            .zip(self.x[r0 * dh..].chunks_exact(dh));
        for (k, (yr, xr)) in rows.enumerate() {
            let row = r0 + k; // (b, h, t) of x
            let (b, ti) = (row / (h * t), row % t);
            let c0 = ((if self.one_table { 0 } else { b }) * t + ti) * dh;
            let (c1, c2) = self.cos[c0..c0 + dh].split_at(half);
            let (s1, s2) = self.sin[c0..c0 + dh].split_at(half);
            let (x1, x2) = xr.split_at(half);
            let (y1, y2) = yr.split_at_mut(half);
            let first = x1.iter().zip(x2).zip(c1.iter().zip(s1).zip(s2));
            let second = x2.iter().zip(x1).zip(c2.iter().zip(s2).zip(s1));
            if self.bwd {
                // dx1 = dy1·c1 + dy2·s2, dx2 = dy2·c2 − dy1·s1
                for (o, ((&a, &b), ((&c, _), &s_2))) in y1.iter_mut().zip(first) {
                    o.write(T::of(m(a, c) + m(b, s_2)));
                }
                for (o, ((&b, &a), ((&c, _), &s_1))) in y2.iter_mut().zip(second) {
                    o.write(T::of(m(b, c) + -m(a, s_1)));
                }
            } else {
                // y1 = x1·c1 − x2·s1, y2 = x2·c2 + x1·s2
                for (o, ((&a, &b), ((&c, &s), _))) in y1.iter_mut().zip(first) {
                    o.write(T::of(m(a, c) + -m(b, s)));
                }
                for (o, ((&b, &a), ((&c, &s), _))) in y2.iter_mut().zip(second) {
                    o.write(T::of(m(b, c) + m(a, s)));
                }
            }
        }
    }
}
