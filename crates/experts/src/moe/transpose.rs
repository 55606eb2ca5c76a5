//! A matrix's transpose into another buffer, for the experts' products: `dst[c·ld_d + r] (=, or
//! += with `acc`) src[r·ld_s + c]`. 16 × 16 blocks through AVX-512 registers where the CPU has
//! it (16 row loads, four rounds of shuffles, 16 column stores), else 8 × 8 blocks through
//! AVX2's; the edges and other CPUs one element at a time. A copy (or one add an element): every
//! way gives the same bits.
//!
//! Users: `grouped`'s forward turns a row-major expert weight before `x · Wᵀ`, because the `gemm`
//! crate would gather `W` across its rows element by element (a scalar, strided copy, most of the
//! crate's packing: 10.5% of the bench's step on an AVX-512 Xeon); turned in registers, `W` packs
//! as contiguous vectors (`grouped::turns_weights`: the figures). The panels' backward turns its
//! transposed `dx` tiles back (`panels`' module note).

/// Side of the AVX-512 blocks: one vector of f32.
const B: usize = 16;

/// `dst[c·ld_d + r] (=, or += with acc) src[r·ld_s + c]` for `rows × cols` (module note). Panics
/// when either side is too short (a caller's bug, checked once here, not per element).
pub(super) fn transpose(
    src: &[f32],
    ld_s: usize,
    dst: &mut [f32],
    ld_d: usize,
    (rows, cols): (usize, usize),
    acc: bool,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(
        cols <= ld_s
            && rows <= ld_d
            && (rows - 1) * ld_s + cols <= src.len()
            && (cols - 1) * ld_d + rows <= dst.len(),
        "moe: a {rows} × {cols} transpose out of its buffers"
    );
    transpose_on(blocks_here(), src, ld_s, dst, ld_d, (rows, cols), acc);
}

/// The side of the register blocks this CPU runs: 16 with AVX-512F, 8 with AVX2, none
/// otherwise.
fn blocks_here() -> Option<usize> {
    let f = rtune_backend::cpu_features::get();
    match (cfg!(target_arch = "x86_64"), f.avx512f, f.avx2) {
        (true, true, _) => Some(B),
        (true, false, true) => Some(8),
        _ => None,
    }
}

/// [`transpose`] (bounds checked) with blocks of `side` (the CPU has their ISA: a side
/// [`blocks_here`] or a smaller one gives), the edges by [`plain`].
fn transpose_on(
    side: Option<usize>,
    src: &[f32],
    ld_s: usize,
    dst: &mut [f32],
    ld_d: usize,
    (rows, cols): (usize, usize),
    acc: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(side) = side {
        let (rb, cb) = (rows / side * side, cols / side * side);
        // SAFETY: the CPU has the blocks' ISA (the caller's); the blocks cover rows 0..rb and
        // columns 0..cb, inside both sides (bounds asserted in `transpose`).
        unsafe {
            match side {
                B => avx512::blocks(src, ld_s, dst, ld_d, (rb, cb), acc),
                _ => avx2::blocks(src, ld_s, dst, ld_d, (rb, cb), acc),
            }
        }
        plain(src, ld_s, dst, ld_d, (rb..rows, 0..cols), acc);
        plain(src, ld_s, dst, ld_d, (0..rb, cb..cols), acc);
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = side;
    plain(src, ld_s, dst, ld_d, (0..rows, 0..cols), acc);
}

/// [`transpose`] of the rows and columns given, one element at a time.
fn plain(
    src: &[f32],
    ld_s: usize,
    dst: &mut [f32],
    ld_d: usize,
    (rows, cols): (std::ops::Range<usize>, std::ops::Range<usize>),
    acc: bool,
) {
    for r in rows {
        for c in cols.clone() {
            let (v, d) = (src[r * ld_s + c], &mut dst[c * ld_d + r]);
            *d = if acc { *d + v } else { v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::B;

    /// [`super::transpose`]'s whole 16 × 16 blocks of rows `0..rb`, columns `0..cb`, across a
    /// strip of source rows: each block's row loads continue where the previous block's ended
    /// (the source, the forward's cold weights, read as 16 streams).
    ///
    /// # Safety
    /// AVX-512F; `rb`, `cb` multiples of 16 inside both sides.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn blocks(
        src: &[f32],
        ld_s: usize,
        dst: &mut [f32],
        ld_d: usize,
        (rb, cb): (usize, usize),
        acc: bool,
    ) {
        for r0 in (0..rb).step_by(B) {
            for c0 in (0..cb).step_by(B) {
                // SAFETY: the caller's bounds.
                unsafe {
                    block(
                        src.as_ptr().add(r0 * ld_s + c0),
                        ld_s,
                        dst.as_mut_ptr().add(c0 * ld_d + r0),
                        ld_d,
                        acc,
                    )
                };
            }
        }
    }

    /// A 16 × 16 block: `dst[c·ld_d + r] (=, += with acc) src[r·ld_s + c]`, `r, c < 16`.
    ///
    /// # Safety
    /// AVX-512F; 16 floats readable at each `s + r·ls`, writable at each `d + c·ld`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn block(s: *const f32, ls: usize, d: *mut f32, ld: usize, acc: bool) {
        // SAFETY: the caller's contract: AVX-512F, and the 16 rows of 16 read and the 16
        // columns of 16 written are in bounds.
        unsafe {
            let mut r = [_mm512_setzero_ps(); B];
            for (k, r) in r.iter_mut().enumerate() {
                *r = _mm512_loadu_ps(s.add(k * ls));
            }
            // Round 1, per 128-bit lane L: t[2p] = (r2p[4L], r2p+1[4L], r2p[4L+1], r2p+1[4L+1]),
            // t[2p+1] the same of 4L+2, 4L+3.
            let mut t = [_mm512_setzero_ps(); B];
            for p in 0..B / 2 {
                t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
                t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
            }
            // Round 2: in lane L of r[4q + c], column 4L + c of rows 4q..4q+4.
            let pd = _mm512_castps_pd;
            let ps = _mm512_castpd_ps;
            for q in 0..B / 4 {
                let (a, b, c, e) = (t[4 * q], t[4 * q + 1], t[4 * q + 2], t[4 * q + 3]);
                r[4 * q] = ps(_mm512_unpacklo_pd(pd(a), pd(c)));
                r[4 * q + 1] = ps(_mm512_unpackhi_pd(pd(a), pd(c)));
                r[4 * q + 2] = ps(_mm512_unpacklo_pd(pd(b), pd(e)));
                r[4 * q + 3] = ps(_mm512_unpackhi_pd(pd(b), pd(e)));
            }
            // Rounds 3 and 4 gather column 4L + c's four lanes (rows 0..4, 4..8, 8..12,
            // 12..16) from r[c], r[4 + c], r[8 + c], r[12 + c].
            let put = |col: usize, v: __m512| {
                let p = d.add(col * ld);
                let v = if acc {
                    _mm512_add_ps(_mm512_loadu_ps(p), v)
                } else {
                    v
                };
                _mm512_storeu_ps(p, v);
            };
            for c in 0..4 {
                let (a, b, e, f) = (r[c], r[4 + c], r[8 + c], r[12 + c]);
                // (a.L0, a.L2, b.L0, b.L2) and (a.L1, a.L3, b.L1, b.L3), the same of e, f.
                let ab02 = _mm512_shuffle_f32x4::<0x88>(a, b);
                let ab13 = _mm512_shuffle_f32x4::<0xdd>(a, b);
                let ef02 = _mm512_shuffle_f32x4::<0x88>(e, f);
                let ef13 = _mm512_shuffle_f32x4::<0xdd>(e, f);
                // Column c: lanes L0 of a, b, e, f; column 8 + c: lanes L2; 4 + c: L1; 12 + c: L3.
                put(c, _mm512_shuffle_f32x4::<0x88>(ab02, ef02));
                put(8 + c, _mm512_shuffle_f32x4::<0xdd>(ab02, ef02));
                put(4 + c, _mm512_shuffle_f32x4::<0x88>(ab13, ef13));
                put(12 + c, _mm512_shuffle_f32x4::<0xdd>(ab13, ef13));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::transpose`]'s whole 8 × 8 blocks of rows `0..rb`, columns `0..cb`, along the
    /// destination's rows (each 8 of them written left to right), as the panels' figures were
    /// taken.
    ///
    /// # Safety
    /// AVX2; `rb`, `cb` multiples of 8 inside both sides.
    pub(super) unsafe fn blocks(
        src: &[f32],
        ld_s: usize,
        dst: &mut [f32],
        ld_d: usize,
        (rb, cb): (usize, usize),
        acc: bool,
    ) {
        for c0 in (0..cb).step_by(8) {
            for r0 in (0..rb).step_by(8) {
                // SAFETY: AVX2 and the blocks' bounds: the caller's.
                unsafe {
                    block(
                        src.as_ptr().add(r0 * ld_s + c0),
                        ld_s,
                        dst.as_mut_ptr().add(c0 * ld_d + r0),
                        ld_d,
                        acc,
                    )
                };
            }
        }
    }

    /// An 8 × 8 block: `dst[c·ld_d + r] (=, += with acc) src[r·ld_s + c]`, `r, c < 8`.
    ///
    /// # Safety
    /// AVX2; 8 floats readable at each `src + r·ld_s`, writable at each `dst + c·ld_d`.
    #[target_feature(enable = "avx2")]
    unsafe fn block(src: *const f32, ld_s: usize, dst: *mut f32, ld_d: usize, acc: bool) {
        // SAFETY: the caller's bounds: 8 rows of 8 at `src`, 8 rows of 8 at `dst`.
        unsafe {
            let r: [__m256; 8] = std::array::from_fn(|k| _mm256_loadu_ps(src.add(k * ld_s)));
            // Pairs of rows interleaved, then quadruples, then the 128-bit halves exchanged.
            let t0 = _mm256_unpacklo_ps(r[0], r[1]);
            let t1 = _mm256_unpackhi_ps(r[0], r[1]);
            let t2 = _mm256_unpacklo_ps(r[2], r[3]);
            let t3 = _mm256_unpackhi_ps(r[2], r[3]);
            let t4 = _mm256_unpacklo_ps(r[4], r[5]);
            let t5 = _mm256_unpackhi_ps(r[4], r[5]);
            let t6 = _mm256_unpacklo_ps(r[6], r[7]);
            let t7 = _mm256_unpackhi_ps(r[6], r[7]);
            let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
            let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
            let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
            let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
            let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
            let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
            let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
            let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
            let c = [
                _mm256_permute2f128_ps::<0x20>(u0, u4),
                _mm256_permute2f128_ps::<0x20>(u1, u5),
                _mm256_permute2f128_ps::<0x20>(u2, u6),
                _mm256_permute2f128_ps::<0x20>(u3, u7),
                _mm256_permute2f128_ps::<0x31>(u0, u4),
                _mm256_permute2f128_ps::<0x31>(u1, u5),
                _mm256_permute2f128_ps::<0x31>(u2, u6),
                _mm256_permute2f128_ps::<0x31>(u3, u7),
            ];
            for (k, v) in c.into_iter().enumerate() {
                let d = dst.add(k * ld_d);
                let v = if acc {
                    _mm256_add_ps(_mm256_loadu_ps(d), v)
                } else {
                    v
                };
                _mm256_storeu_ps(d, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value where the definition puts it (exact: a copy, or one add), assigned and added,
    /// on shapes with and without whole blocks of 8 and 16 and edges on either side, packed and
    /// inside wider rows (`ld` past the width), with every block kernel this CPU runs (AVX-512's
    /// and AVX2's on an AVX-512 CPU) and without blocks.
    #[test]
    fn transposes_every_shape() {
        let sides = match blocks_here() {
            Some(B) => vec![Some(B), Some(8), None],
            Some(8) => vec![Some(8), None],
            _ => vec![None],
        };
        for side in sides {
            every_shape(side);
        }
    }

    fn every_shape(side: Option<usize>) {
        let shapes = [
            (1, 1),
            (3, 5),
            (8, 8),
            (16, 16),
            (32, 48),
            (17, 16),
            (16, 33),
            (45, 70),
        ];
        for (rows, cols) in shapes.into_iter().chain([(384, 512), (0, 7)]) {
            for (pad, acc) in [(0, false), (3, false), (0, true), (5, true)] {
                let (ld_s, ld_d) = (cols + pad, rows + 2 * pad);
                let src: Vec<f32> = (0..rows * ld_s).map(|v| v as f32 * 0.5 - 3.0).collect();
                let before = |i: usize| (i % 7) as f32 * 0.25;
                let mut dst: Vec<f32> = (0..cols * ld_d).map(before).collect();
                transpose_on(side, &src, ld_s, &mut dst, ld_d, (rows, cols), acc);
                for (i, &d) in dst.iter().enumerate() {
                    let (c, r) = (i / ld_d, i % ld_d);
                    let want = match r < rows {
                        true if acc => before(i) + src[r * ld_s + c],
                        true => src[r * ld_s + c],
                        false => before(i),
                    };
                    let what =
                        format!("{side:?}: ({rows}, {cols}), pad {pad}, acc {acc}, at ({r}, {c})");
                    assert_eq!(d.to_bits(), want.to_bits(), "{what}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "out of its buffers")]
    fn refuses_short_buffers() {
        let (src, mut dst) = (vec![0f32; 12], vec![0f32; 11]);
        transpose(&src, 4, &mut dst, 3, (3, 4), false);
    }
}
