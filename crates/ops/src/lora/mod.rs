//! A LoRA branch's rank-`r` product added into the frozen path's output as one op, [`lora_up`]:
//! `out = T(y + R(s · xa·M))`, `xa: (N, r)` f32, `M: (r, n)` f32, `y: (N, n)` in the compute
//! dtype `T`, arithmetic in f32; `s` an optional scale, `R` an optional rounding to `T`.
//!
//! - forward, `y = x·Wᵀ` plus `s · xa·Bᵀ` (`M = Bᵀ`), rounded once: the plain form is
//!   `add_wide(y, mm(xa, Bᵀ) * s)`;
//! - backward, `dx = x's frozen gradient + T(dxa·A)` (`M = A`, no scale, rounded first as
//!   `add(dx, dl)` does): the plain form is `add(dx, mm(dxa, A))`.
//!
//! With `r` = 16 the product is a rank-16 update: a GEMM library writes the `(N, n)` f32 product
//! to memory (and zeroes it first), the scale reads and writes it again, the add reads it once
//! more. Measured on bench-small under bf16 autocast, oneDNN ran these at 27–56 GFLOP/s against
//! ~1000 for the square products (2026-12-02, `ONEDNN_VERBOSE`). Here 4 rows × 32 columns of sums
//! stay in registers over the `r` terms (each load of `m` serves four rows): `y` is read once
//! and `out` written once, and the pass runs at memory speed (2048 × 2752, r 16: 5.6 ms against
//! 9.2 ms for the GEMM, the scale and the add, 2 threads).
//!
//! The sum over `r` runs in index order, one f32 multiply and one add per term (no FMA, as every
//! loop in `cpu.rs`), so the bits do not depend on the CPU; they differ from a GEMM library's
//! by its summation order. Under bf16 autocast (`rtune_backend::blas::autocast`) `xa` and `M` are rounded
//! to bf16 first, as every product's operands are: bf16 products are exact in f32, so the result
//! is oneDNN's up to that order. `y` may be a column view (row stride ≠ `n`, as a member's
//! slice of a fused q/k/v product). Other devices take the plain form.
//!
//! [`acc`]: the LoRA branch in the compute dtype (bf16/f16 on CUDA, `RTUNE_UNFUSED=lora_bf16`
//! turns it off): `c += alpha·a·b` by cuBLAS with `beta = 1`, no f32 copy of anything.

pub mod acc;
mod cpu;
#[cfg(test)]
mod tests;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};

use rtune_backend::blas::matmul as mm;
use rtune_backend::storage::{by_dtype, float_dtype, slice};

/// `T(y + R(scale · xa·m))`, `R` the rounding to `y`'s dtype when `round` (see the module note).
pub fn lora_up(
    y: &Tensor,
    xa: &Tensor,
    m: &Tensor,
    scale: Option<f64>,
    round: bool,
) -> Result<Tensor> {
    if !y.device().is_cpu() {
        let p = mm(xa, m)?;
        let p = match scale {
            Some(s) => (p * s)?,
            None => p,
        };
        return if round {
            super::add(y, &p)
        } else {
            super::add_wide(y, &p)
        };
    }
    let (xa, m) = if rtune_backend::blas::autocast::on() {
        (
            rtune_backend::cast::round_bf16(xa)?,
            rtune_backend::cast::round_bf16(m)?,
        )
    } else {
        (xa.clone(), m.clone())
    };
    let (xa, m) = (xa.contiguous()?, m.contiguous()?);
    if let (Ok((rows, r)), Ok(n)) = (xa.dims2(), m.dim(1)) {
        rtune_backend::served::record(|| "rtune lora_up (f32 sums)".into(), 1, rows, r, n);
    }
    let y = if row_view(y.layout()) {
        y.clone()
    } else {
        y.contiguous()?
    };
    y.apply_op3_no_bwd(
        &xa,
        &m,
        &LoraUp {
            scale: scale.map(|s| s as f32),
            round,
        },
    )
}

/// Whether `l` is a 2-d matrix of packed rows at some row stride (a column slice of a wider one).
fn row_view(l: &Layout) -> bool {
    l.dims().len() == 2 && (l.stride()[1] == 1 || l.dims()[1] == 1) && l.stride()[0] >= l.dims()[1]
}

struct LoraUp {
    scale: Option<f32>,
    round: bool,
}

impl CustomOp3 for LoraUp {
    fn name(&self) -> &'static str {
        "lora-up"
    }

    fn cpu_fwd(
        &self,
        sy: &CpuStorage,
        ly: &Layout,
        sx: &CpuStorage,
        lx: &Layout,
        sm: &CpuStorage,
        lm: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (dy, dx, dm) = (ly.dims(), lx.dims(), lm.dims());
        if !row_view(ly) || dx.len() != 2 || dm.len() != 2 {
            bail!(
                "{op}: y {dy:?} (strides {:?}), xa {dx:?}, m {dm:?} are not matrices of rows",
                ly.stride()
            );
        }
        let (rows, n, r) = (dy[0], dy[1], dx[1]);
        if dx[0] != rows || dm != [r, n] {
            bail!("{op}: y {dy:?} = xa {dx:?} · m {dm:?} does not hold");
        }
        if (sx.dtype(), sm.dtype()) != (DType::F32, DType::F32) {
            bail!(
                "{op}: xa and m must be f32, got {:?} and {:?}",
                sx.dtype(),
                sm.dtype()
            );
        }
        let dt = float_dtype(op, &[("y", sy.dtype())])?;
        let (xa, m) = (
            slice::<f32>(op, "xa", sx, lx)?,
            slice::<f32>(op, "m", sm, lm)?,
        );
        let (ld, start) = (ly.stride()[0], ly.start_offset());
        // The rows of y: `rows` rows of `ld`, the last one only `n` long.
        let end = if rows == 0 {
            start
        } else {
            start + (rows - 1) * ld + n
        };
        let out = by_dtype!(dt, T => {
            let y = &sy.as_slice::<T>()?[start..end];
            T::to_cpu_storage_owned(cpu::lora_up(y, ld, xa, m, (rows, n, r), self.scale, self.round))
        });
        Ok((out, Shape::from((rows, n))))
    }
}
