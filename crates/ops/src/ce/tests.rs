//! the cross-entropy of a chunk: the fused op against its plain reference (f32 and bf16), the backward against candle's
//! autograd, and the slice reference against textbook formulas in f64.

use super::reference::*;
use super::*;
use crate::test_util::*;
use candle_core::{DType, Device, IndexOp, Tensor, Var};
use rtune_backend::check::Rng;

/// Random targets in `0..v`, with the first and last ids present.

#[test]
fn cross_entropy_matches_plain() {
    // (5, 13); (37, 1001): several tasks in both ops, a 9-element tail per row.
    for (i, &(n, v)) in [(5, 13), (37, 1001)].iter().enumerate() {
        let s = 10 * i as u64;
        let logits = randn(&[n, v], s + 10, 8.0);
        let tgt = targets(n, v, s + 11);
        for logits in [logits.clone(), bf16(&logits)] {
            let dt = logits.dtype();
            let stats = crate::ce::op::ce_fwd(&logits, &tgt).unwrap();
            let want = crate::ce::cross_entropy_reference(&logits, &tgt).unwrap();
            assert_f32(&stats, &want, &format!("ce_fwd {dt:?}"));
            let lse = stats.i((.., 0)).unwrap();
            let d = crate::ce::op::ce_bwd(&logits, &tgt, &lse, 0.37).unwrap();
            let want = crate::ce::cross_entropy_grad_reference(&logits, &tgt, 0.37).unwrap();
            match dt {
                DType::F32 => assert_f32(&d, &want, "ce_bwd f32"),
                _ => assert_bf16(&d, &want, "ce_bwd bf16"),
            }
        }
    }
}

/// The whole chunked cross-entropy (`mod.rs`) on bf16: the loss and `dh` of the fused path against
/// the plain chain on the same bf16 hidden states and lm_head.
#[test]
fn chunked_cross_entropy_bf16_matches_plain() {
    let h = bf16(&randn(&[11, 16], 40, 1.0));
    let w = bf16(&randn(&[50, 16], 41, 2.0));
    let tgt: Vec<Option<u32>> = (0..11u32)
        .map(|i| (i % 3 != 1).then_some(i * 7 % 50))
        .collect();
    let (loss, dh) = crate::chunked_cross_entropy(&h, &w, &tgt, 0.5, 4).unwrap();
    let mut want_loss = 0f64;
    let mut want_dh = h.zeros_like().unwrap().to_dtype(DType::F32).unwrap();
    for (i, t) in tgt.iter().enumerate() {
        let Some(t) = *t else { continue };
        let logits = h.i(i..i + 1).unwrap().matmul(&w.t().unwrap()).unwrap();
        let tt = Tensor::new(&[t], &Device::Cpu).unwrap();
        let st = crate::ce::cross_entropy_reference(&logits, &tt).unwrap();
        want_loss += st.i((0, 1)).unwrap().to_scalar::<f32>().unwrap() as f64;
        let d = crate::ce::cross_entropy_grad_reference(&logits, &tt, 0.5).unwrap();
        let row = d.matmul(&w).unwrap().to_dtype(DType::F32).unwrap();
        want_dh = want_dh.slice_assign(&[i..i + 1, 0..16], &row).unwrap();
    }
    assert!(
        (loss - want_loss).abs() / want_loss < 1e-6,
        "{loss} vs {want_loss}"
    );
    // dh: one bf16 matmul of the same bf16 dlogits in both.
    assert_bf16(
        &dh,
        &want_dh.to_dtype(DType::BF16).unwrap(),
        "chunked ce dh bf16",
    );
}

#[test]
fn chunked_cross_entropy_matches_autograd() {
    chunked_cross_entropy_matches_autograd_for(None);
}

/// Gemma 2's final-logit soft cap (2.5: the logits here reach ±10, so the cap bends most of them):
/// the loss on `cap·tanh(logits/cap)` and its `dh`, against autograd of that formula.
#[test]
fn softcapped_cross_entropy_matches_autograd() {
    chunked_cross_entropy_matches_autograd_for(Some(2.5));
}

fn chunked_cross_entropy_matches_autograd_for(softcap: Option<f64>) {
    let h = Var::from_tensor(&randn(&[7, 8], 11, 1.0)).unwrap();
    let w = (randn(&[13, 8], 12, 1.0) * 3.0).unwrap();
    let targets = [Some(3u32), None, Some(12), Some(0), None, Some(5), Some(5)];
    // Plain: full logits (soft-capped), log-softmax, pick, sum.
    let logits = h.matmul(&w.t().unwrap()).unwrap();
    let logits = match softcap {
        Some(cap) => ((logits / cap).unwrap().tanh().unwrap() * cap).unwrap(),
        None => logits,
    };
    let max = logits.max_keepdim(1).unwrap().detach();
    let z = logits.broadcast_sub(&max).unwrap();
    let lse = z.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
    let logp = z.broadcast_sub(&lse).unwrap();
    let mut total = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
    for (i, t) in targets.iter().enumerate() {
        if let Some(t) = t {
            total = (total - logp.get(i).unwrap().get(*t as usize).unwrap()).unwrap();
        }
    }
    let grads = (&total * 0.25).unwrap().backward().unwrap();
    for chunk in [1, 2, 3, 100] {
        let (loss, dh, _) =
            chunked_cross_entropy_with(&h, &w, None, softcap, &targets, 0.25, chunk).unwrap();
        let eval = chunked_cross_entropy_loss_with(&h, &w, None, softcap, &targets, chunk).unwrap();
        assert_eq!(loss, eval, "the evaluation loss is the training loss");
        let want = total.to_scalar::<f32>().unwrap() as f64;
        assert!(
            (loss - want).abs() / want < 1e-5,
            "chunk {chunk}: loss {loss} vs {want}"
        );
        assert_close_t(&dh, grads.get(&h).unwrap(), "cross-entropy dh");
    }
}

#[test]
fn ce_fwd_is_log_sum_exp_and_ce_bwd_its_gradient() {
    let mut rng = Rng::new(5);
    let (n, v) = (3, 11);
    let logits = rng.normals(n * v, 3.0, F32);
    let targets: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
    let out = ce_fwd(&logits, &targets, n, v);
    let lse: Vec<f32> = (0..n).map(|i| out[2 * i]).collect();
    let scale = 0.25f32;
    let d = ce_bwd(&logits, &targets, &lse, scale, n, v, F32);
    let lf = f64s(&logits);
    for i in 0..n {
        let row = &lf[i * v..(i + 1) * v];
        let naive = row.iter().map(|x| x.exp()).sum::<f64>().ln();
        assert_close(out[2 * i], naive, 1e-6, "lse");
        assert_close(
            out[2 * i + 1],
            naive - row[targets[i] as usize],
            1e-6,
            "nll",
        );
        assert!(
            d[i * v..(i + 1) * v]
                .iter()
                .map(|&x| x as f64)
                .sum::<f64>()
                .abs()
                < 1e-6
        );
    }
    // scale · Σ nll, differentiated by each logit
    let loss = |x: &[f64]| -> f64 {
        (0..n)
            .map(|i| {
                let row = &x[i * v..(i + 1) * v];
                row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[targets[i] as usize]
            })
            .sum::<f64>()
            * scale as f64
    };
    for (j, &g) in d.iter().enumerate() {
        assert_close(g, fd(&loss, &lf, j), 1e-5, "ce_bwd");
    }
    // Out-of-range target: NaN loss, lse still right, no one-hot.
    let bad = ce_fwd(&logits[..v], &[v as u32], 1, v);
    assert!(bad[1].is_nan() && bad[0] == out[0]);
}

/// The per-row cross-entropy (the preference objectives' head): every row's loss in its place,
/// and `weights ⊙ dh` equal to candle's autograd of `Σ wᵢ·nllᵢ` over log-softmax (f32: the
/// same sums in another order, 1e-5).
#[test]
fn per_row_cross_entropy_weighted_matches_autograd() {
    let (n, d, v) = (9, 8, 23);
    let h = randn(&[n, d], 50, 1.0);
    let w = randn(&[v, d], 51, 1.0);
    let tgt: Vec<Option<u32>> = (0..n as u32)
        .map(|i| (i % 4 != 2).then_some(i * 5 % v as u32))
        .collect();
    let weights: Vec<f32> = (0..n).map(|i| 0.3 - 0.1 * i as f32).collect();
    let (nll, dh) = crate::chunked_cross_entropy_rows(&h, &w, None, &tgt, true, 4).unwrap();
    let wt = Tensor::new(weights.as_slice(), &Device::Cpu).unwrap();
    let dh = dh
        .unwrap()
        .broadcast_mul(&wt.unsqueeze(1).unwrap())
        .unwrap();
    // Autograd of the weighted loss.
    let hv = Var::from_tensor(&h).unwrap();
    let logits = hv.matmul(&w.t().unwrap()).unwrap();
    let lse = logits.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
    let logp = logits.broadcast_sub(&lse).unwrap();
    let mut total = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
    let nll = nll.to_vec1::<f32>().unwrap();
    for (i, t) in tgt.iter().enumerate() {
        let Some(t) = *t else {
            assert_eq!(nll[i], 0.0, "row {i} has no target");
            continue;
        };
        let want = -logp.i((i, t as usize)).unwrap().to_scalar::<f32>().unwrap();
        assert!(
            (nll[i] - want).abs() < 1e-5,
            "row {i}: {} vs {want}",
            nll[i]
        );
        let term = (logp.i((i, t as usize)).unwrap() * (-weights[i] as f64)).unwrap();
        total = (total + term).unwrap();
    }
    let g = total.backward().unwrap();
    assert_f32(&dh, g.get(&hv).unwrap(), "weighted dh");
}

/// The soft-capped kernels' slice reference (`ce_capped_fwd` / `ce_capped_bwd`) against the
/// unfused path of `chunked_cross_entropy_with` on tensors: `softcap_logits`, `ce_fwd` and
/// `ce_bwd` on the capped logits, `softcap_logits_backward`; f32, bf16 and f16, cap 30 and 5.
/// The capped logits the reference forms are the op's bit for bit (`cap_logit`); the statistics
/// and gradient within the kernels' tolerance (the reference's sums in f64).
#[test]
fn soft_capped_reference_equals_the_softcap_then_ce_ops() {
    use rtune_backend::check::{compare, tolerance, Op};
    use rtune_backend::Precision;
    let (n, v) = (6, 333);
    for (dt, p) in [
        (DType::F32, Precision::F32),
        (DType::BF16, Precision::Bf16),
        (DType::F16, Precision::F16),
    ] {
        for cap in [30.0, 5.0] {
            let case = format!("{dt:?} cap {cap}");
            let mut rng = Rng::new(3);
            let (logits, targets) = check_inputs(&mut rng, (n, v), (10.0, 60.0), p);
            let lt = Tensor::from_vec(logits.clone(), (n, v), &Device::Cpu)
                .and_then(|t| t.to_dtype(dt))
                .unwrap();
            let tt = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
            let capped = crate::softcap::softcap_logits(&lt, cap).unwrap();
            let want_z: Vec<f32> = logits.iter().map(|&x| cap_logit(x, cap, p)).collect();
            assert_eq!(flat(&capped), want_z, "{case}: capped logits");
            let stats = crate::ce::op::ce_fwd(&capped, &tt).unwrap();
            let want = ce_capped_fwd(&logits, &targets, (n, v), cap, p);
            let c = compare(
                &flat(&stats),
                &want,
                Precision::F32,
                tolerance(Op::f32_out("ce"), p),
            );
            assert!(c.pass, "{case}: forward {c:?}");
            let lse: Vec<f32> = want.iter().step_by(2).copied().collect();
            let lse_t = Tensor::new(lse.as_slice(), &Device::Cpu).unwrap();
            let dz = crate::ce::op::ce_bwd(&capped, &tt, &lse_t, 0.25).unwrap();
            let d = crate::softcap::softcap_logits_backward(&dz, &capped, cap).unwrap();
            let want = ce_capped_bwd(&logits, &targets, &lse, 0.25, (n, v), cap, p);
            let c = compare(&flat(&d), &want, p, tolerance(Op::typed("ce_bwd"), p));
            assert!(c.pass, "{case}: backward {c:?}");
        }
    }
}

/// The fused soft cap is CUDA only: on the CPU both ops refuse with an error naming the op and
/// the unfused chain (which `chunked_cross_entropy_with` takes there), not a panic.
#[test]
fn capped_ops_refuse_the_cpu() {
    let logits = randn(&[2, 7], 1, 3.0);
    let tgt = Tensor::new(&[1u32, 6], &Device::Cpu).unwrap();
    let e = crate::ce::op::ce_capped_fwd(&logits, &tgt, 30.0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ce_capped_fwd") && e.contains("softcap_logits"),
        "{e}"
    );
    let lse = Tensor::new(&[1f32, 1.0], &Device::Cpu).unwrap();
    let e = crate::ce::op::ce_capped_bwd(&logits, &tgt, &lse, 1.0, 30.0);
    assert!(e.unwrap_err().to_string().contains("ce_capped_bwd"));
}

/// The per-row entropy beside the loss: `−Σ p log p` of each row's full softmax formed at once
/// (f32, the same terms summed in another order: 1e-5), 0 where there is no target; the loss
/// and the gradient equal those of [`crate::chunked_cross_entropy_rows`] (same code, same
/// chunks: bitwise). Chunks of 4 over 9 rows, one of them short.
#[test]
fn per_row_entropy_matches_the_full_softmax() {
    let (n, d, v) = (9, 8, 23);
    let h = randn(&[n, d], 60, 1.0);
    let w = randn(&[v, d], 61, 1.0);
    let tgt: Vec<Option<u32>> = (0..n as u32)
        .map(|i| (i % 4 != 1).then_some(i * 7 % v as u32))
        .collect();
    let (nll, dh, ent) =
        crate::chunked_cross_entropy_rows_entropy(&h, &w, None, &tgt, true, 4).unwrap();
    let (nll0, dh0) = crate::chunked_cross_entropy_rows(&h, &w, None, &tgt, true, 4).unwrap();
    assert_eq!(
        nll.to_vec1::<f32>().unwrap(),
        nll0.to_vec1::<f32>().unwrap()
    );
    assert_eq!(
        dh.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        dh0.unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    );
    let logits = h.matmul(&w.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
    let ent = ent.to_vec1::<f32>().unwrap();
    for (i, t) in tgt.iter().enumerate() {
        if t.is_none() {
            assert_eq!(ent[i], 0.0, "row {i} has no target");
            continue;
        }
        let z: Vec<f64> = logits[i].iter().map(|&x| f64::from(x)).collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let want: f64 = -z.iter().map(|x| (x - lse).exp() * (x - lse)).sum::<f64>();
        assert!(want > 0.1, "row {i}: a spread-out distribution ({want})");
        assert!(
            (f64::from(ent[i]) - want).abs() < 1e-5,
            "row {i}: entropy {} vs {want}",
            ent[i]
        );
    }
}
