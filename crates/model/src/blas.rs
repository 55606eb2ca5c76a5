//! f32 matrix products on the CPU through a system CBLAS (OpenBLAS), loaded at run time.
//!
//! candle's CPU matmul (the `gemm` crate) uses AVX2 kernels only; OpenBLAS has AVX-512 ones and on
//! the bench-small shapes runs ~2× faster on an AVX-512 machine (measured on the 2-core EPYC dev
//! box: 2048×512·512×1376 at 131 vs ~60 GFLOP/s). The library is optional: rtune builds and runs
//! without it (no build-time dependency, no C toolchain), and falls back to candle's matmul when it
//! is absent, when `RTUNE_BLAS=off`, or for any operand it does not cover (not f32, not on the CPU,
//! strides that are neither row- nor column-major).
//!
//! `RTUNE_BLAS`: unset → `libopenblas.so.0` / `libopenblas.so` from the loader's path; `off` → never;
//! a path → that library (any CBLAS exporting `cblas_sgemm`, e.g. MKL's `libmkl_rt.so`).
//!
//! The kernel set: Debian's OpenBLAS 0.3.21 does not know Zen 4/5 and picks its AVX2 "Haswell"
//! kernels there, and some environments pin `OPENBLAS_CORETYPE=Haswell` (this project's dev and CI
//! machines do). rtune chooses for its own process with `RTUNE_BLAS_CORE`: unset or `auto` →
//! `SkylakeX` when the CPU has AVX-512 F/BW/DQ/VL (2× the Haswell kernels' rate on the dev box),
//! otherwise whatever `OPENBLAS_CORETYPE` says or OpenBLAS detects; `inherit` → leave
//! `OPENBLAS_CORETYPE` as the environment has it; any other value → that core name.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::ffi::{c_char, c_int, c_void, CString};
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
    /// What was loaded (for `run.json` and `rtune check`).
    pub name: String,
}

static BLAS: OnceLock<Option<Blas>> = OnceLock::new();

/// Loads the library (once). Call early in `main`, before threads start: it may set
/// `OPENBLAS_CORETYPE`, and setting the environment is only sound while one thread runs.
pub fn init() -> Option<&'static Blas> {
    BLAS.get_or_init(load).as_ref()
}

fn load() -> Option<Blas> {
    let choice = std::env::var("RTUNE_BLAS").unwrap_or_default();
    if choice == "off" || choice == "0" {
        return None;
    }
    let names: Vec<String> = if choice.is_empty() {
        vec!["libopenblas.so.0".into(), "libopenblas.so".into()]
    } else {
        vec![choice]
    };
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
    for name in names {
        let Ok(c) = CString::new(name.clone()) else {
            continue;
        };
        // SAFETY: dlopen/dlsym with valid C strings; the handle is never closed, so the function
        // pointer stays valid for the life of the process.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if h.is_null() {
                continue;
            }
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
            return Some(Blas {
                sgemm: std::mem::transmute::<*mut c_void, Sgemm>(sym),
                name: format!("{name}{core}"),
            });
        }
    }
    None
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
/// when [`init`] loaded one and the operands suit it; candle's matmul otherwise.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let Some(blas) = BLAS.get().and_then(Option::as_ref) else {
        return a.matmul(b);
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
        return a.matmul(b);
    }
    a.apply_op2_no_bwd(b, &Gemm(blas))
}

/// What [`init`] loaded, for reports: `Some("libopenblas.so.0 (skylakex)")`.
pub fn loaded() -> Option<&'static str> {
    BLAS.get().and_then(Option::as_ref).map(|b| b.name.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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

    /// The same values with the last two dims' strides swapped (column-major matrices).
    fn col_major(t: &Tensor) -> Result<Tensor> {
        t.transpose(2, 3)?.contiguous()?.transpose(2, 3)
    }
}
