//! Random weights for the diagnostics' models: no checkpoint on disk, any shape. Two draws:
//! - [`Draw::Normal`]: N(0, 0.02²) drawn on the device (norm weights 1), as transformers
//!   initialises a Llama — fast at 8B scale, different every run: `rtune bench`;
//! - [`Draw::Seeded`]: uniform values from a ChaCha stream seeded by the tensor's name (norm
//!   weights 1 ± 0.1), the same on every device: `rtune selftest`'s GPU-vs-CPU parity.
//!
//! With a 4-bit [`Quantize`], a normal draw serves its linear layers pre-quantized from one tile
//! (see its [`TensorSource::quantized`]); a seeded draw lets the model quantize its stored values, as
//! a real checkpoint would be.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::sync::OnceLock;

use rtune_model::weights::TensorSource;
use rtune_model::{ModelError, Quantize};
use rtune_quant::Nf4Weight;

/// How the values are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Draw {
    Normal,
    Seeded,
}

/// A [`TensorSource`] of random weights in `dtype` on `dev`.
pub struct RandomWeights {
    dev: Device,
    dtype: DType,
    quantize: Quantize,
    draw: Draw,
    /// The quantized tile every 4-bit weight repeats (normal draw; made on first use).
    tile: OnceLock<Nf4Weight>,
}

impl RandomWeights {
    pub fn new(dev: &Device, dtype: DType, quantize: Quantize, draw: Draw) -> Self {
        Self {
            dev: dev.clone(),
            dtype,
            quantize,
            draw,
            tile: OnceLock::new(),
        }
    }

    /// `n` values of the seeded draw for `name` (FNV-1a of the name seeds the stream).
    pub fn seeded_values(name: &str, n: usize) -> Vec<f32> {
        let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        if name.ends_with("norm.weight") {
            return (0..n)
                .map(|_| 1.0 + 0.1 * rng.random_range(-1.0..1.0f32))
                .collect();
        }
        (0..n)
            .map(|_| 0.05 * rng.random_range(-1.0..1.0f32))
            .collect()
    }
}

impl TensorSource for RandomWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let t = match self.draw {
            Draw::Seeded => {
                return self
                    .stored(name, shape)?
                    .to_dtype(self.dtype)
                    .and_then(|t| t.to_device(&self.dev))
                    .map_err(|e| ModelError::candle(format!("seeded {name}"), e))
            }
            Draw::Normal if name.ends_with("norm.weight") => {
                Tensor::ones(shape, self.dtype, &self.dev)
            }
            Draw::Normal => {
                Tensor::randn(0f32, 0.02, shape, &self.dev).and_then(|t| t.to_dtype(self.dtype))
            }
        };
        t.map_err(|e| ModelError::candle(format!("random {name}"), e))
    }

    /// Seeded: the f32 values on the CPU (what the model quantizes from); normal: as
    /// [`TensorSource::tensor`].
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        match self.draw {
            Draw::Seeded => {
                let n = shape.iter().product();
                Tensor::from_vec(Self::seeded_values(name, n), shape, &Device::Cpu)
                    .map_err(|e| ModelError::candle(format!("seeded {name}"), e))
            }
            Draw::Normal => self.tensor(name, shape),
        }
    }

    /// Normal draw, 4-bit: quantizing 7·10⁹ random weights on the CPU would take minutes of an 8B
    /// bench; instead one tile of 2²⁰ random weights is quantized for real, once, and its codes and
    /// scales repeated. The tile spans whole nested blocks (64·256 weights), so every block of the
    /// result is a block bitsandbytes could have produced, and the dequantize kernels do exactly
    /// the work they do on a real checkpoint.
    fn quantized(&self, name: &str, shape: &[usize]) -> Result<Option<Nf4Weight>, ModelError> {
        let (Draw::Normal, Quantize::Nf4 { double_quant }) = (self.draw, self.quantize) else {
            return Ok(None);
        };
        let err = |source| ModelError::Quant {
            path: name.into(),
            source,
        };
        const TILE: usize = 1 << 20;
        let n: usize = shape.iter().product();
        let tile = match self.tile.get() {
            Some(t) => t.clone(),
            None => {
                let values = Tensor::randn(0f32, 0.02, TILE, &Device::Cpu)
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(|e| ModelError::candle(format!("random {name}"), e))?;
                let t = rtune_quant::quantize::quantize_nf4(&values, &[TILE], double_quant)
                    .map_err(err)?;
                self.tile.get_or_init(|| t).clone()
            }
        };
        let cycle = |v: &[u8], len: usize| v.iter().copied().cycle().take(len).collect();
        let blocks = n.div_ceil(tile.blocksize);
        let absmax = match tile.absmax {
            rtune_quant::Absmax::Plain(a) => {
                rtune_quant::Absmax::Plain(a.iter().copied().cycle().take(blocks).collect())
            }
            rtune_quant::Absmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                offset,
                nested_blocksize,
            } => rtune_quant::Absmax::Double {
                codes: cycle(&codes, blocks),
                nested_absmax: nested_absmax
                    .iter()
                    .copied()
                    .cycle()
                    .take(blocks.div_ceil(nested_blocksize))
                    .collect(),
                nested_quant_map,
                offset,
                nested_blocksize,
            },
        };
        Ok(Some(Nf4Weight {
            shape: shape.to_vec(),
            packed: cycle(&tile.packed, n.div_ceil(2)),
            absmax,
            ..tile
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_values_depend_on_the_name_only() {
        let a = RandomWeights::seeded_values("model.layers.0.mlp.up_proj.weight", 64);
        assert_eq!(
            a,
            RandomWeights::seeded_values("model.layers.0.mlp.up_proj.weight", 64)
        );
        assert_ne!(
            a,
            RandomWeights::seeded_values("model.layers.1.mlp.up_proj.weight", 64)
        );
        assert!(a.iter().all(|v| v.abs() <= 0.05));
        let norm = RandomWeights::seeded_values("model.norm.weight", 64);
        assert!(norm.iter().all(|v| (v - 1.0).abs() <= 0.1));
    }

    #[test]
    fn a_quantized_tile_repeats_to_the_asked_shape() -> Result<(), crate::DiagError> {
        let nf4 = Quantize::Nf4 { double_quant: true };
        let w = RandomWeights::new(&Device::Cpu, DType::F32, nf4, Draw::Normal);
        let q = w.quantized("q_proj.weight", &[512, 4096])?.expect("4-bit");
        assert_eq!(
            (q.shape.as_slice(), q.packed.len()),
            (&[512, 4096][..], 512 * 4096 / 2)
        );
        let seeded = RandomWeights::new(&Device::Cpu, DType::F32, nf4, Draw::Seeded);
        assert!(seeded.quantized("q_proj.weight", &[8, 8])?.is_none());
        Ok(())
    }
}
