//! The frozen base sharded across the ranks of a data-parallel run (issue 37, FSDP-style QLoRA):
//! `[distributed] shard_base`.
//!
//! Each rank keeps a [`Shard`] of every frozen weight — the decoder layers' linear weights (dense,
//! or NF4 with their scales), the embedding table and an untied lm_head: the elements
//! [`span`]`(n, unit, world, rank)` of the weight's row-major flattening, where a unit is one
//! element of a dense weight, a whole first-level block of an NF4 one (64 elements) and with double
//! quantization a whole second-level group (64 · 256), so a piece is whole quantization blocks and
//! its codes are the whole weight's ([`rtune_quant::shard`]). Norms and biases (a few KB a layer)
//! stay whole on every rank.
//!
//! This file holds the shards and their transport; `crate::gathered` turns them into the layers
//! and tables a pass uses. A layer's weights are all-gathered ([`Gather`]) just before it
//! computes — its forward, its recomputation and backward (once for both), a decoding step — into
//! an ordinary [`Layer`](crate::layer::Layer) whose weights are bit for bit those of the
//! unsharded model, so every op, and so every number,
//! is the unsharded model's; the gathered layer is dropped when its pass is done. The embedding
//! table is gathered for each lookup and the lm_head for each head pass, likewise dropped. A rank
//! so holds `1/world` of the base plus one layer's weights (and while the head runs, the
//! lm_head's).
//!
//! Every rank must make the same gathers in the same order: every rank runs every forward and
//! backward of a step (each its own micro-batches; every rank has as many), the evaluation, the
//! reference pass and the decoding of the evaluation prompts. The transport is the world's
//! (`rtune_dist`: MPI's `MPI_Allgatherv` over host memory); on a CUDA rank the gathered weights
//! are then copied to the device. One process (`World::single`) runs the same code with a world
//! of one, its gather a copy.

use candle_core::{DType, Device, Tensor};
use std::ops::Range;

use rtune_quant::{Absmax, Nf4Weight};

/// The collective a sharded model gathers its weights through (`rtune_dist::World` over MPI).
pub trait Gather {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Every rank's `mine`, in rank order, into `out`: rank `r` sends `counts[r]` bytes and
    /// `out.len()` is their sum (`what` names the gather if it waits too long).
    fn all_gather_into(&self, what: &str, mine: &[u8], counts: &[usize], out: &mut [u8]);
}

/// The elements of rank `rank` of `size` in a weight of `n` elements split in units of `unit`:
/// the `ceil(n / unit)` units are dealt in order, the first `units % size` ranks one more than
/// the rest (a world that does not divide the weight gives shards of unequal size; a rank past
/// the last unit gets an empty span at the end).
pub fn span(n: usize, unit: usize, size: usize, rank: usize) -> Range<usize> {
    let units = n.div_ceil(unit);
    let (q, r) = (units / size, units % size);
    let first = rank * q + rank.min(r);
    let len = q + usize::from(rank < r);
    (first * unit).min(n)..((first + len) * unit).min(n)
}

/// This rank's part of a frozen weight: the elements [`Shard::span`] of its flattening.
#[derive(Debug, Clone)]
pub enum Piece {
    /// Little-endian values in `dtype` (the compute dtype, or bf16 under autocast).
    Dense { dtype: DType, bytes: Vec<u8> },
    /// A piece of an NF4 weight ([`Nf4Weight::piece`]).
    Nf4(Nf4Weight),
}

/// One rank's shard of a frozen weight of `shape`.
#[derive(Debug, Clone)]
pub struct Shard {
    pub shape: Vec<usize>,
    pub piece: Piece,
    /// Elements per unit of the split (see [`span`]).
    pub unit: usize,
}

impl Shard {
    /// A dense weight's shard from its piece `t` (1-D, any float dtype; its values as they are).
    pub fn dense(shape: &[usize], t: &Tensor) -> candle_core::Result<Self> {
        Ok(Self {
            shape: shape.to_vec(),
            piece: Piece::Dense {
                dtype: t.dtype(),
                bytes: le_bytes(t)?,
            },
            unit: 1,
        })
    }

    /// An NF4 weight's shard from its piece.
    pub fn nf4(shape: &[usize], q: Nf4Weight) -> Self {
        let unit = rtune_quant::shard::unit(q.absmax.is_double());
        Self {
            shape: shape.to_vec(),
            piece: Piece::Nf4(q),
            unit,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rank `rank` of `size`'s elements.
    pub fn span(&self, size: usize, rank: usize) -> Range<usize> {
        span(self.numel(), self.unit, size, rank)
    }

    /// Bytes this rank holds for the weight.
    pub fn resident_bytes(&self) -> usize {
        match &self.piece {
            Piece::Dense { bytes, .. } => bytes.len(),
            Piece::Nf4(q) => q.resident_bytes(),
        }
    }

    /// The piece's values in `dtype` (bf16 autocast rounds a dense piece once, as the unsharded
    /// model rounds its weights; an NF4 piece is unchanged: it dequantizes into the new dtype).
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<Self> {
        let Piece::Dense { dtype: from, bytes } = &self.piece else {
            return Ok(self.clone());
        };
        let n = bytes.len() / from.size_in_bytes();
        let t = Tensor::from_raw_buffer(bytes, *from, &[n], &Device::Cpu)?.to_dtype(dtype)?;
        Self::dense(&self.shape, &t).map(|s| Self {
            unit: self.unit,
            ..s
        })
    }

    /// The counts every rank sends of this weight: `of(span)` bytes each.
    fn counts(&self, size: usize, of: &dyn Fn(&Range<usize>) -> usize) -> Vec<usize> {
        (0..size).map(|r| of(&self.span(size, r))).collect()
    }

    /// A dense weight gathered into `out` (its whole row-major bytes, `numel · dtype` long):
    /// each rank's piece in rank order.
    pub(crate) fn gather_dense_into(
        &self,
        comm: &dyn Gather,
        name: &str,
        out: &mut [u8],
    ) -> candle_core::Result<()> {
        let Piece::Dense { dtype, bytes } = &self.piece else {
            candle_core::bail!("{name}: an NF4 shard gathered as a dense weight");
        };
        let s = dtype.size_in_bytes();
        let counts = self.counts(comm.size(), &|sp| sp.len() * s);
        comm.all_gather_into(&format!("the gather of {name}"), bytes, &counts, out);
        Ok(())
    }

    /// An NF4 weight gathered: each rank's codes and scales in rank order, joined.
    pub(crate) fn gather_nf4(
        &self,
        comm: &dyn Gather,
        name: &str,
    ) -> candle_core::Result<Nf4Weight> {
        let Piece::Nf4(q) = &self.piece else {
            candle_core::bail!("{name}: a dense shard gathered as an NF4 weight");
        };
        let size = comm.size();
        let gather = |what: &str, mine: &[u8], of: &dyn Fn(&Range<usize>) -> usize| {
            let counts = self.counts(size, of);
            let mut out = vec![0u8; counts.iter().sum()];
            let what = format!("the gather of {name}'s {what}");
            comm.all_gather_into(&what, mine, &counts, &mut out);
            out
        };
        let bs = q.blocksize;
        let blocks = |sp: &Range<usize>| sp.end.div_ceil(bs) - sp.start.div_ceil(bs);
        let nibbles = |sp: &Range<usize>| sp.end.div_ceil(2) - sp.start.div_ceil(2);
        let packed = gather("4-bit codes", &q.packed, &nibbles);
        let absmax = match &q.absmax {
            Absmax::Plain(a) => {
                let all = gather("scales", &f32_bytes(a), &|sp| 4 * blocks(sp));
                Absmax::Plain(f32s(&all))
            }
            Absmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                offset,
                nested_blocksize,
            } => {
                let nb = *nested_blocksize;
                let groups = |sp: &Range<usize>| {
                    let b = sp.start.div_ceil(bs)..sp.end.div_ceil(bs);
                    b.end.div_ceil(nb) - b.start.div_ceil(nb)
                };
                let nested = gather("second-level scales", &f32_bytes(nested_absmax), &|sp| {
                    4 * groups(sp)
                });
                Absmax::Double {
                    codes: gather("scale codes", codes, &blocks),
                    nested_absmax: f32s(&nested),
                    nested_quant_map: nested_quant_map.clone(),
                    offset: *offset,
                    nested_blocksize: nb,
                }
            }
        };
        let w = Nf4Weight {
            shape: self.shape.clone(),
            packed,
            absmax,
            quant_map: q.quant_map,
            quant_type: q.quant_type,
            blocksize: bs,
            dtype: q.dtype,
        };
        w.check()
            .map_err(|e| candle_core::Error::Msg(format!("gathering {name}: {e}")))?;
        Ok(w)
    }

    /// The dense dtype of this shard (`None` for NF4).
    pub(crate) fn dense_dtype(&self) -> Option<DType> {
        match &self.piece {
            Piece::Dense { dtype, .. } => Some(*dtype),
            Piece::Nf4(_) => None,
        }
    }
}

/// A tensor of `shape` in `dtype` on `device` whose row-major bytes `fill` writes: the gather
/// lands in the tensor's own buffer (no copy on the CPU).
pub(crate) fn dense_tensor(
    dtype: DType,
    shape: &[usize],
    device: &Device,
    fill: impl FnOnce(&mut [u8]) -> candle_core::Result<()>,
) -> candle_core::Result<Tensor> {
    fn typed<T: bytemuck::Pod + candle_core::WithDType>(
        shape: &[usize],
        fill: impl FnOnce(&mut [u8]) -> candle_core::Result<()>,
    ) -> candle_core::Result<Tensor> {
        let mut v = vec![T::zeroed(); shape.iter().product()];
        fill(bytemuck::cast_slice_mut(&mut v))?;
        Tensor::from_vec(v, shape, &Device::Cpu)
    }
    let t = match dtype {
        DType::F32 => typed::<f32>(shape, fill)?,
        DType::BF16 => typed::<half::bf16>(shape, fill)?,
        DType::F16 => typed::<half::f16>(shape, fill)?,
        other => candle_core::bail!("a sharded weight is f32, bf16 or f16, not {other:?}"),
    };
    t.to_device(device)
}

/// The little-endian bytes of a CPU or device tensor's values (allocated once at their size: a
/// collected `flat_map` would grow by doubling and leave the heap the larger blocks).
fn le_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    fn bytes<T: Copy, const N: usize>(v: &[T], f: fn(T) -> [u8; N]) -> Vec<u8> {
        let mut out = Vec::with_capacity(v.len() * N);
        for &x in v {
            out.extend_from_slice(&f(x));
        }
        out
    }
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => bytes(&t.to_vec1::<f32>()?, f32::to_le_bytes),
        DType::BF16 => bytes(&t.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        DType::F16 => bytes(&t.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        other => candle_core::bail!("a sharded weight is f32, bf16 or f16, not {other:?}"),
    })
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 * v.len());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// For the loader's double quantization of a piece: every rank's first-level absmax, in rank
/// order (the weight's whole absmax, whose mean is the second level's offset).
pub fn gather_absmax(
    comm: &dyn Gather,
    name: &str,
    mine: &[f32],
    shape: &[usize],
    unit: usize,
) -> Vec<f32> {
    let (n, size) = (shape.iter().product::<usize>(), comm.size());
    let bs = rtune_quant::BLOCKSIZE;
    let counts: Vec<usize> = (0..size)
        .map(|r| {
            let sp = span(n, unit, size, r);
            4 * (sp.end.div_ceil(bs) - sp.start.div_ceil(bs))
        })
        .collect();
    let mut out = vec![0u8; counts.iter().sum()];
    comm.all_gather_into(
        &format!("the gather of {name}'s scales for double quantization"),
        &f32_bytes(mine),
        &counts,
        &mut out,
    );
    f32s(&out)
}

/// A weight's shard read from `w` (only its piece) and, when asked, quantized piece by piece:
/// the loader's one door for a sharded weight. `stored_nf4`: the weight as a bnb-4bit
/// checkpoint holds it (read whole; this rank keeps its piece).
pub(crate) fn load_shard(
    w: &dyn crate::weights::TensorSource,
    comm: &dyn Gather,
    name: &str,
    shape: &[usize],
    stored_nf4: Option<Nf4Weight>,
    quantize: rtune_quant::Quantize,
) -> crate::Result<Shard> {
    use crate::ModelError;
    let (size, rank, n) = (comm.size(), comm.rank(), shape.iter().product::<usize>());
    let qerr = |source| ModelError::Quant {
        path: name.into(),
        source,
    };
    if let Some(q) = stored_nf4 {
        // A bnb-4bit checkpoint: the weight is read whole, then this rank keeps its piece.
        let sp = span(
            n,
            rtune_quant::shard::unit(q.absmax.is_double()),
            size,
            rank,
        );
        return Ok(Shard::nf4(shape, q.piece(sp).map_err(qerr)?));
    }
    match quantize {
        rtune_quant::Quantize::None => {
            let t = w.piece(name, shape, span(n, 1, size, rank))?;
            Shard::dense(shape, &t).map_err(|e| ModelError::candle(format!("shard of {name}"), e))
        }
        rtune_quant::Quantize::Nf4 { double_quant } => {
            let unit = rtune_quant::shard::unit(double_quant);
            let t = w.stored_piece(name, shape, span(n, unit, size, rank))?;
            let values = t
                .to_dtype(DType::F32)
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| ModelError::candle(format!("shard of {name}"), e))?;
            let mut q = rtune_quant::shard::quantize_piece(&values).map_err(qerr)?;
            q.dtype = t.dtype();
            if double_quant {
                let all = gather_absmax(comm, name, &q.absmax.decode(), shape, unit);
                let offset = rtune_quant::torch_mean_f32(&all);
                rtune_quant::shard::double_quantize_piece(&mut q, offset).map_err(qerr)?;
            }
            Ok(Shard::nf4(shape, q))
        }
    }
}
