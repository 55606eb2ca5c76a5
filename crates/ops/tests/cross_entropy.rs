//! The chunked cross-entropy's target check: a target id outside the lm_head's vocabulary is an
//! error naming the id and the vocabulary, in training and in evaluation, whatever the chunking
//! (on a GPU the kernels would read out of bounds and the loss would come back NaN).

use candle_core::{DType, Device, Tensor};
use rtune_ops::{chunked_cross_entropy, chunked_cross_entropy_loss};

#[test]
fn out_of_range_target_is_an_error_naming_it() -> candle_core::Result<()> {
    let (n, d, vocab) = (10, 8, 80);
    let h = Tensor::randn(0f32, 1.0, (n, d), &Device::Cpu)?;
    let w = Tensor::randn(0f32, 1.0, (vocab, d), &Device::Cpu)?;
    // Row 7's target is the vocabulary size itself: one past the last id.
    let mut targets: Vec<Option<u32>> = (0..n).map(|i| Some(i as u32 * 7 % 80)).collect();
    targets[2] = None;
    targets[7] = Some(vocab as u32);
    for chunk in [1, 3, 64] {
        for err in [
            chunked_cross_entropy(&h, &w, &targets, 0.1, chunk).map(|_| ()),
            chunked_cross_entropy_loss(&h, &w, &targets, chunk).map(|_| ()),
        ] {
            let msg = err.expect_err("target 80 of vocab 80").to_string();
            assert!(
                msg.contains("target token id 80 (row 7)") && msg.contains("vocabulary of 80"),
                "{msg}"
            );
        }
    }
    // The last valid id and the ignored rows are fine, in bf16 too; the loss is a finite sum.
    targets[7] = Some(vocab as u32 - 1);
    for dt in [DType::F32, DType::BF16] {
        let (h, w) = (h.to_dtype(dt)?, w.to_dtype(dt)?);
        let (loss, dh) = chunked_cross_entropy(&h, &w, &targets, 0.1, 3)?;
        assert!(loss.is_finite() && loss > 0.0, "{loss}");
        assert_eq!(dh.dims(), &[n, d]);
        // Row 2 has no target: no gradient.
        let row2 = dh.get(2)?.to_dtype(DType::F32)?.abs()?.sum_all()?;
        assert_eq!(row2.to_scalar::<f32>()?, 0.0);
    }
    Ok(())
}
