//! Each fused op against its plain candle formulation (the `*_reference` functions beside the call
//! sites in ops.rs and rope.rs) on fresh random inputs with odd shapes — rows that are not a
//! multiple of the kernels' 16 lanes, and tensors big enough to be split over several rayon tasks.
//!
//! Tolerances:
//! - f32: `max |fused − plain| ≤ 1e-6 · max |plain|` ([`F32_TOL`]). Both compute in f32; the fused
//!   op sums a row in another order (16 partial sums), its `exp` is within 2 ulp of libm's, and the
//!   cross-entropy's backward takes `exp(x − lse)` where the chain takes `exp((x − max) − ln Σ)`
//!   (an ulp of lse ≈ 10 is 1e-6 of it). Each is a few f32 ulps (6e-8) of the largest entry.
//! - bf16: the same bf16 inputs into both; each element within [`BF16_ULPS`] bf16 ulps of the plain
//!   op's (1 ulp = 2^-7 relative). The fused ops round to bf16 exactly where the chain holds a bf16
//!   tensor, so the results differ only where an f32 intermediate (a row sum, a libm vs polynomial
//!   exp) falls on the other side of a bf16 rounding boundary — and for SwiGLU, where candle's bf16
//!   silu rounds three times (exp, 1 + e, division) and the fused op once, as PyTorch does.
//!   Elements that cancel to below 1/256 of the tensor's largest are compared at that magnitude.

use super::cpu;
use super::norm::RmsNorm;
use crate::{fused, ops, rope as rope_ref};
use candle_core::{DType, Device, IndexOp, Result, Tensor};

const F32_TOL: f32 = 1e-6;
const BF16_ULPS: f32 = 2.0;

fn randn(shape: &[usize], seed: u64, scale: f32) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `max |got − want| / max |want|`.
fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.dims(), want.dims());
    let (g, w) = (flat(got), flat(want));
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let err = g
        .iter()
        .zip(&w)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    err / scale
}

fn assert_f32(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dtype(), DType::F32, "{what}");
    let e = rel_err(got, want);
    eprintln!("{what}: relative error {e:.2e}");
    assert!(e <= F32_TOL, "{what}: relative error {e:e} > {F32_TOL:e}");
}

/// The largest difference in bf16 ulps (of the plain value, floored at 1/256 of the largest).
fn bf16_ulps(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.dims(), want.dims());
    let (g, w) = (flat(got), flat(want));
    let floor = w.iter().fold(0f32, |m, v| m.max(v.abs())) / 256.0;
    let ulp = |v: f32| {
        let v = v.abs().max(floor).max(f32::MIN_POSITIVE);
        f32::from_bits(v.to_bits() & 0x7f80_0000) / 128.0 // 2^(exponent − 7)
    };
    g.iter()
        .zip(&w)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs() / ulp(*b)))
}

fn assert_bf16(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dtype(), DType::BF16, "{what}");
    let u = bf16_ulps(got, want);
    let (g, w) = (flat(got), flat(want));
    let differ = g.iter().zip(&w).filter(|(a, b)| a != b).count();
    eprintln!(
        "{what}: {u:.2} bf16 ulps, {differ} of {} elements differ",
        g.len()
    );
    assert!(u <= BF16_ULPS, "{what}: {u} bf16 ulps > {BF16_ULPS}");
}

fn bf16(t: &Tensor) -> Tensor {
    t.to_dtype(DType::BF16).unwrap()
}

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
fn rms_norm_matches_plain() {
    // (7, 37): one task, a 5-element tail; (40, 515): several tasks of 31 rows.
    for (i, &(n, d)) in [(7, 37), (40, 515)].iter().enumerate() {
        let s = 10 * i as u64;
        let x = randn(&[n, d], s + 1, 3.0);
        let w = randn(&[d], s + 2, 1.5);
        let dy = randn(&[n, d], s + 3, 1.0);
        let eps = 1e-5;
        let y = fused::rms_norm(&x, &w, eps).unwrap();
        assert_f32(
            &y,
            &ops::rms_norm_reference(&x, &w, eps).unwrap(),
            "rms_norm f32",
        );
        let dx = fused::rms_norm_bwd(&dy, &x, &w, eps).unwrap();
        let want = ops::rms_norm_backward_reference(&dy, &x, &w, eps).unwrap();
        assert_f32(&dx, &want, "rms_norm_bwd f32");

        let (x, w, dy) = (bf16(&x), bf16(&w), bf16(&dy));
        let y = fused::rms_norm(&x, &w, eps).unwrap();
        assert_bf16(
            &y,
            &ops::rms_norm_reference(&x, &w, eps).unwrap(),
            "rms_norm bf16",
        );
        let dx = fused::rms_norm_bwd(&dy, &x, &w, eps).unwrap();
        let want = ops::rms_norm_backward_reference(&dy, &x, &w, eps).unwrap();
        assert_bf16(&dx, &want, "rms_norm_bwd bf16");
    }
}

#[test]
fn swiglu_matches_plain() {
    // 13·1377 = 17901 elements: two rayon tasks, the second partial.
    for (i, shape) in [[3, 7], [13, 1377]].iter().enumerate() {
        let s = 10 * i as u64;
        // Gates out to ±12 so σ saturates on both sides.
        let g = randn(shape, s + 4, 12.0);
        let u = randn(shape, s + 5, 2.0);
        let dh = randn(shape, s + 6, 1.0);
        let h = fused::swiglu(&g, &u).unwrap();
        assert_f32(&h, &ops::swiglu_reference(&g, &u).unwrap(), "swiglu f32");
        let (dg, du) = fused::swiglu_bwd(&dh, &g, &u).unwrap();
        let (wg, wu) = ops::swiglu_backward_reference(&dh, &g, &u).unwrap();
        assert_f32(&dg, &wg, "swiglu dg f32");
        assert_f32(&du, &wu, "swiglu du f32");
        assert!(dg.is_contiguous() && du.is_contiguous());

        let (g, u, dh) = (bf16(&g), bf16(&u), bf16(&dh));
        let h = fused::swiglu(&g, &u).unwrap();
        assert_bf16(&h, &ops::swiglu_reference(&g, &u).unwrap(), "swiglu bf16");
        let (dg, du) = fused::swiglu_bwd(&dh, &g, &u).unwrap();
        let (wg, wu) = ops::swiglu_backward_reference(&dh, &g, &u).unwrap();
        assert_bf16(&dg, &wg, "swiglu dg bf16");
        assert_bf16(&du, &wu, "swiglu du bf16");
    }
}

/// `cos, sin: (b, 1, t, dh)` for positions `3 + 2i`.
fn tables(b: usize, t: usize, dh: usize) -> (Tensor, Tensor) {
    let inv: Vec<f32> = (0..dh / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / dh as f32))
        .collect();
    let pos: Vec<u32> = (0..b * t).map(|i| 3 + 2 * i as u32).collect();
    rope_ref::tables(&inv, &pos, b, t, DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn rope_matches_plain() {
    // (2, 3, 5, 6): half 3; (2, 4, 33, 64): 16896 elements, split into row pieces of 256 rows.
    for (i, &[b, h, t, dh]) in [[2, 3, 5, 6], [2, 4, 33, 64]].iter().enumerate() {
        let s = 10 * i as u64;
        let x = randn(&[b, h, t, dh], s + 7, 2.0);
        let dy = randn(&[b, h, t, dh], s + 8, 1.0);
        let (cos, sin) = tables(b, t, dh);
        let y = fused::rope(&x, &cos, &sin).unwrap();
        assert_f32(
            &y,
            &rope_ref::apply_reference(&x, &cos, &sin).unwrap(),
            "rope f32",
        );
        let dx = fused::rope_bwd(&dy, &cos, &sin).unwrap();
        let want = rope_ref::apply_backward_reference(&dy, &cos, &sin).unwrap();
        assert_f32(&dx, &want, "rope_bwd f32");

        let (x, dy, cos, sin) = (bf16(&x), bf16(&dy), bf16(&cos), bf16(&sin));
        let y = fused::rope(&x, &cos, &sin).unwrap();
        assert_bf16(
            &y,
            &rope_ref::apply_reference(&x, &cos, &sin).unwrap(),
            "rope bf16",
        );
        let dx = fused::rope_bwd(&dy, &cos, &sin).unwrap();
        let want = rope_ref::apply_backward_reference(&dy, &cos, &sin).unwrap();
        assert_bf16(&dx, &want, "rope_bwd bf16");
    }
}

#[test]
fn rope_broadcasts_a_table_of_batch_one() {
    let x = randn(&[3, 2, 4, 8], 9, 1.0);
    let (cos, sin) = tables(1, 4, 8);
    let y = fused::rope(&x, &cos, &sin).unwrap();
    assert_f32(
        &y,
        &rope_ref::apply_reference(&x, &cos, &sin).unwrap(),
        "rope batch-1 table",
    );
}

#[test]
fn attention_softmax_matches_plain() {
    // (1, 2, 3·37, 37): rows with a 5-element tail; (1, 1, 2·130, 130): many rayon tasks. A
    // causal mask with a window, so rows hold −∞; scale 1/√6 is not exact in bf16 (rounded as
    // candle does).
    for (i, &(hkv, g, t)) in [(2, 3, 37), (1, 2, 130)].iter().enumerate() {
        let s = 10 * i as u64;
        let raw = randn(&[1, hkv, g * t, t], s + 50, 6.0);
        let dp = randn(&[1, hkv, g * t, t], s + 51, 1.0);
        let mask = ops::causal_mask(t, Some(t / 2 + 1), &Device::Cpu).unwrap();
        let scale = 1.0 / 6f64.sqrt();
        for (raw, dp) in [(raw.clone(), dp.clone()), (bf16(&raw), bf16(&dp))] {
            let dt = raw.dtype();
            let p = fused::attn_softmax(&raw, &mask, scale).unwrap();
            let want = ops::attention_probs_reference(&raw, &mask, scale).unwrap();
            // Probabilities are f32 whatever the scores' dtype; bf16 scores scale identically.
            assert_f32(&p, &want, &format!("attn_softmax {dt:?}"));
            let ds = fused::attn_softmax_bwd(&want, &dp, scale).unwrap();
            let want = ops::attention_grad_reference(&want, &dp, scale).unwrap();
            match dt {
                DType::F32 => assert_f32(&ds, &want, "attn_softmax_bwd f32"),
                _ => assert_bf16(&ds, &want, "attn_softmax_bwd bf16"),
            }
        }
    }
}

/// Random targets in `0..v`, with the first and last ids present.
fn targets(n: usize, v: usize, seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
    t[0] = 0;
    t[n - 1] = v as u32 - 1;
    Tensor::new(t.as_slice(), &Device::Cpu).unwrap()
}

#[test]
fn cross_entropy_matches_plain() {
    // (5, 13); (37, 1001): several tasks in both ops, a 9-element tail per row.
    for (i, &(n, v)) in [(5, 13), (37, 1001)].iter().enumerate() {
        let s = 10 * i as u64;
        let logits = randn(&[n, v], s + 10, 8.0);
        let tgt = targets(n, v, s + 11);
        for logits in [logits.clone(), bf16(&logits)] {
            let dt = logits.dtype();
            let stats = fused::ce_fwd(&logits, &tgt).unwrap();
            let want = ops::cross_entropy_reference(&logits, &tgt).unwrap();
            assert_f32(&stats, &want, &format!("ce_fwd {dt:?}"));
            let lse = stats.i((.., 0)).unwrap();
            let d = fused::ce_bwd(&logits, &tgt, &lse, 0.37).unwrap();
            let want = ops::cross_entropy_grad_reference(&logits, &tgt, 0.37).unwrap();
            match dt {
                DType::F32 => assert_f32(&d, &want, "ce_bwd f32"),
                _ => assert_bf16(&d, &want, "ce_bwd bf16"),
            }
        }
    }
}

#[test]
fn inputs_at_an_offset_and_strided_inputs() {
    // A contiguous view at an offset into a larger buffer is read in place.
    let big = randn(&[9, 37], 20, 2.0);
    let w = randn(&[37], 21, 1.0);
    let x = big.narrow(0, 2, 5).unwrap();
    assert!(x.is_contiguous() && x.layout().start_offset() > 0);
    let y = fused::rms_norm(&x, &w, 1e-6).unwrap();
    assert_f32(
        &y,
        &ops::rms_norm_reference(&x, &w, 1e-6).unwrap(),
        "rms_norm at offset",
    );
    // The raw op refuses a strided tensor, naming the op and the layout...
    let xt = randn(&[37, 5], 22, 1.0).t().unwrap();
    let err = xt.apply_op2_no_bwd(&w, &RmsNorm { eps: 1e-6 }).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("rms_norm: `x` must be contiguous"), "{msg}");
    // ... and the function copies it first.
    let y = fused::rms_norm(&xt, &w, 1e-6).unwrap();
    assert_f32(
        &y,
        &ops::rms_norm_reference(&xt, &w, 1e-6).unwrap(),
        "rms_norm strided",
    );
    let g = randn(&[7, 4], 23, 3.0).t().unwrap();
    let u = randn(&[4, 7], 24, 1.0);
    let h = fused::swiglu(&g, &u).unwrap();
    assert_f32(
        &h,
        &ops::swiglu_reference(&g, &u).unwrap(),
        "swiglu strided",
    );
}

#[test]
fn bad_inputs_are_errors() {
    let x = randn(&[3, 8], 30, 1.0);
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    let m = msg(fused::rms_norm(&x, &bf16(&randn(&[8], 31, 1.0)), 1e-6));
    assert!(m.contains("rms_norm: `w` is BF16 but `x` is F32"), "{m}");
    let m = msg(fused::rms_norm(&x, &randn(&[7], 31, 1.0), 1e-6));
    assert!(
        m.contains("rms_norm: `w` has shape [7], expected [8]"),
        "{m}"
    );
    let m = msg(fused::swiglu(&x, &x.to_dtype(DType::F64).unwrap()));
    assert!(m.contains("swiglu: `u` is F64"), "{m}");
    let tgt = Tensor::new(&[1u32, 8, 2], &Device::Cpu).unwrap();
    let m = msg(fused::ce_fwd(&x, &tgt));
    assert!(
        m.contains("target 8 of row 1 is outside the vocabulary of 8"),
        "{m}"
    );
    let (cos, sin) = tables(1, 3, 6);
    let m = msg(fused::rope(&x.reshape((1, 1, 3, 8)).unwrap(), &cos, &sin));
    assert!(m.contains("rope: `cos` has shape [1, 1, 3, 6]"), "{m}");
}

/// The whole chunked cross-entropy (ops.rs) on bf16: the loss and `dh` of the fused path against
/// the plain chain on the same bf16 hidden states and lm_head.
#[test]
fn chunked_cross_entropy_bf16_matches_plain() {
    let h = bf16(&randn(&[11, 16], 40, 1.0));
    let w = bf16(&randn(&[50, 16], 41, 2.0));
    let tgt: Vec<Option<u32>> = (0..11u32)
        .map(|i| (i % 3 != 1).then_some(i * 7 % 50))
        .collect();
    let (loss, dh) = ops::chunked_cross_entropy(&h, &w, &tgt, 0.5, 4).unwrap();
    let mut want_loss = 0f64;
    let mut want_dh = h.zeros_like().unwrap().to_dtype(DType::F32).unwrap();
    for (i, t) in tgt.iter().enumerate() {
        let Some(t) = *t else { continue };
        let logits = h.i(i..i + 1).unwrap().matmul(&w.t().unwrap()).unwrap();
        let tt = Tensor::new(&[t], &Device::Cpu).unwrap();
        let st = ops::cross_entropy_reference(&logits, &tt).unwrap();
        want_loss += st.i((0, 1)).unwrap().to_scalar::<f32>().unwrap() as f64;
        let d = ops::cross_entropy_grad_reference(&logits, &tt, 0.5).unwrap();
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

/// Every op gives the same bits on the AVX-512, AVX2 and baseline paths (no FMA, fixed summation
/// order), so a run does not depend on the CPU it lands on.
#[test]
fn every_instruction_set_gives_the_same_bits() {
    use cpu::ISA_CAP;
    use std::sync::atomic::Ordering;
    let x = randn(&[9, 300], 60, 3.0);
    let w = randn(&[300], 61, 1.0);
    let (cos, sin) = tables(2, 5, 64);
    let q = randn(&[2, 3, 5, 64], 62, 2.0);
    let logits = randn(&[7, 333], 63, 8.0);
    let tgt = targets(7, 333, 64);
    let mask = ops::causal_mask(37, Some(20), &Device::Cpu).unwrap();
    let sc = randn(&[1, 2, 74, 37], 65, 6.0);
    let all = |dt: DType| -> Vec<Vec<f32>> {
        let c = |t: &Tensor| t.to_dtype(dt).unwrap();
        let (x, w, q, cos, sin, logits, sc) =
            (c(&x), c(&w), c(&q), c(&cos), c(&sin), c(&logits), c(&sc));
        let (dg, du) = fused::swiglu_bwd(&x, &x, &w.broadcast_as((9, 300)).unwrap()).unwrap();
        let stats = fused::ce_fwd(&logits, &tgt).unwrap();
        let p = fused::attn_softmax(&sc, &mask, 0.3).unwrap();
        [
            fused::rms_norm(&x, &w, 1e-5).unwrap(),
            fused::rms_norm_bwd(&x, &x, &w, 1e-5).unwrap(),
            fused::swiglu(&x, &x).unwrap(),
            dg,
            du,
            fused::rope(&q, &cos, &sin).unwrap(),
            fused::rope_bwd(&q, &cos, &sin).unwrap(),
            fused::ce_bwd(&logits, &tgt, &stats.i((.., 0)).unwrap(), 0.5).unwrap(),
            stats,
            fused::attn_softmax_bwd(&p, &sc, 0.3).unwrap(),
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

/// One shape of [`tiled_attention_matches_plain`]: `(b, t, heads, kv_heads, head_dim)`, a sliding
/// window, packed rows (sample lengths of each row).
struct AttnCase {
    dims: (usize, usize, usize, usize, usize),
    window: Option<usize>,
    packed: Option<Vec<Vec<usize>>>,
    what: &'static str,
}

/// `(out, dq, dk, dv)` of the model's attention ([`ops::attend`]) on `path`, inputs of dtype `dt`
/// (rounded through bf16 first when `via_bf16`).
fn attend_on(c: &AttnCase, dt: DType, path: ops::AttnPath, via_bf16: bool) -> [Tensor; 4] {
    let (b, t, h, hkv, dh) = c.dims;
    let s = ops::AttnShape {
        b,
        t,
        heads: h,
        kv_heads: hkv,
        head_dim: dh,
    };
    let n = b * t;
    let cast = |x: Tensor| {
        let x = if via_bf16 { bf16(&x) } else { x };
        x.to_dtype(dt).unwrap()
    };
    let q = cast(randn(&[n, h * dh], 70, 1.5));
    let k = cast(randn(&[n, hkv * dh], 71, 1.5));
    let v = cast(randn(&[n, hkv * dh], 72, 1.0));
    let d_out = cast(randn(&[n, h * dh], 73, 1.0));
    let (cos, sin) = tables(b, t, dh);
    let (cos, sin) = (cast(cos), cast(sin));
    let segs: Option<Vec<u32>> = c.packed.as_ref().map(|rows| {
        rows.iter()
            .flat_map(|lens| {
                assert_eq!(lens.iter().sum::<usize>(), t);
                lens.iter()
                    .enumerate()
                    .flat_map(|(i, &l)| std::iter::repeat_n(i as u32, l))
            })
            .collect()
    });
    let mask = ops::AttnMask::new(segs.as_deref(), b, t, c.window, &Device::Cpu).unwrap();
    let (o, cache) = ops::attend(&q, &k, &v, &s, &cos, &sin, &mask, path).unwrap();
    let (dq, dk, dv) = ops::attention_backward(&d_out, &cache, &s, &cos, &sin).unwrap();
    [o, dq, dk, dv]
}

/// Names of the four tensors [`attend_on`] returns.
const ATTN_OUTPUTS: [&str; 4] = ["out", "dq", "dk", "dv"];

/// The f32 rule for a tiled attention against the plain path: both compute in f32; the tiled one
/// sums scores in another order, rescales by e^(m_old − m_new) and takes P = e^(s − lse) in the
/// backward, D = rowsum(dO∘O) for Σ dP∘P: a few f32 ulps of each term, far under 1e-5 of the
/// largest element.
fn assert_attention_f32(c: &AttnCase, got: &[Tensor; 4], plain: &[Tensor; 4]) {
    const TOL: f32 = 1e-5;
    for (name, (g, w)) in ATTN_OUTPUTS.iter().zip(got.iter().zip(plain)) {
        let e = rel_err(g, w);
        eprintln!("{} {name}: relative error {e:.2e}", c.what);
        assert!(
            e <= TOL,
            "{} {name}: relative error {e:e} > {TOL:e}",
            c.what
        );
    }
}

/// The bf16 rule: `got` (bf16 inputs, f32 accumulation) against `truth` (the plain path in f32 on
/// the same bf16-rounded inputs). The plain bf16 path rounds P to bf16 before P·V and dP, dS
/// between its products: a few bf16 roundings (2^-8 relative each) of terms as large as the
/// result. `got` is held to the plain bf16 path's own error against the truth plus one rounding of
/// the largest element (2^-8: its rotated q/k are bf16 as the plain path's are, its output is
/// rounded once), and to 2% overall.
fn assert_attention_bf16(
    c: &AttnCase,
    got: &[Tensor; 4],
    plain: &[Tensor; 4],
    truth: &[Tensor; 4],
) {
    const TOL: f32 = 2e-2;
    const ONE_ROUNDING: f32 = 1.0 / 256.0;
    for (i, name) in ATTN_OUTPUTS.iter().enumerate() {
        assert_eq!(got[i].dtype(), DType::BF16);
        let e = rel_err(&got[i], &truth[i]);
        let e_plain = rel_err(&plain[i], &truth[i]);
        eprintln!(
            "{} {name}: relative error {e:.2e} (plain bf16: {e_plain:.2e})",
            c.what
        );
        assert!(
            e <= TOL && e <= e_plain + ONE_ROUNDING,
            "{} {name}: relative error {e:e} (plain bf16 {e_plain:e})",
            c.what
        );
    }
}

#[test]
fn tiled_attention_matches_plain() {
    // Odd T everywhere (not a multiple of the 64-query/64-key tiles), several tiles per head.
    let cases = [
        AttnCase {
            dims: (2, 77, 8, 2, 16),
            window: None,
            packed: None,
            what: "causal GQA 8/2",
        },
        AttnCase {
            dims: (1, 130, 4, 1, 24),
            window: None,
            packed: None,
            what: "causal MQA",
        },
        AttnCase {
            dims: (2, 12, 4, 2, 8),
            window: Some(5),
            packed: None,
            what: "sliding window 5 over 12",
        },
        AttnCase {
            dims: (2, 141, 4, 2, 16),
            window: Some(50),
            packed: None,
            what: "sliding window 50 over 141",
        },
        AttnCase {
            dims: (2, 99, 4, 2, 16),
            window: None,
            packed: Some(vec![vec![30, 50, 19], vec![1, 70, 28]]),
            what: "packed rows of 3 samples",
        },
        AttnCase {
            dims: (2, 99, 4, 1, 16),
            window: Some(20),
            packed: Some(vec![vec![10, 60, 29], vec![65, 33, 1]]),
            what: "packed rows of 3 samples, window 20, MQA",
        },
    ];
    for c in &cases {
        let plain = attend_on(c, DType::F32, ops::AttnPath::Plain, false);
        let tiled = attend_on(c, DType::F32, ops::AttnPath::Tiled, false);
        assert_attention_f32(c, &tiled, &plain);
    }
}

#[test]
fn tiled_attention_bf16_matches_plain_within_its_rounding() {
    // bf16 inputs (and rotary tables, and the rotated q/k), f32 accumulation on the tiled path;
    // the rule is assert_attention_bf16's.
    for c in [
        AttnCase {
            dims: (2, 77, 8, 2, 16),
            window: None,
            packed: None,
            what: "bf16 causal GQA 8/2",
        },
        AttnCase {
            dims: (2, 99, 4, 1, 16),
            window: Some(20),
            packed: Some(vec![vec![10, 60, 29], vec![65, 33, 1]]),
            what: "bf16 packed, window, MQA",
        },
    ] {
        let truth = attend_on(&c, DType::F32, ops::AttnPath::Plain, true);
        let plain = attend_on(&c, DType::BF16, ops::AttnPath::Plain, false);
        let tiled = attend_on(&c, DType::BF16, ops::AttnPath::Tiled, false);
        assert_attention_bf16(&c, &tiled, &plain, &truth);
    }
}

/// Under bf16 autocast the tiled attention's tile products take bf16-rounded operands, as every
/// other product of an autocast step (regression: it computed in f32, so f32 noise in `q, k, v, dO`
/// — oneDNN vs the fallback's summation order — reached the gradients instead of vanishing in the
/// rounding). Checked as what rounding means: f32 inputs give the same bits as the same inputs
/// rounded to bf16 first (tolerance 0: rounding is idempotent, the kernel's sums run in a fixed
/// order). Without autocast the two differ (the f32 kernel reads the unrounded values), so the
/// check is not vacuous. Three key tiles (T = 150), GQA 4/2.
#[test]
fn tiled_attention_under_autocast_rounds_its_operands_to_bf16() {
    let (b, h, hkv, t, dh) = (2, 4, 2, 150, 16);
    let q = randn(&[b, h, t, dh], 80, 1.5);
    let k = randn(&[b, hkv, t, dh], 81, 1.5);
    let v = randn(&[b, hkv, t, dh], 82, 1.0);
    let d_o = randn(&[b, t, h, dh], 83, 1.0);
    let starts = Tensor::zeros((1, t), DType::U32, &Device::Cpu).unwrap();
    let r = |x: &Tensor| bf16(x).to_dtype(DType::F32).unwrap();
    let (qr, kr, vr, d_or) = (r(&q), r(&k), r(&v), r(&d_o));
    let run = |[q, k, v, d_o]: [&Tensor; 4]| -> [Tensor; 5] {
        let (o, lse) = fused::flash::flash_attn(q, k, v, &starts, 0.25).unwrap();
        let (dq, dk, dv) =
            fused::flash::flash_attn_bwd(q, k, v, &o, &lse, d_o, &starts, 0.25).unwrap();
        [o, lse, dq, dk, dv]
    };
    let names = ["o", "lse", "dq", "dk", "dv"];
    {
        let _autocast = crate::blas::autocast::scope(true);
        let raw = run([&q, &k, &v, &d_o]);
        let rounded = run([&qr, &kr, &vr, &d_or]);
        for (name, (a, b)) in names.iter().zip(raw.iter().zip(&rounded)) {
            assert_eq!(a.dtype(), DType::F32, "{name}");
            let e = rel_err(a, b);
            assert!(
                e == 0.0,
                "autocast {name}: f32 vs bf16-rounded inputs differ by {e:e}"
            );
        }
    }
    let raw = run([&q, &k, &v, &d_o]);
    let rounded = run([&qr, &kr, &vr, &d_or]);
    for (name, (a, b)) in names.iter().zip(raw.iter().zip(&rounded)) {
        let e = rel_err(a, b);
        eprintln!("f32 {name}: unrounded vs rounded inputs {e:.2e}");
        assert!(
            e > 1e-4,
            "f32 {name}: rounding the inputs changes nothing ({e:e})"
        );
    }
}

/// Under autocast the tile products take bf16 operands, `P` and `dS` included: one tile (T = 40,
/// causal) against the formulas in plain ops with `Q, K, V, dO` rounded and `S = Q·Kᵀ·scale`.
/// Forward: `o = bf16(e^(S − m))·V / Σ e^(S − m)` (the unnormalised `P` rounded, as torch's CPU
/// flash kernel; the row sum unrounded). Backward, with `P = e^(S − L)` from the forward's
/// log-sum-exp, `D = rowsum(dO ∘ O)`, `dS = P ∘ (dO·Vᵀ − D)·scale`: `dQ = bf16(dS)·K`,
/// `dK = bf16(dS)ᵀ·Q`, `dV = bf16(P)ᵀ·dO`. Tolerance 1e-5: f32 summation order and the kernel's
/// own `exp` (an entry that lands on the other side of a bf16 boundary would move a result by
/// ~1e-3; none does here). The same formulas on unrounded `P` and `dS` are > 1e-4 away (checked):
/// without `P`'s rounding `o` is 7.8e-4 off, `dV` 1.3e-3; without `dS`'s `dQ` 2.3e-3.
#[test]
fn tiled_attention_under_autocast_rounds_p_and_ds() -> Result<()> {
    let (t, dh, scale) = (40, 16, 0.25);
    let q = randn(&[1, 1, t, dh], 93, 1.5);
    let k = randn(&[1, 1, t, dh], 94, 1.5);
    let v = randn(&[1, 1, t, dh], 95, 1.0);
    let d_o = randn(&[1, t, 1, dh], 96, 1.0);
    let starts = Tensor::zeros((1, t), DType::U32, &Device::Cpu)?;
    let (o, lse, got) = {
        let _autocast = crate::blas::autocast::scope(true);
        let (o, lse) = fused::flash::flash_attn(&q, &k, &v, &starts, scale)?;
        let g = fused::flash::flash_attn_bwd(&q, &k, &v, &o, &lse, &d_o, &starts, scale)?;
        (o, lse, g)
    };
    let r = |x: &Tensor| bf16(x).to_dtype(DType::F32);
    let (qr, kr, vr) = (r(&q)?, r(&k)?, r(&v)?);
    let dor = r(&d_o)?.transpose(1, 2)?.contiguous()?; // (1, 1, T, Dh)
    let o = o.transpose(1, 2)?.contiguous()?;
    let lse = lse.reshape((1, 1, t, 1))?;
    let mask = ops::causal_mask(t, None, &Device::Cpu)?.reshape((1, 1, t, t))?;
    let s = (qr.matmul(&kr.t()?)? * scale)?.broadcast_add(&mask)?;
    let e = s.broadcast_sub(&s.max_keepdim(3)?)?.exp()?;
    let l = e.sum_keepdim(3)?;
    let fwd = |e: &Tensor| e.matmul(&vr)?.broadcast_div(&l);
    let err = rel_err(&o, &fwd(&r(&e)?)?);
    assert!(err < 1e-5, "o vs its formula on bf16 operands: {err:e}");
    let err = rel_err(&o, &fwd(&e)?);
    assert!(err > 1e-4, "o: the rounding of P is visible: {err:e}");
    let p = s.broadcast_sub(&lse)?.exp()?;
    let dd = (&dor * &o)?.sum_keepdim(3)?;
    let ds = (p.clone() * dor.matmul(&vr.t()?)?.broadcast_sub(&dd)?)?.affine(scale, 0.0)?;
    let formulas = |p: &Tensor, ds: &Tensor| -> Result<[Tensor; 3]> {
        Ok([ds.matmul(&kr)?, ds.t()?.matmul(&qr)?, p.t()?.matmul(&dor)?])
    };
    let want = formulas(&r(&p)?, &r(&ds)?)?;
    let unrounded = formulas(&p, &ds)?;
    for (name, (g, (w, u))) in ["dq", "dk", "dv"].iter().zip(
        [&got.0, &got.1, &got.2]
            .into_iter()
            .zip(want.iter().zip(&unrounded)),
    ) {
        let e = rel_err(g, w);
        assert!(e < 1e-5, "{name} vs its formula on bf16 operands: {e:e}");
        let eu = rel_err(g, u);
        assert!(eu > 1e-4, "{name}: the rounding of P/dS is visible: {eu:e}");
    }
    Ok(())
}

#[test]
fn tiled_attention_bad_inputs_are_errors() {
    let q = randn(&[1, 4, 10, 8], 1, 1.0);
    let k = randn(&[1, 2, 10, 8], 2, 1.0);
    let starts = Tensor::new(&[[0u32, 0, 0, 0, 0, 0, 0, 0, 9, 9]], &Device::Cpu).unwrap();
    let e = fused::flash::flash_attn(&q, &k, &k, &starts, 0.3).unwrap_err();
    assert!(format!("{e}").contains("query 8 starts at key 9"), "{e}");
    let k3 = randn(&[1, 3, 10, 8], 2, 1.0);
    let e = fused::flash::flash_attn(&q, &k3, &k3, &starts, 0.3).unwrap_err();
    assert!(format!("{e}").contains("Hkv dividing H"), "{e}");
    let short = Tensor::new(&[[0u32, 1, 2]], &Device::Cpu).unwrap();
    let e = fused::flash::flash_attn(&q, &k, &k, &short, 0.3).unwrap_err();
    assert!(format!("{e}").contains("`starts`"), "{e}");
}

mod flash_ref;
mod lora;
