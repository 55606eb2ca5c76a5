//! Intel MKL as the f32 CBLAS beside OpenBLAS, chosen at start by measurement.
//!
//! MKL is what PyTorch runs its CPU f32 GEMMs through; on Intel CPUs it can be faster than
//! OpenBLAS, on AMD often not. So neither is assumed: when both load, `choose` times one f32
//! GEMM of the bench's shapes on each (alternating rounds, best of each) and the faster serves
//! every f32 product of the run, with the figures in `rtune check` and run.json ([`super::loaded`]).
//!
//! Where MKL comes from: `RTUNE_MKL` (a path to `libmkl_rt.so.*`; `off` → never), else
//! `libmkl_rt.so.3` / `.so.2` in a Python environment's `lib/` (PyPI's `mkl` wheel, see
//! [`crate::dl`]), else the system's `libmkl_rt.so.2` (Debian's `libmkl-rt`). MKL runs on GNU
//! OpenMP (`MKL_THREADING_LAYER=GNU` unless the environment chooses): the runtime oneDNN already
//! brings, one thread pool instead of two on the same cores, and no `libiomp5` needed.

use super::Blas;
use std::time::Instant;

/// The files to try for MKL given `RTUNE_MKL`; `None` when it is `off`.
pub(super) fn names(env: Option<&str>) -> Option<Vec<String>> {
    match env.unwrap_or("") {
        "off" | "0" => None,
        "" | "auto" => {
            let mut n = crate::dl::in_wheels("libmkl_rt.so.3");
            n.extend(crate::dl::in_wheels("libmkl_rt.so.2"));
            n.push("libmkl_rt.so.2".into());
            Some(n)
        }
        path => Some(vec![path.to_string()]),
    }
}

/// Sets `MKL_THREADING_LAYER=GNU` unless the environment has chosen; call before MKL loads,
/// while one thread runs ([`super::init`]'s contract).
pub(super) fn threading_env() {
    if std::env::var_os("MKL_THREADING_LAYER").is_none() {
        // Sound only while one thread runs: the contract of `init`.
        std::env::set_var("MKL_THREADING_LAYER", "GNU");
    }
}

/// `rates[i]`: GFLOP/s measured for candidate `i`, the incumbent (OpenBLAS) first. The
/// candidate that serves: the fastest, unless it beats the incumbent by less than 3% (the
/// probe's round-to-round spread on a quiet machine), when the incumbent stays. `None` when
/// there is no candidate.
pub fn pick(rates: &[f64]) -> Option<usize> {
    let first = *rates.first()?;
    let (best, rate) = rates
        .iter()
        .enumerate()
        .fold((0, first), |b, (i, &r)| if r > b.1 { (i, r) } else { b });
    Some(if rate > first * 1.03 { best } else { 0 })
}

/// One f32 GEMM of the bench's shapes: `(512, 512)·(512, 1376)` (an MLP projection of
/// bench-small at 512 tokens), 0.72 GFLOP.
const PROBE: (usize, usize, usize) = (512, 512, 1376);

/// `c (m×n) = a (m×k) · b (k×n)` through `blas`'s `cblas_sgemm`, all row-major and packed.
fn sgemm_packed(
    blas: &Blas,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    (m, k, n): (usize, usize, usize),
) {
    assert!(
        a.len() >= m * k && b.len() >= k * n && c.len() >= m * n,
        "sgemm_packed: short slices"
    );
    let i = |x: usize| x as std::ffi::c_int;
    // SAFETY: `a` is m×k, `b` k×n, `c` m×n (checked above), row-major and packed; with beta = 0
    // sgemm writes `c` and reads only `a` and `b`.
    unsafe {
        (blas.sgemm)(
            super::ROW_MAJOR,
            super::NO_TRANS,
            super::NO_TRANS,
            i(m),
            i(n),
            i(k),
            1.0,
            a.as_ptr(),
            i(k),
            b.as_ptr(),
            i(n),
            0.0,
            c.as_mut_ptr(),
            i(n),
        )
    };
}

/// GFLOP/s of one call of `blas`'s `cblas_sgemm` on [`PROBE`].
fn time_once(blas: &Blas, a: &[f32], b: &[f32], c: &mut [f32]) -> f64 {
    let (m, k, n) = PROBE;
    let t = Instant::now();
    sgemm_packed(blas, a, b, c, PROBE);
    2.0 * (m * k * n) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// The measured rates of `libs` (one warm-up call each, then 3 alternating rounds, best of each).
pub(super) fn probe(libs: &[&Blas]) -> Vec<f64> {
    let (m, k, n) = PROBE;
    let a: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) / 8.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i % 7) as f32 - 3.0) / 4.0).collect();
    let mut c = vec![0f32; m * n];
    let mut best = vec![0f64; libs.len()];
    for round in 0..4 {
        for (i, l) in libs.iter().enumerate() {
            let r = time_once(l, &a, &b, &mut c);
            if round > 0 {
                best[i] = best[i].max(r);
            }
        }
    }
    best
}

/// The CBLAS that serves f32: the one loaded, or of OpenBLAS and MKL the faster measured
/// ([`pick`] on `rates`, the measured GFLOP/s of each: [`probe`]), described with the figures.
pub(super) fn choose(
    openblas: Option<Blas>,
    mkl: Option<Blas>,
    rates: fn(&[&Blas]) -> Vec<f64>,
) -> Option<Blas> {
    match (openblas, mkl) {
        (None, None) => None,
        (Some(mut b), None) | (None, Some(mut b)) => {
            b.described = format!("{} (the only CBLAS found)", b.name);
            Some(b)
        }
        (Some(o), Some(m)) => {
            let rates = rates(&[&o, &m]);
            let (mut win, lose, (rw, rl)) = if pick(&rates) == Some(1) {
                (m, o, (rates[1], rates[0]))
            } else {
                (o, m, (rates[0], rates[1]))
            };
            win.described = format!(
                "{}; measured at start {rw:.1} GFLOP/s against {} {rl:.1} on a {}×{}·{}×{} f32 \
                 GEMM: the faster serves (RTUNE_BLAS or RTUNE_MKL=off to choose)",
                win.name, lose.name, PROBE.0, PROBE.1, PROBE.1, PROBE.2
            );
            Some(win)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule on made-up figures: the faster serves, OpenBLAS (first) keeps ties within 3%.
    #[test]
    fn the_faster_measured_blas_serves() {
        assert_eq!(pick(&[]), None);
        assert_eq!(pick(&[100.0]), Some(0));
        assert_eq!(pick(&[100.0, 150.0]), Some(1));
        assert_eq!(pick(&[150.0, 100.0]), Some(0));
        // MKL 2% faster: within the probe's spread, OpenBLAS stays.
        assert_eq!(pick(&[100.0, 102.0]), Some(0));
        assert_eq!(pick(&[100.0, 104.0]), Some(1));
        // A library that failed to run (0 GFLOP/s) never serves.
        assert_eq!(pick(&[0.0, 50.0]), Some(1));
    }

    #[test]
    fn rtune_mkl_names_the_files_tried() {
        assert_eq!(names(Some("off")), None);
        assert_eq!(
            names(Some("/x/libmkl_rt.so.2")),
            Some(vec!["/x/libmkl_rt.so.2".into()])
        );
        assert_eq!(names(None).unwrap().last().unwrap(), "libmkl_rt.so.2");
    }
}

/// Each CBLAS that loads here against a plain f32 reference: OpenBLAS from the loader's path and
/// MKL from `RTUNE_TEST_MKL` (a path; `.ci/run` installs PyPI's `mkl` and sets it; set and not
/// loading fails the test) or else a Python environment's `lib/`.
#[cfg(test)]
mod engines {
    use super::*;

    /// `c = a·b` in f64, row-major.
    fn reference(a: &[f32], b: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for p in 0..k {
                let x = a[i * k + p] as f64;
                for j in 0..n {
                    c[i * n + j] += x * b[p * n + j] as f64;
                }
            }
        }
        c
    }

    #[test]
    fn each_cblas_equals_the_plain_product() {
        let mut libs = Vec::new();
        libs.extend(super::super::library::open(&["libopenblas.so.0".into()]));
        match std::env::var("RTUNE_TEST_MKL") {
            Ok(p) => libs.push(
                super::super::library::open(std::slice::from_ref(&p))
                    .unwrap_or_else(|| panic!("RTUNE_TEST_MKL={p} does not load as a CBLAS")),
            ),
            Err(_) => libs.extend(super::super::library::open(
                &names(None).unwrap_or_default(),
            )),
        }
        if libs.is_empty() {
            eprintln!("no CBLAS loads here; nothing to compare");
        }
        let (m, k, n) = (37, 300, 45);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919 % 97) as f32 - 48.0) / 32.0)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 104729 % 89) as f32 - 44.0) / 32.0)
            .collect();
        let want = reference(&a, &b, (m, k, n));
        let scale = want.iter().fold(0f64, |s, x| s.max(x.abs()));
        for l in &libs {
            let mut c = vec![f32::NAN; m * n];
            let rate = {
                sgemm_packed(l, &a, &b, &mut c, (m, k, n));
                probe(&[l])[0]
            };
            // f32 sums of 300 products against the exact (f64) sum: 1e-5 of the largest |c| is
            // ~100 f32 ulps, far below any transposition or stride mistake (O(1)).
            let err = c
                .iter()
                .zip(&want)
                .fold(0f64, |e, (&g, &w)| e.max((g as f64 - w).abs()))
                / scale;
            assert!(err < 1e-5, "{}: {err}", l.name);
            assert!(rate > 0.0);
            eprintln!("{}: {rate:.1} GFLOP/s on the probe", l.name);
        }
    }

    #[test]
    fn a_bogus_path_loads_nothing() {
        assert!(super::super::library::open(&["/nonexistent/libmkl_rt.so.2".into()]).is_none());
    }
}
