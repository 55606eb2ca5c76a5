//! GeGLU against its f64 reference (f32: 2e-6 relative to the largest entry, a few f32 roundings
//! of values of order 1; bf16: 1e-2, two bf16 roundings of 2⁻⁸ each), and against candle's own
//! tanh-GELU (`Tensor::gelu`) in the forward.

use super::*;
use candle_core::{DType, Device};

fn data(n: usize, seed: u64) -> Vec<f32> {
    // A fixed spread over [-6, 6): the tanh saturates at both ends.
    (0..n)
        .map(|i| {
            let x = ((i as u64 * 2654435761 + seed * 40503) % 10007) as f32 / 10007.0;
            12.0 * x - 6.0
        })
        .collect()
}

fn max_rel(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b).abs()))
        / scale
}

fn run(dt: DType, tol: f64) {
    let n = 3 * 257;
    let (g, u, dh) = (data(n, 1), data(n, 2), data(n, 3));
    let t = |v: &[f32]| {
        Tensor::from_slice(v, (3, 257), &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    };
    let (gt, ut, dht) = (t(&g), t(&u), t(&dh));
    let back = |x: &Tensor| -> Vec<f32> {
        x.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    // The reference on the values the op actually read (rounded to `dt`).
    let f64s = |x: &Tensor| back(x).iter().map(|&v| v as f64).collect::<Vec<_>>();
    let (g64, u64_, dh64) = (f64s(&gt), f64s(&ut), f64s(&dht));
    let y = back(&geglu(&gt, &ut).unwrap());
    let e = max_rel(&y, &geglu_reference(&g64, &u64_));
    assert!(e <= tol, "{dt:?} forward {e:e}");
    let (dg, du) = geglu_backward(&dht, &gt, &ut).unwrap();
    let (rdg, rdu) = geglu_backward_reference(&dh64, &g64, &u64_);
    let (eg, eu) = (max_rel(&back(&dg), &rdg), max_rel(&back(&du), &rdu));
    assert!(eg <= tol && eu <= tol, "{dt:?} dg {eg:e} du {eu:e}");
}

#[test]
fn geglu_matches_reference_f32() {
    run(DType::F32, 2e-6);
}

#[test]
fn geglu_matches_reference_bf16() {
    run(DType::BF16, 1e-2);
}

#[test]
fn geglu_gate_is_candles_tanh_gelu() {
    let g = Tensor::from_slice(&data(512, 7), 512, &Device::Cpu).unwrap();
    let ones = Tensor::ones(512, DType::F32, &Device::Cpu).unwrap();
    let ours: Vec<f32> = geglu(&g, &ones).unwrap().to_vec1().unwrap();
    let candle: Vec<f32> = g.gelu().unwrap().to_vec1().unwrap();
    let e = ours
        .iter()
        .zip(&candle)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(e <= 1e-5, "{e:e}");
}

/// The fused op equals the chain of candle ops it replaced bit for bit (tolerance 0: the loops take
/// the chain's f32 steps in its order, and both round to the storage type at the same points), in
/// f32, bf16 and f16, on 13·1377 elements (two rayon tasks, the second partial) with gates out to
/// ±12 (the tanh saturates on both sides). So Gemma's goldens and the families' tests are unchanged.
#[test]
fn fused_geglu_is_the_candle_chain_bit_for_bit() {
    use crate::test_util::{bits, randn};
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (i, shape) in [[3, 7], [13, 1377]].iter().enumerate() {
            let s = 10 * i as u64;
            let c = |x: Tensor| x.to_dtype(dt).unwrap();
            let g = c(randn(shape, s + 4, 12.0));
            let u = c(randn(shape, s + 5, 2.0));
            let dh = c(randn(shape, s + 6, 1.0));
            let h = geglu(&g, &u).unwrap();
            assert_eq!(h.dtype(), dt);
            let want = reference::geglu_chain(&g, &u).unwrap();
            assert!(bits(&h) == bits(&want), "{dt:?} {shape:?} forward");
            let (dg, du) = geglu_backward(&dh, &g, &u).unwrap();
            let (wg, wu) = reference::geglu_backward_chain(&dh, &g, &u).unwrap();
            assert!(bits(&dg) == bits(&wg), "{dt:?} {shape:?} dg");
            assert!(bits(&du) == bits(&wu), "{dt:?} {shape:?} du");
            assert!(dg.is_contiguous() && du.is_contiguous());
        }
    }
}

/// The kernels' slice reference (`geglu_fwd`, `geglu_bwd` with a precision's rounding) against the
/// f64 formulation: f32 within 2e-6 of the largest entry (a few f32 roundings), and equal to the
/// fused CPU op's f32 results exactly (one formulation).
#[test]
fn kernel_reference_matches_f64_and_the_cpu_op() {
    use rtune_backend::Precision;
    let n = 1001;
    let (g, u, dh) = (data(n, 11), data(n, 12), data(n, 13));
    let h = reference::geglu_fwd(&g, &u, Precision::F32);
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let e = max_rel(&h, &geglu_reference(&f64s(&g), &f64s(&u)));
    assert!(e <= 2e-6, "geglu_fwd {e:e}");
    let out = reference::geglu_bwd(&dh, &g, &u, Precision::F32);
    let (rdg, rdu) = geglu_backward_reference(&f64s(&dh), &f64s(&g), &f64s(&u));
    let (eg, eu) = (max_rel(&out[..n], &rdg), max_rel(&out[n..], &rdu));
    assert!(eg <= 2e-6 && eu <= 2e-6, "geglu_bwd dg {eg:e} du {eu:e}");
    let t = |v: &[f32]| Tensor::from_slice(v, n, &Device::Cpu).unwrap();
    let op_h: Vec<f32> = geglu(&t(&g), &t(&u)).unwrap().to_vec1().unwrap();
    assert_eq!(op_h, h);
    let (dg, du) = geglu_backward(&t(&dh), &t(&g), &t(&u)).unwrap();
    assert_eq!(dg.to_vec1::<f32>().unwrap(), out[..n]);
    assert_eq!(du.to_vec1::<f32>().unwrap(), out[n..]);
}
