//! The products themselves: [`plain`], what [`super::matmul`] runs once the operands are laid out
//! (oneDNN for bf16, the CBLAS for f32, candle's matmul for the rest), and [`sgemm`] on slices,
//! with [`one_thread`] for callers that spread small products over their own threads.

use super::{Blas, BLAS, NO_TRANS, ROW_MAJOR, TRANS};
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::ffi::c_int;

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

/// [`matmul`] of operands already laid out for it, in their own dtype (no autocast).
pub(super) fn plain(a: &Tensor, b: &Tensor) -> Result<Tensor> {
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
/// on one thread, slower, and not always to the same bits (0.3.21's Zen kernels round some shapes
/// differently on 1 and 2 threads: `sgemm` 5×512·512×128 by 3.4e-5, measured on an AVX2 EPYC).
/// rtune's passes run no product beside the experts'; tests that compare bits across threads of
/// one process hold a guard throughout. `None`: no library loaded, or one without OpenBLAS's
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
