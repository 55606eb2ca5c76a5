//! Elementwise sums of two tensors of one shape, in the first one's dtype, as one op: [`add`]
//! (`a + b.to_dtype(a.dtype())`: the residual adds, and a LoRA branch's f32 `dx` into the frozen
//! path's) and [`add_wide`] (`(a.to_dtype(F32) + b).to_dtype(a.dtype())`: the LoRA branch's f32
//! output into the frozen product's, rounded once).
//!
//! candle's bf16 add on the CPU calls its intrinsics out of line (they are not compiled for the
//! CPU's features) and asks the CPU's features at every 8 elements; on a bench-small bf16 step those
//! adds were the largest single cost beside the GEMMs (`perf`, 2026-12-02). Here: one parallel,
//! vectorised pass in f32 with one rounding, `T::of` (half's nearest even) — candle's bf16 add
//! rounds through `vcvtneps2bf16` where the CPU has it, which flushes subnormal results to zero,
//! the one place the bits can differ. f32 is plain IEEE addition, candle's bits.
//!
//! Inputs of other shapes (broadcasts), other dtypes or other devices go to candle's ops.

mod cpu;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

use rtune_backend::storage::{by_dtype, check_shape, slice};

/// `a + b.to_dtype(a.dtype())`, in `a`'s dtype (`b` rounded to it first, the sum rounded once).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    sum(a, b, true, |a, b| a + b.to_dtype(a.dtype())?)
}

/// `(a.to_dtype(F32) + b).to_dtype(a.dtype())` for an f32 `b`: the sum in f32, rounded once.
pub fn add_wide(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    sum(a, b, false, |a, b| {
        (a.to_dtype(DType::F32)? + b.to_dtype(DType::F32)?)?.to_dtype(a.dtype())
    })
}

fn sum(
    a: &Tensor,
    b: &Tensor,
    round_b: bool,
    plain: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let float = |dt| matches!(dt, DType::F32 | DType::BF16 | DType::F16);
    if !a.device().is_cpu() || a.dims() != b.dims() || !float(a.dtype()) || !float(b.dtype()) {
        return plain(a, b);
    }
    a.contiguous()?
        .apply_op2_no_bwd(&b.contiguous()?, &Add { round_b })
}

/// The op: `T(a + (T(b) if round_b else b))`, arithmetic in f32.
struct Add {
    round_b: bool,
}

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "add"
    }

    fn cpu_fwd(
        &self,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = self.name();
        check_shape(n, "b", lb, la.shape())?;
        let out = by_dtype!(sa.dtype(), T => {
            let a = slice::<T>(n, "a", sa, la)?;
            by_dtype!(sb.dtype(), U => {
                T::to_cpu_storage_owned(cpu::add(a, slice::<U>(n, "b", sb, lb)?, self.round_b))
            })
        });
        Ok((out, la.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, IndexOp};
    use rtune_backend::cpu::ISA_CAP;
    use std::sync::atomic::Ordering;

    use crate::test_util::bits;

    /// Both sums give the plain chain's bits for every pair of f32 / bf16 / f16, contiguous,
    /// at an offset and transposed, on every instruction set; candle's bf16 add is held to
    /// `T::of`'s rounding by keeping the values away from subnormals (see the module note).
    #[test]
    fn sums_give_the_plain_chains_bits() -> Result<()> {
        let dev = Device::Cpu;
        let a = (Tensor::randn(0f32, 1.0, (9, 70, 130), &dev)? * 3.0)?; // > 4 rayon tasks
        let b = Tensor::randn(0f32, 1.0, (9, 70, 130), &dev)?;
        for cap in [2, 1, 0] {
            ISA_CAP.store(cap, Ordering::Relaxed);
            for ta in [DType::F32, DType::BF16, DType::F16] {
                for tb in [DType::F32, DType::BF16, DType::F16] {
                    let (a, b) = (a.to_dtype(ta)?, b.to_dtype(tb)?);
                    for (what, a, b) in [
                        ("contiguous", a.clone(), b.clone()),
                        ("offset", a.i(2..)?, b.i(..7)?),
                        ("transposed", a.transpose(1, 2)?, b.transpose(1, 2)?),
                    ] {
                        let case = format!("{ta:?} + {tb:?}, {what}, isa cap {cap}");
                        let want = (&a + b.to_dtype(ta)?)?;
                        let got = add(&a, &b)?;
                        assert_eq!((got.dims(), got.dtype()), (want.dims(), ta), "{case}");
                        assert!(bits(&got) == bits(&want), "add: {case}");
                        let want =
                            (a.to_dtype(DType::F32)? + b.to_dtype(DType::F32)?)?.to_dtype(ta)?;
                        let got = add_wide(&a, &b)?;
                        assert!(bits(&got) == bits(&want), "add_wide: {case}");
                    }
                }
            }
        }
        ISA_CAP.store(2, Ordering::Relaxed);
        // A broadcast view (stride 0) of the other's shape is read as the row repeated.
        let row = Tensor::randn(0f32, 1.0, (1, 130), &dev)?.to_dtype(DType::BF16)?;
        let m = Tensor::randn(0f32, 1.0, (70, 130), &dev)?.to_dtype(DType::BF16)?;
        let got = add(&m, &row.broadcast_as(m.shape())?)?;
        assert!(
            bits(&got) == bits(&m.broadcast_add(&row)?),
            "broadcast view"
        );
        Ok(())
    }
}
