//! Test helpers of the crate: seeded inputs, comparisons with a stated tolerance, finite differences.

use candle_core::{DType, Device, Tensor};
use rtune_backend::Precision;

pub const F32: Precision = Precision::F32;

pub const F32_TOL: f32 = 1e-6;
pub const BF16_ULPS: f32 = 2.0;

/// Each element's f32 bits (a bf16/f16 tensor widened first, which is exact): for results that
/// must equal another formulation's bit for bit.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

pub fn randn(shape: &[usize], seed: u64, scale: f32) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

pub fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `max |got − want| / max |want|`, infinite where one is NaN and the other is not.
pub fn rel_err(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.dims(), want.dims());
    let (g, w) = (flat(got), flat(want));
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let err = g.iter().zip(&w).fold(0f32, |m, (a, b)| {
        let d = match a == b || (a.is_nan() && b.is_nan()) {
            true => 0.0,
            false => (a - b).abs(),
        };
        // A NaN beside a number: an infinite error (`f32::max` would skip the NaN).
        match d.is_nan() {
            true => f32::INFINITY,
            false => m.max(d),
        }
    });
    err / scale
}

pub fn assert_f32(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.dtype(), DType::F32, "{what}");
    let e = rel_err(got, want);
    eprintln!("{what}: relative error {e:.2e}");
    assert!(e <= F32_TOL, "{what}: relative error {e:e} > {F32_TOL:e}");
}

/// The largest difference in bf16 ulps (of the plain value, floored at 1/256 of the largest).
pub fn bf16_ulps(got: &Tensor, want: &Tensor) -> f32 {
    bf16_ulps_floored(got, want, 256.0)
}

/// The largest difference in bf16 ulps of `want`'s largest entry: for sums whose terms cancel,
/// where a small entry moves by an ulp of the terms (the attention's `dq`, `dk`).
pub fn ulps_of_largest(got: &Tensor, want: &Tensor) -> f32 {
    bf16_ulps_floored(got, want, 1.0)
}

/// [`bf16_ulps`] with the ulp floored at `1/div` of `want`'s largest entry.
fn bf16_ulps_floored(got: &Tensor, want: &Tensor, div: f32) -> f32 {
    assert_eq!(got.dims(), want.dims());
    let (g, w) = (flat(got), flat(want));
    let floor = w.iter().fold(0f32, |m, v| m.max(v.abs())) / div;
    let ulp = |v: f32| {
        let v = v.abs().max(floor).max(f32::MIN_POSITIVE);
        f32::from_bits(v.to_bits() & 0x7f80_0000) / 128.0 // 2^(exponent − 7)
    };
    g.iter()
        .zip(&w)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs() / ulp(*b)))
}

pub fn assert_bf16(got: &Tensor, want: &Tensor, what: &str) {
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

pub fn bf16(t: &Tensor) -> Tensor {
    t.to_dtype(DType::BF16).unwrap()
}

/// `max |got − want| / max |want| < 1e-5`: f32 against candle's autograd on the plain formulation
/// (the same math in another order).
pub fn assert_close_t(got: &Tensor, want: &Tensor, what: &str) {
    let scale = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .max(1e-6);
    let err = (got - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(err / scale < 1e-5, "{what}: max err {err} vs scale {scale}");
}

/// Central difference of `f` at `x` along coordinate `i`, in f64.
pub fn fd(f: &dyn Fn(&[f64]) -> f64, x: &[f64], i: usize) -> f64 {
    let h = 1e-6 * x[i].abs().max(1.0);
    let (mut a, mut b) = (x.to_vec(), x.to_vec());
    a[i] += h;
    b[i] -= h;
    (f(&a) - f(&b)) / (2.0 * h)
}

pub fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

pub fn assert_close(got: f32, want: f64, rtol: f64, what: &str) {
    let tol = rtol * want.abs().max(1.0);
    assert!(
        (got as f64 - want).abs() <= tol,
        "{what}: got {got}, want {want}"
    );
}

pub fn rand_tables(b: usize, t: usize, dh: usize) -> (Tensor, Tensor) {
    let inv: Vec<f32> = (0..dh / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / dh as f32))
        .collect();
    let pos: Vec<u32> = (0..b * t).map(|i| 3 + 2 * i as u32).collect();
    crate::rope::tables(&inv, &pos, b, t, DType::F32, &Device::Cpu).unwrap()
}

pub fn targets(n: usize, v: usize, seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
    t[0] = 0;
    t[n - 1] = v as u32 - 1;
    Tensor::new(t.as_slice(), &Device::Cpu).unwrap()
}
