//! Test helpers of the crate's unit tests.

use candle_core::{Device, Result, Tensor};

/// `shape` of uniform values in [-1, 1), seeded (ChaCha8).
pub(crate) fn randn(shape: &[usize], seed: u64) -> Result<Tensor> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0f32)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}
