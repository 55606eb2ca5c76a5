//! A matrix's transpose into another buffer: `dst (cols, rows) = srcᵀ`, `src (rows, cols)`,
//! both row-major. On AVX-512 CPUs 16 × 16 blocks go through registers (16 row loads, four
//! rounds of shuffles, 16 column stores); the edges and other CPUs take the plain loop. A copy:
//! every value lands unchanged, so both ways give the same bits.
//!
//! Why: `grouped`'s forward product `x · Wᵀ` of a row-major expert weight makes the `gemm`
//! crate gather `W` across its rows element by element (a scalar, strided copy, most of the
//! crate's packing: 10.5% of the bench's step on an AVX-512 Xeon). Turned once per product in
//! registers, `W` then packs as contiguous vectors (`grouped::turns_weights`: the figures).

/// Side of the register blocks: one AVX-512 vector of f32.
const B: usize = 16;

/// `dst[j·rows + i] = src[i·cols + j]` for `src (rows, cols)`. Errors when either buffer is
/// shorter than `rows·cols`.
pub(super) fn transpose(
    src: &[f32],
    dst: &mut [f32],
    (rows, cols): (usize, usize),
) -> candle_core::Result<()> {
    let len = rows * cols;
    if src.len() < len || dst.len() < len {
        candle_core::bail!(
            "moe transpose: ({rows}, {cols}) from {} into {} elements",
            src.len(),
            dst.len()
        );
    }
    let (src, dst) = (&src[..len], &mut dst[..len]);
    #[cfg(target_arch = "x86_64")]
    if rtune_backend::cpu_features::get().avx512f {
        // SAFETY: the CPU has AVX-512F (checked on the line above); both slices hold
        // `rows·cols` elements (sliced above).
        unsafe { avx512::transpose(src, dst, (rows, cols)) };
        return Ok(());
    }
    plain(src, dst, (rows, cols), (0, 0));
    Ok(())
}

/// The loop over every element at or past `(r0, c0)` in either index: the whole matrix from
/// `(0, 0)`, the edges the 16 × 16 blocks leave (rows from `r0`, columns from `c0`).
fn plain(src: &[f32], dst: &mut [f32], (rows, cols): (usize, usize), (r0, c0): (usize, usize)) {
    for i in 0..rows {
        let from = if i < r0 { c0 } else { 0 };
        for j in from..cols {
            dst[j * rows + i] = src[i * cols + j];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{plain, B};

    /// [`super::transpose`] with AVX-512F: the full 16 × 16 blocks in registers, the edges by
    /// [`plain`].
    ///
    /// # Safety
    /// The CPU has AVX-512F; `src` and `dst` hold `rows·cols` elements.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose(src: &[f32], dst: &mut [f32], (rows, cols): (usize, usize)) {
        let (rb, cb) = (rows / B * B, cols / B * B);
        // Across a strip of 16 rows: each block's 16 row loads continue where the previous
        // block's ended, so the source is read as 16 streams.
        for i in (0..rb).step_by(B) {
            for j in (0..cb).step_by(B) {
                // SAFETY: rows i..i+16 and columns j..j+16 are inside both matrices.
                unsafe {
                    block(
                        src.as_ptr().add(i * cols + j),
                        cols,
                        dst.as_mut_ptr().add(j * rows + i),
                        rows,
                    )
                };
            }
        }
        plain(src, dst, (rows, cols), (rb, cb));
    }

    /// One 16 × 16 block: rows at `s + r·ls` (`r` < 16) to columns at `d + c·ld`.
    ///
    /// # Safety
    /// AVX-512F; 16 floats readable at each `s + r·ls`, writable at each `d + c·ld`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn block(s: *const f32, ls: usize, d: *mut f32, ld: usize) {
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
            for c in 0..4 {
                let (a, b, e, f) = (r[c], r[4 + c], r[8 + c], r[12 + c]);
                // (a.L0, a.L2, b.L0, b.L2) and (a.L1, a.L3, b.L1, b.L3), the same of e, f.
                let ab02 = _mm512_shuffle_f32x4::<0x88>(a, b);
                let ab13 = _mm512_shuffle_f32x4::<0xdd>(a, b);
                let ef02 = _mm512_shuffle_f32x4::<0x88>(e, f);
                let ef13 = _mm512_shuffle_f32x4::<0xdd>(e, f);
                // Column c: lanes L0 of a, b, e, f; column 8 + c: lanes L2; 4 + c: L1; 12 + c: L3.
                _mm512_storeu_ps(d.add(c * ld), _mm512_shuffle_f32x4::<0x88>(ab02, ef02));
                _mm512_storeu_ps(
                    d.add((8 + c) * ld),
                    _mm512_shuffle_f32x4::<0xdd>(ab02, ef02),
                );
                _mm512_storeu_ps(
                    d.add((4 + c) * ld),
                    _mm512_shuffle_f32x4::<0x88>(ab13, ef13),
                );
                _mm512_storeu_ps(
                    d.add((12 + c) * ld),
                    _mm512_shuffle_f32x4::<0xdd>(ab13, ef13),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every value where the definition puts it, on shapes with and without 16 × 16 blocks and
    /// edges on either side (exact: a copy).
    #[test]
    fn transposes_every_shape() -> candle_core::Result<()> {
        for (rows, cols) in [
            (1, 1),
            (3, 5),
            (16, 16),
            (32, 48),
            (17, 16),
            (16, 33),
            (45, 70),
            (384, 512),
            (0, 7),
        ] {
            let src: Vec<f32> = (0..rows * cols).map(|v| v as f32 * 0.5 - 3.0).collect();
            let mut dst = vec![f32::NAN; rows * cols];
            transpose(&src, &mut dst, (rows, cols))?;
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(
                        dst[j * rows + i].to_bits(),
                        src[i * cols + j].to_bits(),
                        "({rows}, {cols}) at ({i}, {j})"
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn refuses_short_buffers() {
        let (src, mut dst) = (vec![0f32; 12], vec![0f32; 11]);
        assert!(transpose(&src, &mut dst, (3, 4)).is_err());
        assert!(transpose(&src[..11], &mut [0f32; 12], (3, 4)).is_err());
    }
}
