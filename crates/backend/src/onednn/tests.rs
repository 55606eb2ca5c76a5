//! oneDNN's products against plain f32 references, for each version that loads here.

use super::*;
use candle_core::Device;

/// The choice: `off` always falls back, `force` loads whatever the CPU, no bf16 instructions
/// fall back (the path the fallback test below forces), a path is tried as given.
#[test]
fn fallback_is_chosen_without_instructions_or_when_off() {
    assert_eq!(choose(Some("off"), true, &[]), Err(Fallback::Off));
    assert_eq!(choose(None, false, &[]), Err(Fallback::NoBf16Instructions));
    assert!(choose(Some("force"), false, &[]).is_ok());
    assert_eq!(
        choose(
            Some("/x/libdnnl.so.2"),
            true,
            &["/v/lib/libdnnl.so.3".into()]
        ),
        Ok(vec!["/x/libdnnl.so.2".into()])
    );
    // Unset: the system's 2.x, then a wheel's 3.x, then a system 3.x.
    let wheel = ["/v/lib/libdnnl.so.3".to_string()];
    assert_eq!(
        choose(None, true, &wheel).unwrap(),
        [
            "libdnnl.so.2",
            "/v/lib/libdnnl.so.3",
            "libdnnl.so.3",
            "libdnnl.so"
        ]
    );
    // A candidate that does not load is skipped for the next (Debian's 2.x, where installed).
    if std::path::Path::new("/usr/lib/x86_64-linux-gnu/libdnnl.so.2").exists() {
        let l = load(&["/nonexistent/libdnnl.so.3".into(), "libdnnl.so.2".into()]);
        assert_eq!(l.map(|l| l.major()).ok(), Some(2));
    }
    // A library that is not there: the fallback's reason names it and the package.
    let Err(Fallback::Library(m)) = load(&["libdnnl-nonexistent.so".into()]) else {
        panic!("a missing library loads");
    };
    assert!(
        m.contains("libdnnl-nonexistent.so") && m.contains("libdnnl2") && m.contains("onednn"),
        "{m}"
    );
}

/// OpenMP's threads sleep when idle unless the environment says how they wait.
#[test]
fn wait_policy_is_passive_unless_the_environment_chooses() {
    let some = |v: &str| Some(std::ffi::OsString::from(v));
    assert_eq!(wait_policy(None, None), Some("passive"));
    assert_eq!(wait_policy(some("active"), None), None);
    assert_eq!(wait_policy(None, some("100000")), None);
    assert_eq!(wait_policy(some("passive"), some("0")), None);
}

/// A packed frozen weight against the plain product of the same operands (another copy of
/// the weight, not registered), forward `x·Wᵀ` and backward `dy·W`, for the row count it was
/// packed at and another: the same bf16 values in another memory order, so the f32 outputs
/// agree to 1e-5 of the largest |entry| (the kernel's summation order only; a misread packed
/// layout is off by O(1)) and the bf16 outputs to one bf16 rounding (2⁻⁸). The copies exist
/// after the first products and are freed with the handle. Skips where oneDNN is not in use.
#[test]
fn packed_weights_give_the_plain_product() -> Result<()> {
    if get().is_err() {
        eprintln!("oneDNN not in use ({}); nothing to compare", describe());
        return Ok(());
    }
    let dev = Device::Cpu;
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    // (out, in) = (96, 320): several of the kernel's N blocks and K pairs.
    let w = bf(Tensor::randn(0f32, 1.0, (96, 320), &dev)?)?;
    let plain = w.copy()?;
    let before = packed_bytes();
    let handle = register(&w).expect("a bf16 CPU matrix registers");
    assert_eq!(
        packed_bytes(),
        before,
        "packed on first use, not at registration"
    );
    let runs = || PACKED_RUNS.load(std::sync::atomic::Ordering::Relaxed);
    let runs_before = runs();
    for rows in [256, 37] {
        let x = bf(Tensor::randn(0f32, 1.0, (rows, 320), &dev)?)?;
        let dy = bf(Tensor::randn(0f32, 1.0, (rows, 96), &dev)?)?;
        for (a, b, b_plain) in [(&x, w.t()?, plain.t()?), (&dy, w.clone(), plain.clone())] {
            for (dst, tol) in [(DType::F32, 1e-5), (DType::BF16, 1.0 / 256.0)] {
                let want = matmul(a, &b_plain, dst).expect("taken")?;
                let got = matmul(a, &b, dst).expect("taken")?;
                let want = want.to_dtype(DType::F32)?;
                let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
                let err = (got.to_dtype(DType::F32)? - &want)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?
                    / scale;
                assert!(err < tol, "{rows} rows, {:?}, {dst:?}: {err}", b.dims());
            }
        }
    }
    // The packed path ran (at least both orientations at the first row count), and both
    // orientations were packed: at least the weight's bytes twice.
    assert!(
        runs() >= runs_before + 4,
        "{} packed products",
        runs() - runs_before
    );
    assert!(
        packed_bytes() >= before + 2 * 96 * 320 * 2,
        "{}",
        packed_bytes()
    );
    drop(handle);
    assert_eq!(packed_bytes(), before, "freed with the last handle");
    // Not registered: f32, or a 3-d tensor.
    assert!(register(&w.to_dtype(DType::F32)?).is_none());
    assert!(register(&w.reshape((2, 48, 320))?).is_none());
    Ok(())
}

/// The forced fallback: with oneDNN unavailable the caller gets `None` and computes the
/// product itself (candle's bf16 matmul), which is what `blas::matmul` then returns.
#[test]
fn forced_fallback_leaves_the_product_to_candle() -> Result<()> {
    let a = Tensor::randn(0f32, 1.0, (8, 16), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let b = Tensor::randn(0f32, 1.0, (16, 4), &Device::Cpu)?.to_dtype(DType::BF16)?;
    // f32 operands are never taken, whatever the library.
    assert!(matmul(
        &a.to_dtype(DType::F32)?,
        &b.to_dtype(DType::F32)?,
        DType::F32
    )
    .is_none());
    if get().is_err() {
        assert!(matmul(&a, &b, DType::BF16).is_none());
        assert!(describe().starts_with("candle's gemm ("), "{}", describe());
    }
    Ok(())
}

/// oneDNN against the plain product of the same bf16 values in f32 (f64-exact products of
/// bf16 numbers, f32 sums): f32 output within 1e-5 relative of the largest |entry| (only the
/// summation order differs), bf16 output within one bf16 rounding (2⁻⁸ relative) of it; in
/// plain, transposed-weight and batched layouts. Skips where oneDNN is not in use.
#[test]
fn onednn_matches_the_plain_matmul_within_bf16_rounding() -> Result<()> {
    let Ok(lib) = get() else {
        eprintln!("oneDNN not in use ({}); nothing to compare", describe());
        return Ok(());
    };
    let dev = Device::Cpu;
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let a = bf(Tensor::randn(0f32, 1.0, (37, 300), &dev)?)?;
    let w = bf(Tensor::randn(0f32, 1.0, (45, 300), &dev)?)?;
    let a3 = bf(Tensor::randn(0f32, 1.0, (3, 20, 33), &dev)?)?;
    let b3 = bf(Tensor::randn(0f32, 1.0, (3, 33, 17), &dev)?)?;
    let cases = [
        (a.clone(), w.t()?.contiguous()?),
        (a.clone(), w.t()?),
        (a3.clone(), b3.clone()),
        (a3.narrow(1, 2, 10)?, b3.clone()),
    ];
    for (x, y) in cases {
        let want = x.to_dtype(DType::F32)?.matmul(&y.to_dtype(DType::F32)?)?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        let got = matmul(&x, &y, DType::F32).expect("taken")?;
        assert_eq!(got.dtype(), DType::F32);
        let err = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()? / scale;
        assert!(err < 1e-5, "f32 out {:?}·{:?}: {err}", x.dims(), y.dims());
        let got = matmul(&x, &y, DType::BF16).expect("taken")?;
        assert_eq!(got.dtype(), DType::BF16);
        let err = (got.to_dtype(DType::F32)? - &want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?
            / scale;
        assert!(
            err < 1.0 / 256.0,
            "bf16 out {:?}·{:?}: {err}",
            x.dims(),
            y.dims()
        );
    }
    assert!(!lib.name.is_empty());
    // What `rtune check` and run.json's `hardware.bf16_gemm` say: the library and its version.
    let said = describe();
    assert!(
        said.starts_with("oneDNN (") && said.contains(&format!(", oneDNN {}.", lib.major())),
        "{said}"
    );
    eprintln!(
        "oneDNN: {}",
        implementation(2048, 512, 1376).unwrap_or_default()
    );
    Ok(())
}

/// The oneDNN libraries to check: Debian's 2.x when it loads, and a 3.x from
/// `RTUNE_TEST_ONEDNN3` (a path; `.ci/run` installs PyPI's `onednn` and sets it) or else from a
/// Python environment's `lib/` ([`crate::dl::in_wheels`]). A set `RTUNE_TEST_ONEDNN3` that
/// does not load fails the test. None on a CPU without bf16 instructions (AVX-512 BF16 or
/// AMX): oneDNN has no bf16 matmul there (3.x: `primitive_desc_create` returns
/// `dnnl_unimplemented`, seen on an AVX2-only EPYC) and rtune does not use it
/// (`fallback_is_chosen_without_instructions_or_when_off`).
fn versions() -> Vec<OneDnn> {
    let mut libs = Vec::new();
    let bf16 = crate::cpu_features::get().bf16();
    if let (true, Ok(l)) = (bf16, load(&["libdnnl.so.2".into()])) {
        libs.push(l);
    }
    let v3 = match std::env::var("RTUNE_TEST_ONEDNN3") {
        Ok(p) => Some(load(std::slice::from_ref(&p)).unwrap_or_else(|e| panic!("{p}: {e}"))),
        Err(_) => load(&crate::dl::in_wheels("libdnnl.so.3")).ok(),
    };
    match v3 {
        Some(l) if bf16 => libs.push(l),
        Some(l) => eprintln!("{}: loads; no bf16 instructions here to run it on", l.name),
        None => {}
    }
    libs
}

#[test]
fn each_onednn_version_gives_the_plain_product_and_accumulates() -> Result<()> {
    let libs = versions();
    if libs.is_empty() {
        eprintln!("no oneDNN loads here; nothing to compare");
    }
    let dev = Device::Cpu;
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let a = bf(Tensor::randn(0f32, 1.0, (37, 300), &dev)?)?;
    let w = bf(Tensor::randn(0f32, 1.0, (45, 300), &dev)?)?;
    let c0 = Tensor::randn(0f32, 1.0, (37, 45), &dev)?;
    let want = a
        .to_dtype(DType::F32)?
        .matmul(&w.t()?.to_dtype(DType::F32)?)?;
    let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
    let rel = |got: &Tensor, want: &Tensor| -> Result<f32> {
        let e = (got.to_dtype(DType::F32)? - want)?.abs()?.max_all()?;
        Ok(e.to_scalar::<f32>()? / scale)
    };
    let storage = |t: &Tensor| -> Result<Vec<bf16>> { t.flatten_all()?.to_vec1::<bf16>() };
    let (av, wv) = (storage(&a)?, storage(&w.t()?.contiguous()?)?);
    let la = Layout::contiguous((37, 300));
    let lb = Layout::contiguous((300, 45));
    for lib in &libs {
        let v = lib.major();
        // C = A·B, f32 out: the same f32 sums in another order (1e-5 of the largest |C|).
        let (c, imp) = lib.run(&av, &la, &wv, &lb, DType::F32)?;
        let CpuStorage::F32(c) = c else {
            panic!("f32 out")
        };
        let got = Tensor::from_vec(c, (37, 45), &dev)?;
        assert!(rel(&got, &want)? < 1e-5, "v{v} f32 out ({imp})");
        // bf16 out: the f32 sum rounded once (2⁻⁹ relative, 1/256 of the largest |C| bound).
        let (c, _) = lib.run(&av, &la, &wv, &lb, DType::BF16)?;
        let CpuStorage::BF16(c) = c else {
            panic!("bf16 out")
        };
        let got = Tensor::from_vec(c, (37, 45), &dev)?;
        assert!(rel(&got, &want)? < 1.0 / 256.0, "v{v} bf16 out");
        // C = 0.5·A·B + C into f32 rows (2.x: output scale and sum; 3.x: linear and sum).
        let mut c: Vec<f32> = c0.flatten_all()?.to_vec1()?;
        let out = Out {
            ptr: c.as_mut_ptr().cast(),
            cs: vec![45, 1],
            alpha: 0.5,
            sum: true,
        };
        lib.exec(&av, &la, &wv, &lb, DType::F32, out)?;
        let got = Tensor::from_vec(c, (37, 45), &dev)?;
        let want_acc = ((&want * 0.5)? + &c0)?;
        assert!(rel(&got, &want_acc)? < 1e-5, "v{v} alpha·A·B + C");
        eprintln!("{}: {imp}", lib.name);
    }
    Ok(())
}
