//! GeGLU against its f64 reference (f32: 2e-6 relative to the largest entry, a few f32 roundings
//! of values of order 1; bf16: 1e-2, two bf16 roundings of 2⁻⁸ each), and against candle's own
//! tanh-GELU (`Tensor::gelu`) in the forward.

use super::*;
use candle_core::Device;

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
