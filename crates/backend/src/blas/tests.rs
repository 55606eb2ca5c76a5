use super::cuda_rule::gemm_ready;
use super::library::open;
use super::pick::{select, thread_timeout};
use super::*;
use candle_core::{Device, Layout, Result, Tensor};
use std::borrow::Cow;

/// A library named in `RTUNE_BLAS` or `RTUNE_MKL` that is not there: a notice naming it and
/// the fallback (candle's gemm; OpenBLAS alone, when it loads here).
#[test]
fn a_bogus_path_gives_a_notice_and_falls_back() {
    let user = |c: &str| crate::pin::Choice::User(c.into());
    let (b, n) = select(&user("/nonexistent/libcblas.so"), None, mkl::probe);
    assert!(b.is_none());
    let n = n.expect("a notice");
    assert!(n.contains("RTUNE_BLAS=/nonexistent/libcblas.so") && n.contains("candle's gemm"));
    let (b, n) = select(
        &crate::pin::Choice::Default,
        Some("/nonexistent/libmkl_rt.so.2"),
        mkl::probe,
    );
    let n = n.expect("a notice");
    assert!(n.contains("RTUNE_MKL=/nonexistent/libmkl_rt.so.2"), "{n}");
    // What serves is OpenBLAS where it is installed, unmeasured (the only CBLAS found).
    if let Some(b) = b {
        assert!(
            b.name.contains("openblas") && b.described.contains("only CBLAS"),
            "{n}"
        );
        assert!(n.contains("use OpenBLAS"), "{n}");
    }
}

/// A resume serves the CBLAS its run recorded whatever the start-up probe says now; a fresh
/// run serves the probe's pick. With OpenBLAS and MKL both here (MKL from `RTUNE_TEST_MKL`:
/// set and not loading fails; else a Python environment's), the probe is made to answer each
/// way in turn, and each resume must keep the other library.
#[test]
fn a_resume_serves_the_recorded_cblas_whatever_the_probe_says() {
    use crate::pin::Choice;
    let mkl = match std::env::var("RTUNE_TEST_MKL") {
        Ok(p) => {
            assert!(
                open(std::slice::from_ref(&p)).is_some(),
                "RTUNE_TEST_MKL={p} does not load"
            );
            p
        }
        Err(_) => match mkl::names(None)
            .unwrap_or_default()
            .into_iter()
            .find(|n| open(std::slice::from_ref(n)).is_some())
        {
            Some(p) => p,
            None => return eprintln!("no MKL here (RTUNE_TEST_MKL unset); nothing to check"),
        },
    };
    let Some(openblas) = open(&["libopenblas.so.0".into()]) else {
        return eprintln!("no OpenBLAS here; nothing to check");
    };
    let mkl_faster: fn(&[&Blas]) -> Vec<f64> = |_| vec![10.0, 100.0];
    let openblas_faster: fn(&[&Blas]) -> Vec<f64> = |_| vec![100.0, 10.0];
    let serves = |choice: &Choice, rates| select(choice, Some(&mkl), rates).0.unwrap().name;
    // Fresh runs: the probe decides.
    assert_eq!(serves(&Choice::Default, mkl_faster), mkl);
    assert_eq!(serves(&Choice::Default, openblas_faster), openblas.name);
    // The runs they record, resumed while the probe says the other.
    let recorded_openblas = Choice::Recorded(crate::pin::blas_value(Some(&format!(
        "{}; measured at start 100.0 GFLOP/s against {mkl} 10.0",
        openblas.name
    ))));
    let recorded_mkl = Choice::Recorded(crate::pin::blas_value(Some(&format!(
        "{mkl}; measured at start 100.0 GFLOP/s against {} 10.0",
        openblas.name
    ))));
    assert_eq!(serves(&recorded_openblas, mkl_faster), openblas.name);
    assert_eq!(serves(&recorded_mkl, openblas_faster), mkl);
    // A recorded library that is gone: the fresh run's choice, and the loss reported.
    let gone = Choice::Recorded("/nonexistent/libmkl_rt.so.3".into());
    assert_eq!(serves(&gone, openblas_faster), openblas.name);
    assert!(crate::pin::lost()
        .iter()
        .any(|l| l.contains("/nonexistent/libmkl_rt.so.3") && l.contains("does not load")));
}

/// The guard holds OpenBLAS to one thread while any guard is open and gives back the count it
/// found; the grouped experts' products run under it (`rtune_experts`' grouped path test
/// compares them with the per-expert path).
#[test]
fn one_thread_holds_openblas_to_one_thread_until_the_last_guard_drops() {
    let Some((get, _)) = init().and_then(|b| b.threads) else {
        eprintln!("no OpenBLAS with its thread calls found; nothing to check");
        return;
    };
    // SAFETY: OpenBLAS's own entry point, no arguments.
    let count = || unsafe { get() };
    let before = count();
    let outer = one_thread();
    assert!(outer.is_some());
    assert_eq!(count(), 1);
    let inner = one_thread();
    drop(outer);
    assert_eq!(count(), 1, "an inner guard still open");
    drop(inner);
    assert_eq!(count(), before);
}

#[test]
fn thread_timeout_is_short_unless_the_environment_chooses() {
    let some = |s: &str| Some(std::ffi::OsString::from(s));
    assert_eq!(thread_timeout(None, None), Some("20"));
    assert_eq!(thread_timeout(some("28"), None), None);
    assert_eq!(thread_timeout(None, some("4")), None);
}

/// BLAS and candle's gemm sum in different orders: 1e-5 relative on sums of ≤ 300 products of
/// O(1) values is ~100 f32 ulps of slack, far below any layout or transposition mistake (O(1)).
#[test]
fn matches_candle_matmul_in_every_layout() -> Result<()> {
    if init().is_none() {
        eprintln!("no CBLAS found (install libopenblas0); nothing to compare");
        return Ok(());
    }
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (2, 3, 37, 29), &dev)?;
    let y = Tensor::randn(0f32, 1.0, (2, 3, 29, 41), &dev)?;
    let w = Tensor::randn(0f32, 1.0, (41, 29), &dev)?;
    let cases: Vec<(Tensor, Tensor)> = vec![
        (x.clone(), y.clone()),
        (col_major(&x)?, y.clone()),
        (x.clone(), y.t()?.contiguous()?.t()?),
        (x.narrow(1, 1, 2)?, y.narrow(1, 0, 2)?),
        (x.get(1)?.get(2)?, w.t()?),
        (x.get(0)?.get(0)?.narrow(0, 3, 1)?, w.t()?),
        (w.t()?.narrow(1, 5, 1)?.t()?, w.t()?),
    ];
    for (i, (a, b)) in cases.iter().enumerate() {
        let want = a.contiguous()?.matmul(&b.contiguous()?)?;
        let got = matmul(a, b)?;
        assert_eq!(got.dims(), want.dims(), "case {i}");
        let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            err <= 1e-5 * scale,
            "case {i}: max abs err {err} of {scale}"
        );
    }
    Ok(())
}

/// [`sgemm`] on slices against candle's matmul, in each transposition, accumulating into `c`
/// (beta 1) with a scale; sizes that do not fit are errors. Tolerance as
/// `matches_candle_matmul_in_every_layout`.
#[test]
fn sgemm_on_slices_matches_candle_matmul() -> Result<()> {
    if init().is_none() {
        eprintln!("no CBLAS found (install libopenblas0); nothing to compare");
        return Ok(());
    }
    let dev = Device::Cpu;
    let (m, k, n) = (37, 29, 41);
    let a = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
    let b = Tensor::randn(0f32, 1.0, (k, n), &dev)?;
    let c0 = Tensor::randn(0f32, 1.0, (m, n), &dev)?;
    let want = ((a.matmul(&b)? * 0.5)? + &c0)?;
    let v = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let av = if ta {
            v(&a.t()?.contiguous()?)?
        } else {
            v(&a)?
        };
        let bv = if tb {
            v(&b.t()?.contiguous()?)?
        } else {
            v(&b)?
        };
        let (oa, ob) = (
            Operand {
                data: &av,
                trans: ta,
                ld: if ta { m } else { k },
            },
            Operand {
                data: &bv,
                trans: tb,
                ld: if tb { k } else { n },
            },
        );
        let mut c = v(&c0)?;
        assert!(sgemm(oa, ob, &mut c, (m, n, k), 0.5, 1.0)?);
        let got = Tensor::from_vec(c, (m, n), &dev)?;
        let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err <= 1e-5 * scale, "trans {ta}/{tb}: {err} of {scale}");
        // One row too few for c: refused, c untouched.
        let mut short = vec![7f32; (m - 1) * n];
        let e = sgemm(oa, ob, &mut short, (m, n, k), 1.0, 0.0).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        assert!(short.iter().all(|&x| x == 7.0));
    }
    Ok(())
}

/// candle's CUDA rule on hand-made layouts, each case one clause of `gemm_config`.
#[test]
fn cuda_rule_matches_gemm_config() -> Result<()> {
    let c = |d: &[usize]| Layout::contiguous(d);
    let w = c(&[16, 40]); // (out, in), as a frozen weight
                          // x·Wᵀ: contiguous lhs, transposed contiguous rhs (column-major, ld = k).
    assert!(cuda_gemm_ok(&c(&[24, 40]), &w.transpose(0, 1)?));
    // A column view of (24, 12): ld 12 ≠ its 4 columns, and not column-major either.
    let xa = c(&[24, 12]).narrow(1, 4, 4)?;
    assert!(!operand_ok(&xa, 24, 4));
    assert!(!cuda_gemm_ok(&xa, &c(&[4, 16])));
    // ... and transposed (the dB product `dyᵀ·xa` takes it as the rhs): still refused.
    assert!(!cuda_gemm_ok(&c(&[16, 24]), &xa));
    assert!(!cuda_gemm_ok(&xa.transpose(0, 1)?, &c(&[24, 7])));
    // A row view (narrow on the row axis) stays packed.
    assert!(cuda_gemm_ok(
        &c(&[30, 40]).narrow(0, 3, 24)?,
        &w.transpose(0, 1)?
    ));
    // One column: the column stride is excused, the row stride is not (it must be 1).
    let one_col = c(&[24, 12]).narrow(1, 5, 1)?;
    assert!(!operand_ok(&one_col, 24, 1));
    assert!(operand_ok(
        &Layout::new((24, 1).into(), vec![1, 7], 0),
        24,
        1
    ));
    // One row: the row stride is excused, the column stride must be 1.
    assert!(operand_ok(&c(&[24, 12]).narrow(0, 5, 1)?, 1, 12));
    assert!(operand_ok(
        &Layout::new((1, 12).into(), vec![999, 1], 0),
        1,
        12
    ));
    assert!(!operand_ok(&one_col.transpose(0, 1)?, 1, 24));
    // Batch dims: one of any stride; two that step as one, or one of size 1; three refused.
    let b4 = c(&[2, 3, 24, 40]);
    assert!(operand_ok(&b4, 24, 40));
    assert!(operand_ok(&b4.narrow(0, 1, 1)?, 24, 40));
    assert!(operand_ok(&b4.narrow(1, 0, 1)?, 24, 40));
    assert!(!operand_ok(&b4.narrow(1, 0, 2)?, 24, 40));
    assert!(operand_ok(&c(&[3, 24, 40]).narrow(0, 1, 2)?, 24, 40));
    assert!(!operand_ok(&c(&[1, 1, 1, 24, 40]), 24, 40));
    Ok(())
}

/// An operand the rule refuses is copied, and the product is the product of the views.
#[test]
fn refused_operands_are_copied_and_audited() -> Result<()> {
    let dev = Device::Cpu;
    let xa = Tensor::randn(0f32, 1.0, (24, 12), &dev)?.narrow(1, 4, 4)?;
    let b = Tensor::randn(0f32, 1.0, (16, 4), &dev)?;
    let got = matmul(&xa, &b.t()?)?;
    let want = xa.contiguous()?.matmul(&b.t()?.contiguous()?)?;
    let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(err <= 1e-5, "max abs err {err}");
    let bt = b.t()?;
    let (a2, b2) = gemm_ready(&xa, &bt)?;
    assert!(a2.is_contiguous());
    assert!(
        matches!(b2, Cow::Borrowed(_)),
        "an accepted operand is not copied"
    );
    assert!(cuda_gemm_ok(a2.layout(), b2.layout()));
    Ok(())
}

/// The same values with the last two dims' strides swapped (column-major matrices).
fn col_major(t: &Tensor) -> Result<Tensor> {
    t.transpose(2, 3)?.contiguous()?.transpose(2, 3)
}
