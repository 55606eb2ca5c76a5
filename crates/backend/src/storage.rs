//! What every fused op shares: reading a contiguous input out of its storage ([`contiguous`],
//! [`slice`], and on CUDA `view`), the dtype rule (one float dtype per op: [`float_dtype`], and
//! [`by_dtype!`] to name its Rust type), shape checks ([`check_shape`]), and on CUDA the output
//! allocation and the kernels' error as a candle error naming the op.
//!
//! The ops require contiguous inputs (an offset into a larger buffer is fine); the errors name the
//! op, the tensor and its layout.

use candle_core::{bail, CpuStorage, DType, Error, Layout, Result, Shape, WithDType};
use rayon::prelude::*;

/// `(start, end)` of a contiguous layout in its storage, or an error naming the op and the layout.
pub fn contiguous(op: &str, what: &str, l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| {
        Error::Msg(format!(
            "{op}: `{what}` must be contiguous, got shape {:?} with strides {:?} \
             (call .contiguous() first)",
            l.dims(),
            l.stride()
        ))
        .bt()
    })
}

/// The contiguous elements of `l` in `s`.
pub fn slice<'a, T: WithDType>(
    op: &str,
    what: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<&'a [T]> {
    let (a, b) = contiguous(op, what, l)?;
    Ok(&s.as_slice::<T>()?[a..b])
}

/// Elements one rayon job copies at least in [`par_copy`].
const COPY_BLOCK: usize = 1 << 16;

/// `v` copied over rayon's threads (a `Vec` clone or candle's `to_vec1` copies on one), written
/// once into the new vector (no zeroing first).
pub fn par_copy(v: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(v.len());
    v.par_iter()
        .with_min_len(COPY_BLOCK)
        .copied()
        .collect_into_vec(&mut out);
    out
}

/// An f32 tensor's values as a flat vector: a contiguous host tensor's copied with [`par_copy`],
/// any other through candle (`flatten_all`, `to_vec1`, which refuses another dtype).
pub fn host_f32(t: &candle_core::Tensor) -> Result<Vec<f32>> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(par_copy(&v[a..b]));
        }
    }
    t.flatten_all()?.to_vec1()
}

/// The one float dtype of an op's tensors (f32, bf16 or f16).
pub fn float_dtype(op: &str, dts: &[(&str, DType)]) -> Result<DType> {
    let dt = dts[0].1;
    if let Some((name, other)) = dts.iter().find(|(_, d)| *d != dt) {
        bail!("{op}: `{name}` is {other:?} but `{}` is {dt:?}", dts[0].0);
    }
    if !matches!(dt, DType::F32 | DType::BF16 | DType::F16) {
        bail!("{op}: {dt:?} is not supported (f32, bf16, f16)");
    }
    Ok(dt)
}

/// Evaluates `$body` with `$T` the Rust type of `$dt` (f32, bf16 or f16; `$dt` from
/// [`float_dtype`]).
#[macro_export]
macro_rules! by_dtype {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            ::candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            ::candle_core::DType::BF16 => {
                type $T = ::half::bf16;
                $body
            }
            ::candle_core::DType::F16 => {
                type $T = ::half::f16;
                $body
            }
            dt => unreachable!("float_dtype let {dt:?} through"),
        }
    };
}
pub use crate::by_dtype;

/// `got` must have the shape `want`.
pub fn check_shape(op: &str, what: &str, got: &Layout, want: &Shape) -> Result<()> {
    if got.shape() != want {
        bail!(
            "{op}: `{what}` has shape {:?}, expected {want:?}",
            got.dims()
        );
    }
    Ok(())
}

/// The kernels' error as a candle error naming the op.
#[cfg(feature = "cuda")]
pub fn kerr(op: &'static str) -> impl FnOnce(crate::KernelError) -> Error {
    move |e| Error::Msg(format!("{op} (cuda): {e}")).bt()
}

/// The contiguous elements of `l` in `s`, as a view.
#[cfg(feature = "cuda")]
pub fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    op: &str,
    what: &str,
    s: &'a candle_core::CudaStorage,
    l: &Layout,
) -> Result<cudarc::driver::CudaView<'a, T>> {
    let (a, b) = contiguous(op, what, l)?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// An output buffer of `n` elements on `dev`, every one of which the kernel writes.
#[cfg(feature = "cuda")]
pub fn output<T: cudarc::driver::DeviceRepr>(
    dev: &candle_core::CudaDevice,
    n: usize,
) -> Result<cudarc::driver::CudaSlice<T>> {
    // SAFETY: each fused kernel writes all n elements of its output before anything reads them.
    unsafe { dev.alloc::<T>(n) }
}

/// The stream candle runs `dev`'s ops on (so a kernel is ordered with every other candle op).
#[cfg(feature = "cuda")]
pub fn stream(dev: &candle_core::CudaDevice) -> std::sync::Arc<cudarc::driver::CudaStream> {
    dev.cuda_stream()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// `host_f32` is candle's `to_vec1` of the flattened tensor, exactly (a copy moves values):
    /// contiguous, at an offset into a larger buffer (a narrow), strided (a transpose, through
    /// candle), over several copy blocks with a tail; a bf16 tensor refused as `to_vec1` refuses
    /// it.
    #[test]
    fn host_f32_is_candles_flat_copy() {
        let n = 3 * COPY_BLOCK + 17;
        let v: Vec<f32> = (0..2 * n).map(|i| i as f32 * 0.5 - 7.0).collect();
        let t = Tensor::from_vec(v, (2, n), &Device::Cpu).unwrap();
        let want = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
        for x in [
            t.clone(),
            t.narrow(0, 1, 1).unwrap(),
            t.narrow(1, 5, 40).unwrap().t().unwrap(),
        ] {
            assert_eq!(host_f32(&x).unwrap(), want(&x), "{:?}", x.layout());
        }
        assert_eq!(par_copy(&[]), Vec::<f32>::new());
        assert!(host_f32(&t.to_dtype(DType::BF16).unwrap()).is_err());
    }
}
