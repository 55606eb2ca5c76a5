//! Float casts as one op: [`cast`] (f32 ↔ bf16 / f16, `Tensor::to_dtype`'s bits) and
//! [`round_bf16`] (f32 values rounded to bf16, kept as f32: an autocast operand).
//!
//! candle's CPU `to_dtype` converts on one thread, element by element through `half`'s branchy
//! scalar conversion, and walks a strided index for a non-contiguous input. Under bf16 autocast
//! every matrix product converts its f32 operands, so on a 2-core machine that loop was 29% of a
//! bench-small step's main-thread time (`perf`, 2026-12-02) while the other core waited. Here the
//! pass is parallel over rows with rayon and vectorised (`cpu::cast`; bf16's rounding is
//! branch-free, [`cpu::Elem::of`]). A transposed or otherwise permuted dense input is converted in
//! its memory order and handed back with the same permutation (no gather). On CUDA a contiguous
//! bf16/f16 → f32 cast is rtune's `widen` kernel (`kernels/fused.cu`: candle's ran bf16 → f32 at
//! ~15% of an H200's copy bandwidth, and the LoRA branch widens its input and output gradient at
//! every module). Other layouts, other dtypes and other devices go to `to_dtype`.
//!
//! The plain reference is `to_dtype` itself; the tests below hold this op to it bit for bit.

#[cfg(feature = "kernels")]
pub mod check;
mod cpu;
#[cfg(feature = "kernels")]
pub mod cuda;
pub mod reference;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, WithDType};

use crate::storage::{by_dtype, slice};

/// `x.to_dtype(dt)`, the same bits; a parallel, vectorised pass for CPU casts between f32, bf16
/// and f16, and on CUDA rtune's widening kernel for contiguous bf16/f16 → f32.
pub fn cast(x: &Tensor, dt: DType) -> Result<Tensor> {
    if x.dtype() == dt || !float(x.dtype()) || !float(dt) {
        return x.to_dtype(dt);
    }
    counting::note();
    if x.device().is_cuda() && dt == DType::F32 && x.is_contiguous() {
        // bf16/f16 → f32 through `kernels/fused.cu`'s `widen` (candle's kernel ran bf16 → f32 at
        // ~15% of an H200's copy bandwidth); the other CUDA casts are candle's.
        return x.apply_op1_no_bwd(&Cast::To(dt));
    }
    if !x.device().is_cpu() {
        return x.to_dtype(dt);
    }
    in_memory_order(x, |x| x.apply_op1_no_bwd(&Cast::To(dt)), |x| x.to_dtype(dt))
}

/// `x.to_dtype(BF16)?.to_dtype(F32)` for an f32 `x` in one pass (same bits): the values an
/// autocast product takes, kept in f32 for code that reads f32.
pub fn round_bf16(x: &Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F32 || !x.device().is_cpu() {
        return x.to_dtype(DType::BF16)?.to_dtype(x.dtype());
    }
    in_memory_order(
        x,
        |x| x.apply_op1_no_bwd(&Cast::RoundBf16),
        |x| x.to_dtype(DType::BF16)?.to_dtype(DType::F32),
    )
}

/// How many [`cast`]s between float types this thread ran while a [`counting::start`] guard lived:
/// `rtune selftest`'s check that the LoRA branch in bf16 casts no activation (every activation
/// cast of the LoRA code goes through [`cast`]; `to_dtype` elsewhere is not counted).
pub mod counting {
    use std::cell::Cell;

    thread_local! {
        /// `None` outside a guard.
        static CASTS: Cell<Option<usize>> = const { Cell::new(None) };
    }

    /// Counts from zero on this thread until the guard drops.
    pub fn start() -> Guard {
        CASTS.with(|c| c.set(Some(0)));
        Guard(())
    }

    pub(super) fn note() {
        CASTS.with(|c| {
            if let Some(n) = c.get() {
                c.set(Some(n + 1));
            }
        });
    }

    /// Counting is on while it lives.
    pub struct Guard(());

    impl Guard {
        /// The casts counted so far.
        pub fn casts(&self) -> usize {
            CASTS.with(|c| c.get().unwrap_or(0))
        }
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            CASTS.with(|c| c.set(None));
        }
    }
}

fn float(dt: DType) -> bool {
    matches!(dt, DType::F32 | DType::BF16 | DType::F16)
}

/// `op(x)` where `x` is contiguous; where `x` is a permutation of a dense block (a transpose, say),
/// `op` of that block permuted back; `other(x)` otherwise.
fn in_memory_order(
    x: &Tensor,
    op: impl Fn(&Tensor) -> Result<Tensor>,
    other: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    if x.is_contiguous() {
        return op(x);
    }
    // The dims in memory order: strides descending (size-1 dims anywhere; their stride is moot).
    let (dims, strides) = (x.dims(), x.stride());
    let mut order: Vec<usize> = (0..dims.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(strides[i]), i));
    let block = x.permute(order.clone())?;
    if !block.is_contiguous() {
        return other(x);
    }
    let mut back = vec![0; order.len()];
    for (pos, &d) in order.iter().enumerate() {
        back[d] = pos;
    }
    op(&block)?.permute(back)
}

/// The op: a cast to a dtype, or f32 rounded to bf16 and kept as f32.
enum Cast {
    To(DType),
    RoundBf16,
}

impl CustomOp1 for Cast {
    fn name(&self) -> &'static str {
        "cast"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = self.name();
        let out = match self {
            Cast::RoundBf16 => {
                let x = slice::<f32>(n, "x", s, l)?;
                f32::to_cpu_storage_owned(cpu::round_bf16(x))
            }
            Cast::To(dt) => by_dtype!(s.dtype(), S => {
                let x = slice::<S>(n, "x", s, l)?;
                by_dtype!(*dt, D => D::to_cpu_storage_owned(cpu::cast::<S, D>(x)))
            }),
        };
        Ok((out, l.shape().clone()))
    }

    /// bf16/f16 → f32 only ([`cast`] sends nothing else here): `cuda::widen`, the
    /// same bits as candle's CUDA cast (a NaN keeps its payload).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use self::cuda as k;
        use crate::storage::{kerr, output, stream, view};
        use crate::FusedFloat;
        use candle_core::cuda_backend::CudaDType;

        fn run<T: CudaDType + FusedFloat>(
            s: &candle_core::CudaStorage,
            l: &Layout,
        ) -> Result<candle_core::CudaStorage> {
            let (dev, n) = (&s.device, l.shape().elem_count());
            let mut y = output::<f32>(dev, n)?;
            k::widen::<T>(
                &stream(dev),
                &view::<T>("cast", "x", s, l)?,
                &mut y.as_view_mut(),
                n,
            )
            .map_err(kerr("cast"))?;
            Ok(candle_core::CudaStorage::wrap_cuda_slice(y, dev.clone()))
        }
        let y = match (self, s.dtype()) {
            (Cast::To(DType::F32), DType::BF16) => run::<half::bf16>(s, l)?,
            (Cast::To(DType::F32), DType::F16) => run::<half::f16>(s, l)?,
            (_, dt) => candle_core::bail!("cast (cuda): {dt:?} → f32 only reaches this op"),
        };
        Ok((y, l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{Elem, ISA_CAP};
    use candle_core::{Device, IndexOp};
    use half::{bf16, f16};
    use std::sync::atomic::Ordering;

    /// Every f32 bit pattern's top half with the bottom halves where rounding turns (ties, one
    /// either side, the extremes): every exponent, sign, ±0, ±∞, subnormals and NaNs.
    fn patterns() -> impl Iterator<Item = f32> {
        (0..=0xffffu32).flat_map(|hi| {
            [0, 1, 0x3fff, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff]
                .map(|lo| f32::from_bits(hi << 16 | lo))
        })
    }

    /// The branch-free bf16 rounding is `half`'s, bit for bit, NaNs included.
    #[test]
    fn bf16_rounding_is_halfs_bit_for_bit() {
        for v in patterns() {
            let (got, want) = (<bf16 as Elem>::of(v), bf16::from_f32(v));
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{v:e} ({:#010x})",
                v.to_bits()
            );
        }
    }

    /// The bits of a float tensor, as u32 (each dtype's own bits widened).
    fn bits(t: &Tensor) -> Vec<u32> {
        let t = t.flatten_all().unwrap();
        match t.dtype() {
            DType::F32 => t
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect(),
            DType::BF16 => t
                .to_vec1::<bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits() as u32)
                .collect(),
            DType::F16 => t
                .to_vec1::<f16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits() as u32)
                .collect(),
            dt => panic!("{dt:?}"),
        }
    }

    /// `cast` and `round_bf16` give `to_dtype`'s bits, dims and dtype for every pair of f32, bf16
    /// and f16; on contiguous inputs, at an offset, transposed, permuted, and strided (not dense:
    /// the fallback); large enough for several rayon tasks; on every instruction set.
    #[test]
    fn casts_give_to_dtypes_bits_in_every_layout() -> Result<()> {
        let n = 70_000; // > 4 tasks of 16384
        let mut v: Vec<f32> = patterns().step_by(7).take(n - 3).collect();
        v.extend([f32::NAN, -0.0, 1e-40]);
        let x = Tensor::from_vec(v, (7, 100, 100), &Device::Cpu)?;
        let views = |x: &Tensor| -> Result<Vec<(&'static str, Tensor)>> {
            Ok(vec![
                ("contiguous", x.clone()),
                ("at an offset", x.i(3..)?),
                ("transposed", x.transpose(1, 2)?),
                ("permuted", x.permute((2, 0, 1))?),
                ("strided", x.i((.., .., 10..60))?),
            ])
        };
        for cap in [2, 1, 0] {
            ISA_CAP.store(cap, Ordering::Relaxed);
            for from in [DType::F32, DType::BF16, DType::F16] {
                for (what, x) in views(&x.to_dtype(from)?)? {
                    for to in [DType::F32, DType::BF16, DType::F16] {
                        let (got, want) = (cast(&x, to)?, x.to_dtype(to)?);
                        let case = format!("{from:?} → {to:?}, {what}, isa cap {cap}");
                        assert_eq!((got.dims(), got.dtype()), (want.dims(), to), "{case}");
                        assert!(bits(&got) == bits(&want), "{case}");
                    }
                    if from == DType::F32 {
                        let want = x.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
                        let got = round_bf16(&x)?;
                        assert_eq!(got.dims(), want.dims(), "round_bf16, {what}");
                        assert!(bits(&got) == bits(&want), "round_bf16, {what}, cap {cap}");
                    }
                }
            }
        }
        ISA_CAP.store(2, Ordering::Relaxed);
        Ok(())
    }
}
