//! The frozen base sharded across the ranks of a data-parallel run (issue 37, FSDP-style QLoRA):
//! `[distributed] shard_base`.
//!
//! Each rank keeps a [`Shard`] of every frozen weight — the decoder layers' linear weights (dense,
//! or NF4 with their scales), a sparse layer's router and expert stacks (`crate::moe::MoeShards`),
//! the embedding table and an untied lm_head: the elements [`span`]`(n, unit, world, rank)` of
//! the weight's row-major flattening, where a unit is one element of a dense weight, a whole
//! first-level block of an NF4 one (64 elements) and with double quantization a whole
//! second-level group (64 · 256), so a piece is whole quantization blocks and its codes are the
//! whole weight's ([`rtune_quant::shard`]); and one whole expert `(out, in)` of an expert stack,
//! dense or NF4 (each expert quantized on its own, sent as its record: [`Piece::Nf4Experts`]).
//! Norms and biases (a few KB a layer) stay whole on every rank.
//!
//! This file holds the shards, what of them a gather moves (`Part`, into a typed `Buf`) and
//! their transport; `crate::gathered` turns them into the layers and tables a pass uses, and
//! `crate::feed` hands a pass its layers. A layer's weights are all-gathered ([`Gather`]) just
//! before it computes — its forward, its recomputation and backward (once for both, or kept from
//! the forward: `keep_gathered_layers`), a decoding step — into an ordinary
//! [`Layer`](crate::layer::Layer) whose weights are bit for bit those of the unsharded model, so
//! every op, and so every number, is the unsharded model's; the gathered layer is dropped when
//! its pass is done. With `prefetch`, the next layer's gathers run on another thread
//! ([`Gather::background`]) while this one computes. The embedding
//! table is gathered for each lookup and the lm_head for each head pass, likewise dropped. A rank
//! so holds `1/world` of the base plus one layer's weights (and while the head runs, the
//! lm_head's).
//!
//! Every rank must make the same gathers in the same order: every rank runs every forward and
//! backward of a step (each its own micro-batches; every rank has as many), the evaluation, the
//! reference pass and the decoding of the evaluation prompts. The transport is the world's
//! (`rtune_dist`: MPI's `MPI_Allgatherv` over host memory); on a CUDA rank the shards live on the
//! GPU and a [`DeviceGather`] (NCCL) gathers them between device buffers
//! (`crate::device_gather`). One process (`World::single`) runs the same code with a world
//! of one, its gather a copy.

use candle_core::{DType, Device, Tensor};
use std::ops::Range;
use std::sync::Arc;

use rtune_experts::moe::Nf4Stack;
use rtune_quant::shard::Pieces;
use rtune_quant::{Absmax, Nf4Weight};

/// The collective a sharded model gathers its weights through (`rtune_dist::World` over MPI).
pub trait Gather {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Every rank's `mine`, in rank order, into `out`: rank `r` sends `counts[r]` bytes and
    /// `out.len()` is their sum (`what` names the gather if it waits too long).
    fn all_gather_into(&self, what: &str, mine: &[u8], counts: &[usize], out: &mut [u8]);
    /// The same transport for another thread, which gathers the next layer while this one
    /// computes (`crate::gathered::Feed`); `None` (the default) when the transport cannot be used
    /// off this thread: every gather then runs here, in turn. Never used by two threads at once:
    /// this thread makes no gather, nor any other collective, until it has waited for the other.
    fn background(&self) -> Option<std::sync::Arc<dyn Gather + Send + Sync>> {
        None
    }
    /// Runs `wait`, this thread waiting for a gather started in the background, as the transport
    /// watches its own collectives (a rank that never joins must not hang this one forever).
    fn waiting(&self, what: &str, wait: &mut dyn FnMut()) {
        let _ = what;
        wait()
    }
}

/// The collective a sharded base gathers its device-resident shards through (on a CUDA rank
/// `rtune_dist`'s NCCL communicator; `crate::device_gather` says how it is used).
pub trait DeviceGather {
    /// `out[at .. at + Σ counts]` = every rank's `mine` in rank order, rank r's `counts[r]`
    /// elements of `mine`'s dtype (`mine`: this rank's, that many; `out`: a 1-D contiguous
    /// buffer of the same dtype and device). Collective: every rank calls it with the same
    /// `counts`, in the same order. May return before the elements have landed where the device
    /// orders later uses after it (`what` names the gather in errors).
    fn all_gather(
        &self,
        what: &str,
        mine: &Tensor,
        counts: &[usize],
        out: &Tensor,
        at: usize,
    ) -> candle_core::Result<()>;
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
    /// A piece of an NF4 weight ([`Pieces::piece`]).
    Nf4(Nf4Weight),
    /// A sparse layer's NF4 expert stack `(E, out, in)` (`[model] quantize_experts`): this
    /// rank's whole experts (a unit is one expert), each quantized on its own, as their records
    /// ([`Nf4Stack::records`]).
    Nf4Experts {
        records: Vec<u8>,
        double_quant: bool,
        /// The dtype the experts were quantized from (what they dequantize to).
        dtype: DType,
    },
}

/// One rank's shard of a frozen weight of `shape`.
#[derive(Debug, Clone)]
pub struct Shard {
    pub shape: Vec<usize>,
    pub piece: Piece,
    /// Elements per unit of the split (see [`span`]).
    pub unit: usize,
    /// The piece on the device, one 1-D tensor per part (`Shard::parts`) in their order, typed
    /// as `Shard::part_dtype` says (`crate::device_gather`); empty while the piece is in host
    /// memory. Once [`upload`](Self::upload)ed, `piece` keeps only the layout: its bytes, codes
    /// and scales are emptied.
    pub device: Vec<Tensor>,
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
            device: Vec::new(),
        })
    }

    /// An NF4 expert stack's shard of `shape = (E, out, in)` from this rank's experts
    /// `mine: (n, out, in)`, the [`span`] of units of one expert each, quantized from `dtype`
    /// (double-quantized or not: every rank says so, also one with no expert).
    pub fn nf4_experts(
        shape: [usize; 3],
        mine: &Nf4Stack,
        double_quant: bool,
        dtype: DType,
    ) -> candle_core::Result<Self> {
        let [_, out, inp] = shape;
        let agree = mine
            .experts
            .iter()
            .all(|w| w.absmax.is_double() == double_quant && w.dtype == dtype);
        if !agree {
            candle_core::bail!(
                "NF4 experts of a {shape:?} stack not all of {dtype:?} with double quantization \
                 {double_quant}"
            );
        }
        Ok(Self {
            shape: shape.to_vec(),
            piece: Piece::Nf4Experts {
                records: mine.records()?,
                double_quant,
                dtype,
            },
            unit: out * inp,
            device: Vec::new(),
        })
    }

    /// The whole NF4 expert stack from its gathered records (one [`Part::Records`] buffer).
    pub(crate) fn join_nf4_experts(&self, name: &str, buf: Buf) -> candle_core::Result<Nf4Stack> {
        let (
            &Piece::Nf4Experts {
                double_quant,
                dtype,
                ..
            },
            &[e, out, inp],
        ) = (&self.piece, &self.shape[..])
        else {
            candle_core::bail!("{name}: a shard {:?} gathered as NF4 experts", self.shape);
        };
        Nf4Stack::from_records(&buf.into_u8()?, (e, out, inp), double_quant, dtype)
            .map_err(|err| candle_core::Error::Msg(format!("gathering {name}: {err}")))
    }

    /// An NF4 weight's shard from its piece.
    pub fn nf4(shape: &[usize], q: Nf4Weight) -> Self {
        let unit = rtune_quant::shard::unit(q.absmax.is_double());
        Self {
            shape: shape.to_vec(),
            piece: Piece::Nf4(q),
            unit,
            device: Vec::new(),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rank `rank` of `size`'s elements.
    pub fn span(&self, size: usize, rank: usize) -> Range<usize> {
        span(self.numel(), self.unit, size, rank)
    }

    /// Bytes this rank holds for the weight (in host memory and on the device).
    pub fn resident_bytes(&self) -> usize {
        let host = match &self.piece {
            Piece::Dense { bytes, .. } => bytes.len(),
            Piece::Nf4(q) => q.resident_bytes(),
            Piece::Nf4Experts { records, .. } => records.len(),
        };
        let device: usize = self
            .device
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        host + device
    }

    /// The shard with its piece on `device` (one tensor per part, [`Shard::device`]) and its
    /// host copy emptied; the layout (shape, dtype, blocks, the NF4 tables) stays. Done once, at
    /// set-up: afterwards only a [`DeviceGather`] gathers it.
    pub fn upload(&self, device: &Device) -> candle_core::Result<Self> {
        if !self.device.is_empty() {
            return Ok(self.clone());
        }
        let mut on = Vec::with_capacity(self.parts().len());
        for &part in self.parts() {
            let dtype = self.part_dtype(part);
            let bytes = self.mine(part)?;
            let n = bytes.len() / dtype.size_in_bytes();
            on.push(Tensor::from_raw_buffer(bytes, dtype, &[n], device)?);
        }
        let piece = match &self.piece {
            Piece::Dense { dtype, .. } => Piece::Dense {
                dtype: *dtype,
                bytes: Vec::new(),
            },
            Piece::Nf4(q) => Piece::Nf4(Nf4Weight {
                shape: q.shape.clone(),
                ..self.nf4_layout("an uploaded shard")?
            }),
            Piece::Nf4Experts {
                double_quant,
                dtype,
                ..
            } => Piece::Nf4Experts {
                records: Vec::new(),
                double_quant: *double_quant,
                dtype: *dtype,
            },
        };
        Ok(Self {
            shape: self.shape.clone(),
            piece,
            unit: self.unit,
            device: on,
        })
    }

    /// The dtype `part`'s elements have (a gather moves whole elements of it).
    pub(crate) fn part_dtype(&self, part: Part) -> DType {
        match (part, &self.piece) {
            (Part::Values, Piece::Dense { dtype, .. }) => *dtype,
            (Part::Scales | Part::Nested, _) => DType::F32,
            _ => DType::U8,
        }
    }

    /// `part`'s tensor on the device ([`upload`](Self::upload)).
    pub(crate) fn on_device(&self, part: Part) -> candle_core::Result<&Tensor> {
        let at = self.parts().iter().position(|&p| p == part);
        match at.and_then(|i| self.device.get(i)) {
            Some(t) => Ok(t),
            None => candle_core::bail!(
                "a shard {:?} with no {part:?} on the device (not uploaded)",
                self.shape
            ),
        }
    }

    /// The piece's values in `dtype` (bf16 autocast rounds a dense piece once, as the unsharded
    /// model rounds its weights; an NF4 piece is unchanged: it dequantizes into the new dtype).
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<Self> {
        let Piece::Dense { dtype: from, bytes } = &self.piece else {
            return Ok(self.clone());
        };
        if let [t] = &self.device[..] {
            return Ok(Self {
                piece: Piece::Dense {
                    dtype,
                    bytes: Vec::new(),
                },
                device: vec![t.to_dtype(dtype)?],
                ..self.clone()
            });
        }
        let n = bytes.len() / from.size_in_bytes();
        let t = Tensor::from_raw_buffer(bytes, *from, &[n], &Device::Cpu)?.to_dtype(dtype)?;
        Self::dense(&self.shape, &t).map(|s| Self {
            unit: self.unit,
            ..s
        })
    }

    /// What a gather of this shard moves, in order: a dense weight's values; an NF4 weight's
    /// codes and scales (with double quantization: the scales' codes and the second-level
    /// scales).
    pub(crate) fn parts(&self) -> &'static [Part] {
        match &self.piece {
            Piece::Dense { .. } => &[Part::Values],
            Piece::Nf4(q) if q.absmax.is_double() => &[Part::Codes, Part::ScaleCodes, Part::Nested],
            Piece::Nf4(_) => &[Part::Codes, Part::Scales],
            Piece::Nf4Experts { .. } => &[Part::Records],
        }
    }

    /// The buffer `part` of the whole weight gathers into: typed as what it becomes.
    pub(crate) fn buffer(&self, part: Part, size: usize) -> candle_core::Result<Buf> {
        let bytes: usize = self.counts(part, size).iter().sum();
        if let Some(t) = self.device.first() {
            let dtype = self.part_dtype(part);
            return Buf::on_device(dtype, bytes / dtype.size_in_bytes(), t.device());
        }
        match (part, &self.piece) {
            (Part::Values, Piece::Dense { dtype, .. }) => {
                Buf::zeroed(*dtype, bytes / dtype.size_in_bytes())
            }
            (Part::Scales | Part::Nested, _) => Ok(Buf::F32(vec![0.0; bytes / 4])),
            _ => Ok(Buf::U8(vec![0; bytes])),
        }
    }

    /// The bytes this rank sends of `part` (native byte order, little-endian on every target
    /// rtune builds for, as the pieces are stored).
    pub(crate) fn mine(&self, part: Part) -> candle_core::Result<&[u8]> {
        if !self.device.is_empty() {
            candle_core::bail!(
                "a shard {:?} on the device gathered through a host transport",
                self.shape
            );
        }
        let q = match (&self.piece, part) {
            (Piece::Dense { bytes, .. }, Part::Values) => return Ok(bytes),
            (Piece::Nf4Experts { records, .. }, Part::Records) => return Ok(records),
            (Piece::Nf4(q), _) => q,
            _ => candle_core::bail!("a dense shard has no {part:?}"),
        };
        Ok(match (part, &q.absmax) {
            (Part::Codes, _) => &q.packed,
            (Part::Scales, Absmax::Plain(a)) => bytemuck::cast_slice(a),
            (Part::ScaleCodes, Absmax::Double { codes, .. }) => codes,
            (Part::Nested, Absmax::Double { nested_absmax, .. }) => {
                bytemuck::cast_slice(nested_absmax)
            }
            _ => candle_core::bail!("this NF4 shard has no {part:?}"),
        })
    }

    /// The bytes every rank sends of `part`, in rank order.
    pub(crate) fn counts(&self, part: Part, size: usize) -> Vec<usize> {
        let elem = match &self.piece {
            Piece::Dense { dtype, .. } => dtype.size_in_bytes(),
            Piece::Nf4(_) => 0,
            // A record a unit (one expert).
            Piece::Nf4Experts { double_quant, .. } => match self.shape[..] {
                [_, out, inp] => Nf4Stack::record_len(out, inp, *double_quant),
                _ => 0,
            },
        };
        // (elements a first-level block, blocks a second-level group)
        let (bs, nb) = match &self.piece {
            Piece::Nf4(q) => match &q.absmax {
                Absmax::Double {
                    nested_blocksize, ..
                } => (q.blocksize, *nested_blocksize),
                Absmax::Plain(_) => (q.blocksize, 1),
            },
            Piece::Dense { .. } | Piece::Nf4Experts { .. } => (1, 1),
        };
        let blocks = |sp: &Range<usize>| sp.start.div_ceil(bs)..sp.end.div_ceil(bs);
        (0..size)
            .map(|r| {
                let sp = self.span(size, r);
                let b = blocks(&sp);
                match part {
                    Part::Values => sp.len() * elem,
                    Part::Codes => sp.end.div_ceil(2) - sp.start.div_ceil(2),
                    Part::Scales => 4 * b.len(),
                    Part::ScaleCodes => b.len(),
                    Part::Nested => 4 * (b.end.div_ceil(nb) - b.start.div_ceil(nb)),
                    Part::Records => sp.len() / self.unit.max(1) * elem,
                }
            })
            .collect()
    }

    /// The whole NF4 weight from its gathered [`parts`](Self::parts), in their order.
    pub(crate) fn join_nf4(&self, name: &str, parts: Vec<Buf>) -> candle_core::Result<Nf4Weight> {
        let q = self.nf4_layout(name)?;
        let mut parts = parts.into_iter();
        let mut next = || {
            parts
                .next()
                .ok_or_else(|| candle_core::Error::Msg(format!("{name}: a gathered part missing")))
        };
        let packed = next()?.into_u8()?;
        let absmax = match &q.absmax {
            Absmax::Plain(_) => Absmax::Plain(next()?.into_f32()?),
            Absmax::Double {
                nested_quant_map,
                offset,
                nested_blocksize,
                ..
            } => Absmax::Double {
                codes: next()?.into_u8()?,
                nested_absmax: next()?.into_f32()?,
                nested_quant_map: nested_quant_map.clone(),
                offset: *offset,
                nested_blocksize: *nested_blocksize,
            },
        };
        let w = Nf4Weight {
            packed,
            absmax,
            ..q
        };
        w.check()
            .map_err(|e| candle_core::Error::Msg(format!("gathering {name}: {e}")))?;
        Ok(w)
    }

    /// The whole NF4 weight's layout: its shape, tables and block sizes, with no codes or scales
    /// (what [`join_nf4`](Self::join_nf4) fills; on a GPU, the host side of a weight whose codes
    /// and scales are gathered on the device).
    pub(crate) fn nf4_layout(&self, name: &str) -> candle_core::Result<Nf4Weight> {
        let Piece::Nf4(q) = &self.piece else {
            candle_core::bail!("{name}: a dense shard gathered as an NF4 weight");
        };
        Ok(Nf4Weight {
            shape: self.shape.clone(),
            packed: Vec::new(),
            absmax: emptied(&q.absmax),
            quant_map: q.quant_map,
            quant_type: q.quant_type,
            blocksize: q.blocksize,
            dtype: q.dtype,
        })
    }

    /// The dense dtype of this shard (`None` for NF4).
    pub(crate) fn dense_dtype(&self) -> Option<DType> {
        match &self.piece {
            Piece::Dense { dtype, .. } => Some(*dtype),
            Piece::Nf4(_) | Piece::Nf4Experts { .. } => None,
        }
    }
}

/// `a`'s kind and tables with no scales.
fn emptied(a: &Absmax) -> Absmax {
    match a {
        Absmax::Plain(_) => Absmax::Plain(Vec::new()),
        Absmax::Double {
            nested_quant_map,
            offset,
            nested_blocksize,
            ..
        } => Absmax::Double {
            codes: Vec::new(),
            nested_absmax: Vec::new(),
            nested_quant_map: nested_quant_map.clone(),
            offset: *offset,
            nested_blocksize: *nested_blocksize,
        },
    }
}

/// What of a shard one gather moves ([`Shard::parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// A dense weight's values.
    Values,
    /// An NF4 weight's packed 4-bit codes.
    Codes,
    /// Its first-level scales, f32.
    Scales,
    /// With double quantization, the scales' 8-bit codes ...
    ScaleCodes,
    /// ... and the second-level scales, f32.
    Nested,
    /// NF4 experts' records ([`Nf4Stack::records`]), bytes.
    Records,
}

impl Part {
    /// For the gather's name (`the gather of q_proj's scales`).
    fn what(self) -> &'static str {
        match self {
            Part::Values => "",
            Part::Codes => "'s 4-bit codes",
            Part::Scales => "'s scales",
            Part::ScaleCodes => "'s scale codes",
            Part::Nested => "'s second-level scales",
            Part::Records => "'s NF4 experts",
        }
    }
}

/// A buffer gathers fill: the typed vector a tensor (or an NF4 weight's field) is then made of
/// without a copy; for shards on the device, a 1-D tensor there.
pub(crate) enum Buf {
    F32(Vec<f32>),
    Bf16(Vec<half::bf16>),
    F16(Vec<half::f16>),
    U8(Vec<u8>),
    Device(Tensor),
}

impl Buf {
    /// `n` zeros of `dtype` (a dense weight's: f32, bf16 or f16).
    pub(crate) fn zeroed(dtype: DType, n: usize) -> candle_core::Result<Self> {
        Ok(match dtype {
            DType::F32 => Buf::F32(vec![0.0; n]),
            DType::BF16 => Buf::Bf16(vec![half::bf16::ZERO; n]),
            DType::F16 => Buf::F16(vec![half::f16::ZERO; n]),
            other => candle_core::bail!("a sharded weight is f32, bf16 or f16, not {other:?}"),
        })
    }

    /// `n` zeros of `dtype` on `device` (a [`Buf::Device`]).
    pub(crate) fn on_device(dtype: DType, n: usize, device: &Device) -> candle_core::Result<Self> {
        Tensor::zeros(n, dtype, device).map(Buf::Device)
    }

    /// The host buffer's bytes (`None` for a device one).
    pub(crate) fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(match self {
            Buf::F32(v) => bytemuck::cast_slice_mut(v),
            Buf::Bf16(v) => bytemuck::cast_slice_mut(v),
            Buf::F16(v) => bytemuck::cast_slice_mut(v),
            Buf::U8(v) => v,
            Buf::Device(_) => return None,
        })
    }

    /// A tensor of `shape` on `device` made of the buffer (no copy on the CPU, nor of a device
    /// buffer on its device).
    pub(crate) fn tensor(self, shape: &[usize], device: &Device) -> candle_core::Result<Tensor> {
        let t = match self {
            Buf::F32(v) => Tensor::from_vec(v, shape, &Device::Cpu)?,
            Buf::Bf16(v) => Tensor::from_vec(v, shape, &Device::Cpu)?,
            Buf::F16(v) => Tensor::from_vec(v, shape, &Device::Cpu)?,
            Buf::Device(t) if t.dtype() != DType::U8 => t.reshape(shape)?,
            Buf::U8(_) | Buf::Device(_) => {
                candle_core::bail!("a weight's values gathered as bytes")
            }
        };
        t.to_device(device)
    }

    /// The device buffer (an NF4 part gathered on a GPU).
    #[cfg(feature = "cuda")]
    pub(crate) fn into_device(self) -> candle_core::Result<Tensor> {
        match self {
            Buf::Device(t) => Ok(t),
            _ => candle_core::bail!("a part gathered in host memory where a device one was due"),
        }
    }

    /// Whether the buffer is a device one.
    pub(crate) fn is_device(&self) -> bool {
        matches!(self, Buf::Device(_))
    }

    /// The codes (a device buffer's copied to the host: a CPU rank's, or the tests').
    pub(crate) fn into_u8(self) -> candle_core::Result<Vec<u8>> {
        match self {
            Buf::U8(v) => Ok(v),
            Buf::Device(t) if t.dtype() == DType::U8 => t.to_vec1(),
            _ => candle_core::bail!("gathered NF4 codes are bytes"),
        }
    }

    fn into_f32(self) -> candle_core::Result<Vec<f32>> {
        match self {
            Buf::F32(v) => Ok(v),
            Buf::Device(t) if t.dtype() == DType::F32 => t.to_vec1(),
            _ => candle_core::bail!("gathered NF4 scales are f32"),
        }
    }
}

/// One gather: `part` of `shard` (weight `name`) into `bufs[buf]` from byte `at`.
pub(crate) struct Job {
    pub shard: Arc<Shard>,
    pub part: Part,
    pub name: String,
    pub buf: usize,
    pub at: usize,
}

/// Runs `jobs` in order through `comm` (every rank runs the same jobs), each into its buffer:
/// a host buffer through `comm` itself, a device one ([`Buf::Device`], for shards on the device)
/// through `device`, in elements of the part's dtype. Allocates nothing on the host: the buffers
/// were made by the thread that planned the gathers, so a gathering thread of its own leaves no
/// memory in its allocator arena.
pub(crate) fn fill(
    comm: &dyn Gather,
    device: Option<&dyn DeviceGather>,
    jobs: &[Job],
    bufs: &mut [Buf],
) -> candle_core::Result<()> {
    for j in jobs {
        let counts = j.shard.counts(j.part, comm.size());
        let n: usize = counts.iter().sum();
        let what = format!("the gather of {}{}", j.name, j.part.what());
        let no_room = || format!("{}: no room for the gathered {:?}", j.name, j.part);
        match bufs.get_mut(j.buf) {
            Some(Buf::Device(out)) => {
                let Some(dg) = device else {
                    candle_core::bail!("{what}: a device buffer and no device transport");
                };
                let elem = j.shard.part_dtype(j.part).size_in_bytes();
                let counts: Vec<usize> = counts.iter().map(|c| c / elem).collect();
                let at = j.at / elem;
                if out.dtype() != j.shard.part_dtype(j.part) || at + n / elem > out.elem_count() {
                    candle_core::bail!("{}", no_room());
                }
                dg.all_gather(&what, j.shard.on_device(j.part)?, &counts, out, at)?;
            }
            Some(b) => {
                let Some(out) = b.bytes_mut().and_then(|b| b.get_mut(j.at..j.at + n)) else {
                    candle_core::bail!("{}", no_room());
                };
                comm.all_gather_into(&what, j.shard.mine(j.part)?, &counts, out);
            }
            None => candle_core::bail!("{}", no_room()),
        }
    }
    Ok(())
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
    let mut out = vec![0f32; counts.iter().sum::<usize>() / 4];
    comm.all_gather_into(
        &format!("the gather of {name}'s scales for double quantization"),
        bytemuck::cast_slice(mine),
        &counts,
        bytemuck::cast_slice_mut(&mut out),
    );
    out
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
        rtune_quant::Quantize::Nf4 { double_quant, .. } => {
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
