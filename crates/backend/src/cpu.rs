//! The machinery of the fused ops' CPU loops (each op's loops are its folder's `cpu.rs` in
//! `rtune-ops`; the casts' are [`crate::cast`]'s, the dropout masks' [`crate::dropout`]'s): one pass
//! over each row (the row itself stays in L1/L2 while it is read twice), parallel over rows with
//! rayon ([`par_rows`]), arithmetic in f32 whatever the storage type ([`Elem`]).
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
pub trait Elem: candle_core::WithDType + Copy + Send + Sync {
    fn f(self) -> f32;
    fn of(v: f32) -> Self;
    /// The slice itself when `Self` is f32 (read in place, no converted copy).
    #[inline(always)]
    fn f32s(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// The slice itself when `Self` is bf16 (a oneDNN operand in place).
    #[inline(always)]
    fn bf16s(_: &[Self]) -> Option<&[bf16]> {
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
    #[inline(always)]
    fn bf16s(a: &[bf16]) -> Option<&[bf16]> {
        Some(a)
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
pub fn rt<T: Elem>(v: f32) -> f32 {
    T::of(v).f()
}

/// `e^x`, within 2 ulp of libm's `expf` (Cephes' `expf`: `2^n · e^r`, `n = round(x·log2 e)`,
/// `r = x − n·ln 2` in two parts, `e^r` by a degree-6 polynomial on `|r| ≤ ln2/2`). Branch-free so
/// it vectorises. Results below `f32::MIN_POSITIVE` (`x < −87.34`) are flushed to 0 and
/// `x > 88.376` gives +∞ (libm is finite up to 88.72; only a sigmoid of −88.4 or less sees the
/// difference, as 0 instead of 3e-39). NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
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
pub const LANES: usize = 16;

/// `Σ f(a[i])` over [`LANES`] partial sums.
#[inline(always)]
pub fn sum1<A: Elem>(a: &[A], f: impl Fn(f32) -> f32) -> f32 {
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

/// `Σ f(a[i], b[i])` over [`LANES`] partial sums.
#[inline(always)]
pub fn sum2<T: Elem>(a: &[T], b: &[T], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let ((ca, ra), (cb, rb)) = (a.as_chunks::<LANES>(), b.as_chunks::<LANES>());
    for (xa, xb) in ca.iter().zip(cb) {
        for i in 0..LANES {
            acc[i] += f(xa[i].f(), xb[i].f());
        }
    }
    let mut tail = 0f32;
    for (&x, &y) in ra.iter().zip(rb) {
        tail += f(x.f(), y.f());
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ f(a[i], b[i], c[i])` over [`LANES`] partial sums.
#[inline(always)]
pub fn sum3<T: Elem>(a: &[T], b: &[T], c: &[T], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
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
pub fn max<A: Elem>(a: &[A]) -> f32 {
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
pub trait Kernel: Sync {
    type Out<'o>;
    fn run(&self, r0: usize, out: Self::Out<'_>);
}

/// The widest instruction set [`dispatch`] may use: 2 AVX-512F (the default), 1 AVX2, 0 the
/// baseline. Tests lower it to run each op on each path (they must give the same bits: rtune-ops'
/// `tests::every_instruction_set_gives_the_same_bits`); nothing else writes it. One relaxed load
/// per rayon task, not per element.
#[doc(hidden)]
pub static ISA_CAP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Runs `k` compiled for AVX-512F or AVX2 when the CPU has it, else for the baseline.
#[inline(always)]
pub fn dispatch<K: Kernel>(k: &K, r0: usize, out: K::Out<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        let cap = ISA_CAP.load(std::sync::atomic::Ordering::Relaxed);
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
pub const TASK: usize = 1 << 14;

/// A `Vec` of `n` elements, every one of which `fill` writes.
pub fn filled<T>(n: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    fill(&mut v.spare_capacity_mut()[..n]);
    // SAFETY: every caller's `fill` writes each of the n elements (each kernel writes whole rows,
    // and `par_rows` hands it every row; the dropout's mask passes write every element of theirs).
    unsafe { v.set_len(n) };
    v
}

/// A `Vec` of `n` elements from `k` run over rows of `d` in parallel; `cost` is the work of one
/// row in elements (sets how many rows a rayon task takes).
pub fn par_rows<T: Send, K>(n: usize, d: usize, cost: usize, k: &K) -> Vec<T>
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
