//! RMSNorm as one op, forward and backward (transformers' `LlamaRMSNorm`):
//! `y = T(T(x·r)·w)` with `r = 1/sqrt(mean(x²) + eps)` per row in f32, and
//! `dx = r·g − (x·r³)·mean(g·x)` with `g = T(dy·w)`, `r` recomputed from `x`.
//!
//! Here: the functions the model calls ([`rms_norm`], [`rms_norm_bwd`]), each op's checks, its
//! `cpu_fwd` (the row loops are `cpu::rms_norm*`) and with the `cuda` feature its `cuda_fwd`
//! (`super::cuda::rms_norm_*`, `kernels/fused.cu`). The plain reference is
//! [`crate::norm::rms_norm_reference`] / [`crate::norm::rms_norm_backward_reference`].

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use super::cpu;
use rtune_backend::storage::{by_dtype, check_shape, float_dtype, slice};

/// `x: (..., D)`, `w: (D)` → `T(T(x·r)·w)` with `r = 1/sqrt(mean(x²) + eps)` per row, in f32
/// (transformers' `LlamaRMSNorm`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &RmsNorm { eps })
}

/// [`rms_norm`]'s `dx = r·g − (x·r³)·mean(g·x)` with `g = T(dy·w)`, `r` recomputed from `x`.
/// `dy, x: (..., D)`, `w: (D)`.
pub fn rms_norm_bwd(dy: &Tensor, x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    dy.contiguous()?
        .apply_op3_no_bwd(&x.contiguous()?, &w.contiguous()?, &RmsNormBwd { eps })
}

/// `(rows, D)` of RMSNorm's `x: (..., D)` against `w: (D)`.
fn norm_dims(op: &str, x: &Layout, w: &Layout) -> Result<(usize, usize)> {
    let d = x.dims().last().copied().unwrap_or(1);
    check_shape(op, "w", w, &Shape::from(d))?;
    Ok((x.shape().elem_count() / d.max(1), d))
}

pub(crate) struct RmsNorm {
    pub(crate) eps: f64,
}

impl RmsNorm {
    /// `(rows, D, dtype)`.
    pub(crate) fn check(
        &self,
        x: (DType, &Layout),
        w: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let dt = float_dtype("rms_norm", &[("x", x.0), ("w", w.0)])?;
        let (n, d) = norm_dims("rms_norm", x.1, w.1)?;
        Ok((n, d, dt))
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, dt) = self.check((sx.dtype(), lx), (sw.dtype(), lw))?;
        let n = self.name();
        let y = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::rms_norm::<T>(
            slice(n, "x", sx, lx)?,
            slice(n, "w", sw, lw)?,
            self.eps as f32,
        )));
        Ok((y, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let (rows, dim, dt) = self.check((sx.dtype(), lx), (sw.dtype(), lw))?;
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            sx: &CudaStorage,
            lx: &Layout,
            sw: &CudaStorage,
            lw: &Layout,
            (rows, dim, eps): (usize, usize, f32),
        ) -> Result<CudaStorage> {
            let dev = &sx.device;
            let mut y = output::<T>(dev, rows * dim)?;
            k::rms_norm_fwd::<T>(
                &stream(dev),
                &view::<T>("rms_norm", "x", sx, lx)?,
                &view::<T>("rms_norm", "w", sw, lw)?,
                &mut y.as_view_mut(),
                rows,
                dim,
                eps,
            )
            .map_err(kerr("rms_norm"))?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
        }
        let dims = (rows, dim, self.eps as f32);
        let y = by_dtype!(dt, T => run::<T>(sx, lx, sw, lw, dims)?);
        Ok((y, lx.shape().clone()))
    }
}

pub(crate) struct RmsNormBwd {
    pub(crate) eps: f64,
}

impl RmsNormBwd {
    /// `(rows, D, dtype)`.
    pub(crate) fn check(
        &self,
        dy: (DType, &Layout),
        x: (DType, &Layout),
        w: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let op = "rms_norm_bwd";
        let dt = float_dtype(op, &[("dy", dy.0), ("x", x.0), ("w", w.0)])?;
        check_shape(op, "x", x.1, dy.1.shape())?;
        let (n, d) = norm_dims(op, x.1, w.1)?;
        Ok((n, d, dt))
    }
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rms_norm_bwd"
    }

    fn cpu_fwd(
        &self,
        sdy: &CpuStorage,
        ldy: &Layout,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, dt) = self.check((sdy.dtype(), ldy), (sx.dtype(), lx), (sw.dtype(), lw))?;
        let n = self.name();
        let dx = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::rms_norm_bwd::<T>(
            slice(n, "dy", sdy, ldy)?,
            slice(n, "x", sx, lx)?,
            slice(n, "w", sw, lw)?,
            self.eps as f32,
        )));
        Ok((dx, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sdy: &candle_core::CudaStorage,
        ldy: &Layout,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let (rows, dim, dt) = self.check((sdy.dtype(), ldy), (sx.dtype(), lx), (sw.dtype(), lw))?;
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            sdy: &CudaStorage,
            ldy: &Layout,
            sx: &CudaStorage,
            lx: &Layout,
            sw: &CudaStorage,
            lw: &Layout,
            (rows, dim, eps): (usize, usize, f32),
        ) -> Result<CudaStorage> {
            let dev = &sx.device;
            let op = "rms_norm_bwd";
            let mut dx = output::<T>(dev, rows * dim)?;
            k::rms_norm_bwd::<T>(
                &stream(dev),
                &view::<T>(op, "dy", sdy, ldy)?,
                &view::<T>(op, "x", sx, lx)?,
                &view::<T>(op, "w", sw, lw)?,
                &mut dx.as_view_mut(),
                rows,
                dim,
                eps,
            )
            .map_err(kerr(op))?;
            Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
        }
        let dims = (rows, dim, self.eps as f32);
        let dx = by_dtype!(dt, T => run::<T>(sdy, ldy, sx, lx, sw, lw, dims)?);
        Ok((dx, lx.shape().clone()))
    }
}
