//! The attention softmax as one op, forward and backward, one batch row of
//! [`crate::attention::attention`] at a time: `p = softmax(f32(scores·scale) + mask)` over the last dim
//! (f32 probabilities whatever the scores' dtype), and `ds = (p·(dp − Σ_row dp·p))·scale`.
//!
//! Here: [`attn_softmax`], [`attn_softmax_bwd`], the checks, `cpu_fwd` (loops:
//! `cpu::softmax_rows`, `cpu::softmax_bwd_rows`) and with the `cuda` feature `cuda_fwd`
//! (`kernels/attn.cu` through `super::softmax_cuda`, same semantics, restated in
//! `super::reference`). The plain chain they replace — scale, cast to f32, add the mask,
//! max, subtract, exp, sum, divide; and `p·(dp − Σ dp·p)·scale` — stays in `reference.rs` as
//! [`crate::attention::attention_probs_reference`] / [`crate::attention::attention_grad_reference`].

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

use super::cpu;
use rtune_backend::storage::{by_dtype, float_dtype, slice};

/// `p = softmax(f32(scores·scale) + mask)` over the last dim, f32. `scores: (..., G·Tq, Tk)` f32,
/// bf16 or f16 (the product `scores·scale` rounds to that type, as candle's `scores * scale`);
/// `mask: (Tq, Tk)` additive f32 (any leading dims of 1, e.g. `(1, 1, 1, Tq, Tk)`), row `r` of the
/// scores taking mask row `r % Tq`.
pub fn attn_softmax(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    scores
        .contiguous()?
        .apply_op2_no_bwd(&mask.contiguous()?, &AttnSoftmax { scale })
}

/// [`attn_softmax`]'s backward: `ds = (p·(dp − Σ_row dp·p))·scale` in `dp`'s dtype; `p` f32,
/// `dp` of `p`'s shape (f32, bf16 or f16).
pub fn attn_softmax_bwd(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    p.contiguous()?
        .apply_op2_no_bwd(&dp.contiguous()?, &AttnSoftmaxBwd { scale })
}

/// Rows and row length of `(..., T)`.
fn rows(l: &Layout) -> (usize, usize) {
    let t = l.dims().last().copied().unwrap_or(1);
    (l.shape().elem_count() / t.max(1), t)
}

pub(crate) struct AttnSoftmax {
    pub(crate) scale: f64,
}

impl AttnSoftmax {
    /// `(rows, Tk, mask rows, dtype of the scores)`.
    pub(crate) fn check(
        &self,
        scores: (DType, &Layout),
        mask: (DType, &Layout),
    ) -> Result<(usize, usize, usize, DType)> {
        let op = self.name();
        let (ls, lm) = (scores.1, mask.1);
        let dt = float_dtype(op, &[("scores", scores.0)])?;
        if mask.0 != DType::F32 {
            bail!("{op}: `mask` must be f32, got {:?}", mask.0);
        }
        // The mask's rows repeat down the scores' second-to-last dim (the G query heads of a kv
        // head are stacked there: G·Tq rows).
        let (n, tk) = rows(ls);
        let (mrows, mk) = rows(lm);
        let stacked = ls.dims().iter().rev().nth(1).copied().unwrap_or(1);
        if mk != tk || mrows == 0 || stacked % mrows != 0 {
            bail!(
                "{op}: `mask` {:?} does not fit scores {:?} \
                 (want (Tq, {tk}) with Tq dividing {stacked})",
                lm.dims(),
                ls.dims()
            );
        }
        Ok((n, tk, mrows, dt))
    }
}

impl CustomOp2 for AttnSoftmax {
    fn name(&self) -> &'static str {
        "attn_softmax"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        ls: &Layout,
        sm: &CpuStorage,
        lm: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, tk, _, dt) = self.check((ss.dtype(), ls), (sm.dtype(), lm))?;
        let mask = slice::<f32>(op, "mask", sm, lm)?;
        let p = by_dtype!(dt, T => cpu::softmax_rows::<T>(
            slice(op, "scores", ss, ls)?,
            mask,
            tk,
            self.scale as f32,
        ));
        Ok((CpuStorage::F32(p), ls.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ss: &candle_core::CudaStorage,
        ls: &Layout,
        sm: &candle_core::CudaStorage,
        lm: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::softmax_cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let (rows, t, mrows, dt) = self.check((ss.dtype(), ls), (sm.dtype(), lm))?;
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            ss: &CudaStorage,
            ls: &Layout,
            sm: &CudaStorage,
            lm: &Layout,
            scale: f32,
            (rows, t, mrows): (usize, usize, usize),
        ) -> Result<CudaStorage> {
            let dev = &ss.device;
            let op = "attn_softmax";
            let mut p = output::<f32>(dev, rows * t)?;
            k::attn_softmax_fwd::<T>(
                &stream(dev),
                &view::<T>(op, "scores", ss, ls)?,
                &view::<f32>(op, "mask", sm, lm)?,
                &mut p.as_view_mut(),
                rows,
                t,
                mrows,
                scale,
            )
            .map_err(kerr(op))?;
            Ok(CudaStorage::wrap_cuda_slice(p, dev.clone()))
        }
        let (scale, dims) = (self.scale as f32, (rows, t, mrows));
        let p = by_dtype!(dt, T => run::<T>(ss, ls, sm, lm, scale, dims)?);
        Ok((p, ls.shape().clone()))
    }
}

pub(crate) struct AttnSoftmaxBwd {
    pub(crate) scale: f64,
}

impl AttnSoftmaxBwd {
    /// `(rows, T, dtype of dp)`.
    pub(crate) fn check(
        &self,
        p: (DType, &Layout),
        dp: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let op = self.name();
        if p.0 != DType::F32 {
            bail!("{op}: `p` must be f32, got {:?}", p.0);
        }
        let dt = float_dtype(op, &[("dp", dp.0)])?;
        if p.1.shape() != dp.1.shape() {
            bail!(
                "{op}: `dp` has shape {:?}, `p` {:?}",
                dp.1.dims(),
                p.1.dims()
            );
        }
        let (n, t) = rows(p.1);
        Ok((n, t, dt))
    }
}

impl CustomOp2 for AttnSoftmaxBwd {
    fn name(&self) -> &'static str {
        "attn_softmax_bwd"
    }

    fn cpu_fwd(
        &self,
        sp: &CpuStorage,
        lp: &Layout,
        sd: &CpuStorage,
        ld: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, t, dt) = self.check((sp.dtype(), lp), (sd.dtype(), ld))?;
        let p = slice::<f32>(op, "p", sp, lp)?;
        let ds = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::softmax_bwd_rows::<T>(
            p,
            slice(op, "dp", sd, ld)?,
            t,
            self.scale as f32,
        )));
        Ok((ds, lp.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sp: &candle_core::CudaStorage,
        lp: &Layout,
        sd: &candle_core::CudaStorage,
        ld: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::softmax_cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let (rows, t, dt) = self.check((sp.dtype(), lp), (sd.dtype(), ld))?;
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            sp: &CudaStorage,
            lp: &Layout,
            sd: &CudaStorage,
            ld: &Layout,
            scale: f32,
            (rows, t): (usize, usize),
        ) -> Result<CudaStorage> {
            let dev = &sp.device;
            let op = "attn_softmax_bwd";
            let mut ds = output::<T>(dev, rows * t)?;
            k::attn_softmax_bwd::<T>(
                &stream(dev),
                &view::<f32>(op, "p", sp, lp)?,
                &view::<T>(op, "dp", sd, ld)?,
                &mut ds.as_view_mut(),
                rows,
                t,
                scale,
            )
            .map_err(kerr(op))?;
            Ok(CudaStorage::wrap_cuda_slice(ds, dev.clone()))
        }
        let ds = by_dtype!(dt, T => run::<T>(sp, lp, sd, ld, self.scale as f32, (rows, t))?);
        Ok((ds, lp.shape().clone()))
    }
}
