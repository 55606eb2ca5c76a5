//! f32 matrix products on the CPU through a system CBLAS (OpenBLAS), loaded at run time.
//!
//! candle's CPU matmul (the `gemm` crate) ran AVX2 kernels only, and OpenBLAS's AVX-512 ones were
//! ~2× faster on the bench-small shapes (2-core EPYC dev box: 2048×512·512×1376 at 131 vs ~60
//! GFLOP/s). rtune-model now enables the crate's `x86-v4` feature (for the tiled attention's tile
//! products, `rtune_ops::attention::tiled`), so candle's matmul has AVX-512 kernels too. The library is optional: rtune builds and runs
//! without it (no build-time dependency, no C toolchain), and falls back to candle's matmul when it
//! is absent, when `RTUNE_BLAS=off`, or for any operand it does not cover (not f32, not on the CPU,
//! strides that are neither row- nor column-major).
//!
//! Every matmul of the training path comes through [`matmul`], on every device, and every operand
//! there is first held to candle's CUDA rule ([`cuda_gemm_ok`], a copy of `gemm_config` in
//! candle-core 0.11.1's `cuda_backend`): the last two dims packed row- or column-major (leading
//! dimension equal to the column or row count), at most two batch dims that a strided-batched GEMM
//! can step through. An operand that fails it is made contiguous before the GEMM, whatever the
//! device, so a layout that cuBLAS would refuse never reaches it; [`layout_audit`] records the
//! operands the callers pass that fail it, so a CPU test proves the training path produces none.
//!
//! `RTUNE_BLAS`: unset → `libopenblas.so.0` / `libopenblas.so` from the loader's path, and MKL
//! beside it when one is found, the faster measured at start serving ([`mkl`]); `off` → never;
//! a path → that library alone (any CBLAS exporting `cblas_sgemm`, e.g. MKL's `libmkl_rt.so`).
//!
//! The kernel set: Debian's OpenBLAS 0.3.21 does not know Zen 4/5 and picks its AVX2 "Haswell"
//! kernels there, and some environments pin `OPENBLAS_CORETYPE=Haswell` (this project's dev and CI
//! machines do). rtune chooses for its own process with `RTUNE_BLAS_CORE`: unset or `auto` →
//! `SkylakeX` when the CPU has AVX-512 F/BW/DQ/VL (2× the Haswell kernels' rate on the dev box),
//! otherwise whatever `OPENBLAS_CORETYPE` says or OpenBLAS detects; `inherit` → leave
//! `OPENBLAS_CORETYPE` as the environment has it; any other value → that core name.
//!
//! bf16 autocast ([`autocast`], `[model] dtype = "bf16-autocast"`): while an [`autocast::Scope`]
//! is on (and for any product of an f32 and a bf16 operand), [`matmul`] rounds both operands to
//! bf16 and accumulates in f32, as `torch.autocast('cpu', dtype=torch.bfloat16)` runs `linear`,
//! `matmul`, `bmm` and `scaled_dot_product_attention`.
//!
//! The files: `pick.rs` (which library serves: the variables, a resumed run's pin, the probe),
//! `library.rs` (a CBLAS opened, its symbols looked up), `gemm.rs` (the products after [`matmul`]
//! laid them out: tensors and [`sgemm`] on slices, [`one_thread`]), `cuda_rule.rs`
//! ([`cuda_gemm_ok`]), [`layout_audit`], and beside them [`mkl`] (MKL and the start-up probe),
//! [`autocast`], [`acc`].

use std::ffi::c_int;
use std::sync::OnceLock;

pub mod acc;
pub mod autocast;
mod cuda_rule;
mod gemm;
pub mod layout_audit;
mod library;
pub mod mkl;
mod pick;

use candle_core::{Result, Tensor};
use cuda_rule::gemm_ready;
pub use cuda_rule::{cuda_gemm_ok, operand_ok};
use gemm::plain;
pub use gemm::{one_thread, sgemm, OneThread, Operand};
use std::borrow::Cow;

type Sgemm = unsafe extern "C" fn(
    c_int, // order
    c_int, // transa
    c_int, // transb
    c_int, // m
    c_int, // n
    c_int, // k
    f32,   // alpha
    *const f32,
    c_int, // lda
    *const f32,
    c_int, // ldb
    f32,   // beta
    *mut f32,
    c_int, // ldc
);

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

/// A loaded CBLAS.
pub struct Blas {
    sgemm: Sgemm,
    /// OpenBLAS's `openblas_get_num_threads` / `openblas_set_num_threads`, when the library has
    /// them ([`one_thread`]).
    threads: Option<(unsafe extern "C" fn() -> c_int, unsafe extern "C" fn(c_int))>,
    /// What was loaded: `libopenblas.so.0 (skylakex)` (the engine name `rtune bench` tallies).
    pub name: String,
    /// The name and why this library serves f32 (for `run.json` and `rtune check`), e.g.
    /// `libopenblas.so.0 (skylakex); measured at start 131.2 GFLOP/s, MKL 98.4: the faster serves`.
    pub described: String,
}

static BLAS: OnceLock<Option<Blas>> = OnceLock::new();

/// Loads the library (once). Call early in `main`, before threads start: it may set
/// `OPENBLAS_CORETYPE`, and setting the environment is only sound while one thread runs.
pub fn init() -> Option<&'static Blas> {
    BLAS.get_or_init(pick::load).as_ref()
}
static NOTICE: OnceLock<Option<String>> = OnceLock::new();

/// Why a CBLAS named in `RTUNE_BLAS` or `RTUNE_MKL` is not in use (it did not load), once [`init`]
/// ran; the binary logs it.
pub fn notice() -> Option<&'static str> {
    NOTICE.get().and_then(Option::as_deref)
}
/// What [`init`] loaded and why, for reports: `Some("libopenblas.so.0 (skylakex); ...")`.
pub fn loaded() -> Option<&'static str> {
    BLAS.get()
        .and_then(Option::as_ref)
        .map(|b| b.described.as_str())
}
/// `a·b` as `Tensor::matmul` (`a: (..., M, K)`, `b: (..., K, N)`, same batch dims), through BLAS
/// when [`init`] loaded one and the operands suit it; candle's matmul otherwise. An operand that
/// fails [`cuda_gemm_ok`]'s rule is made contiguous first, on every device (see the module note);
/// [`layout_audit`] records it under the caller's file and line.
#[track_caller]
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let site = std::panic::Location::caller();
    layout_audit::call("matmul", a.dims(), b.dims());
    let (a, b) = if cuda_gemm_ok(a.layout(), b.layout()) {
        (Cow::Borrowed(a), Cow::Borrowed(b))
    } else {
        layout_audit::record(site, layout_audit::Stage::Passed, a.layout(), b.layout());
        let (a, b) = gemm_ready(a, b)?;
        if !cuda_gemm_ok(a.layout(), b.layout()) {
            layout_audit::record(site, layout_audit::Stage::AtGemm, a.layout(), b.layout());
        }
        (a, b)
    };
    let (a, b) = (a.as_ref(), b.as_ref());
    if autocast::on() || a.dtype() != b.dtype() {
        return autocast::matmul(a, b);
    }
    plain(a, b)
}

#[cfg(test)]
mod tests;
