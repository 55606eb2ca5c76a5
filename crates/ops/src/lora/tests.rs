//! [`crate::lora_up`] against its plain form (a GEMM, the scale, then `add_wide` / `add`): the
//! forward's `T(y + s·xa·Bᵀ)` and the backward's `T(dx + T(dxa·A))`, f32 / bf16 `y`, `y` packed
//! and as a column slice of a wider product, `n` over one column block of the kernel and not a
//! multiple of 16, ranks 16 and 48 (a group's stacked rank), under bf16 autocast too, on every
//! instruction set. Tolerances as the module's: f32 within `F32_TOL` of the largest entry (the
//! kernel sums the r terms in index order, the GEMM in its own), bf16 within `BF16_ULPS` (a sum
//! that lands on the other side of a bf16 rounding boundary).

use crate::test_util::{assert_bf16, assert_f32, randn};
use candle_core::{DType, IndexOp, Result, Tensor};
use rtune_backend::blas::{autocast, matmul as mm};

#[test]
fn lora_up_matches_the_gemm_and_add() -> Result<()> {
    use rtune_backend::cpu::ISA_CAP;
    use std::sync::atomic::Ordering;
    for (rows, n, r, seed) in [(37, 700, 16, 1u64), (64, 130, 48, 2), (5, 16, 1, 3)] {
        let wide = randn(&[rows, n + 50], seed, 4.0); // the frozen product, with other members' columns
        let xa = randn(&[rows, r], seed + 10, 2.0);
        let b = randn(&[n, r], seed + 20, 0.5);
        for cap in [2, 1, 0] {
            ISA_CAP.store(cap, Ordering::Relaxed);
            for (dt, ac) in [
                (DType::F32, false),
                (DType::F32, true),
                (DType::BF16, false),
            ] {
                let _scope = autocast::scope(ac);
                let wide = wide.to_dtype(dt)?;
                for (view, y) in [
                    ("packed", wide.i((.., ..n))?.contiguous()?),
                    ("column slice", wide.i((.., 25..25 + n))?),
                ] {
                    let case =
                        format!("rows {rows} n {n} r {r} {dt:?} autocast {ac} {view} cap {cap}");
                    // Forward: y + 2·xa·Bᵀ, rounded once.
                    let want = crate::add::add_wide(&y, &(mm(&xa, &b.t()?)? * 2.0)?)?;
                    let got = crate::lora::lora_up(&y, &xa, &b.t()?, Some(2.0), false)?;
                    check(&got, &want, &format!("forward, {case}"));
                    // Backward: y + T(xa·m), m = Bᵀ as an (r, n) matrix.
                    let m = b.t()?.contiguous()?;
                    let want = crate::add::add(&y, &mm(&xa, &m)?)?;
                    let got = crate::lora::lora_up(&y, &xa, &m, None, true)?;
                    check(&got, &want, &format!("backward, {case}"));
                }
            }
        }
        ISA_CAP.store(2, Ordering::Relaxed);
    }
    Ok(())
}

fn check(got: &Tensor, want: &Tensor, what: &str) {
    if want.dtype() == DType::F32 {
        assert_f32(got, want, what)
    } else {
        assert_bf16(got, want, what)
    }
}

/// The kernel computes the product: without its rank-r term the result is `y` itself, which
/// the comparison above must reject (a guard against a test that compares two no-ops).
#[test]
fn lora_up_is_not_y() -> Result<()> {
    let y = randn(&[8, 40], 5, 1.0);
    let xa = randn(&[8, 4], 6, 1.0);
    let m = randn(&[4, 40], 7, 1.0);
    let got = crate::lora::lora_up(&y, &xa, &m, Some(1.0), false)?;
    let want = (&y + mm(&xa, &m)?)?;
    assert_f32(&got, &want, "lora_up");
    let e = (got - &y)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(e > 0.1, "the product is missing: {e}");
    Ok(())
}
