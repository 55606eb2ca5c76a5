//! `c += alpha · a·b` in place: cuBLAS's GEMM with `beta = 1` (issue 48, item 2), what the LoRA
//! branch in bf16 uses to add its rank-`r` products into the frozen path's tensors without an
//! `(N, out)` product of its own: the forward's `y += s·xa·Bᵀ`, the backward's `dx += dxa·A`, and
//! (into fresh f32 tensors, [`gemm`]) the adapters' `dB = s·dyᵀ·xa`, `dA = dxaᵀ·x` straight
//! from bf16 operands, no cast. `rtune_ops::lora::acc` is what the model calls: these, counted
//! as the `lora_bf16` fused path for its tests.
//!
//! `a: (M, K)`, `b: (K, N)` of one type (f32, bf16 or f16); `c: (M, N)` of that type or f32, rows
//! packed at any row stride (a member's column view of a fused q/k/v product is one). Each
//! operand must be laid out as candle's CUDA GEMM requires ([`crate::blas::operand_ok`]:
//! packed row- or column-major, leading dimension its column or row count), on every device, so
//! a layout cuBLAS would refuse is found by the CPU's tests; the error names the operand and its
//! shape and strides.
//!
//! Numerics: products and sums in f32, then `c = R(c + alpha·Σ)` rounded once to `c`'s type
//! (cuBLAS `CUBLAS_COMPUTE_32F`; `alpha` in f32, not rounded to bf16). On the CPU bf16 operands
//! go through oneDNN where it is in use ([`crate::onednn::acc`]: output scale and sum post-op,
//! the same numerics in its order), other operands through a loop that sums in index order;
//! cuBLAS in its own order (f32 sums of bf16 products, exact each: the two differ by f32
//! rounding only). PEFT under bf16 autocast rounds `xa·Bᵀ`, then `·s`, then the add: three
//! roundings where this has one.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, InplaceOp3, Layout, Result, Tensor, WithDType};
use half::{bf16, f16};

use crate::blas::operand_ok;

/// `c += alpha · a·b` in place (see the module docs for the shapes and layouts).
pub fn gemm_acc(c: &Tensor, a: &Tensor, b: &Tensor, alpha: f64) -> Result<()> {
    c.inplace_op3(
        a,
        b,
        &GemmAcc {
            alpha: alpha as f32,
        },
    )
}

/// `alpha · a·b` as a new `(M, N)` tensor of `dtype` (a zeroed one, accumulated into: one
/// rounding, the scale in alpha): a LoRA gradient of bf16 operands straight into f32, no cast.
pub fn gemm(a: &Tensor, b: &Tensor, alpha: f64, dtype: DType) -> Result<Tensor> {
    let (m, n) = (a.dim(0)?, b.dim(1)?);
    let c = Tensor::zeros((m, n), dtype, a.device())?;
    gemm_acc(&c, a, b, alpha)?;
    Ok(c)
}

/// A GEMM operand as cuBLAS takes it in column-major terms: transposed or not, and its leading
/// dimension (`rows × cols` being the row-major matrix). `None`: candle's CUDA GEMM refuses it.
pub fn plan(l: &Layout, rows: usize, cols: usize) -> Option<(bool, usize)> {
    if l.dims().len() != 2 || !operand_ok(l, rows, cols) {
        return None;
    }
    let st = l.stride();
    // Row-major (unit column stride): cuBLAS reads it as its transpose, untransposed, ld = the
    // row stride (`cols` when packed). Column-major: transposed, ld = the column stride.
    if st[1] == 1 || cols == 1 {
        Some((false, if rows == 1 { cols.max(1) } else { st[0] }))
    } else {
        Some((true, if cols == 1 { rows.max(1) } else { st[1] }))
    }
}

struct GemmAcc {
    alpha: f32,
}

/// `(M, K, N)` after checking shapes, dtypes and that every operand has a cuBLAS layout; `c`'s
/// row stride.
fn check(
    (cd, cl): (DType, &Layout),
    (ad, al): (DType, &Layout),
    (bd, bl): (DType, &Layout),
) -> Result<(usize, usize, usize, usize)> {
    const OP: &str = "gemm_acc";
    let (&[m, k], &[k2, n], &[cm, cn]) = (al.dims(), bl.dims(), cl.dims()) else {
        bail!(
            "{OP}: c {:?} += a {:?}·b {:?}: each must be a matrix",
            cl.dims(),
            al.dims(),
            bl.dims()
        );
    };
    if k != k2 || (cm, cn) != (m, n) {
        bail!(
            "{OP}: c {:?} += a {:?}·b {:?} does not hold",
            cl.dims(),
            al.dims(),
            bl.dims()
        );
    }
    if ad != bd || !matches!(ad, DType::F32 | DType::BF16 | DType::F16) {
        bail!("{OP}: a is {ad:?}, b {bd:?}: one float type (f32, bf16, f16) for both");
    }
    if cd != ad && cd != DType::F32 {
        bail!("{OP}: c is {cd:?} for {ad:?} operands: their type or f32");
    }
    for (what, l, rows, cols) in [("a", al, m, k), ("b", bl, k, n)] {
        if plan(l, rows, cols).is_none() {
            bail!(
                "{OP}: `{what}` {:?} with strides {:?} is laid out as cuBLAS refuses (packed row- \
                 or column-major only: leading dimension {cols} or {rows}); make it contiguous",
                l.dims(),
                l.stride()
            );
        }
    }
    let cst = cl.stride();
    if !(cst[1] == 1 || n <= 1) || (m > 1 && cst[0] < n) {
        bail!(
            "{OP}: `c` {:?} with strides {:?}: its rows must be packed (unit column stride)",
            cl.dims(),
            cst
        );
    }
    Ok((m, k, n, if m > 1 { cst[0] } else { n.max(1) }))
}

/// The elements of a 2-d operand as f32, row-major `(rows, cols)`, read through its strides.
fn dense_f32<T: WithDType>(s: &[T], l: &Layout) -> Vec<f32> {
    let (d, st, o) = (l.dims(), l.stride(), l.start_offset());
    let mut out = Vec::with_capacity(d[0] * d[1]);
    for i in 0..d[0] {
        for j in 0..d[1] {
            out.push(s[o + i * st[0] + j * st[1]].to_f64() as f32);
        }
    }
    out
}

fn operand_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    Ok(match s {
        CpuStorage::F32(v) => dense_f32(v, l),
        CpuStorage::BF16(v) => dense_f32(v, l),
        CpuStorage::F16(v) => dense_f32(v, l),
        _ => bail!("gemm_acc: operand of {:?}", s.dtype()),
    })
}

/// `c[i, j] = R(c[i, j] + alpha·Σ_k a[i, k]·b[k, j])`, the sum in f32 in index order.
fn acc_rows<C: WithDType>(
    c: &mut [C],
    (off, ldc): (usize, usize),
    a: &[f32],
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    alpha: f32,
) {
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f32;
            for p in 0..k {
                s += a[i * k + p] * b[p * n + j];
            }
            let e = &mut c[off + i * ldc + j];
            *e = C::from_f64((e.to_f64() as f32 + alpha * s) as f64);
        }
    }
}

impl InplaceOp3 for GemmAcc {
    fn name(&self) -> &'static str {
        "gemm_acc"
    }

    fn cpu_fwd(
        &self,
        sc: &mut CpuStorage,
        lc: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<()> {
        let (m, k, n, ldc) = check((sc.dtype(), lc), (sa.dtype(), la), (sb.dtype(), lb))?;
        // bf16 operands: oneDNN's kernels where in use (the same numerics, f32 sums in its order).
        if let Some(done) =
            crate::onednn::acc::gemm_acc((&mut *sc, lc, ldc), (sa, la), (sb, lb), self.alpha)
        {
            return done;
        }
        let (a, b) = (operand_f32(sa, la)?, operand_f32(sb, lb)?);
        let at = (lc.start_offset(), ldc);
        match sc {
            CpuStorage::F32(c) => acc_rows::<f32>(c, at, &a, &b, (m, k, n), self.alpha),
            CpuStorage::BF16(c) => acc_rows::<bf16>(c, at, &a, &b, (m, k, n), self.alpha),
            CpuStorage::F16(c) => acc_rows::<f16>(c, at, &a, &b, (m, k, n), self.alpha),
            _ => bail!("gemm_acc: c of {:?}", sc.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sc: &mut candle_core::CudaStorage,
        lc: &Layout,
        sa: &candle_core::CudaStorage,
        la: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<()> {
        use cudarc::cublas::{result::gemm_ex, sys};
        use cudarc::driver::{DevicePtr, DevicePtrMut};

        const OP: &str = "gemm_acc";
        let (m, k, n, ldc) = check((sc.dtype(), lc), (sa.dtype(), la), (sb.dtype(), lb))?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (ta, lda) = plan(la, m, k).expect("checked");
        let (tb, ldb) = plan(lb, k, n).expect("checked");
        let ty = |d: DType| match d {
            DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
            DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
            _ => sys::cudaDataType_t::CUDA_R_32F,
        };
        let op = |t: bool| match t {
            true => sys::cublasOperation_t::CUBLAS_OP_T,
            false => sys::cublasOperation_t::CUBLAS_OP_N,
        };
        let int = |what: &str, v: usize| -> Result<i32> {
            i32::try_from(v)
                .map_err(|_| candle_core::Error::Msg(format!("{OP}: {what} {v} past i32")))
        };
        let dev = sc.device.clone();
        let stream = dev.cuda_stream();
        let blas = dev.cublas_handle();
        // Row-major c = a·b is column-major cᵀ = bᵀ·aᵀ: cuBLAS's A is b (n × k), its B is a.
        let (alpha, beta) = (self.alpha, 1f32);
        let (pa, pb, pc);
        // Device addresses of each operand's first element (the layouts' start offsets); one
        // stream, so the access records the guards would keep are not needed.
        macro_rules! ptrs {
            ($T:ty, $C:ty) => {{
                let va = sa.as_cuda_slice::<$T>()?.slice(la.start_offset()..);
                let vb = sb.as_cuda_slice::<$T>()?.slice(lb.start_offset()..);
                pa = va.device_ptr(&stream).0;
                pb = vb.device_ptr(&stream).0;
                let mut vc = sc.as_cuda_slice_mut::<$C>()?.slice_mut(lc.start_offset()..);
                pc = vc.device_ptr_mut(&stream).0;
            }};
        }
        match (sa.dtype(), sc.dtype()) {
            (DType::BF16, DType::BF16) => ptrs!(bf16, bf16),
            (DType::BF16, _) => ptrs!(bf16, f32),
            (DType::F16, DType::F16) => ptrs!(f16, f16),
            (DType::F16, _) => ptrs!(f16, f32),
            _ => ptrs!(f32, f32),
        }
        // SAFETY: pointers to the operands' first elements on `stream` (cuBLAS runs on candle's
        // stream); shapes, types and leading dimensions checked above; c is written only within
        // its rows (ldc ≥ n).
        unsafe {
            gemm_ex(
                *blas.handle(),
                op(tb),
                op(ta),
                int("n", n)?,
                int("m", m)?,
                int("k", k)?,
                (&alpha) as *const f32 as *const _,
                pb as *const _,
                ty(sb.dtype()),
                int("ldb", ldb)?,
                pa as *const _,
                ty(sa.dtype()),
                int("lda", lda)?,
                (&beta) as *const f32 as *const _,
                pc as *mut _,
                ty(sc.dtype()),
                int("ldc", ldc)?,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| candle_core::Error::Msg(format!("{OP} (cublas): {e:?}")))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Precision;
    use candle_core::Device;

    /// `(rows, cols)` of N(0, 1) values in `dt`.
    fn randn(rows: usize, cols: usize, dt: DType) -> Tensor {
        Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu)
            .and_then(|t| t.to_dtype(dt))
            .unwrap()
    }

    fn f64s(t: &Tensor) -> Vec<Vec<f64>> {
        t.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap()
    }

    /// `c + alpha·a·b` in f64 from the operands' values, and the sum of the terms' magnitudes.
    fn want(c: &Tensor, a: &Tensor, b: &Tensor, alpha: f64) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let (c, a, b) = (f64s(c), f64s(a), f64s(b));
        let mut w = c.clone();
        let mut mag = c.clone();
        for i in 0..w.len() {
            for j in 0..w[0].len() {
                let s: f64 = (0..b.len()).map(|p| a[i][p] * b[p][j]).sum();
                let m: f64 = (0..b.len()).map(|p| (a[i][p] * b[p][j]).abs()).sum();
                w[i][j] += alpha * s;
                mag[i][j] = c[i][j].abs() + alpha.abs() * m;
            }
        }
        (w, mag)
    }

    /// Against the f64 sum, every operand type with a bf16/f16/f32 c, `b` transposed (as `Bᵀ`
    /// is), `c` a column view of a wider matrix (a member of a fused q/k/v product): within the
    /// f32 sum's rounding (1e-6 of the terms' magnitudes, K ≤ 40) plus one rounding to c's type
    /// (half an ulp: one rounding); the columns outside the view untouched, bit for bit. Where
    /// oneDNN is in use the bf16 operands went through it (the served tally shows its products
    /// of this shape), else through the loop.
    #[test]
    fn accumulates_into_views_within_one_rounding() {
        let (m, k, n, wide, col) = (7, 37, 9, 20, 5);
        let tally = crate::served::start();
        for (dt, cdt) in [
            (DType::F32, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::BF16, DType::F32),
            (DType::F16, DType::F16),
        ] {
            let a = randn(m, k, dt);
            let b = randn(n, k, dt).t().unwrap(); // (k, n), column-major
            let full = randn(m, wide, cdt);
            let before = f64s(&full);
            let c = full.narrow(1, col, n).unwrap();
            let (w, mag) = want(&c, &a, &b, 0.75);
            gemm_acc(&c, &a, &b, 0.75).unwrap();
            let p = match cdt {
                DType::BF16 => Precision::Bf16,
                DType::F16 => Precision::F16,
                _ => Precision::F32,
            };
            let after = f64s(&full);
            for i in 0..m {
                for j in 0..wide {
                    let got = after[i][j];
                    if !(col..col + n).contains(&j) {
                        assert_eq!(got.to_bits(), before[i][j].to_bits(), "{cdt:?} ({i}, {j})");
                        continue;
                    }
                    let want = w[i][j - col];
                    let tol = 1e-6 * mag[i][j - col] + 0.5 * p.ulp(want as f32) as f64;
                    assert!(
                        (got - want).abs() <= tol,
                        "{dt:?}/{cdt:?} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
        let onednn = tally
            .rows()
            .iter()
            .filter(|r| r.engine.starts_with("oneDNN") && [r.m, r.k, r.n] == [m, k, n])
            .map(|r| r.calls)
            .sum::<u64>();
        let want = if crate::onednn::get().is_ok() { 2 } else { 0 };
        assert!(onednn >= want, "{onednn} oneDNN products of {want}");
    }

    /// The cuBLAS plan of candle's accepted layouts, and the layouts it refuses refused here too
    /// (on the CPU, so the tests find them), naming the operand, its shape and strides.
    #[test]
    fn layouts_follow_candles_cuda_rule() {
        let c = |d: &[usize]| Layout::contiguous(d);
        assert_eq!(plan(&c(&[24, 40]), 24, 40), Some((false, 40)));
        assert_eq!(
            plan(&c(&[16, 24]).transpose(0, 1).unwrap(), 24, 16),
            Some((true, 24))
        );
        // A row view keeps its row stride as the leading dimension.
        assert_eq!(
            plan(&c(&[30, 40]).narrow(0, 2, 24).unwrap(), 24, 40),
            Some((false, 40))
        );
        // A column view of (N, Σr): leading dimension Σr for 4 columns, refused.
        assert_eq!(plan(&c(&[24, 12]).narrow(1, 4, 4).unwrap(), 24, 4), None);
        let xa = randn(24, 12, DType::BF16).narrow(1, 4, 4).unwrap();
        let y = randn(24, 8, DType::BF16);
        let e = gemm_acc(&y, &xa, &randn(4, 8, DType::BF16), 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`a` [24, 4]") && e.contains("[12, 1]"), "{e}");
        // c with columns not packed (a transposed view), and mixed operand types.
        let yt = randn(8, 24, DType::BF16).t().unwrap();
        let e = gemm_acc(
            &yt,
            &xa.contiguous().unwrap(),
            &randn(4, 8, DType::BF16),
            1.0,
        );
        assert!(e.unwrap_err().to_string().contains("`c` [24, 8]"));
        let e = gemm_acc(
            &y,
            &randn(24, 4, DType::F32),
            &randn(4, 8, DType::BF16),
            1.0,
        );
        assert!(e.unwrap_err().to_string().contains("one float type"));
    }
}
