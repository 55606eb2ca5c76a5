//! The CPU loop of [`super::lora_up`]: 4 rows × 32 columns of sums in registers over the `r` terms.

use std::mem::MaybeUninit;

use rtune_backend::cpu::{par_rows, rt, Elem, Kernel, TASK};

/// `T(y + R(s · xa·m))` row by row (`crate::lora::lora_up`): `y` rows of `n` at stride `ld`,
/// `xa: (N, r)`, `m: (r, n)`, all f32 but `y`; `R` rounds to `T` when `round`.
pub(crate) fn lora_up<T: Elem>(
    y: &[T],
    ld: usize,
    xa: &[f32],
    m: &[f32],
    (rows, n, r): (usize, usize, usize),
    scale: Option<f32>,
    round: bool,
) -> Vec<T> {
    let k = LoraUp {
        y,
        ld,
        xa,
        m,
        n,
        r,
        scale,
        round,
    };
    // Tasks of 16 rows (four register tiles high), whatever the row's work.
    par_rows(rows * n, n, TASK / 16, &k)
}

struct LoraUp<'a, T> {
    y: &'a [T],
    ld: usize,
    xa: &'a [f32],
    m: &'a [f32],
    n: usize,
    r: usize,
    scale: Option<f32>,
    round: bool,
}

/// Rows and columns of one register tile of [`LoraUp`]: 4 × 32 sums, eight AVX-512 registers,
/// each `m` load used by four rows.
const LORA_ROWS: usize = 4;
const LORA_COLS: usize = 32;

impl<T: Elem> LoraUp<'_, T> {
    /// The `R × C` sums `xa[row..row+R]·m[.., c0..c0+C]`, each over `k` in index order.
    #[inline(always)]
    fn tile<const R: usize, const C: usize>(&self, row: usize, c0: usize) -> [[f32; C]; R] {
        let (n, r) = (self.n, self.r);
        let mut acc = [[0f32; C]; R];
        for k in 0..r {
            let mk: &[f32; C] = self.m[k * n + c0..k * n + c0 + C].try_into().unwrap();
            for (i, acc) in acc.iter_mut().enumerate() {
                let a = self.xa[(row + i) * r + k];
                for (s, &w) in acc.iter_mut().zip(mk) {
                    *s += a * w;
                }
            }
        }
        acc
    }

    /// Rows `row..row+R` (`i0` of them into this piece of the output), columns `c0..c0+C`.
    #[inline(always)]
    fn block<const R: usize, const C: usize>(
        &self,
        ys: &mut [MaybeUninit<T>],
        (row, i0): (usize, usize),
        c0: usize,
    ) {
        let acc = self.tile::<R, C>(row, c0);
        for (i, acc) in acc.iter().enumerate() {
            let y = &self.y[(row + i) * self.ld + c0..][..C];
            let out = &mut ys[(i0 + i) * self.n + c0..][..C];
            for ((o, &s), yv) in out.iter_mut().zip(acc).zip(y) {
                // As candle's `p * s` (affine: `v·s + 0`) and `to_dtype` would.
                let v = match self.scale {
                    Some(sc) => s * sc + 0.0,
                    None => s,
                };
                let v = if self.round { rt::<T>(v) } else { v };
                o.write(T::of(yv.f() + v));
            }
        }
    }

    /// Rows `row..row+R` over all columns: register tiles, then the last `n % 32` one by one.
    #[inline(always)]
    fn rows<const R: usize>(&self, ys: &mut [MaybeUninit<T>], at: (usize, usize)) {
        let full = self.n / LORA_COLS * LORA_COLS;
        for c0 in (0..full).step_by(LORA_COLS) {
            self.block::<R, LORA_COLS>(ys, at, c0);
        }
        for c0 in full..self.n {
            self.block::<R, 1>(ys, at, c0);
        }
    }
}

impl<T: Elem> Kernel for LoraUp<'_, T> {
    type Out<'o> = &'o mut [MaybeUninit<T>];
    #[inline(always)]
    fn run(&self, r0: usize, ys: Self::Out<'_>) {
        let rows = ys.len() / self.n; // par_rows hands whole rows, n > 0
        let full = rows / LORA_ROWS * LORA_ROWS;
        for i in (0..full).step_by(LORA_ROWS) {
            self.rows::<LORA_ROWS>(ys, (r0 + i, i));
        }
        for i in full..rows {
            self.rows::<1>(ys, (r0 + i, i));
        }
    }
}
