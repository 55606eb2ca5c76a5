//! Rotate-half RoPE as one op, forward and backward: `y = x·cos + rotate_half(x)·sin` with
//! `rotate_half([x1, x2]) = [−x2, x1]`, and its transpose `dx = dy·cos + rotate_halfᵀ(dy·sin)`,
//! `rotate_halfᵀ([z1, z2]) = [z2, −z1]`; each product rounded to the storage type as the plain
//! chain rounds it. One op struct (`Rope`) serves both directions (`bwd`).
//!
//! Here: [`rope`], [`rope_bwd`], the checks, `cpu_fwd` (loops: `cpu::rope`) and with the `cuda`
//! feature `cuda_fwd` (`super::cuda::rope_{fwd,bwd}`). The plain reference is
//! [`crate::rope::apply_reference`] / [`crate::rope::reference::apply_backward_reference`].
//!
//! On CUDA, `cos, sin` must have the batch of `x` (the kernels index the table by x's batch):
//! [`rope`] broadcasts a batch of 1 before launching; the CPU loop reads a batch of 1 for every row.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};

use super::cpu;
use rtune_backend::storage::{by_dtype, check_shape, float_dtype, slice};

/// Rotate-half RoPE: `x: (B, H, T, Dh)`, `cos, sin: (B or 1, 1, T, Dh)` →
/// `x·cos + rotate_half(x)·sin`, each product rounded to the storage type as the plain chain does.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (table(x, cos)?, table(x, sin)?);
    x.contiguous()?
        .apply_op3_no_bwd(&cos, &sin, &Rope { bwd: false })
}

/// [`rope`]'s backward (the rotation's transpose): `dx = dy·cos + rotate_halfᵀ(dy·sin)`.
pub fn rope_bwd(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (table(dy, cos)?, table(dy, sin)?);
    dy.contiguous()?
        .apply_op3_no_bwd(&cos, &sin, &Rope { bwd: true })
}

/// A RoPE table, contiguous; on CUDA a batch of 1 is broadcast to `x`'s batch (the kernels index
/// the table by x's batch; the CPU kernel reads a batch of 1 for every row).
fn table(x: &Tensor, c: &Tensor) -> Result<Tensor> {
    match (x.dims().first(), c.dims()) {
        (Some(&b), &[1, a, t, d]) if b != 1 && x.device().is_cuda() => {
            c.broadcast_as((b, a, t, d))?.contiguous()
        }
        _ => c.contiguous(),
    }
}

/// `(b, h, t, dh)` of RoPE's `x` against `cos, sin: (b or 1, 1, t, dh)`.
fn rope_dims(op: &str, x: &Layout, c: &Layout, s: &Layout) -> Result<[usize; 4]> {
    let &[b, h, t, dh] = x.dims() else {
        bail!("{op}: `x` must be (B, H, T, Dh), got {:?}", x.dims());
    };
    if dh % 2 != 0 {
        bail!("{op}: head dim {dh} is odd");
    }
    let cb = c.dims().first().copied().unwrap_or(0);
    let cb = if cb == 1 { 1 } else { b };
    check_shape(op, "cos", c, &Shape::from((cb, 1, t, dh)))?;
    check_shape(op, "sin", s, &Shape::from((cb, 1, t, dh)))?;
    Ok([b, h, t, dh])
}

pub(crate) struct Rope {
    /// The backward (transposed rotation) instead of the forward.
    pub(crate) bwd: bool,
}

impl Rope {
    /// `([b, h, t, dh], dtype)`.
    pub(crate) fn check(
        &self,
        x: (DType, &Layout),
        c: (DType, &Layout),
        s: (DType, &Layout),
    ) -> Result<([usize; 4], DType)> {
        let op = self.op_name();
        let dt = float_dtype(op, &[("x", x.0), ("cos", c.0), ("sin", s.0)])?;
        Ok((rope_dims(op, x.1, c.1, s.1)?, dt))
    }

    pub(crate) fn op_name(&self) -> &'static str {
        if self.bwd {
            "rope_bwd"
        } else {
            "rope"
        }
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        self.op_name()
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let ([_, h, t, dh], dt) =
            self.check((sx.dtype(), lx), (sc.dtype(), lc), (ss.dtype(), ls))?;
        let n = self.name();
        let y = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::rope::<T>(
            slice(n, "x", sx, lx)?,
            slice(n, "cos", sc, lc)?,
            slice(n, "sin", ss, ls)?,
            (h, t, dh),
            self.bwd,
        )));
        Ok((y, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sc: &candle_core::CudaStorage,
        lc: &Layout,
        ss: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda as k;
        use candle_core::cuda_backend::CudaDType;
        use candle_core::CudaStorage;
        use cudarc::driver::DeviceRepr;
        use rtune_backend::storage::{kerr, output, stream, view};
        use rtune_backend::FusedFloat;

        let ([b, h, t, dh], dt) =
            self.check((sx.dtype(), lx), (sc.dtype(), lc), (ss.dtype(), ls))?;
        if lc.dims()[0] != b {
            bail!(
                "{} (cuda): cos/sin must have the batch of x ({b}), got {:?}",
                self.op_name(),
                lc.dims()
            );
        }
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + FusedFloat + DeviceRepr>(
            bwd: bool,
            sx: &CudaStorage,
            lx: &Layout,
            sc: &CudaStorage,
            lc: &Layout,
            ss: &CudaStorage,
            ls: &Layout,
            [b, h, t, dh]: [usize; 4],
        ) -> Result<CudaStorage> {
            let dev = &sx.device;
            let op = if bwd { "rope_bwd" } else { "rope" };
            let mut y = output::<T>(dev, b * h * t * dh)?;
            let (x, cos, sin) = (
                view::<T>(op, "x", sx, lx)?,
                view::<T>(op, "cos", sc, lc)?,
                view::<T>(op, "sin", ss, ls)?,
            );
            let st = stream(dev);
            let launched = if bwd {
                k::rope_bwd::<T>(&st, &x, &cos, &sin, &mut y.as_view_mut(), b, h, t, dh)
            } else {
                k::rope_fwd::<T>(&st, &x, &cos, &sin, &mut y.as_view_mut(), b, h, t, dh)
            };
            launched.map_err(kerr(op))?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
        }
        let dims = [b, h, t, dh];
        let y = by_dtype!(dt, T => run::<T>(self.bwd, sx, lx, sc, lc, ss, ls, dims)?);
        Ok((y, lx.shape().clone()))
    }
}
