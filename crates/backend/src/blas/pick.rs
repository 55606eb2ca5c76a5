//! Which CBLAS serves f32: `RTUNE_BLAS` / `RTUNE_MKL` / a resumed run's record ([`crate::pin`]),
//! the faster of OpenBLAS and MKL on the start-up probe otherwise ([`mkl`]), and the OpenBLAS
//! kernel set and thread timeout set in the environment before it loads.

use super::library::open;
use super::{mkl, Blas, NOTICE};

pub(super) fn load() -> Option<Blas> {
    let mkl_env = std::env::var("RTUNE_MKL").ok();
    // A resumed run's recorded library unless the user names one ([`crate::pin`]).
    let choice = crate::pin::blas(
        std::env::var("RTUNE_BLAS").ok().as_deref(),
        mkl_env.as_deref(),
    );
    if let crate::pin::Choice::User(c) | crate::pin::Choice::Recorded(c) = &choice {
        if c == "off" || c == "0" {
            return None;
        }
    }
    match std::env::var("RTUNE_BLAS_CORE").as_deref() {
        Ok("inherit") => {}
        Ok(core) if !core.is_empty() && core != "auto" => {
            // Sound only while one thread runs: the contract of `init` (a later call finds the
            // OnceLock filled and does not come here).
            std::env::set_var("OPENBLAS_CORETYPE", core)
        }
        _ => {
            if avx512() {
                std::env::set_var("OPENBLAS_CORETYPE", "SkylakeX")
            }
        }
    }
    if let Some(t) = thread_timeout(
        std::env::var_os("OPENBLAS_THREAD_TIMEOUT"),
        std::env::var_os("GOTO_THREAD_TIMEOUT"),
    ) {
        // Sound only while one thread runs (the contract of `init`); OpenBLAS reads it when it
        // loads, below.
        std::env::set_var("OPENBLAS_THREAD_TIMEOUT", t)
    }
    if mkl::names(mkl_env.as_deref()).is_some() {
        mkl::threading_env();
    }
    let (blas, notice) = select(&choice, mkl_env.as_deref(), mkl::probe);
    // Kept for [`notice`]: `init` runs before the binary's log is set up.
    let _ = NOTICE.set(notice);
    blas
}
/// The CBLAS that serves f32 given the choice ([`crate::pin::blas`]: `RTUNE_BLAS`, else a resumed
/// run's record, else the default search) and `RTUNE_MKL`, and the notice to print when a library
/// the user named did not load (then the fallback serves: candle's gemm for `RTUNE_BLAS`, OpenBLAS
/// alone for `RTUNE_MKL`). A recorded library that does not load falls back to the default search
/// and is reported to [`crate::pin::lose`]. `rates`: the start-up probe ([`mkl::probe`]; a test
/// gives its own answer).
pub(super) fn select(
    choice: &crate::pin::Choice,
    mkl_env: Option<&str>,
    rates: fn(&[&Blas]) -> Vec<f64>,
) -> (Option<Blas>, Option<String>) {
    use crate::pin::Choice;
    match choice {
        Choice::User(c) => {
            // A library the user names serves alone, unmeasured.
            return match open(std::slice::from_ref(c)) {
                Some(mut b) => {
                    b.described = format!("{} (RTUNE_BLAS names it)", b.name);
                    (Some(b), None)
                }
                None => (
                    None,
                    Some(format!(
                        "RTUNE_BLAS={c} did not load as a CBLAS (no such file, or no \
                         cblas_sgemm); f32 matmuls use candle's gemm"
                    )),
                ),
            };
        }
        Choice::Recorded(c) => {
            if let Some(mut b) = open(std::slice::from_ref(c)) {
                b.described = format!("{} (pinned: the resumed run's run.json records it)", b.name);
                return (Some(b), None);
            }
            crate::pin::lose(format!(
                "this resumed run recorded f32 matmuls through {c}, which does not load now (no \
                 such file, or no cblas_sgemm); a fresh run's choice serves"
            ));
        }
        Choice::Default => {}
    }
    let openblas = open(&["libopenblas.so.0".into(), "libopenblas.so".into()]);
    let mut notice = None;
    let mkl = mkl::names(mkl_env).and_then(|names| {
        let m = open(&names);
        if m.is_none() && mkl_env.is_some() {
            notice = Some(format!(
                "RTUNE_MKL={} did not load (tried {}); f32 matmuls use {}",
                mkl_env.unwrap_or(""),
                names.join(", "),
                if openblas.is_some() {
                    "OpenBLAS"
                } else {
                    "candle's gemm"
                }
            ));
        }
        m
    });
    (mkl::choose(openblas, mkl, rates), notice)
}

/// The `OPENBLAS_THREAD_TIMEOUT` [`init`] sets given the environment's `OPENBLAS_THREAD_TIMEOUT`
/// and `GOTO_THREAD_TIMEOUT`: `20` when neither is set, nothing (the user's choice) otherwise.
///
/// An idle OpenBLAS worker calls `sched_yield` in a loop for 2^timeout cycles before it sleeps;
/// OpenBLAS 0.3.21's default is 2^28 (~0.1 s), so between two products the step's other work
/// (rayon's fused ops, oneDNN's bf16 GEMMs) shares its cores with spinning threads. 2^20 cycles
/// (~0.4 ms) still covers the gap between back-to-back products. Measured on 2 cores (bench-small,
/// `rtune bench --steps 4 --warmup 1 --no-ceiling`, interleaved rounds, 2026-12-03): `--dtype
/// bf16` 1654 / 1674 tokens/s with the default, 1934–2034 with 16 or 22 (`sched_yield` was 21% of
/// the step's samples); f32 seq 512 unchanged (953–1050 either way); f32 seq 2048 768.7 / 778.2 →
/// 798.0 / 812.7.
pub(super) fn thread_timeout(
    openblas: Option<std::ffi::OsString>,
    goto: Option<std::ffi::OsString>,
) -> Option<&'static str> {
    (openblas.is_none() && goto.is_none()).then_some("20")
}

/// AVX-512 F/BW/DQ/VL: what OpenBLAS's SkylakeX kernels use.
fn avx512() -> bool {
    crate::cpu_features::get().avx512_skylake()
}
