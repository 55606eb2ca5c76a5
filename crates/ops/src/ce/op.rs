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
//!
//! Soft-capped ([`ce_capped_fwd`], [`ce_capped_bwd`]: Gemma 2's final-logit cap fused in, the
//! capped logits formed in registers, never stored): CUDA only. The CPU runs the unfused chain,
//! `softcap_logits`, [`ce_fwd`], [`ce_bwd`], `softcap_logits_backward` (`crate::ce`); the fused
//! kernels' reference is `reference::ce_capped_{fwd,bwd}`, itself tested against that chain.

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
        .apply_op2_no_bwd(&targets.contiguous()?, &CeFwd { cap: None })
}

/// [`ce_fwd`] of the soft-capped logits `cap·tanh(logits/cap)` (as `softcap_logits` rounds
/// them), formed on the fly: CUDA only (see the module docs).
pub fn ce_capped_fwd(logits: &Tensor, targets: &Tensor, cap: f64) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &CeFwd { cap: Some(cap) })
}

/// [`ce_bwd`] through the soft cap: `d logits` for the uncapped `logits`, from
/// [`ce_capped_fwd`]'s `lse`: CUDA only.
pub fn ce_capped_bwd(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    scale: f64,
    cap: f64,
) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(
        &targets.contiguous()?,
        &lse.contiguous()?,
        &CeBwd {
            scale: scale as f32,
            cap: Some(cap),
        },
    )
}

/// The CPU's refusal of the fused soft cap (the CPU runs the unfused chain).
fn cpu_capped(op: &str) -> Result<()> {
    bail!(
        "{op}: the soft-capped cross-entropy is fused on CUDA only; on the CPU `crate::ce` runs \
         softcap_logits, then ce_fwd / ce_bwd, then softcap_logits_backward"
    )
}

/// `dlogits = (softmax(logits) − onehot(targets))·scale` in the logits' dtype, from
/// `lse: (n)` f32 ([`ce_fwd`]'s first column).
pub fn ce_bwd(logits: &Tensor, targets: &Tensor, lse: &Tensor, scale: f64) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(
        &targets.contiguous()?,
        &lse.contiguous()?,
        &CeBwd {
            scale: scale as f32,
            cap: None,
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

/// `cap`: the soft cap fused in (CUDA only).
pub(crate) struct CeFwd {
    pub(crate) cap: Option<f64>,
}

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
        match self.cap {
            None => "ce_fwd",
            Some(_) => "ce_capped_fwd",
        }
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
        if self.cap.is_some() {
            cpu_capped(op)?;
        }
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
            cap: Option<f64>,
        ) -> Result<CudaStorage> {
            let dev = &sl.device;
            let op = if cap.is_some() {
                "ce_capped_fwd"
            } else {
                "ce_fwd"
            };
            let mut out = output::<f32>(dev, 2 * n)?; // (n, 2): [lse, loss]
            let (s, logits) = (stream(dev), view::<T>(op, "logits", sl, ll)?);
            let targets = view::<u32>(op, "targets", st, lt)?;
            let o = &mut out.as_view_mut();
            match cap {
                None => k::ce_fwd::<T>(&s, &logits, &targets, o, n, v),
                Some(c) => k::ce_capped_fwd::<T>(&s, &logits, &targets, o, (n, v), c),
            }
            .map_err(kerr(op))?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let out = by_dtype!(dt, T => run::<T>(sl, ll, st, lt, (n, v), self.cap)?);
        Ok((out, Shape::from((n, 2))))
    }
}

/// `cap`: the soft cap fused in (CUDA only).
pub(crate) struct CeBwd {
    pub(crate) scale: f32,
    pub(crate) cap: Option<f64>,
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
        match self.cap {
            None => "ce_bwd",
            Some(_) => "ce_capped_bwd",
        }
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
        if self.cap.is_some() {
            cpu_capped(op)?;
        }
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
            (scale, cap): (f32, Option<f64>),
            (n, v): (usize, usize),
        ) -> Result<CudaStorage> {
            let dev = &sl.device;
            let op = if cap.is_some() {
                "ce_capped_bwd"
            } else {
                "ce_bwd"
            };
            let mut d = output::<T>(dev, n * v)?;
            let (s, logits) = (stream(dev), view::<T>(op, "logits", sl, ll)?);
            let targets = view::<u32>(op, "targets", st, lt)?;
            let lse = view::<f32>(op, "lse", slse, llse)?;
            let dv = &mut d.as_view_mut();
            match cap {
                None => k::ce_bwd::<T>(&s, &logits, &targets, &lse, scale, dv, n, v),
                Some(c) => k::ce_capped_bwd::<T>(&s, &logits, &targets, &lse, scale, dv, (n, v), c),
            }
            .map_err(kerr(op))?;
            Ok(CudaStorage::wrap_cuda_slice(d, dev.clone()))
        }
        let sc = (self.scale, self.cap);
        let d = by_dtype!(dt, T => run::<T>(sl, ll, st, lt, slse, llse, sc, (n, v))?);
        Ok((d, ll.shape().clone()))
    }
}
