//! A gated unit as one candle op, forward and backward: `h = T(T(act(g))·u)` and
//! `(dg, du)` as `super` states, for any [`Activation`].
//!
//! Here: [`fwd`], [`bwd`], each op's checks, its `cpu_fwd` (loops: `super::cpu`) and with the
//! `cuda` feature its `cuda_fwd` (`super::cuda`).

use std::marker::PhantomData;

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use super::{cpu, Activation};
use rtune_backend::storage::{by_dtype, check_shape, float_dtype, slice};

/// `T(T(act(g))·u)`, `g, u` of one shape.
pub fn fwd<A: Activation>(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    g.contiguous()?
        .apply_op2_no_bwd(&u.contiguous()?, &Fwd::<A>(PhantomData))
}

/// [`fwd`]'s `(dg, du)`, computed in f32 and rounded once. Both are views into one `(2, ...)`
/// buffer (contiguous, at offsets 0 and n).
pub fn bwd<A: Activation>(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = dh.contiguous()?.apply_op3_no_bwd(
        &g.contiguous()?,
        &u.contiguous()?,
        &Bwd::<A>(PhantomData),
    )?;
    Ok((both.get(0)?, both.get(1)?))
}

pub(crate) struct Fwd<A>(PhantomData<A>);

impl<A: Activation> Fwd<A> {
    pub(crate) fn check(&self, g: (DType, &Layout), u: (DType, &Layout)) -> Result<DType> {
        check_shape(A::NAME, "u", u.1, g.1.shape())?;
        float_dtype(A::NAME, &[("g", g.0), ("u", u.0)])
    }
}

impl<A: Activation> CustomOp2 for Fwd<A> {
    fn name(&self) -> &'static str {
        A::NAME
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
        let h = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::fwd::<A, T>(
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
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let dt = self.check((sg.dtype(), lg), (su.dtype(), lu))?;
        fn run<A: Activation, T: CudaDType + FusedFloat + DeviceRepr>(
            sg: &CudaStorage,
            lg: &Layout,
            su: &CudaStorage,
            lu: &Layout,
        ) -> Result<CudaStorage> {
            let dev = &sg.device;
            let n = lg.shape().elem_count();
            let mut h = output::<T>(dev, n)?;
            super::cuda::fwd::<T>(
                A::KERNELS,
                &stream(dev),
                &view::<T>(A::NAME, "g", sg, lg)?,
                &view::<T>(A::NAME, "u", su, lu)?,
                &mut h.as_view_mut(),
                n,
            )
            .map_err(kerr(A::NAME))?;
            Ok(CudaStorage::wrap_cuda_slice(h, dev.clone()))
        }
        let h = by_dtype!(dt, T => run::<A, T>(sg, lg, su, lu)?);
        Ok((h, lg.shape().clone()))
    }
}

pub(crate) struct Bwd<A>(PhantomData<A>);

impl<A: Activation> Bwd<A> {
    /// `(dtype, output shape (2, ...))`.
    pub(crate) fn check(
        &self,
        dh: (DType, &Layout),
        g: (DType, &Layout),
        u: (DType, &Layout),
    ) -> Result<(DType, Shape)> {
        let op = A::BWD_NAME;
        check_shape(op, "g", g.1, dh.1.shape())?;
        check_shape(op, "u", u.1, dh.1.shape())?;
        let dt = float_dtype(op, &[("dh", dh.0), ("g", g.0), ("u", u.0)])?;
        let mut dims = vec![2];
        dims.extend_from_slice(g.1.dims());
        Ok((dt, Shape::from(dims)))
    }
}

impl<A: Activation> CustomOp3 for Bwd<A> {
    fn name(&self) -> &'static str {
        A::BWD_NAME
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
        let out = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::bwd::<A, T>(
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
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let (dt, shape) = self.check((sdh.dtype(), ldh), (sg.dtype(), lg), (su.dtype(), lu))?;
        fn run<A: Activation, T: CudaDType + FusedFloat + DeviceRepr>(
            sdh: &CudaStorage,
            ldh: &Layout,
            sg: &CudaStorage,
            lg: &Layout,
            su: &CudaStorage,
            lu: &Layout,
        ) -> Result<CudaStorage> {
            let dev = &sg.device;
            let op = A::BWD_NAME;
            let n = lg.shape().elem_count();
            let mut out = output::<T>(dev, 2 * n)?; // (2, n): dg then du
            super::cuda::bwd::<T>(
                A::KERNELS,
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
        let out = by_dtype!(dt, T => run::<A, T>(sdh, ldh, sg, lg, su, lu)?);
        Ok((out, shape))
    }
}
