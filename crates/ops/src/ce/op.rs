//! The cross-entropy of a chunk of rows as one op, forward and backward (the chunked loss of
//! [`crate::ce::chunked_cross_entropy`] runs it on `(chunk, V)` logits at a time):
//! forward `[lse, lse − logit[target]]` per row with `lse = max + ln Σ exp(logit − max)` (the
//! second column is the row's loss), backward `dlogits = (softmax(logits) − onehot(target))·scale`
//! from the forward's `lse`.
//!
//! Here: [`ce_fwd`], [`ce_bwd`], the checks, `cpu_fwd` (loops: `cpu::ce_*`) and with the `cuda`
//! feature `cuda_fwd` (`super::cuda::ce_*`). The plain reference is
//! [`crate::ce::cross_entropy_reference`] / [`crate::ce::cross_entropy_grad_reference`].
//!
//! On CUDA the targets are not checked against V on the host (that would copy them back): the
//! kernels give NaN loss and no one-hot for a target `>= V`. The CPU path refuses such a target.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

use super::cpu;
use rtune_backend::storage::{by_dtype, check_shape, float_dtype, slice};

/// Cross-entropy statistics of `logits: (n, V)` against `targets: (n)` u32: `(n, 2)` f32
/// `[lse, lse − logit[target]]` (the second column is each row's loss).
pub fn ce_fwd(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &CeFwd)
}

/// `dlogits = (softmax(logits) − onehot(targets))·scale` in the logits' dtype, from
/// `lse: (n)` f32 ([`ce_fwd`]'s first column).
pub fn ce_bwd(logits: &Tensor, targets: &Tensor, lse: &Tensor, scale: f64) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(
        &targets.contiguous()?,
        &lse.contiguous()?,
        &CeBwd {
            scale: scale as f32,
        },
    )
}

/// `(n, V)` of the cross-entropy's `logits: (n, V)` against `targets: (n)` u32.
fn ce_dims(op: &str, logits: &Layout, tgt: &Layout, dt: DType) -> Result<(usize, usize)> {
    let &[n, v] = logits.dims() else {
        bail!("{op}: `logits` must be (n, V), got {:?}", logits.dims());
    };
    if v == 0 {
        bail!("{op}: vocabulary of 0");
    }
    check_shape(op, "targets", tgt, &Shape::from(n))?;
    if dt != DType::U32 {
        bail!("{op}: `targets` must be u32, got {dt:?}");
    }
    Ok((n, v))
}

/// Every target `< v`, else an error naming the row (the kernels index by it).
fn check_targets(op: &str, targets: &[u32], v: usize) -> Result<()> {
    match targets.iter().position(|&t| t as usize >= v) {
        Some(i) => bail!(
            "{op}: target {} of row {i} is outside the vocabulary of {v}",
            targets[i]
        ),
        None => Ok(()),
    }
}

pub(crate) struct CeFwd;

impl CeFwd {
    /// `(n, V, logits dtype)`.
    pub(crate) fn check(
        &self,
        l: (DType, &Layout),
        t: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let dt = float_dtype("ce_fwd", &[("logits", l.0)])?;
        let (n, v) = ce_dims("ce_fwd", l.1, t.1, t.0)?;
        Ok((n, v, dt))
    }
}

impl CustomOp2 for CeFwd {
    fn name(&self) -> &'static str {
        "ce_fwd"
    }

    fn cpu_fwd(
        &self,
        sl: &CpuStorage,
        ll: &Layout,
        st: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v, dt) = self.check((sl.dtype(), ll), (st.dtype(), lt))?;
        let op = self.name();
        let targets = slice::<u32>(op, "targets", st, lt)?;
        check_targets(op, targets, v)?;
        let out = by_dtype!(dt, T => cpu::ce_fwd::<T>(slice(op, "logits", sl, ll)?, targets, v));
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sl: &candle_core::CudaStorage,
        ll: &Layout,
        st: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let (n, v, dt) = self.check((sl.dtype(), ll), (st.dtype(), lt))?;
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            sl: &CudaStorage,
            ll: &Layout,
            st: &CudaStorage,
            lt: &Layout,
            (n, v): (usize, usize),
        ) -> Result<CudaStorage> {
            let dev = &sl.device;
            let mut out = output::<f32>(dev, 2 * n)?; // (n, 2): [lse, loss]
            k::ce_fwd::<T>(
                &stream(dev),
                &view::<T>("ce_fwd", "logits", sl, ll)?,
                &view::<u32>("ce_fwd", "targets", st, lt)?,
                &mut out.as_view_mut(),
                n,
                v,
            )
            .map_err(kerr("ce_fwd"))?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let out = by_dtype!(dt, T => run::<T>(sl, ll, st, lt, (n, v))?);
        Ok((out, Shape::from((n, 2))))
    }
}

pub(crate) struct CeBwd {
    pub(crate) scale: f32,
}

impl CeBwd {
    /// `(n, V, logits dtype)`.
    pub(crate) fn check(
        &self,
        l: (DType, &Layout),
        t: (DType, &Layout),
        lse: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let op = "ce_bwd";
        let dt = float_dtype(op, &[("logits", l.0)])?;
        let (n, v) = ce_dims(op, l.1, t.1, t.0)?;
        check_shape(op, "lse", lse.1, &Shape::from(n))?;
        if lse.0 != DType::F32 {
            bail!("{op}: `lse` must be f32, got {:?}", lse.0);
        }
        Ok((n, v, dt))
    }
}

impl CustomOp3 for CeBwd {
    fn name(&self) -> &'static str {
        "ce_bwd"
    }

    fn cpu_fwd(
        &self,
        sl: &CpuStorage,
        ll: &Layout,
        st: &CpuStorage,
        lt: &Layout,
        slse: &CpuStorage,
        llse: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, v, dt) = self.check((sl.dtype(), ll), (st.dtype(), lt), (slse.dtype(), llse))?;
        let op = self.name();
        let targets = slice::<u32>(op, "targets", st, lt)?;
        check_targets(op, targets, v)?;
        let lse = slice::<f32>(op, "lse", slse, llse)?;
        let d = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::ce_bwd::<T>(
            slice(op, "logits", sl, ll)?,
            targets,
            lse,
            self.scale,
            v,
        )));
        Ok((d, ll.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sl: &candle_core::CudaStorage,
        ll: &Layout,
        st: &candle_core::CudaStorage,
        lt: &Layout,
        slse: &candle_core::CudaStorage,
        llse: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let (n, v, dt) = self.check((sl.dtype(), ll), (st.dtype(), lt), (slse.dtype(), llse))?;
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            sl: &CudaStorage,
            ll: &Layout,
            st: &CudaStorage,
            lt: &Layout,
            slse: &CudaStorage,
            llse: &Layout,
            scale: f32,
            (n, v): (usize, usize),
        ) -> Result<CudaStorage> {
            let dev = &sl.device;
            let op = "ce_bwd";
            let mut d = output::<T>(dev, n * v)?;
            k::ce_bwd::<T>(
                &stream(dev),
                &view::<T>(op, "logits", sl, ll)?,
                &view::<u32>(op, "targets", st, lt)?,
                &view::<f32>(op, "lse", slse, llse)?,
                scale,
                &mut d.as_view_mut(),
                n,
                v,
            )
            .map_err(kerr(op))?;
            Ok(CudaStorage::wrap_cuda_slice(d, dev.clone()))
        }
        let d = by_dtype!(dt, T => run::<T>(sl, ll, st, lt, slse, llse, self.scale, (n, v))?);
        Ok((d, ll.shape().clone()))
    }
}
