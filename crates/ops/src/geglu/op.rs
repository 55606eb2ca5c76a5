//! GeGLU as one op, forward and backward: `h = T(T(gelu_tanh(g))·u)` (the gate in f32, rounded once,
//! as torch's `gelu_pytorch_tanh(gate) * up`), and `dg = T(dh·u·gelu_tanh'(g))`, `du = T(dh·T(gelu_tanh(g)))`
//! (see `super` for the formulas).
//!
//! Here: [`geglu`], [`geglu_bwd`], each op's checks, its `cpu_fwd` (loops: `cpu::geglu*`) and
//! with the `cuda` feature its `cuda_fwd` (`super::cuda::geglu_*`). The plain reference
//! is [`crate::geglu::reference::geglu_chain`] / [`crate::geglu::reference::geglu_backward_chain`].

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use super::cpu;
use rtune_backend::storage::{by_dtype, check_shape, float_dtype, slice};

/// GeGLU `T(T(gelu_tanh(g))·u)`, `g, u` of one shape.
pub fn geglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    g.contiguous()?.apply_op2_no_bwd(&u.contiguous()?, &Geglu)
}

/// [`geglu`]'s `(dg, du)`: `dg = dh·u·gelu_tanh'(g)`, `du = dh·gelu_tanh(g)`, computed in f32 and rounded
/// once. Both are views into one `(2, ...)` buffer (contiguous, at offsets 0 and n).
pub fn geglu_bwd(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = dh
        .contiguous()?
        .apply_op3_no_bwd(&g.contiguous()?, &u.contiguous()?, &GegluBwd)?;
    Ok((both.get(0)?, both.get(1)?))
}

pub(crate) struct Geglu;

impl Geglu {
    pub(crate) fn check(&self, g: (DType, &Layout), u: (DType, &Layout)) -> Result<DType> {
        check_shape("geglu", "u", u.1, g.1.shape())?;
        float_dtype("geglu", &[("g", g.0), ("u", u.0)])
    }
}

impl CustomOp2 for Geglu {
    fn name(&self) -> &'static str {
        "geglu"
    }

    fn cpu_fwd(
        &self,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dt = self.check((sg.dtype(), lg), (su.dtype(), lu))?;
        let n = self.name();
        let h = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::geglu::<T>(
            slice(n, "g", sg, lg)?,
            slice(n, "u", su, lu)?,
        )));
        Ok((h, lg.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
        su: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let dt = self.check((sg.dtype(), lg), (su.dtype(), lu))?;
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            sg: &CudaStorage,
            lg: &Layout,
            su: &CudaStorage,
            lu: &Layout,
        ) -> Result<CudaStorage> {
            let dev = &sg.device;
            let n = lg.shape().elem_count();
            let mut h = output::<T>(dev, n)?;
            k::geglu_fwd::<T>(
                &stream(dev),
                &view::<T>("geglu", "g", sg, lg)?,
                &view::<T>("geglu", "u", su, lu)?,
                &mut h.as_view_mut(),
                n,
            )
            .map_err(kerr("geglu"))?;
            Ok(CudaStorage::wrap_cuda_slice(h, dev.clone()))
        }
        let h = by_dtype!(dt, T => run::<T>(sg, lg, su, lu)?);
        Ok((h, lg.shape().clone()))
    }
}

pub(crate) struct GegluBwd;

impl GegluBwd {
    /// `(dtype, output shape (2, ...))`.
    pub(crate) fn check(
        &self,
        dh: (DType, &Layout),
        g: (DType, &Layout),
        u: (DType, &Layout),
    ) -> Result<(DType, Shape)> {
        let op = "geglu_bwd";
        check_shape(op, "g", g.1, dh.1.shape())?;
        check_shape(op, "u", u.1, dh.1.shape())?;
        let dt = float_dtype(op, &[("dh", dh.0), ("g", g.0), ("u", u.0)])?;
        let mut dims = vec![2];
        dims.extend_from_slice(g.1.dims());
        Ok((dt, Shape::from(dims)))
    }
}

impl CustomOp3 for GegluBwd {
    fn name(&self) -> &'static str {
        "geglu_bwd"
    }

    fn cpu_fwd(
        &self,
        sdh: &CpuStorage,
        ldh: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (dt, shape) = self.check((sdh.dtype(), ldh), (sg.dtype(), lg), (su.dtype(), lu))?;
        let n = self.name();
        let out = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::geglu_bwd::<T>(
            slice(n, "dh", sdh, ldh)?,
            slice(n, "g", sg, lg)?,
            slice(n, "u", su, lu)?,
        )));
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sdh: &candle_core::CudaStorage,
        ldh: &Layout,
        sg: &candle_core::CudaStorage,
        lg: &Layout,
        su: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let (dt, shape) = self.check((sdh.dtype(), ldh), (sg.dtype(), lg), (su.dtype(), lu))?;
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            sdh: &CudaStorage,
            ldh: &Layout,
            sg: &CudaStorage,
            lg: &Layout,
            su: &CudaStorage,
            lu: &Layout,
        ) -> Result<CudaStorage> {
            let dev = &sg.device;
            let op = "geglu_bwd";
            let n = lg.shape().elem_count();
            let mut out = output::<T>(dev, 2 * n)?; // (2, n): dg then du
            k::geglu_bwd::<T>(
                &stream(dev),
                &view::<T>(op, "dh", sdh, ldh)?,
                &view::<T>(op, "g", sg, lg)?,
                &view::<T>(op, "u", su, lu)?,
                &mut out.as_view_mut(),
                n,
            )
            .map_err(kerr(op))?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let out = by_dtype!(dt, T => run::<T>(sdh, ldh, sg, lg, su, lu)?);
        Ok((out, shape))
    }
}
