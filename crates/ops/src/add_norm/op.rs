//! The fused residual add + RMSNorm as candle ops: [`add_rms_norm`] (`x, res, w` → `h` and `y`
//! in one `(2, rows·dim)` buffer) and [`add_rms_norm_bwd`] (`dy, h, dres` → `dh = dres +
//! norm_bwd(dy)`, out of place: `dres` is the caller's gradient and stays as it is).
//!
//! `cuda_fwd` launches `kernels/add_norm.cuh` (`super::cuda`); `cpu_fwd` runs the slice reference
//! (`super::reference`, the formulation the kernels are checked against), so the CPU can run the
//! fused path's plumbing — what goes in, what comes out, which buffer is accumulated — when a test
//! forces it ([`crate::fused::forced`]). Left alone, the CPU runs `add` then `norm` (`super`).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};

use super::reference::{self, Weight};
use rtune_backend::storage::{by_dtype, check_shape, float_dtype, slice};
use rtune_backend::Precision;

/// `h = T(x + res)` and `y = norm(h)` with weight `w: (D)` (of `x`'s type, or f32 for
/// [`Weight::F32`]): `x, res: (..., D)` → `(h, y)`, each shaped like `x`.
pub fn add_rms_norm(
    x: &Tensor,
    res: &Tensor,
    w: &Tensor,
    eps: f64,
    weight: Weight,
) -> Result<(Tensor, Tensor)> {
    let both = x.contiguous()?.apply_op3_no_bwd(
        &res.contiguous()?,
        &w.contiguous()?,
        &AddRmsNorm { eps, weight },
    )?;
    // (2, n): rows of h then rows of y, each a contiguous view.
    Ok((
        both.get(0)?.reshape(x.shape())?,
        both.get(1)?.reshape(x.shape())?,
    ))
}

/// `dh = T(dres + norm_bwd(dy))`, the norm's backward with weight `w` at its input `h`: `dy, h,
/// dres: (..., D)` → `(..., D)`.
pub fn add_rms_norm_bwd(
    dy: &Tensor,
    h: &Tensor,
    dres: &Tensor,
    w: &Tensor,
    eps: f64,
    weight: Weight,
) -> Result<Tensor> {
    dy.contiguous()?.apply_op3_no_bwd(
        &h.contiguous()?,
        &dres.contiguous()?,
        &AddRmsNormBwd {
            eps,
            weight,
            w: w.contiguous()?,
        },
    )
}

fn precision(dt: DType) -> Precision {
    match dt {
        DType::BF16 => Precision::Bf16,
        DType::F16 => Precision::F16,
        _ => Precision::F32,
    }
}

/// `(rows, dim, dtype)` of two `(..., D)` tensors of one float type against `w: (D)` of that type
/// or f32 (as `weight` says).
fn dims(
    op: &str,
    (a, b): ((&str, DType, &Layout), (&str, DType, &Layout)),
    (wdt, wl): (DType, &Layout),
    weight: Weight,
) -> Result<(usize, usize, DType)> {
    let dt = float_dtype(op, &[(a.0, a.1), (b.0, b.1)])?;
    check_shape(op, b.0, b.2, a.2.shape())?;
    let want = match weight {
        Weight::Typed => dt,
        Weight::F32 => DType::F32,
    };
    if wdt != want {
        bail!("{op}: the norm weight `w` is {wdt:?}; a {weight:?} weight for {dt:?} inputs must be {want:?}");
    }
    let d = a.2.dims().last().copied().unwrap_or(1);
    check_shape(op, "w", wl, &Shape::from(d))?;
    Ok((a.2.shape().elem_count() / d.max(1), d, dt))
}

/// The elements of a contiguous `T` tensor as f32.
fn f32s<T: WithDType>(op: &str, what: &str, s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    Ok(slice::<T>(op, what, s, l)?
        .iter()
        .map(|v| v.to_f64() as f32)
        .collect())
}

/// The norm weight as f32 (of the inputs' type `T`, or f32).
fn weight_f32<T: WithDType>(
    op: &str,
    s: &CpuStorage,
    l: &Layout,
    weight: Weight,
) -> Result<Vec<f32>> {
    match weight {
        Weight::Typed => f32s::<T>(op, "w", s, l),
        Weight::F32 => f32s::<f32>(op, "w", s, l),
    }
}

fn from_f32s<T: WithDType>(v: Vec<f32>) -> CpuStorage {
    T::to_cpu_storage_owned(v.into_iter().map(|x| T::from_f64(x as f64)).collect())
}

struct AddRmsNorm {
    eps: f64,
    weight: Weight,
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add_rms_norm"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sr: &CpuStorage,
        lr: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let ins = (("x", sx.dtype(), lx), ("res", sr.dtype(), lr));
        let (rows, dim, dt) = dims(op, ins, (sw.dtype(), lw), self.weight)?;
        let out = by_dtype!(dt, T => {
            let (h, y) = reference::add_rms_norm_fwd(
                &f32s::<T>(op, "x", sx, lx)?,
                &f32s::<T>(op, "res", sr, lr)?,
                &weight_f32::<T>(op, sw, lw, self.weight)?,
                (rows, dim),
                self.eps as f32,
                precision(dt),
                self.weight,
            );
            from_f32s::<T>([h, y].concat())
        });
        Ok((out, Shape::from((2, rows * dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sr: &candle_core::CudaStorage,
        lr: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let op = self.name();
        let ins = (("x", sx.dtype(), lx), ("res", sr.dtype(), lr));
        let (rows, dim, dt) = dims(op, ins, (sw.dtype(), lw), self.weight)?;
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            (sx, lx, sr, lr, sw, lw): (
                &CudaStorage,
                &Layout,
                &CudaStorage,
                &Layout,
                &CudaStorage,
                &Layout,
            ),
            (rows, dim, eps): (usize, usize, f32),
            weight: Weight,
        ) -> Result<CudaStorage> {
            const OP: &str = "add_rms_norm";
            let dev = &sx.device;
            let n = rows * dim;
            let mut out = output::<T>(dev, 2 * n)?;
            let (mut h, mut y) = out.split_at_mut(n);
            let (x, res) = (view::<T>(OP, "x", sx, lx)?, view::<T>(OP, "res", sr, lr)?);
            let st = stream(dev);
            match weight {
                Weight::Typed => {
                    let w = view::<T>(OP, "w", sw, lw)?;
                    k::add_rms_norm_fwd::<T>(&st, &x, &res, &w, &mut h, &mut y, (rows, dim), eps)
                }
                Weight::F32 => {
                    let w = view::<f32>(OP, "w", sw, lw)?;
                    k::add_rms_norm1_fwd::<T>(&st, &x, &res, &w, &mut h, &mut y, (rows, dim), eps)
                }
            }
            .map_err(kerr(OP))?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let args = (sx, lx, sr, lr, sw, lw);
        let dims = (rows, dim, self.eps as f32);
        let out = by_dtype!(dt, T => run::<T>(args, dims, self.weight)?);
        Ok((out, Shape::from((2, rows * dim))))
    }
}

struct AddRmsNormBwd {
    eps: f64,
    weight: Weight,
    /// The norm's weight `(D)`: held here, the op's three inputs being `dy, h, dres`.
    w: Tensor,
}

impl CustomOp3 for AddRmsNormBwd {
    fn name(&self) -> &'static str {
        "add_rms_norm_bwd"
    }

    fn cpu_fwd(
        &self,
        sdy: &CpuStorage,
        ldy: &Layout,
        sh: &CpuStorage,
        lh: &Layout,
        sr: &CpuStorage,
        lr: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (sw, lw) = self.w.storage_and_layout();
        let candle_core::Storage::Cpu(sw) = &*sw else {
            bail!(
                "{op}: the norm weight is on {:?}, dy on the CPU",
                self.w.device()
            );
        };
        let ins = (("dy", sdy.dtype(), ldy), ("h", sh.dtype(), lh));
        let (rows, dim, dt) = dims(op, ins, (sw.dtype(), lw), self.weight)?;
        check_shape(op, "dres", lr, ldy.shape())?;
        if sr.dtype() != dt {
            bail!("{op}: dres is {:?}, dy {dt:?}", sr.dtype());
        }
        let out = by_dtype!(dt, T => from_f32s::<T>(reference::add_rms_norm_bwd(
            &f32s::<T>(op, "dy", sdy, ldy)?,
            &f32s::<T>(op, "h", sh, lh)?,
            &weight_f32::<T>(op, sw, lw, self.weight)?,
            &f32s::<T>(op, "dres", sr, lr)?,
            (rows, dim),
            self.eps as f32,
            precision(dt),
            self.weight,
        )));
        Ok((out, ldy.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sdy: &candle_core::CudaStorage,
        ldy: &Layout,
        sh: &candle_core::CudaStorage,
        lh: &Layout,
        sr: &candle_core::CudaStorage,
        lr: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let op = self.name();
        let (sw, lw) = self.w.storage_and_layout();
        let candle_core::Storage::Cuda(sw) = &*sw else {
            bail!(
                "{op}: the norm weight is on {:?}, dy on a GPU",
                self.w.device()
            );
        };
        let ins = (("dy", sdy.dtype(), ldy), ("h", sh.dtype(), lh));
        let (rows, dim, dt) = dims(op, ins, (sw.dtype(), lw), self.weight)?;
        check_shape(op, "dres", lr, ldy.shape())?;
        if sr.dtype() != dt {
            bail!("{op}: dres is {:?}, dy {dt:?}", sr.dtype());
        }
        #[allow(clippy::type_complexity)]
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            (sdy, ldy, sh, lh, sr, lr, sw, lw): (
                &CudaStorage,
                &Layout,
                &CudaStorage,
                &Layout,
                &CudaStorage,
                &Layout,
                &CudaStorage,
                &Layout,
            ),
            (rows, dim, eps): (usize, usize, f32),
            weight: Weight,
        ) -> Result<CudaStorage> {
            const OP: &str = "add_rms_norm_bwd";
            let dev = &sdy.device;
            let mut dh = output::<T>(dev, rows * dim)?;
            let (dy, h) = (view::<T>(OP, "dy", sdy, ldy)?, view::<T>(OP, "h", sh, lh)?);
            let dres = view::<T>(OP, "dres", sr, lr)?;
            let st = stream(dev);
            let shape = (rows, dim);
            match weight {
                Weight::Typed => {
                    let w = view::<T>(OP, "w", sw, lw)?;
                    k::add_rms_norm_bwd_out(
                        &st,
                        &dy,
                        &h,
                        &w,
                        &dres,
                        &mut dh.as_view_mut(),
                        shape,
                        eps,
                    )
                }
                Weight::F32 => {
                    let w = view::<f32>(OP, "w", sw, lw)?;
                    k::add_rms_norm_bwd_out(
                        &st,
                        &dy,
                        &h,
                        &w,
                        &dres,
                        &mut dh.as_view_mut(),
                        shape,
                        eps,
                    )
                }
            }
            .map_err(kerr(OP))?;
            Ok(CudaStorage::wrap_cuda_slice(dh, dev.clone()))
        }
        let args = (sdy, ldy, sh, lh, sr, lr, sw, lw);
        let dims = (rows, dim, self.eps as f32);
        let dh = by_dtype!(dt, T => run::<T>(args, dims, self.weight)?);
        Ok((dh, ldy.shape().clone()))
    }
}
