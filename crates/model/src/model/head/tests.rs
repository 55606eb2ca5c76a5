//! The tempered head (GRPO's log-probabilities, TRL's `logits / temperature`): `token_nll_at`
//! against the full forward's logits divided by T, log-softmaxed in f64.

use super::*;
use candle_core::{DType, Device, IndexOp};
use std::path::Path;

/// Every target position's `−log softmax(z / T)[target]` equals the forward's logits divided by
/// T (1e-5 absolute: f32 logits of ~1 magnitude, the rows scaled instead of the logits), for
/// T = 0.7 and 1.3; positions without a target are 0.
#[test]
fn tempered_nll_is_the_log_softmax_of_the_logits_over_t() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    let model = Model::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..10).map(|i| (i * 37 + 5) % 200 + 3).collect();
    let inp = Inputs::new(ids.clone(), 1, ids.len());
    let logits = model.forward(&inp, None, false).unwrap().logits;
    let mut targets: Vec<Option<u32>> = ids[1..].iter().map(|&t| Some(t)).collect();
    targets.push(None);
    targets[2] = None;
    for t in [0.7, 1.3] {
        let got = model.token_nll_at(&inp, &targets, None, t).unwrap();
        for (i, target) in targets.iter().enumerate() {
            let want = match target {
                None => 0.0,
                Some(y) => {
                    let z: Vec<f64> = logits
                        .i((0, i))
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|v| f64::from(*v) / t)
                        .collect();
                    let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
                    lse - z[*y as usize]
                }
            };
            let d = (f64::from(got[i]) - want).abs();
            assert!(d <= 1e-5, "T {t}, position {i}: {} vs {want}", got[i]);
        }
    }
}
