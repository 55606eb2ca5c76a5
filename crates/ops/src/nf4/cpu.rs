//! [`Nf4Weight`] → full precision on the CPU, multi-threaded (rayon) and table-driven.
//!
//! `value[i] = quant_map[code[i]] * absmax[i / blocksize]` in f32, then rounded (RNE) to the output
//! dtype — bitsandbytes' `dequantize_4bit`. Per block the scale is decoded once and the 16 possible
//! products are formed and converted once, so the inner loop is two table loads and two stores per
//! packed byte, with no float work (the result is the same as converting each product on its own).

use candle_core::{DType, Device, Tensor};
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;
use half::{bf16, f16};
use rayon::prelude::*;

use super::{Nf4Weight, QuantError, Result};

/// Blocks per parallel work item (16384 elements: 64 KiB of f32 output).
const CHUNK_BLOCKS: usize = 256;
/// Below this many elements one thread does it all (rayon's hand-off costs more).
const PARALLEL_MIN: usize = 1 << 16;

/// The f32 → output conversion applied to each block's 16 scaled code values.
trait Convert {
    type Out: Copy + Send + Sync;
    fn cvt(x: f32) -> Self::Out;
}
struct ToF32;
struct ToBf16Bits;
struct ToF16Bits;
impl Convert for ToF32 {
    type Out = f32;
    #[inline(always)]
    fn cvt(x: f32) -> f32 {
        x
    }
}
impl Convert for ToBf16Bits {
    type Out = u16;
    #[inline(always)]
    fn cvt(x: f32) -> u16 {
        f32_to_bf16_bits(x)
    }
}
impl Convert for ToF16Bits {
    type Out = u16;
    #[inline(always)]
    fn cvt(x: f32) -> u16 {
        f16::from_f32(x).to_bits()
    }
}

/// f32 → bf16 bits, round to nearest even (NaN stays a quiet NaN): what `half::bf16::from_f32`
/// and CUDA's `__float2bfloat16_rn` compute, inlined (16 calls per block are in the hot loop).
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

impl Nf4Weight {
    /// The dequantized weight, row-major, `[numel]` f32.
    pub fn dequantize_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel()];
        self.dequant_into::<ToF32>(&mut out);
        out
    }

    /// Dequantize into `out` (`[numel]`), e.g. a buffer reused layer after layer.
    pub fn dequantize_into_f32(&self, out: &mut [f32]) -> Result<()> {
        self.check_out(out.len())?;
        self.dequant_into::<ToF32>(out);
        Ok(())
    }

    /// Dequantize into `out` (`[numel]`), each value rounded from f32 to bf16 (nearest-even).
    pub fn dequantize_into_bf16(&self, out: &mut [bf16]) -> Result<()> {
        self.check_out(out.len())?;
        self.dequant_into::<ToBf16Bits>(out.reinterpret_cast_mut());
        Ok(())
    }

    /// Dequantize into `out` (`[numel]`), each value rounded from f32 to f16 (nearest-even).
    pub fn dequantize_into_f16(&self, out: &mut [f16]) -> Result<()> {
        self.check_out(out.len())?;
        self.dequant_into::<ToF16Bits>(out.reinterpret_cast_mut());
        Ok(())
    }

    /// The dequantized weight as a tensor of `shape` in `dtype` on `device` (dequantized on the CPU;
    /// the CUDA kernels live in `rtune-ops`). F32/BF16/F16 are produced directly; other float
    /// dtypes go through f32.
    pub fn to_tensor(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let n = self.numel();
        let cerr = |op| move |source| QuantError::Candle { op, source };
        let shape = self.shape.as_slice();
        match dtype {
            DType::BF16 | DType::F16 => {
                let mut bits = vec![0u16; n];
                if dtype == DType::BF16 {
                    self.dequant_into::<ToBf16Bits>(&mut bits);
                    Tensor::from_vec(bits.reinterpret_into::<bf16>(), shape, device)
                } else {
                    self.dequant_into::<ToF16Bits>(&mut bits);
                    Tensor::from_vec(bits.reinterpret_into::<f16>(), shape, device)
                }
                .map_err(cerr("to_tensor"))
            }
            _ => Tensor::from_vec(self.dequantize_f32(), shape, device)
                .and_then(|t| t.to_dtype(dtype))
                .map_err(cerr("to_tensor")),
        }
    }

    fn check_out(&self, got: usize) -> Result<()> {
        let want = self.numel();
        if got != want {
            return Err(QuantError::OutLen { got, want });
        }
        Ok(())
    }

    /// `out: [numel]`. Work items are runs of whole blocks, so each starts on a byte boundary
    /// (blocksize is even).
    fn dequant_into<C: Convert>(&self, out: &mut [C::Out]) {
        debug_assert_eq!(out.len(), self.numel());
        let bs = self.blocksize;
        let chunk = CHUNK_BLOCKS * bs;
        let work = |(ci, o): (usize, &mut [C::Out])| {
            let bytes = &self.packed[ci * chunk / 2..];
            for (j, ob) in o.chunks_mut(bs).enumerate() {
                let scale = self.absmax.get(ci * CHUNK_BLOCKS + j);
                let table: [C::Out; 16] =
                    std::array::from_fn(|k| C::cvt(self.quant_map[k] * scale));
                decode_block(&bytes[j * bs / 2..], ob, &table);
            }
        };
        if out.len() >= PARALLEL_MIN {
            out.par_chunks_mut(chunk).enumerate().for_each(work);
        } else {
            out.chunks_mut(chunk).enumerate().for_each(work);
        }
    }
}

/// One block: `out[2i] = table[hi(bytes[i])]`, `out[2i+1] = table[lo(bytes[i])]`; a last odd
/// element takes the high nibble of its byte. `bytes` may run past the block.
#[inline(always)]
fn decode_block<T: Copy>(bytes: &[u8], out: &mut [T], table: &[T; 16]) {
    // The common case, 64 elements from 32 bytes, with fixed sizes so it unrolls.
    if let (Ok(o), Some(b)) = (
        <&mut [T; 64]>::try_from(&mut *out),
        bytes.first_chunk::<32>(),
    ) {
        for (pair, &byte) in o.chunks_exact_mut(2).zip(b) {
            pair[0] = table[(byte >> 4) as usize];
            pair[1] = table[(byte & 15) as usize];
        }
        return;
    }
    let last_byte = out.len() / 2;
    let mut pairs = out.chunks_exact_mut(2);
    for (pair, &byte) in (&mut pairs).zip(bytes) {
        pair[0] = table[(byte >> 4) as usize];
        pair[1] = table[(byte & 15) as usize];
    }
    if let [last] = pairs.into_remainder() {
        *last = table[(bytes[last_byte] >> 4) as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nf4::quantize_nf4;

    /// Element by element, no tables, no threads: `quant_map[code] * absmax`, then convert.
    fn reference(w: &Nf4Weight) -> Vec<f32> {
        (0..w.numel())
            .map(|i| {
                let byte = w.packed[i / 2];
                let code = if i % 2 == 0 { byte >> 4 } else { byte & 15 };
                w.quant_map[code as usize] * w.absmax.get(i / w.blocksize)
            })
            .collect()
    }

    #[test]
    fn bf16_rounding_matches_half() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            f32::INFINITY,
        ];
        let edges = (0..1u32 << 20).map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B9)));
        for x in specials.into_iter().chain(edges) {
            for x in [x, -x] {
                assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(x).to_bits(), "{x:e}");
            }
        }
        assert!(bf16::from_bits(f32_to_bf16_bits(f32::NAN)).is_nan());
    }

    #[test]
    fn threaded_table_dequant_equals_the_plain_formula() {
        // 100_003 elements: several parallel chunks, a short last chunk and block, an odd count.
        // Bit-exact: both compute the same single f32 product per element.
        let n = 100_003;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i as f32) * 0.618).sin() * (1.0 + (i / 64 % 7) as f32))
            .collect();
        for dq in [false, true] {
            let w = quantize_nf4(&x, &[n], dq).unwrap();
            let want = reference(&w);
            let got = w.dequantize_f32();
            assert!(got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
            let mut b16 = vec![bf16::ZERO; n];
            w.dequantize_into_bf16(&mut b16).unwrap();
            assert!(b16.iter().zip(&want).all(|(a, b)| *a == bf16::from_f32(*b)));
            let mut h16 = vec![f16::ZERO; n];
            w.dequantize_into_f16(&mut h16).unwrap();
            assert!(h16.iter().zip(&want).all(|(a, b)| *a == f16::from_f32(*b)));
            assert!(matches!(
                w.dequantize_into_f32(&mut vec![0f32; n - 1]),
                Err(QuantError::OutLen { .. })
            ));
        }
    }
}
