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

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::borrow::Cow;
use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

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
    BLAS.get_or_init(load).as_ref()
}

fn load() -> Option<Blas> {
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

static NOTICE: OnceLock<Option<String>> = OnceLock::new();

/// Why a CBLAS named in `RTUNE_BLAS` or `RTUNE_MKL` is not in use (it did not load), once [`init`]
/// ran; the binary logs it.
pub fn notice() -> Option<&'static str> {
    NOTICE.get().and_then(Option::as_deref)
}

/// The CBLAS that serves f32 given the choice ([`crate::pin::blas`]: `RTUNE_BLAS`, else a resumed
/// run's record, else the default search) and `RTUNE_MKL`, and the notice to print when a library
/// the user named did not load (then the fallback serves: candle's gemm for `RTUNE_BLAS`, OpenBLAS
/// alone for `RTUNE_MKL`). A recorded library that does not load falls back to the default search
/// and is reported to [`crate::pin::lose`]. `rates`: the start-up probe ([`mkl::probe`]; a test
/// gives its own answer).
fn select(
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

/// The first of `names` that opens ([`crate::dl::open`]) and exports `cblas_sgemm`.
fn open(names: &[String]) -> Option<Blas> {
    for name in names {
        // SAFETY: dlsym with valid C strings; the handle is never closed, so the function
        // pointer stays valid for the life of the process.
        unsafe {
            let Ok(h) = crate::dl::open(name) else {
                continue;
            };
            let sym = libc::dlsym(h, c"cblas_sgemm".as_ptr());
            if sym.is_null() {
                continue;
            }
            let core = libc::dlsym(h, c"openblas_get_corename".as_ptr());
            let core = if core.is_null() {
                String::new()
            } else {
                let f: unsafe extern "C" fn() -> *const c_char = std::mem::transmute(core);
                let p = f();
                if p.is_null() {
                    String::new()
                } else {
                    format!(
                        " ({})",
                        std::ffi::CStr::from_ptr(p).to_string_lossy().to_lowercase()
                    )
                }
            };
            let (get, set) = (
                libc::dlsym(h, c"openblas_get_num_threads".as_ptr()),
                libc::dlsym(h, c"openblas_set_num_threads".as_ptr()),
            );
            let threads = (!get.is_null() && !set.is_null()).then(|| {
                (
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(get),
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(set),
                )
            });
            let name = format!("{name}{core}");
            return Some(Blas {
                sgemm: std::mem::transmute::<*mut c_void, Sgemm>(sym),
                threads,
                described: name.clone(),
                name,
            });
        }
    }
    None
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
fn thread_timeout(
    openblas: Option<std::ffi::OsString>,
    goto: Option<std::ffi::OsString>,
) -> Option<&'static str> {
    (openblas.is_none() && goto.is_none()).then_some("20")
}

/// AVX-512 F/BW/DQ/VL: what OpenBLAS's SkylakeX kernels use.
fn avx512() -> bool {
    crate::cpu_features::get().avx512_skylake()
}

/// One operand's matrix view: BLAS transposition flag and leading dimension.
#[derive(Debug, Clone, Copy)]
struct Mat {
    trans: c_int,
    ld: usize,
}

/// `(rows, cols)` with strides `(s0, s1)` as a BLAS operand, if it is one.
fn as_mat(rows: usize, cols: usize, s0: usize, s1: usize) -> Option<Mat> {
    if s1 == 1 || cols == 1 {
        Some(Mat {
            trans: NO_TRANS,
            ld: if rows == 1 { cols.max(1) } else { s0.max(cols) },
        })
    } else if s0 == 1 || rows == 1 {
        Some(Mat {
            trans: TRANS,
            ld: if cols == 1 { rows.max(1) } else { s1.max(rows) },
        })
    } else {
        None
    }
}

/// Batch offsets of a `(..., R, C)` layout, one per matrix, in row-major batch order.
fn batch_offsets(l: &Layout) -> Vec<usize> {
    let dims = l.dims();
    let st = l.stride();
    let nb = dims.len() - 2;
    let count: usize = dims[..nb].iter().product();
    let mut offs = Vec::with_capacity(count);
    let mut idx = vec![0usize; nb];
    for _ in 0..count {
        offs.push(l.start_offset() + idx.iter().zip(st).map(|(i, s)| i * s).sum::<usize>());
        for d in (0..nb).rev() {
            idx[d] += 1;
            if idx[d] < dims[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    offs
}

fn plan(l: &Layout) -> Option<Mat> {
    let d = l.dims();
    let s = l.stride();
    let r = d.len();
    as_mat(d[r - 2], d[r - 1], s[r - 2], s[r - 1])
}

struct Gemm(&'static Blas);

impl CustomOp2 for Gemm {
    fn name(&self) -> &'static str {
        "blas-sgemm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (s1, s2) else {
            candle_core::bail!("blas-sgemm: f32 operands only");
        };
        let (da, db) = (l1.dims(), l2.dims());
        let r = da.len();
        let (m, k, n) = (da[r - 2], da[r - 1], db[r - 1]);
        let (ma, mb) = match (plan(l1), plan(l2)) {
            (Some(x), Some(y)) => (x, y),
            _ => candle_core::bail!("blas-sgemm: strides {:?} / {:?}", l1.stride(), l2.stride()),
        };
        let (oa, ob) = (batch_offsets(l1), batch_offsets(l2));
        crate::served::record(|| self.0.name.clone(), oa.len(), m, k, n);
        let mut out_dims = da[..r - 2].to_vec();
        out_dims.extend([m, n]);
        let total = oa.len() * m * n;
        let mut c: Vec<f32> = Vec::with_capacity(total);
        for (i, (&pa, &pb)) in oa.iter().zip(&ob).enumerate() {
            // SAFETY: the layouts were checked by `matmul` (dims, strides within the storage); with
            // beta = 0 sgemm writes every element of the (m, n) block and reads none of it.
            unsafe {
                (self.0.sgemm)(
                    ROW_MAJOR,
                    ma.trans,
                    mb.trans,
                    m as c_int,
                    n as c_int,
                    k as c_int,
                    1.0,
                    a.as_ptr().add(pa),
                    ma.ld as c_int,
                    b.as_ptr().add(pb),
                    mb.ld as c_int,
                    0.0,
                    c.as_mut_ptr().add(i * m * n),
                    n as c_int,
                );
            }
        }
        // SAFETY: every element was written above.
        unsafe { c.set_len(total) };
        Ok((CpuStorage::F32(c), Shape::from(out_dims)))
    }
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

/// [`matmul`] of operands already laid out for it, in their own dtype (no autocast).
fn plain(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    // bf16 on the CPU: oneDNN's bf16 kernels where the CPU has them (f32 accumulation, bf16 out,
    // as candle's matmul), candle's gemm otherwise.
    if a.dtype() == DType::BF16 {
        if let Some(y) = crate::onednn::matmul(a, b, DType::BF16) {
            return y;
        }
    }
    let Some(blas) = BLAS.get().and_then(Option::as_ref) else {
        return candle(a, b);
    };
    let (da, db) = (a.dims(), b.dims());
    let ok = a.device().is_cpu()
        && a.dtype() == DType::F32
        && b.dtype() == DType::F32
        && da.len() >= 2
        && da.len() == db.len()
        && da[..da.len() - 2] == db[..db.len() - 2]
        && da[da.len() - 1] == db[db.len() - 2]
        && da
            .iter()
            .chain(db)
            .all(|&d| d > 0 && d < c_int::MAX as usize)
        && plan(a.layout()).is_some()
        && plan(b.layout()).is_some();
    if !ok {
        return candle(a, b);
    }
    a.apply_op2_no_bwd(b, &Gemm(blas))
}

/// candle's own matmul (the `gemm` crate on the CPU, cuBLAS on CUDA), tallied for reports.
fn candle(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (batch, m, k, n) = crate::served::dims(a.dims(), b.dims());
    let engine = || {
        let on = if a.device().is_cpu() {
            "gemm crate"
        } else {
            "cuBLAS"
        };
        format!("candle's matmul ({on}, {:?})", a.dtype()).to_lowercase()
    };
    crate::served::record(engine, batch, m, k, n);
    a.matmul(b)
}

/// The operands with each one that fails [`cuda_gemm_ok`]'s rule replaced by a contiguous copy
/// (a row-major packed matrix with packed batches passes it whatever the other operand is).
fn gemm_ready<'a>(a: &'a Tensor, b: &'a Tensor) -> Result<(Cow<'a, Tensor>, Cow<'a, Tensor>)> {
    let fix = |t: &'a Tensor, rows: usize, cols: usize| -> Result<Cow<'a, Tensor>> {
        if operand_ok(t.layout(), rows, cols) {
            Ok(Cow::Borrowed(t))
        } else {
            Ok(Cow::Owned(t.contiguous()?))
        }
    };
    let (da, db) = (a.dims(), b.dims());
    if da.len() < 2 || db.len() < 2 {
        return Ok((Cow::Borrowed(a), Cow::Borrowed(b)));
    }
    let (m, k) = (da[da.len() - 2], da[da.len() - 1]);
    let n = db[db.len() - 1];
    Ok((fix(a, m, k)?, fix(b, k, n)?))
}

/// Whether candle 0.11.1's CUDA matmul accepts `lhs: (..., M, K)` times `rhs: (..., K, N)` as laid
/// out: `gemm_config` in `candle-core/src/cuda_backend/mod.rs`, rule for rule. Each operand's
/// matrix must be packed row-major (unit column stride, row stride = its column count) or
/// column-major (unit row stride, column stride = its row count), a dim of size 1 excusing the
/// stride that steps along it; the batch dims (at most two) must step by one stride (two of
/// them as one, or one of them of size 1). Shapes that do not multiply are not this rule's business: `true`.
pub fn cuda_gemm_ok(lhs: &Layout, rhs: &Layout) -> bool {
    let (dl, dr) = (lhs.dims(), rhs.dims());
    if dl.len() < 2 || dl.len() != dr.len() {
        return true;
    }
    let r = dl.len();
    let (m, k, n) = (dl[r - 2], dl[r - 1], dr[r - 1]);
    operand_ok(lhs, m, k) && operand_ok(rhs, k, n)
}

/// One operand of [`cuda_gemm_ok`], `rows × cols` being its last two dims: candle's
/// `(lda, transa)` / `(ldb, transb)` choice and its `stride_a` / `stride_b` match.
pub fn operand_ok(l: &Layout, rows: usize, cols: usize) -> bool {
    let st = l.stride();
    let r = st.len();
    let (s_row, s_col) = (st[r - 2], st[r - 1]);
    // candle: `(m1 == 1 || cols == 1) && (m2 == cols || rows == 1)` → no transpose, ld = cols.
    let row_major = (s_col == 1 || cols == 1) && (s_row == cols || rows == 1);
    // candle: `(m1 == rows || cols == 1) && (m2 == 1 || rows == 1)` → transpose, ld = rows.
    let col_major = (s_col == rows || cols == 1) && (s_row == 1 || rows == 1);
    (row_major || col_major) && batch_ok(l)
}

/// candle's batch-stride match (`stride_a` / `stride_b`): no batch dim; one; or two that step as
/// one (outer stride = inner stride × inner size), or of which one has size 1. Three or more batch
/// dims are refused whatever their strides.
fn batch_ok(l: &Layout) -> bool {
    let (d, st) = (l.dims(), l.stride());
    match st[..st.len() - 2] {
        [] | [_] => true,
        [s1, s2] => s1 == s2 * d[1] || d[0] == 1 || d[1] == 1,
        _ => false,
    }
}

/// A record of the matmul operands that fail [`cuda_gemm_ok`]'s rule, for tests: while a
/// [`layout_audit::Guard`] from [`layout_audit::start`] lives, every [`matmul`] call with such an operand is recorded with its
/// call site, shapes and strides; so is every product's shapes ([`matmul`]'s and the tiled
/// attention's, [`layout_audit::Call`]), which tests count. Process-wide (any thread's calls
/// count): a test that asserts on it should be the only one of its binary running model code at
/// the time.
pub mod layout_audit {
    use candle_core::Layout;
    use std::panic::Location;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// Where a failing layout was seen.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Stage {
        /// As the caller passed it to [`super::matmul`] (the code produced it; it was then copied
        /// to a contiguous tensor before the GEMM).
        Passed,
        /// As it reached the GEMM, after that copy: cuBLAS would refuse it. Never expected.
        AtGemm,
    }

    /// One matmul whose operands fail the rule.
    #[derive(Debug, Clone)]
    pub struct Violation {
        pub stage: Stage,
        /// `file:line` of the [`super::matmul`] call.
        pub site: String,
        pub lhs_dims: Vec<usize>,
        pub lhs_stride: Vec<usize>,
        pub rhs_dims: Vec<usize>,
        pub rhs_stride: Vec<usize>,
    }

    impl std::fmt::Display for Violation {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "{:?} at {}: lhs {:?} strides {:?} · rhs {:?} strides {:?}",
                self.stage,
                self.site,
                self.lhs_dims,
                self.lhs_stride,
                self.rhs_dims,
                self.rhs_stride
            )
        }
    }

    /// One product computed while recording: `op` (`matmul`, `flash_attn`) and its first two
    /// operands' dims.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Call {
        pub op: &'static str,
        pub lhs: Vec<usize>,
        pub rhs: Vec<usize>,
    }

    static ACTIVE: AtomicUsize = AtomicUsize::new(0);
    static SEEN: Mutex<Vec<Violation>> = Mutex::new(Vec::new());
    static CALLS: Mutex<Vec<Call>> = Mutex::new(Vec::new());

    /// Records until the guard drops; what was recorded before is cleared.
    pub fn start() -> Guard {
        SEEN.lock().unwrap_or_else(|e| e.into_inner()).clear();
        CALLS.lock().unwrap_or_else(|e| e.into_inner()).clear();
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        Guard(())
    }

    /// Recording is on while one lives.
    pub struct Guard(());

    impl Guard {
        /// Everything recorded since [`start`].
        pub fn violations(&self) -> Vec<Violation> {
            SEEN.lock().unwrap_or_else(|e| e.into_inner()).clone()
        }

        /// Everything recorded since [`start`] or the last `take`, cleared.
        pub fn take(&self) -> Vec<Violation> {
            std::mem::take(&mut *SEEN.lock().unwrap_or_else(|e| e.into_inner()))
        }

        /// Every product since [`start`] or the last `take_calls`, in call order, cleared.
        pub fn take_calls(&self) -> Vec<Call> {
            std::mem::take(&mut *CALLS.lock().unwrap_or_else(|e| e.into_inner()))
        }
    }

    /// Notes a product of operands `lhs`, `rhs` while recording.
    pub fn call(op: &'static str, lhs: &[usize], rhs: &[usize]) {
        if ACTIVE.load(Ordering::Relaxed) == 0 {
            return;
        }
        CALLS.lock().unwrap_or_else(|e| e.into_inner()).push(Call {
            op,
            lhs: lhs.to_vec(),
            rhs: rhs.to_vec(),
        });
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
        }
    }

    pub(super) fn record(site: &Location<'_>, stage: Stage, lhs: &Layout, rhs: &Layout) {
        if ACTIVE.load(Ordering::Relaxed) == 0 {
            return;
        }
        SEEN.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Violation {
                stage,
                site: format!("{}:{}", site.file(), site.line()),
                lhs_dims: lhs.dims().to_vec(),
                lhs_stride: lhs.stride().to_vec(),
                rhs_dims: rhs.dims().to_vec(),
                rhs_stride: rhs.stride().to_vec(),
            });
    }
}

pub mod acc;
pub mod autocast;
pub mod mkl;

/// One operand of [`sgemm`]: a row-major matrix in `data`, read as stored (`trans` false:
/// `rows × cols` of the product, row `i` at `i·ld`) or transposed (`trans` true: stored
/// `cols × rows`, the product reads its transpose).
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    pub data: &'a [f32],
    pub trans: bool,
    pub ld: usize,
}

impl Operand<'_> {
    /// Whether `data` holds the `rows × cols` matrix the product reads.
    fn covers(&self, rows: usize, cols: usize) -> bool {
        let (r, c) = if self.trans {
            (cols, rows)
        } else {
            (rows, cols)
        };
        r == 0 || c == 0 || (self.ld >= c && (r - 1) * self.ld + c <= self.data.len())
    }
}

/// `c = alpha · a·b + beta · c` on slices, `a: m × k`, `b: k × n`, `c: m × n` row-major packed,
/// through the loaded CBLAS (its own threads). For callers that lay out many small products
/// themselves (the experts' grouped GEMM, `rtune_experts::moe`): no tensor per product.
/// `Ok(false)`: no CBLAS is loaded (nothing written); the caller computes it another way. Sizes
/// that do not fit their slices are an error naming the product, before any read.
pub fn sgemm(
    a: Operand,
    b: Operand,
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    beta: f32,
) -> Result<bool> {
    let Some(blas) = BLAS.get().and_then(Option::as_ref) else {
        return Ok(false);
    };
    let fits = |d: usize| d < c_int::MAX as usize;
    if !(a.covers(m, k) && b.covers(k, n) && c.len() >= m * n && fits(m) && fits(n) && fits(k))
        || !(fits(a.ld) && fits(b.ld))
    {
        candle_core::bail!(
            "blas sgemm: {m}×{k}·{k}×{n} does not fit its slices (a {} ld {}, b {} ld {}, c {})",
            a.data.len(),
            a.ld,
            b.data.len(),
            b.ld,
            c.len()
        );
    }
    if m == 0 || n == 0 {
        return Ok(true);
    }
    let flag = |t: bool| if t { TRANS } else { NO_TRANS };
    // SAFETY: each operand's m×k, k×n and m×n elements lie within its slice (checked above);
    // `c` is borrowed mutably and cannot alias the shared `a` and `b`. A zero `k` reads nothing
    // of `a`, `b` (CBLAS scales `c` by beta), and a leading dimension of at least 1 is passed.
    unsafe {
        (blas.sgemm)(
            ROW_MAJOR,
            flag(a.trans),
            flag(b.trans),
            m as c_int,
            n as c_int,
            k as c_int,
            alpha,
            a.data.as_ptr(),
            a.ld.max(1) as c_int,
            b.data.as_ptr(),
            b.ld.max(1) as c_int,
            beta,
            c.as_mut_ptr(),
            n.max(1) as c_int,
        );
    }
    Ok(true)
}

/// Open [`OneThread`] guards and the thread count to restore when the last closes.
static ONE_THREAD: std::sync::Mutex<(usize, c_int)> = std::sync::Mutex::new((0, 0));

/// While held, OpenBLAS runs on one thread ([`one_thread`]); dropping the last open guard
/// restores the count it had before the first.
pub struct OneThread {
    set: unsafe extern "C" fn(c_int),
}

/// OpenBLAS on one thread (`openblas_set_num_threads(1)`) until the guard drops, for a caller
/// that spreads many small products over its own threads (the experts' grouped GEMM): OpenBLAS
/// 0.3.21 runs a one-thread call without its threaded level-3 driver and that driver's lock, so
/// products from several threads run at once, and no idle OpenBLAS worker spins in `sched_yield`
/// between them. The count is the process's: a product another thread starts meanwhile also runs
/// on one thread (the same result, slower). `None`: no library loaded, or one without OpenBLAS's
/// thread calls.
pub fn one_thread() -> Option<OneThread> {
    let (get, set) = BLAS.get().and_then(Option::as_ref)?.threads?;
    let mut open = ONE_THREAD
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if open.0 == 0 {
        // SAFETY: OpenBLAS's own entry points, no pointers; 1 is within the pool it started (no
        // thread is created).
        open.1 = unsafe { get() };
        // SAFETY: as above.
        unsafe { set(1) };
    }
    open.0 += 1;
    Some(OneThread { set })
}

impl Drop for OneThread {
    fn drop(&mut self) {
        let mut open = ONE_THREAD
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        open.0 -= 1;
        if open.0 == 0 {
            // SAFETY: as in `one_thread`; the count read when the first guard opened.
            unsafe { (self.set)(open.1.max(1)) };
        }
    }
}

/// What [`init`] loaded and why, for reports: `Some("libopenblas.so.0 (skylakex); ...")`.
pub fn loaded() -> Option<&'static str> {
    BLAS.get()
        .and_then(Option::as_ref)
        .map(|b| b.described.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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
}
