//! bf16 autocast for the training path's matrix products: `[model] dtype = "bf16-autocast"`, the
//! semantics of PEFT under `torch.autocast('cpu', dtype=torch.bfloat16)` on an f32 model.
//!
//! torch's CPU autocast runs the ops of its lower-precision list in bf16 — among them `linear`,
//! `matmul`, `mm`, `bmm`, `addmm`, `baddbmm` and `scaled_dot_product_attention` — and everything
//! else (embedding gathers, RMSNorm's f32 upcast, the residual adds, softmax, the loss on
//! `logits.float()`) as it finds it. PEFT's LoRA `Linear` casts its input to the adapter's dtype
//! (f32), but `lora_A`/`lora_B` are `nn.Linear`s, so under autocast they run in bf16 too, and the
//! f32 master weights only see gradients cast back to f32. So in an autocast step every product —
//! frozen base, LoRA A and B, attention `q·kᵀ` and `p·v`, the lm_head, and each of their backward
//! products — takes bf16-rounded operands and accumulates in f32.
//!
//! rtune does the same with one difference: the f32 accumulator is kept (torch rounds each
//! autocast output to bf16). The results differ by at most one bf16 rounding of a product's
//! output; rtune's is the more precise. The frozen weights are rounded to bf16 once at load
//! (`Model::set_autocast`), the activations and the f32 LoRA weights at each product.
//!
//! The products go through oneDNN's bf16 × bf16 → f32 kernels where [`crate::onednn`] is in use;
//! otherwise the bf16-rounded operands are widened back to f32 and multiplied in f32 (BLAS or
//! candle): the same numbers up to summation order.
//!
//! The mode is thread-local, as torch's: a [`Scope`] turns it on for the thread that runs the
//! model (every [`super::matmul`] of a step is called from that thread; the kernels' own worker
//! threads never call it). A product of an f32 and a bf16 operand is autocast whatever the mode.

use candle_core::{DType, Result, Tensor};
use std::cell::Cell;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is in autocast.
pub fn on() -> bool {
    ON.with(Cell::get)
}

/// Autocast on this thread (when made with `true`) until dropped; the previous mode comes back.
#[must_use = "autocast ends when the scope is dropped"]
pub struct Scope {
    prev: bool,
}

/// Sets this thread's autocast mode to `enabled` for the life of the returned [`Scope`].
pub fn scope(enabled: bool) -> Scope {
    Scope {
        prev: ON.with(|c| c.replace(enabled)),
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        ON.with(|c| c.set(self.prev));
    }
}

/// `a·b` with both operands rounded to bf16 and f32 accumulation; f32 out.
pub(super) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    product(a, b, true)
}

/// [`matmul`]; `use_onednn = false` forces the fallback (tests).
fn product(a: &Tensor, b: &Tensor, use_onednn: bool) -> Result<Tensor> {
    let bf16 = |t: &Tensor| crate::cast::cast(t, DType::BF16);
    let (a16, b16) = (bf16(a)?, bf16(b)?);
    if !a.device().is_cpu() {
        // CUDA: candle's bf16 GEMM (cuBLAS, f32 compute, bf16 out: torch's autocast exactly).
        return super::plain(&a16, &b16)?.to_dtype(DType::F32);
    }
    if use_onednn {
        if let Some(y) = crate::onednn::matmul(&a16, &b16, DType::F32) {
            return y;
        }
    }
    // The same bf16 values, widened exactly, multiplied in f32.
    let f32 = |t: &Tensor| crate::cast::cast(t, DType::F32);
    super::plain(&f32(&a16)?, &f32(&b16)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The scope turns the mode on for its life and restores the previous mode, nested.
    #[test]
    fn scope_is_thread_local_and_nests() {
        assert!(!on());
        {
            let _a = scope(true);
            assert!(on());
            {
                let _b = scope(false);
                assert!(!on());
            }
            assert!(on());
            std::thread::spawn(|| assert!(!on(), "another thread is not in autocast"))
                .join()
                .expect("thread");
        }
        assert!(!on());
    }

    /// Autocast products equal the f32 product of the operands rounded to bf16: within 1e-5 of the
    /// largest |entry| (summation order only; a product of unrounded operands is ~2⁻⁹ away, so the
    /// test fails if an operand is not rounded), through oneDNN where in use and through the forced
    /// fallback, for f32·f32, f32·bf16 (a frozen weight, transposed view) and batched operands;
    /// `super::matmul` under a scope and with mixed dtypes takes this path.
    #[test]
    fn products_equal_the_f32_product_of_bf16_rounded_operands() -> Result<()> {
        let dev = Device::Cpu;
        let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let x = Tensor::randn(0f32, 1.0, (37, 300), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (45, 300), &dev)?;
        let w16 = w.to_dtype(DType::BF16)?;
        let q = Tensor::randn(0f32, 1.0, (2, 3, 20, 33), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (2, 3, 17, 33), &dev)?;
        let cases = [
            (x.clone(), w.t()?),
            (x.clone(), w16.t()?),
            (q.clone(), k.transpose(2, 3)?),
        ];
        for (a, b) in &cases {
            let want = round(a)?.contiguous()?.matmul(&round(b)?.contiguous()?)?;
            let unrounded = a
                .contiguous()?
                .matmul(&b.to_dtype(DType::F32)?.contiguous()?)?;
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
            let err = |got: &Tensor| -> Result<f32> {
                assert_eq!(got.dtype(), DType::F32);
                Ok((got - &want)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
            };
            let gap = err(&unrounded)?;
            assert!(gap > 1e-4, "rounding changes the product: {gap}");
            for use_onednn in [true, false] {
                let e = err(&product(a, b, use_onednn)?)?;
                assert!(
                    e < 1e-5,
                    "{:?}·{:?} onednn={use_onednn}: {e}",
                    a.dims(),
                    b.dims()
                );
            }
            let _s = scope(true);
            let e = err(&super::super::matmul(a, b)?)?;
            assert!(e < 1e-5, "blas::matmul under autocast: {e}");
        }
        // Mixed dtypes are autocast without a scope.
        let want = round(&x)?.matmul(&round(&w)?.t()?)?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        let e = (super::super::matmul(&x, &w16.t()?)? - want)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(e < 1e-5 * scale, "mixed dtypes: {e} of {scale}");
        Ok(())
    }
}
