//! One layer's expert stack, `(E, out, in)`, as the op reads it: in the compute dtype, in f32
//! panels ([`PanelStack`]: f32 on a CPU where [`panels::fast`] says so), or in NF4 (`[model]
//! quantize_experts`), one [`Nf4Weight`] per expert.
//!
//! An NF4 stack holds expert `e`'s `(out, in)` matrix quantized on its own, exactly as
//! bitsandbytes' `quantize_4bit` quantizes that 2-D tensor (`rtune_ops::nf4::quantize_tensor`:
//! blocks of 64 over the row-major matrix, with double quantization its own mean offset and
//! nested blocks of 256), so expert `e` dequantizes to bitsandbytes' `dequantize_4bit` of its
//! slice (`tests/parity/make_nf4_experts_golden.py`). Resident: `n/2 + 4·n/64` bytes for `n`
//! elements (≈ 0.56 byte a parameter; double-quantized ≈ 0.52), against 4 in f32.
//!
//! The op never dequantizes the whole stack: each expert that received tokens is dequantized when
//! its product runs and dropped after it ([`Stack::expert`], and in the grouped path
//! `Weights::expert_f32` per expert job: at most one expert a worker thread at a time).

use std::borrow::Cow;

use candle_core::{bail, DType, Device, Result, Tensor};

use super::panels::{self, PanelStack};
use rtune_ops::nf4::{
    Absmax, Nf4Weight, QuantType, BLOCKSIZE, DYNAMIC_SIGNED, NESTED_BLOCKSIZE, NF4,
};

/// Expert `e`'s matrices of a stack in NF4, each `(out, in)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Stack {
    pub experts: Vec<Nf4Weight>,
    /// `(E, out, in)`.
    pub dims: (usize, usize, usize),
}

impl Nf4Stack {
    /// Quantizes `t: (E, out, in)` (any float dtype) expert by expert; one expert's f32 copy is
    /// alive at a time.
    pub fn quantize(t: &Tensor, double_quant: bool) -> Result<Nf4Stack> {
        let (e_n, out, inp) = t.dims3()?;
        let experts = (0..e_n)
            .map(|e| {
                rtune_ops::nf4::quantize_tensor(&t.get(e)?, double_quant).map_err(|err| {
                    candle_core::Error::Msg(format!(
                        "moe: quantizing expert {e} of the ({e_n}, {out}, {inp}) stack: {err}"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Nf4Stack {
            experts,
            dims: (e_n, out, inp),
        })
    }

    /// Bytes held: each expert's packed codes, scales and tables.
    pub fn resident_bytes(&self) -> usize {
        self.experts.iter().map(Nf4Weight::resident_bytes).sum()
    }

    /// Every expert dequantized, `(E, out, in)` in `dtype`: the reference the tests and the
    /// merged export compare against (the op itself never forms it).
    pub fn dequantize(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let each = (0..self.dims.0)
            .map(|e| self.expert(e, dtype, device))
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&each, 0)
    }

    /// Expert `e`'s `(out, in)` in `dtype` (f32 products rounded once to a 16-bit dtype, as
    /// bitsandbytes' `dequantize_4bit` into that dtype).
    pub fn expert(&self, e: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let Some(w) = self.experts.get(e) else {
            bail!("moe: expert {e} of an NF4 stack of {}", self.experts.len());
        };
        w.to_tensor(dtype, device)
            .map_err(|err| candle_core::Error::Msg(format!("moe: dequantizing expert {e}: {err}")))
    }
}

/// Transport of NF4 experts between the ranks of a sharded base (`rtune_model::shard`): each
/// expert as one record of bytes, its packed codes `[ceil(n/2)]`, then its scales, `[b]` f32
/// little-endian (`b = ceil(n/64)` blocks of its `n = out·in` elements), or with double
/// quantization the scales' codes `[b]` u8, the second-level scales `[ceil(b/256)]` f32 and the
/// offset, one f32. The code tables are not sent: every expert holds bitsandbytes' own ([`NF4`],
/// [`DYNAMIC_SIGNED`], blocksizes 64 and 256), as [`Nf4Stack::quantize`] makes them;
/// [`Nf4Stack::records`] refuses any other. Records are concatenated in expert order, so a
/// gather of every rank's records (its experts, in order) is the whole stack's.
impl Nf4Stack {
    /// One expert's record length for `(out, in)` experts.
    pub fn record_len(out: usize, inp: usize, double_quant: bool) -> usize {
        let n = out * inp;
        let b = n.div_ceil(BLOCKSIZE);
        n.div_ceil(2)
            + match double_quant {
                true => b + 4 * b.div_ceil(NESTED_BLOCKSIZE) + 4,
                false => 4 * b,
            }
    }

    /// Whether the experts are double-quantized (`None`: no expert).
    pub fn double_quant(&self) -> Option<bool> {
        self.experts.first().map(|w| w.absmax.is_double())
    }

    /// Every expert's record, concatenated in expert order (`E` records of
    /// [`record_len`](Self::record_len) bytes each).
    pub fn records(&self) -> Result<Vec<u8>> {
        let (_, out, inp) = self.dims;
        let dq = self.double_quant().unwrap_or(false);
        let mut bytes = Vec::with_capacity(self.experts.len() * Self::record_len(out, inp, dq));
        for (e, w) in self.experts.iter().enumerate() {
            let standard = w.quant_map == NF4
                && w.quant_type == QuantType::Nf4
                && w.blocksize == BLOCKSIZE
                && w.shape == [out, inp]
                && w.absmax.is_double() == dq;
            if !standard {
                bail!(
                    "moe: NF4 expert {e} of the {:?} stack is not bitsandbytes' NF4 of ({out}, \
                     {inp}) with blocksize 64 (double quantization {dq}): it has no record",
                    self.dims
                );
            }
            bytes.extend_from_slice(&w.packed);
            match &w.absmax {
                Absmax::Plain(a) => a.iter().for_each(|x| bytes.extend(x.to_le_bytes())),
                Absmax::Double {
                    codes,
                    nested_absmax,
                    nested_quant_map,
                    offset,
                    nested_blocksize,
                } => {
                    if nested_quant_map[..] != DYNAMIC_SIGNED
                        || *nested_blocksize != NESTED_BLOCKSIZE
                    {
                        bail!(
                            "moe: NF4 expert {e} of the {:?} stack has its own second-level \
                             table: it has no record",
                            self.dims
                        );
                    }
                    bytes.extend_from_slice(codes);
                    nested_absmax
                        .iter()
                        .for_each(|x| bytes.extend(x.to_le_bytes()));
                    bytes.extend(offset.to_le_bytes());
                }
            }
        }
        Ok(bytes)
    }

    /// The stack of `dims = (E, out, in)` from its `E` records ([`records`](Self::records)),
    /// each expert's values once dequantized in `dtype` (the dtype it was quantized from).
    pub fn from_records(
        bytes: &[u8],
        dims: (usize, usize, usize),
        double_quant: bool,
        dtype: DType,
    ) -> Result<Nf4Stack> {
        let (e_n, out, inp) = dims;
        let len = Self::record_len(out, inp, double_quant);
        if bytes.len() != e_n * len {
            bail!(
                "moe: {} bytes of NF4 expert records for a {dims:?} stack; expected {e_n} of {len}",
                bytes.len()
            );
        }
        let n = out * inp;
        let b = n.div_ceil(BLOCKSIZE);
        let f32s = |v: &[u8]| -> Vec<f32> {
            v.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let experts = (0..e_n)
            .map(|e| {
                let r = &bytes[e * len..(e + 1) * len];
                let (packed, rest) = r.split_at(n.div_ceil(2));
                let absmax = match double_quant {
                    false => Absmax::Plain(f32s(rest)),
                    true => {
                        let (codes, rest) = rest.split_at(b);
                        let (nested, offset) = rest.split_at(rest.len() - 4);
                        Absmax::Double {
                            codes: codes.to_vec(),
                            nested_absmax: f32s(nested),
                            nested_quant_map: DYNAMIC_SIGNED.to_vec(),
                            offset: f32s(offset)[0],
                            nested_blocksize: NESTED_BLOCKSIZE,
                        }
                    }
                };
                let w = Nf4Weight {
                    shape: vec![out, inp],
                    packed: packed.to_vec(),
                    absmax,
                    quant_map: NF4,
                    quant_type: QuantType::Nf4,
                    blocksize: BLOCKSIZE,
                    dtype,
                };
                w.check().map_err(|err| {
                    candle_core::Error::Msg(format!("moe: NF4 expert {e}'s record: {err}"))
                })?;
                Ok(w)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Nf4Stack { experts, dims })
    }
}

/// A stack as [`super::Experts`] borrows it.
#[derive(Debug, Clone, Copy)]
pub enum Stack<'a> {
    /// `(E, out, in)` in the compute dtype.
    Dense(&'a Tensor),
    /// f32 on the CPU, in panels.
    Panels(&'a PanelStack),
    Nf4(&'a Nf4Stack),
}

impl<'a> From<&'a Tensor> for Stack<'a> {
    fn from(t: &'a Tensor) -> Self {
        Stack::Dense(t)
    }
}

impl<'a> From<&'a Nf4Stack> for Stack<'a> {
    fn from(s: &'a Nf4Stack) -> Self {
        Stack::Nf4(s)
    }
}

impl<'a> Stack<'a> {
    /// `(E, out, in)`.
    pub fn dims3(&self) -> Result<(usize, usize, usize)> {
        match self {
            Stack::Dense(t) => t.dims3(),
            Stack::Panels(p) => Ok(p.dims),
            Stack::Nf4(s) => Ok(s.dims),
        }
    }

    pub fn dims(&self) -> Vec<usize> {
        match self {
            Stack::Dense(t) => t.dims().to_vec(),
            Stack::Panels(PanelStack { dims, .. }) | Stack::Nf4(Nf4Stack { dims, .. }) => {
                vec![dims.0, dims.1, dims.2]
            }
        }
    }

    /// Whether the grouped f32 CPU path reads it: a dense f32 CPU tensor, panels, or NF4
    /// (which dequantizes to f32 on the CPU).
    pub(super) fn f32_cpu(&self) -> bool {
        match self {
            Stack::Dense(t) => t.dtype() == DType::F32 && t.device().is_cpu(),
            Stack::Panels(_) | Stack::Nf4(_) => true,
        }
    }

    /// Expert `e`'s `(out, in)` in `dtype` on `device`: a view of the dense stack (as stored),
    /// or the panels' or the NF4 expert's values (a fresh tensor, dropped by the caller after
    /// its products).
    pub fn expert(&self, e: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        match self {
            Stack::Dense(t) => t.get(e),
            Stack::Panels(p) => {
                let (_, out, inp) = p.dims;
                Tensor::from_vec(p.unpack(e)?, (out, inp), device)?.to_dtype(dtype)
            }
            Stack::Nf4(s) => s.expert(e, dtype, device),
        }
    }

    /// The grouped path's source of expert weights: the contiguous dense stack's f32 elements,
    /// the panels, or the NF4 experts.
    pub(super) fn source(&self) -> Result<Source<'a>> {
        Ok(match self {
            Stack::Dense(t) => Source::Dense(t.contiguous()?),
            Stack::Panels(p) => Source::Panels(p),
            Stack::Nf4(s) => Source::Nf4(s),
        })
    }
}

/// [`Stack::source`]: what the grouped path holds for one call.
pub(super) enum Source<'a> {
    Dense(Tensor),
    Panels(&'a PanelStack),
    Nf4(&'a Nf4Stack),
}

/// The elements of a [`Source`] for the products: the dense stack's whole slice, the panels, or
/// nothing (the NF4 experts are dequantized one job at a time by [`Weights::expert_f32`]).
pub(super) enum Weights<'a> {
    Dense(&'a [f32]),
    Panels(panels::PanelSlice<'a>),
    Nf4(&'a Nf4Stack),
}

/// One expert's frozen `(out, in)` for its products, row-major or in panels: borrowed from the
/// stack, or an NF4 expert dequantized (row-major) into a buffer dropped after its products.
pub(super) enum ExpertWeight<'a> {
    Rows(Cow<'a, [f32]>),
    Panels(&'a [f32]),
}

impl Weights<'_> {
    /// Whether [`Weights::expert_f32`] gives panels (the products' scratch depends on it).
    pub(super) fn in_panels(&self) -> bool {
        match self {
            Weights::Dense(_) => false,
            Weights::Panels(_) => true,
            Weights::Nf4(_) => false,
        }
    }

    /// Expert `e`'s `(out, in)` (`len = out·in` elements) as its products read it.
    pub(super) fn expert_f32(&self, e: usize, len: usize) -> Result<ExpertWeight<'_>> {
        match self {
            Weights::Dense(w) => match w.get(e * len..(e + 1) * len) {
                Some(s) => Ok(ExpertWeight::Rows(Cow::Borrowed(s))),
                None => bail!(
                    "moe grouped: expert {e} past a stack of {} elements",
                    w.len()
                ),
            },
            Weights::Panels(p) => {
                let w = p.expert(e)?;
                if w.len() < len {
                    bail!(
                        "moe grouped: panels of {} elements, the product wants {len}",
                        w.len()
                    );
                }
                Ok(ExpertWeight::Panels(w))
            }
            Weights::Nf4(s) => {
                let Some(q) = s.experts.get(e) else {
                    bail!(
                        "moe grouped: expert {e} of an NF4 stack of {}",
                        s.experts.len()
                    );
                };
                if q.numel() != len {
                    bail!(
                        "moe grouped: NF4 expert {e} has {} elements, the product wants {len}",
                        q.numel()
                    );
                }
                // Row-major for the `gemm` crate: dequantized into panels instead (whole then
                // packed, or 16 rows at a time), the bench's model with NF4 experts ran 1.1–7.4%
                // slower (8 steps, alternating with 8baf213's binary; session 37).
                Ok(ExpertWeight::Rows(Cow::Owned(q.dequantize_f32())))
            }
        }
    }
}

/// A stack as a model holds it: in the compute dtype, in f32 panels, or NF4.
#[derive(Debug, Clone)]
pub enum StackWeights {
    Dense(Tensor),
    Panels(PanelStack),
    Nf4(Nf4Stack),
}

impl StackWeights {
    /// `t: (E, out, in)` quantized expert by expert (`Some(double_quant)`), or else in panels
    /// when it is f32 on the CPU and [`panels::fast`] says so (`t`'s buffer rewritten in place:
    /// one copy held), or as is.
    pub fn new(t: Tensor, nf4: Option<bool>) -> Result<StackWeights> {
        Ok(match nf4 {
            Some(dq) => StackWeights::Nf4(Nf4Stack::quantize(&t, dq)?),
            None if t.dtype() == DType::F32 && t.device().is_cpu() && panels::fast() => {
                StackWeights::Panels(PanelStack::from_tensor(t)?)
            }
            None => StackWeights::Dense(t),
        })
    }

    pub fn stack(&self) -> Stack<'_> {
        match self {
            StackWeights::Dense(t) => Stack::Dense(t),
            StackWeights::Panels(p) => Stack::Panels(p),
            StackWeights::Nf4(s) => Stack::Nf4(s),
        }
    }

    /// The stack in the compute dtype as loaded, `(E, out, in)`: the dense tensor, or the panels
    /// unpacked (a copy); `None` for NF4.
    pub fn dense(&self, device: &Device) -> Result<Option<Tensor>> {
        Ok(match self {
            StackWeights::Dense(t) => Some(t.clone()),
            StackWeights::Panels(p) => Some(Tensor::from_vec(p.unpack_all()?, p.dims, device)?),
            StackWeights::Nf4(_) => None,
        })
    }

    /// Bytes held (the NF4 experts at their packed size).
    pub fn resident_bytes(&self) -> usize {
        match self {
            StackWeights::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            StackWeights::Panels(p) => p.resident_bytes(),
            StackWeights::Nf4(s) => s.resident_bytes(),
        }
    }
}
