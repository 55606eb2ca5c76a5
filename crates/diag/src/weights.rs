//! Random weights for the diagnostics' models: no checkpoint on disk, any shape. Two draws:
//! - [`Draw::Normal`]: N(0, 0.02²) drawn on the device (norm weights 1), as transformers
//!   initialises a Llama — fast at 8B scale, different every run: `rtune bench`. Drawn in the
//!   final dtype: where the device cannot draw it directly (candle's CUDA `randn` is f32/f64 only)
//!   it is drawn in f32 slices of at most [`CHUNK`] elements, each rounded and copied into the
//!   result, so no full-size f32 copy of a weight ever exists (lm_head of Llama 3 8B: 2.1 GB);
//! - [`Draw::Seeded`]: uniform values from a ChaCha stream seeded by the run's seed and the
//!   tensor's name (norm weights 1 ± 0.1, or ±0.1 as offsets of `1 + w` norms), the same on
//!   every device: `rtune selftest`'s GPU-vs-CPU parity.
//!
//! A normal draw makes the embedding table in host memory whatever the device: the model keeps
//! an untied table on the host on a GPU (it is only gathered from), so it never visits the device
//! (`rtune bench` builds untied models, `bench::model_config`). A seeded draw (small models) makes
//! it on the device like every other weight: a tied table is also the lm_head there, and the model
//! moves an untied one to the host itself.
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
    /// Seeded by this value and each tensor's name.
    Seeded(u64),
}

/// The most f32 elements a normal draw holds at once before rounding to the final dtype (64 MB).
pub const CHUNK: usize = 1 << 24;

/// The table the model only gathers from: made on the host by a normal draw.
const EMBED: &str = "model.embed_tokens.weight";

/// A [`TensorSource`] of random weights in `dtype` on `dev`.
pub struct RandomWeights {
    dev: Device,
    dtype: DType,
    quantize: Quantize,
    draw: Draw,
    /// The quantized tile every 4-bit weight repeats (normal draw; made on first use).
    tile: OnceLock<Nf4Weight>,
    /// Seeded norm weights are drawn around 0 instead of 1 (see [`RandomWeights::norm_offsets`]).
    norm_offsets: bool,
}

impl RandomWeights {
    pub fn new(dev: &Device, dtype: DType, quantize: Quantize, draw: Draw) -> Self {
        Self {
            dev: dev.clone(),
            dtype,
            quantize,
            draw,
            tile: OnceLock::new(),
            norm_offsets: false,
        }
    }

    /// With `on`, a seeded draw's norm weights are ±0.1 (1 ± 0.1 less 1): the offsets of a
    /// model whose norms multiply by `1 + w` (Gemma), which its checkpoints store near 0. The
    /// norms then scale by 1 ± 0.1 as a Llama's do, and a norm that multiplied by `w` alone would
    /// scale by ±0.1.
    pub fn norm_offsets(mut self, on: bool) -> Self {
        self.norm_offsets = on;
        self
    }

    /// `n` values of the seeded draw for `name` under `seed` (FNV-1a of the seed's bytes, then
    /// the name's, seeds the stream).
    pub fn seeded_values(seed: u64, name: &str, n: usize) -> Vec<f32> {
        let key = seed
            .to_le_bytes()
            .into_iter()
            .chain(name.bytes())
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(key);
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

/// N(0, 0.02²) of `shape` in `dtype` on `dev`: directly where the device draws `dtype` (any on
/// the CPU; f32/f64 on CUDA), else in f32 slices of at most [`CHUNK`] elements along dim 0, each
/// rounded and copied into the preallocated result.
fn normal(shape: &[usize], dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
    if dev.is_cpu() || matches!(dtype, DType::F32 | DType::F64) {
        return Tensor::randn(0f64, 0.02, shape, dev)?.to_dtype(dtype);
    }
    normal_in_slices(shape, dtype, dev, CHUNK)
}

/// [`normal`]'s slice path: f32 slices of at most `chunk` elements (at least one row each).
fn normal_in_slices(
    shape: &[usize],
    dtype: DType,
    dev: &Device,
    chunk: usize,
) -> candle_core::Result<Tensor> {
    let rows = shape.first().copied().unwrap_or(1);
    let row: usize = shape.iter().skip(1).product();
    let per = (chunk / row.max(1)).max(1);
    let out = Tensor::zeros(shape, dtype, dev)?;
    let mut at = 0;
    while at < rows {
        let n = per.min(rows - at);
        let mut part = shape.to_vec();
        if let Some(p) = part.first_mut() {
            *p = n;
        }
        let piece = Tensor::randn(0f32, 0.02, part, dev)?.to_dtype(dtype)?;
        out.slice_set(&piece, 0, at)?;
        at += n;
    }
    Ok(out)
}

impl TensorSource for RandomWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let dev = if name == EMBED && self.draw == Draw::Normal {
            &Device::Cpu
        } else {
            &self.dev
        };
        let t = match self.draw {
            Draw::Seeded(_) => {
                return self
                    .stored(name, shape)?
                    .to_dtype(self.dtype)
                    .and_then(|t| t.to_device(dev))
                    .map_err(|e| ModelError::candle(format!("seeded {name}"), e))
            }
            Draw::Normal if name.ends_with("norm.weight") => Tensor::ones(shape, self.dtype, dev),
            Draw::Normal => normal(shape, self.dtype, dev),
        };
        t.map_err(|e| ModelError::candle(format!("random {name}"), e))
    }

    /// Seeded: the f32 values on the CPU (what the model quantizes from); normal: as
    /// [`TensorSource::tensor`].
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        match self.draw {
            Draw::Seeded(seed) => {
                let n = shape.iter().product();
                let mut v = Self::seeded_values(seed, name, n);
                if self.norm_offsets && name.ends_with("norm.weight") {
                    v.iter_mut().for_each(|x| *x -= 1.0);
                }
                Tensor::from_vec(v, shape, &Device::Cpu)
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
        let (Draw::Normal, Quantize::Nf4 { double_quant, .. }) = (self.draw, self.quantize) else {
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
    fn seeded_values_depend_on_the_seed_and_name_only() {
        let up0 = "model.layers.0.mlp.up_proj.weight";
        let a = RandomWeights::seeded_values(5, up0, 64);
        assert_eq!(a, RandomWeights::seeded_values(5, up0, 64));
        assert_ne!(
            a,
            RandomWeights::seeded_values(6, up0, 64),
            "the seed counts"
        );
        assert_ne!(
            a,
            RandomWeights::seeded_values(5, "model.layers.1.mlp.up_proj.weight", 64)
        );
        assert!(a.iter().all(|v| v.abs() <= 0.05));
        let norm = RandomWeights::seeded_values(5, "model.norm.weight", 64);
        assert!(norm.iter().all(|v| (v - 1.0).abs() <= 0.1));
    }

    /// Offset norms are the plain draw less 1: jittered around 0; other weights unchanged.
    #[test]
    fn offset_norms_are_drawn_around_zero() -> Result<(), crate::DiagError> {
        let (plain, offsets) = (
            RandomWeights::new(&Device::Cpu, DType::F32, Quantize::None, Draw::Seeded(5)),
            RandomWeights::new(&Device::Cpu, DType::F32, Quantize::None, Draw::Seeded(5))
                .norm_offsets(true),
        );
        let values = |w: &RandomWeights, name: &str| -> Result<Vec<f32>, crate::DiagError> {
            w.tensor(name, &[64])?
                .to_vec1()
                .map_err(|e| ModelError::candle("test", e).into())
        };
        let norm = "model.layers.0.pre_feedforward_layernorm.weight";
        let (a, b) = (values(&plain, norm)?, values(&offsets, norm)?);
        assert!(a.iter().zip(&b).all(|(a, b)| a - 1.0 == *b));
        assert!(b.iter().all(|v| v.abs() <= 0.1) && b.iter().any(|v| v.abs() > 0.05));
        let up = "model.layers.0.mlp.up_proj.weight";
        assert_eq!(values(&plain, up)?, values(&offsets, up)?);
        Ok(())
    }

    #[test]
    fn a_quantized_tile_repeats_to_the_asked_shape() -> Result<(), crate::DiagError> {
        let nf4 = Quantize::linears(true);
        let w = RandomWeights::new(&Device::Cpu, DType::F32, nf4, Draw::Normal);
        let q = w.quantized("q_proj.weight", &[512, 4096])?.expect("4-bit");
        assert_eq!(
            (q.shape.as_slice(), q.packed.len()),
            (&[512, 4096][..], 512 * 4096 / 2)
        );
        let seeded = RandomWeights::new(&Device::Cpu, DType::F32, nf4, Draw::Seeded(0));
        assert!(seeded.quantized("q_proj.weight", &[8, 8])?.is_none());
        Ok(())
    }

    /// A normal draw comes out in the asked dtype and shape with the spread it promises
    /// (std 0.02 ± 10% over 16k values: the sample std's relative error is ~0.6% here).
    #[test]
    fn a_normal_draw_is_in_its_final_dtype() -> Result<(), crate::DiagError> {
        let w = RandomWeights::new(&Device::Cpu, DType::BF16, Quantize::None, Draw::Normal);
        let t = w.tensor("lm_head.weight", &[128, 128])?;
        assert_eq!((t.dtype(), t.dims()), (DType::BF16, &[128, 128][..]));
        let v: Vec<f32> = t
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all()?.to_vec1())
            .map_err(|e| ModelError::candle("test", e))?;
        let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!((std - 0.02).abs() < 0.002, "std {std}");
        Ok(())
    }

    /// The slice path (what CUDA takes for bf16) fills every row: 37 rows in slices of 4.
    #[test]
    fn the_slice_path_fills_every_row() -> Result<(), candle_core::Error> {
        let t = normal_in_slices(&[37, 16], DType::BF16, &Device::Cpu, 64)?;
        assert_eq!((t.dtype(), t.dims()), (DType::BF16, &[37, 16][..]));
        let rows: Vec<Vec<f32>> = t.to_dtype(DType::F32)?.to_vec2()?;
        assert!(rows.iter().all(|r| r.iter().any(|v| *v != 0.0)));
        Ok(())
    }
}
