//! CPU loops of the fused ops in [`crate::fused`] (RMSNorm, SwiGLU, RoPE, cross-entropy, attention
//! softmax; each op's `cpu_fwd` calls its loop here): one pass over each row (the row itself stays
//! in L1/L2 while it is read twice), parallel over rows with rayon, arithmetic in f32 whatever the
//! storage type.
//!
//! Written for LLVM's auto-vectoriser: rows are contiguous slices walked with `zip` and
//! `as_chunks` (no per-element bounds checks); reductions keep [`LANES`] independent partial sums
//! (a fixed order, so the result does not depend on the vector width the CPU gets); `exp` is a
//! branch-free polynomial ([`exp`]) where libm's `expf` would be a scalar call. [`dispatch`] runs a
//! kernel compiled for AVX-512F or AVX2 when the CPU has it ([`crate::cpu_features`]), since the build targets baseline
//! x86-64 (SSE2). No FMA is enabled (and Rust never contracts `a * b + c`), so every path gives the
//! same bits.

use half::{bf16, f16};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// A storage type of the fused ops; all arithmetic is f32.
pub(crate) trait Elem: candle_core::WithDType + Copy + Send + Sync {
    fn f(self) -> f32;
    fn of(v: f32) -> Self;
    /// The slice itself when `Self` is f32 (read in place, no converted copy).
    #[inline(always)]
    fn f32s(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn f32s(a: &[f32]) -> Option<&[f32]> {
        Some(a)
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
    /// `bf16::from_f32`'s bits (nearest even; a NaN keeps its top bits and is made quiet), without
    /// its branches, so loops of it vectorise.
    #[inline(always)]
    fn of(v: f32) -> Self {
        let x = v.to_bits();
        // Adding 0x7fff plus the kept part's lowest bit carries into bit 16 exactly when the
        // dropped half is above one half, or is one half and the kept part is odd.
        let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
        let nan = x & 0x7fff_ffff > 0x7f80_0000;
        bf16::from_bits(if nan { (x >> 16) | 0x40 } else { rounded } as u16)
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn of(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// `v` rounded to `T` and back: the rounding a chain of `T` ops (candle's or PyTorch's) does
/// between two steps. The identity for f32.
#[inline(always)]
pub(crate) fn rt<T: Elem>(v: f32) -> f32 {
    T::of(v).f()
}

/// `e^x`, within 2 ulp of libm's `expf` (Cephes' `expf`: `2^n · e^r`, `n = round(x·log2 e)`,
/// `r = x − n·ln 2` in two parts, `e^r` by a degree-6 polynomial on `|r| ≤ ln2/2`). Branch-free so
/// it vectorises. Results below `f32::MIN_POSITIVE` (`x < −87.34`) are flushed to 0 and
/// `x > 88.376` gives +∞ (libm is finite up to 88.72; only a sigmoid of −88.4 or less sees the
/// difference, as 0 instead of 3e-39). NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LO: f32 = -87.336_55; // ln(f32::MIN_POSITIVE)
    const HI: f32 = 88.376_26; // 127.5·ln 2: n ≤ 127, so 2^n is a normal float
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // ln 2 = LN2_HI + LN2_LO, LN2_HI with 9 significant bits
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer
    let xc = x.clamp(LO, HI); // NaN stays NaN
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let y = p * r * r + r + 1.0;
    // 2^n from the integer in t's low mantissa bits.
    let ni = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        y * scale
    }
}

/// Independent partial sums in every reduction.
pub(crate) const LANES: usize = 16;

/// `Σ f(a[i])` over [`LANES`] partial sums.
#[inline(always)]
pub(crate) fn sum1<A: Elem>(a: &[A], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, ra) = a.as_chunks::<LANES>();
    for xa in ca {
        for i in 0..LANES {
            acc[i] += f(xa[i].f());
        }
    }
    let mut tail = 0f32;
    for &x in ra {
        tail += f(x.f());
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ f(a[i], b[i], c[i])` over [`LANES`] partial sums.
#[inline(always)]
fn sum3<T: Elem>(a: &[T], b: &[T], c: &[T], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, ra) = a.as_chunks::<LANES>();
    let ((cb, rb), (cc, rc)) = (b.as_chunks::<LANES>(), c.as_chunks::<LANES>());
    for ((xa, xb), xc) in ca.iter().zip(cb).zip(cc) {
        for i in 0..LANES {
            acc[i] += f(xa[i].f(), xb[i].f(), xc[i].f());
        }
    }
    let mut tail = 0f32;
    for ((&x, &y), &z) in ra.iter().zip(rb).zip(rc) {
        tail += f(x.f(), y.f(), z.f());
    }
    acc.iter().sum::<f32>() + tail
}

/// `max a[i]` (NaNs are skipped here; they reach the result through the sum that follows).
#[inline(always)]
pub(crate) fn max<A: Elem>(a: &[A]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let (ca, ra) = a.as_chunks::<LANES>();
    for xa in ca {
        for i in 0..LANES {
            let v = xa[i].f();
            acc[i] = if v > acc[i] { v } else { acc[i] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for v in acc.into_iter().chain(ra.iter().map(|x| x.f())) {
        m = if v > m { v } else { m };
    }
    m
}

/// One kernel's work on a piece of its output: rows from `r0` on, written into `out` (one or two
/// slices). Every impl's `run` is `#[inline(always)]`, so [`dispatch`]'s AVX-512 and AVX2 copies
/// compile the whole loop nest for those instruction sets (a closure would be inlined bottom-up
/// and, grown large, left out of line with the baseline's SSE2).
pub(crate) trait Kernel: Sync {
    type Out<'o>;
    fn run(&self, r0: usize, out: Self::Out<'_>);
}

/// The widest instruction set tests let [`dispatch`] use: 2 AVX-512F, 1 AVX2, 0 the baseline (the
/// paths must give the same bits; `fused/tests.rs` runs each op on each).
#[cfg(test)]
pub(crate) static ISA_CAP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Runs `k` compiled for AVX-512F or AVX2 when the CPU has it, else for the baseline.
#[inline(always)]
pub(crate) fn dispatch<K: Kernel>(k: &K, r0: usize, out: K::Out<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        #[cfg(test)]
        let cap = ISA_CAP.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(test))]
        let cap = 2;
        let cpu = crate::cpu_features::get();
        if cap >= 2 && cpu.avx512f {
            // SAFETY: the CPU has AVX-512F, checked on the line above.
            return unsafe { run_avx512(k, r0, out) };
        }
        if cap >= 1 && cpu.avx2 {
            // SAFETY: the CPU has AVX2, checked on the line above.
            return unsafe { run_avx2(k, r0, out) };
        }
    }
    k.run(r0, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_avx512<K: Kernel>(k: &K, r0: usize, out: K::Out<'_>) {
    k.run(r0, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_avx2<K: Kernel>(k: &K, r0: usize, out: K::Out<'_>) {
    k.run(r0, out)
}

/// Elements of work per rayon task: enough that scheduling costs nothing next to the work.
const TASK: usize = 1 << 14;

/// A `Vec` of `n` elements, every one of which `fill` writes.
pub(crate) fn filled<T>(n: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    fill(&mut v.spare_capacity_mut()[..n]);
    // SAFETY: every caller's `fill` writes each of the n elements (each kernel writes whole rows,
    // and `par_rows` hands it every row; the dropout's mask passes write every element of theirs).
    unsafe { v.set_len(n) };
    v
}

/// A `Vec` of `n` elements from `k` run over rows of `d` in parallel; `cost` is the work of one
/// row in elements (sets how many rows a rayon task takes).
pub(crate) fn par_rows<T: Send, K>(n: usize, d: usize, cost: usize, k: &K) -> Vec<T>
where
    K: for<'o> Kernel<Out<'o> = &'o mut [MaybeUninit<T>]>,
{
    filled(n, |out| {
        if n == 0 || d == 0 {
            return;
        }
        let rows = (TASK / cost.max(1)).max(1);
        out.par_chunks_mut(rows * d)
            .enumerate()
            .for_each(|(i, piece)| dispatch(k, i * rows, piece));
    })
}

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

/// `T(y + R(s · xa·m))` row by row (`crate::fused::lora_up`): `y` rows of `n` at stride `ld`,
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

/// Rows of `tk` scores → `p = softmax(f32(T(s·T(scale))) + mask)` in f32, row `r` taking mask row
/// `r % (mask.len() / tk)`. The scaling rounds as candle's `scores * scale` on a `T` tensor does
/// (`affine`: the scale and the product in `T`).
pub(crate) fn softmax_rows<T: Elem>(scores: &[T], mask: &[f32], tk: usize, scale: f32) -> Vec<f32> {
    let k = Softmax {
        scores,
        mask,
        tk,
        scale: rt::<T>(scale),
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
