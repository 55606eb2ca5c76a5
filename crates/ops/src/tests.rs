//! Tests across the ops: the CPU `exp`, inputs at an offset or strided, bad inputs, and every
//! instruction set giving the same bits.

use crate::norm::op::RmsNorm;
use crate::test_util::*;
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use rtune_backend::cpu;

#[test]
fn exp_is_within_2_ulp_of_libm() {
    let mut worst = 0f32;
    let mut x = -87.3f32;
    while x < 88.3 {
        let (got, want) = (cpu::exp(x), x.exp());
        worst = worst.max((got - want).abs() / want);
        x += 0.000_77;
    }
    eprintln!("exp: worst relative error {worst:e} against libm");
    assert!(worst < 2.4e-7, "exp: relative error {worst:e}");
    let e = cpu::exp;
    assert_eq!(e(0.0), 1.0);
    assert_eq!(e(f32::NEG_INFINITY), 0.0);
    assert_eq!(e(-100.0), 0.0);
    assert_eq!(e(f32::INFINITY), f32::INFINITY);
    assert_eq!(e(100.0), f32::INFINITY);
    assert!(e(f32::NAN).is_nan());
}

#[test]
fn inputs_at_an_offset_and_strided_inputs() {
    // A contiguous view at an offset into a larger buffer is read in place.
    let big = randn(&[9, 37], 20, 2.0);
    let w = randn(&[37], 21, 1.0);
    let x = big.narrow(0, 2, 5).unwrap();
    assert!(x.is_contiguous() && x.layout().start_offset() > 0);
    let y = crate::norm::op::rms_norm(&x, &w, 1e-6).unwrap();
    assert_f32(
        &y,
        &crate::norm::rms_norm_reference(&x, &w, 1e-6).unwrap(),
        "rms_norm at offset",
    );
    // The raw op refuses a strided tensor, naming the op and the layout...
    let xt = randn(&[37, 5], 22, 1.0).t().unwrap();
    let err = xt.apply_op2_no_bwd(&w, &RmsNorm { eps: 1e-6 }).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("rms_norm: `x` must be contiguous"), "{msg}");
    // ... and the function copies it first.
    let y = crate::norm::op::rms_norm(&xt, &w, 1e-6).unwrap();
    assert_f32(
        &y,
        &crate::norm::rms_norm_reference(&xt, &w, 1e-6).unwrap(),
        "rms_norm strided",
    );
    let g = randn(&[7, 4], 23, 3.0).t().unwrap();
    let u = randn(&[4, 7], 24, 1.0);
    let h = crate::swiglu::swiglu(&g, &u).unwrap();
    assert_f32(
        &h,
        &crate::swiglu::swiglu_reference(&g, &u).unwrap(),
        "swiglu strided",
    );
}

#[test]
fn bad_inputs_are_errors() {
    let x = randn(&[3, 8], 30, 1.0);
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    let m = msg(crate::norm::op::rms_norm(
        &x,
        &bf16(&randn(&[8], 31, 1.0)),
        1e-6,
    ));
    assert!(m.contains("rms_norm: `w` is BF16 but `x` is F32"), "{m}");
    let m = msg(crate::norm::op::rms_norm(&x, &randn(&[7], 31, 1.0), 1e-6));
    assert!(
        m.contains("rms_norm: `w` has shape [7], expected [8]"),
        "{m}"
    );
    let m = msg(crate::swiglu::swiglu(&x, &x.to_dtype(DType::F64).unwrap()));
    assert!(m.contains("swiglu: `u` is F64"), "{m}");
    let tgt = Tensor::new(&[1u32, 8, 2], &Device::Cpu).unwrap();
    let m = msg(crate::ce::op::ce_fwd(&x, &tgt));
    assert!(
        m.contains("target 8 of row 1 is outside the vocabulary of 8"),
        "{m}"
    );
    let (cos, sin) = rand_tables(1, 3, 6);
    let m = msg(crate::rope::op::rope(
        &x.reshape((1, 1, 3, 8)).unwrap(),
        &cos,
        &sin,
    ));
    assert!(m.contains("rope: `cos` has shape [1, 1, 3, 6]"), "{m}");
}

/// Every op gives the same bits on the AVX-512, AVX2 and baseline paths (no FMA, fixed summation
/// order), so a run does not depend on the CPU it lands on.
#[test]
fn every_instruction_set_gives_the_same_bits() {
    use cpu::ISA_CAP;
    use std::sync::atomic::Ordering;
    let x = randn(&[9, 300], 60, 3.0);
    let w = randn(&[300], 61, 1.0);
    let (cos, sin) = rand_tables(2, 5, 64);
    let q = randn(&[2, 3, 5, 64], 62, 2.0);
    let logits = randn(&[7, 333], 63, 8.0);
    let tgt = targets(7, 333, 64);
    let mask = crate::causal_mask(37, Some(20), &Device::Cpu).unwrap();
    let sc = randn(&[1, 2, 74, 37], 65, 6.0);
    let all = |dt: DType| -> Vec<Vec<f32>> {
        let c = |t: &Tensor| t.to_dtype(dt).unwrap();
        let (x, w, q, cos, sin, logits, sc) =
            (c(&x), c(&w), c(&q), c(&cos), c(&sin), c(&logits), c(&sc));
        let (dg, du) =
            crate::swiglu::swiglu_backward(&x, &x, &w.broadcast_as((9, 300)).unwrap()).unwrap();
        let stats = crate::ce::op::ce_fwd(&logits, &tgt).unwrap();
        let p = crate::attention::softmax::attn_softmax(&sc, &mask, 0.3).unwrap();
        [
            crate::norm::op::rms_norm(&x, &w, 1e-5).unwrap(),
            crate::norm::op::rms_norm_bwd(&x, &x, &w, 1e-5).unwrap(),
            crate::swiglu::swiglu(&x, &x).unwrap(),
            dg,
            du,
            crate::rope::op::rope(&q, &cos, &sin).unwrap(),
            crate::rope::op::rope_bwd(&q, &cos, &sin).unwrap(),
            crate::ce::op::ce_bwd(&logits, &tgt, &stats.i((.., 0)).unwrap(), 0.5).unwrap(),
            stats,
            crate::attention::softmax::attn_softmax_bwd(&p, &sc, 0.3).unwrap(),
            p,
        ]
        .iter()
        .map(flat)
        .collect()
    };
    for dt in [DType::F32, DType::BF16] {
        let mut runs = Vec::new();
        for cap in [2, 1, 0] {
            ISA_CAP.store(cap, Ordering::Relaxed);
            runs.push(all(dt));
        }
        ISA_CAP.store(2, Ordering::Relaxed);
        for (i, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{dt:?} op {i}: AVX2"
            );
        }
        for (i, (a, b)) in runs[0].iter().zip(&runs[2]).enumerate() {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{dt:?} op {i}: base"
            );
        }
    }
}
