//! The tiled attention on CUDA (feature `cuda`): [`super::flash::flash_attn`] and
//! [`super::flash::flash_attn_bwd`] hand tensors on a CUDA device here, which runs
//! `kernels/flash_attn.cu` through `super::flash_kernel` on candle's stream (ordered with every
//! other candle op). Same inputs, outputs, layouts and dtypes as the CPU loops of `flash.rs`; the
//! kernels' own CPU reference (same tiling and roundings) is `crate::attention::flash_ref`, tested
//! against the plain path in `tests/flash_ref.rs` and against the kernels by `rtune selftest`.
//!
//! The starts are not checked here (they are on the device; the CPU path checks `starts[i] ≤ i`):
//! `crate::AttnMask` builds valid ones, and a query that sees no key gets `O = 0` from the kernel.
//!
//! Given the mask's causal band, each call goes to cuDNN's fused attention first
//! (`super::cudnn::try_fwd` / `try_bwd`: bf16/f16, the library loaded, the graph supported), the
//! own kernel otherwise; `RTUNE_UNFUSED=cudnn` keeps every call on the own kernel.

use crate::attention::cudnn::{self, Band};
use crate::attention::flash_kernel::{self as kern, FlashShape};
use crate::fused::{self, Fused};
use candle_core::cuda_backend::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor};
use cudarc::driver::DeviceRepr;
use rtune_backend::FusedFloat;

use rtune_backend::storage::{by_dtype, kerr, output, stream, view};

/// The CUDA storage of `x`, or an error naming the op and the tensor.
fn cuda<'a>(op: &str, what: &str, s: &'a Storage) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        other => bail!(
            "{op}: `{what}` is on {:?}, the other inputs on CUDA",
            other.device().location()
        ),
    }
}

/// A tensor of `shape` over a kernel's output buffer.
fn wrap<T: CudaDType>(
    buf: cudarc::driver::CudaSlice<T>,
    dev: &CudaDevice,
    shape: &[usize],
) -> Tensor {
    let st = Storage::Cuda(CudaStorage::wrap_cuda_slice(buf, dev.clone()));
    Tensor::from_storage(st, shape, BackpropOp::none(), false)
}

/// The forward: `(o: (B, T, H, Dh) in dt, lse: (B, T, H) f32)`; inputs contiguous, checked by
/// the caller.
pub(super) fn fwd(
    s: &FlashShape,
    band: Option<Band>,
    [q, k, v, starts]: [&Tensor; 4],
    scale: f64,
    dt: DType,
) -> Result<(Tensor, Tensor)> {
    let op = "flash_attn";
    // RTUNE_UNFUSED=cudnn: no band, so the own kernel for every call.
    let band = if fused::on(q.device(), Fused::Cudnn)? {
        band
    } else {
        None
    };
    let (sq, lq) = q.storage_and_layout();
    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    let (ss, ls) = starts.storage_and_layout();
    let (cq, ck, cv, cs) = (
        cuda(op, "q", &sq)?,
        cuda(op, "k", &sk)?,
        cuda(op, "v", &sv)?,
        cuda(op, "starts", &ss)?,
    );
    let dev = &cq.device;
    fn run<T: CudaDType + FusedFloat + DeviceRepr>(
        s: &FlashShape,
        band: Option<Band>,
        dev: &CudaDevice,
        x: [(&CudaStorage, &Layout); 3],
        st: (&CudaStorage, &Layout),
        scale: f32,
    ) -> Result<(Tensor, Tensor)> {
        let op = "flash_attn";
        let [(cq, lq), (ck, lk), (cv, lv)] = x;
        let mut o = output::<T>(dev, s.b * s.t * s.h * s.dh)?;
        let mut lse = output::<f32>(dev, s.b * s.t * s.h)?;
        let strm = stream(dev);
        let (q, k, v) = (
            view::<T>(op, "q", cq, lq)?,
            view::<T>(op, "k", ck, lk)?,
            view::<T>(op, "v", cv, lv)?,
        );
        let on_cudnn = cudnn::try_fwd::<T>(
            &strm,
            s,
            band,
            scale,
            [&q, &k, &v],
            &mut o.as_view_mut(),
            &mut lse.as_view_mut(),
        );
        if !on_cudnn {
            kern::flash_fwd::<T>(
                &strm,
                s,
                &q,
                &k,
                &v,
                &view::<u32>(op, "starts", st.0, st.1)?,
                &mut o.as_view_mut(),
                &mut lse.as_view_mut(),
                scale,
            )
            .map_err(kerr(op))?;
        }
        Ok((
            wrap(o, dev, &[s.b, s.t, s.h, s.dh]),
            wrap(lse, dev, &[s.b, s.t, s.h]),
        ))
    }
    let x = [(cq, lq), (ck, lk), (cv, lv)];
    by_dtype!(dt, T => run::<T>(s, band, dev, x, (cs, ls), scale as f32))
}

/// The backward: `(dq, dk, dv)` shaped and typed like `q, k, v`; inputs contiguous, checked by the
/// caller (`o, d_o: (B, T, H, Dh)`, `lse: (B, T, H)` f32).
pub(super) fn bwd(
    s: &FlashShape,
    band: Option<Band>,
    [q, k, v, o, d_o]: [&Tensor; 5],
    lse: &Tensor,
    starts: &Tensor,
    scale: f64,
    dt: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let op = "flash_attn_bwd";
    // RTUNE_UNFUSED=cudnn: no band, so the own kernel for every call.
    let band = if fused::on(q.device(), Fused::Cudnn)? {
        band
    } else {
        None
    };
    let (sq, lq) = q.storage_and_layout();
    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    let (so, lo) = o.storage_and_layout();
    let (sd, ld) = d_o.storage_and_layout();
    let (sl, ll) = lse.storage_and_layout();
    let (ss, ls) = starts.storage_and_layout();
    let x = [
        (cuda(op, "q", &sq)?, lq),
        (cuda(op, "k", &sk)?, lk),
        (cuda(op, "v", &sv)?, lv),
        (cuda(op, "o", &so)?, lo),
        (cuda(op, "d_o", &sd)?, ld),
    ];
    let cl = (cuda(op, "lse", &sl)?, ll);
    let cs = (cuda(op, "starts", &ss)?, ls);
    let dev = &x[0].0.device;
    fn run<T: CudaDType + FusedFloat + DeviceRepr>(
        s: &FlashShape,
        band: Option<Band>,
        dev: &CudaDevice,
        x: [(&CudaStorage, &Layout); 5],
        (lse, starts): ((&CudaStorage, &Layout), (&CudaStorage, &Layout)),
        scale: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let op = "flash_attn_bwd";
        let names = ["q", "k", "v", "o", "d_o"];
        let mut views = Vec::with_capacity(5);
        for ((c, l), name) in x.into_iter().zip(names) {
            views.push(view::<T>(op, name, c, l)?);
        }
        let nq = s.b * s.h * s.t * s.dh;
        let nk = s.b * s.hkv * s.t * s.dh;
        let mut dq = output::<T>(dev, nq)?;
        let mut dk = output::<T>(dev, nk)?;
        let mut dv = output::<T>(dev, nk)?;
        let strm = stream(dev);
        let x = [&views[0], &views[1], &views[2], &views[3], &views[4]];
        let lse = view::<f32>(op, "lse", lse.0, lse.1)?;
        let on_cudnn = cudnn::try_bwd::<T>(
            &strm,
            s,
            band,
            scale,
            x,
            &lse,
            [
                &mut dq.as_view_mut(),
                &mut dk.as_view_mut(),
                &mut dv.as_view_mut(),
            ],
        );
        if !on_cudnn {
            kern::flash_bwd::<T>(
                &strm,
                s,
                x,
                &lse,
                &view::<u32>(op, "starts", starts.0, starts.1)?,
                &mut dq.as_view_mut(),
                &mut dk.as_view_mut(),
                &mut dv.as_view_mut(),
                scale,
            )
            .map_err(kerr(op))?;
        }
        Ok((
            wrap(dq, dev, &[s.b, s.h, s.t, s.dh]),
            wrap(dk, dev, &[s.b, s.hkv, s.t, s.dh]),
            wrap(dv, dev, &[s.b, s.hkv, s.t, s.dh]),
        ))
    }
    by_dtype!(dt, T => run::<T>(s, band, dev, x, (cl, cs), scale as f32))
}
