//! CUDA side of the fused ops ([`crate::fused`], and the attention softmax of
//! [`crate::fused_attn`]): each op's `cuda_fwd` checks shapes and dtypes
//! with the same `check` as the CPU path, allocates the output on the input's device and launches
//! `rtune_kernels::fused`'s kernel for the dtype on candle's stream (so it is ordered with every
//! other candle op). Inputs must be contiguous; an offset into a larger buffer is a sub-view.
//!
//! Differences from the CPU path: RoPE's `cos, sin` must have the batch of `x` (`fused::rope`
//! broadcasts a batch of 1 before launching); targets are not checked against V on the host (that
//! would copy them back): the kernels give NaN loss and no one-hot for a target `>= V`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaDevice, CudaStorage, DType, Error, Layout, Result, Shape};
use cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use rtune_kernels::fused::{self as k, FusedFloat};
use std::sync::Arc;

use crate::fused::{
    by_dtype, contiguous, CeBwd, CeFwd, RmsNorm, RmsNormBwd, Rope, Swiglu, SwigluBwd,
};
use crate::fused_attn::{AttnSoftmax, AttnSoftmaxBwd};

/// The kernels' error as a candle error naming the op.
fn kerr(op: &'static str) -> impl FnOnce(rtune_kernels::KernelError) -> Error {
    move |e| Error::Msg(format!("{op} (cuda): {e}")).bt()
}

/// The contiguous elements of `l` in `s`, as a view.
fn view<'a, T: CudaDType>(
    op: &str,
    what: &str,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<CudaView<'a, T>> {
    let (a, b) = contiguous(op, what, l)?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// An output buffer of `n` elements on `dev`, every one of which the kernel writes.
fn output<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: each fused kernel writes all n elements of its output before anything reads them.
    unsafe { dev.alloc::<T>(n) }
}

fn stream(dev: &CudaDevice) -> Arc<cudarc::driver::CudaStream> {
    dev.cuda_stream()
}

pub(crate) fn rms_norm(
    op: &RmsNorm,
    sx: &CudaStorage,
    lx: &Layout,
    sw: &CudaStorage,
    lw: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (rows, dim, dt) = op.check((sx.dtype(), lx), (sw.dtype(), lw))?;
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
    let dims = (rows, dim, op.eps as f32);
    let y = by_dtype!(dt, T => run::<T>(sx, lx, sw, lw, dims)?);
    Ok((y, lx.shape().clone()))
}

pub(crate) fn rms_norm_bwd(
    op: &RmsNormBwd,
    sdy: &CudaStorage,
    ldy: &Layout,
    sx: &CudaStorage,
    lx: &Layout,
    sw: &CudaStorage,
    lw: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (rows, dim, dt) = op.check((sdy.dtype(), ldy), (sx.dtype(), lx), (sw.dtype(), lw))?;
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
    let dims = (rows, dim, op.eps as f32);
    let dx = by_dtype!(dt, T => run::<T>(sdy, ldy, sx, lx, sw, lw, dims)?);
    Ok((dx, lx.shape().clone()))
}

pub(crate) fn swiglu(
    op: &Swiglu,
    sg: &CudaStorage,
    lg: &Layout,
    su: &CudaStorage,
    lu: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let dt = op.check((sg.dtype(), lg), (su.dtype(), lu))?;
    fn run<T: CudaDType + FusedFloat + DeviceRepr>(
        sg: &CudaStorage,
        lg: &Layout,
        su: &CudaStorage,
        lu: &Layout,
    ) -> Result<CudaStorage> {
        let dev = &sg.device;
        let n = lg.shape().elem_count();
        let mut h = output::<T>(dev, n)?;
        k::swiglu_fwd::<T>(
            &stream(dev),
            &view::<T>("swiglu", "g", sg, lg)?,
            &view::<T>("swiglu", "u", su, lu)?,
            &mut h.as_view_mut(),
            n,
        )
        .map_err(kerr("swiglu"))?;
        Ok(CudaStorage::wrap_cuda_slice(h, dev.clone()))
    }
    let h = by_dtype!(dt, T => run::<T>(sg, lg, su, lu)?);
    Ok((h, lg.shape().clone()))
}

pub(crate) fn swiglu_bwd(
    op: &SwigluBwd,
    sdh: &CudaStorage,
    ldh: &Layout,
    sg: &CudaStorage,
    lg: &Layout,
    su: &CudaStorage,
    lu: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (dt, shape) = op.check((sdh.dtype(), ldh), (sg.dtype(), lg), (su.dtype(), lu))?;
    fn run<T: CudaDType + FusedFloat + DeviceRepr>(
        sdh: &CudaStorage,
        ldh: &Layout,
        sg: &CudaStorage,
        lg: &Layout,
        su: &CudaStorage,
        lu: &Layout,
    ) -> Result<CudaStorage> {
        let dev = &sg.device;
        let op = "swiglu_bwd";
        let n = lg.shape().elem_count();
        let mut out = output::<T>(dev, 2 * n)?; // (2, n): dg then du
        k::swiglu_bwd::<T>(
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

pub(crate) fn rope(
    op: &Rope,
    sx: &CudaStorage,
    lx: &Layout,
    sc: &CudaStorage,
    lc: &Layout,
    ss: &CudaStorage,
    ls: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let ([b, h, t, dh], dt) = op.check((sx.dtype(), lx), (sc.dtype(), lc), (ss.dtype(), ls))?;
    if lc.dims()[0] != b {
        candle_core::bail!(
            "{} (cuda): cos/sin must have the batch of x ({b}), got {:?}",
            op.op_name(),
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
    let y = by_dtype!(dt, T => run::<T>(op.bwd, sx, lx, sc, lc, ss, ls, dims)?);
    Ok((y, lx.shape().clone()))
}

pub(crate) fn ce_fwd(
    op: &CeFwd,
    sl: &CudaStorage,
    ll: &Layout,
    st: &CudaStorage,
    lt: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (n, v, dt) = op.check((sl.dtype(), ll), (st.dtype(), lt))?;
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

pub(crate) fn ce_bwd(
    op: &CeBwd,
    sl: &CudaStorage,
    ll: &Layout,
    st: &CudaStorage,
    lt: &Layout,
    slse: &CudaStorage,
    llse: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (n, v, dt) = op.check((sl.dtype(), ll), (st.dtype(), lt), (slse.dtype(), llse))?;
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
    let d = by_dtype!(dt, T => run::<T>(sl, ll, st, lt, slse, llse, op.scale, (n, v))?);
    Ok((d, ll.shape().clone()))
}

pub(crate) fn attn_softmax(
    op: &AttnSoftmax,
    ss: &CudaStorage,
    ls: &Layout,
    sm: &CudaStorage,
    lm: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (rows, t, mrows, dt) = op.check((ss.dtype(), ls), (sm.dtype(), lm))?;
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
    let (scale, dims) = (op.scale as f32, (rows, t, mrows));
    let p = by_dtype!(dt, T => run::<T>(ss, ls, sm, lm, scale, dims)?);
    Ok((p, ls.shape().clone()))
}

pub(crate) fn attn_softmax_bwd(
    op: &AttnSoftmaxBwd,
    sp: &CudaStorage,
    lp: &Layout,
    sd: &CudaStorage,
    ld: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (rows, t, dt) = op.check((sp.dtype(), lp), (sd.dtype(), ld))?;
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
    let ds = by_dtype!(dt, T => run::<T>(sp, lp, sd, ld, op.scale as f32, (rows, t))?);
    Ok((ds, lp.shape().clone()))
}
