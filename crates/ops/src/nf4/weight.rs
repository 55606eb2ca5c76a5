//! One 4-bit quantized weight ([`Nf4Weight`]): packed codes, a scale per block ([`Absmax`], plain or
//! double-quantized), the code table ([`QuantType`]), and the size checks every constructor runs.

use candle_core::DType;

use super::error::{QuantError, Result};
use super::tables::{FP4, NF4};

/// Elements per first-level block (bitsandbytes' default; the only size rtune reads or writes).
pub const BLOCKSIZE: usize = 64;
/// Absmax values per second-level block in double quantization (fixed in bitsandbytes).
pub const NESTED_BLOCKSIZE: usize = 256;

/// Which 16-value code table the 4-bit codes index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    Nf4,
    Fp4,
}

impl QuantType {
    pub fn table(self) -> [f32; 16] {
        match self {
            QuantType::Nf4 => NF4,
            QuantType::Fp4 => FP4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Nf4 => "nf4",
            QuantType::Fp4 => "fp4",
        }
    }
}

/// The per-block scales of an [`Nf4Weight`].
#[derive(Debug, Clone, PartialEq)]
pub enum Absmax {
    /// `[n_blocks]` f32: 32 bits per 64 elements (+0.5 bit/param).
    Plain(Vec<f32>),
    /// Double quantization: `absmax[b] = nested_quant_map[codes[b]] * nested_absmax[b / 256] + offset`
    /// (f32 multiply, then f32 add). 8 bits per 64 elements + 32 bits per 64·256 (+0.127 bit/param).
    Double {
        /// `[n_blocks]` u8 indices into `nested_quant_map`.
        codes: Vec<u8>,
        /// `[ceil(n_blocks / nested_blocksize)]` f32.
        nested_absmax: Vec<f32>,
        /// `[256]` f32, bitsandbytes' signed dynamic map ([`super::DYNAMIC_SIGNED`]) when made here.
        nested_quant_map: Vec<f32>,
        /// The mean of the first-level absmax, subtracted before 8-bit quantization.
        offset: f32,
        nested_blocksize: usize,
    },
}

impl Absmax {
    /// The f32 scale of first-level block `b` (for `Double`: decoded exactly as bitsandbytes does).
    #[inline]
    pub fn get(&self, b: usize) -> f32 {
        match self {
            Absmax::Plain(a) => a[b],
            Absmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                offset,
                nested_blocksize,
            } => {
                let q = nested_quant_map[codes[b] as usize] * nested_absmax[b / nested_blocksize];
                q + offset
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Absmax::Plain(a) => a.len(),
            Absmax::Double { codes, .. } => codes.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All first-level scales decoded to f32, `[n_blocks]`.
    pub fn decode(&self) -> Vec<f32> {
        (0..self.len()).map(|b| self.get(b)).collect()
    }

    pub fn is_double(&self) -> bool {
        matches!(self, Absmax::Double { .. })
    }

    fn resident_bytes(&self) -> usize {
        match self {
            Absmax::Plain(a) => 4 * a.len(),
            Absmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                ..
            } => codes.len() + 4 * nested_absmax.len() + 4 * nested_quant_map.len() + 4,
        }
    }
}

/// A 4-bit quantized weight, `shape` row-major (for a linear layer: `[out_features, in_features]`).
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4Weight {
    pub shape: Vec<usize>,
    /// `[ceil(numel / 2)]`: byte `i` holds element `2i` (high nibble) and `2i+1` (low nibble).
    pub packed: Vec<u8>,
    /// One scale per `blocksize` elements: `[ceil(numel / blocksize)]`.
    pub absmax: Absmax,
    /// The code table: value of code `c` is `quant_map[c] * absmax`.
    pub quant_map: [f32; 16],
    pub quant_type: QuantType,
    pub blocksize: usize,
    /// The dtype the weight had before quantization (bnb's quant_state `dtype`); the natural output
    /// dtype of [`Nf4Weight::to_tensor`].
    pub dtype: DType,
}

impl Nf4Weight {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn n_blocks(&self) -> usize {
        self.numel().div_ceil(self.blocksize)
    }

    /// Bytes this weight holds in memory: packed codes, scales, code tables. For a weight of `n`
    /// elements: `n/2 + 4·n/64` (plain) or `n/2 + n/64 + 4·n/16384 + 1028` (double quant).
    pub fn resident_bytes(&self) -> usize {
        self.packed.len() + self.absmax.resident_bytes() + 4 * self.quant_map.len()
    }

    /// Checks the internal sizes agree (every constructor calls it; public fields can be edited).
    pub fn check(&self) -> Result<()> {
        let n = self.numel();
        let bad = |m: String| Err(QuantError::Input(m));
        if self.blocksize == 0 || !self.blocksize.is_multiple_of(2) {
            return bad(format!("blocksize {} must be even and > 0", self.blocksize));
        }
        if self.packed.len() != n.div_ceil(2) {
            return bad(format!(
                "{} packed bytes for {n} elements (shape {:?}); expected {}",
                self.packed.len(),
                self.shape,
                n.div_ceil(2)
            ));
        }
        if self.absmax.len() != self.n_blocks() {
            return bad(format!(
                "{} absmax values for {n} elements in blocks of {}; expected {}",
                self.absmax.len(),
                self.blocksize,
                self.n_blocks()
            ));
        }
        if let Absmax::Double {
            nested_absmax,
            nested_quant_map,
            nested_blocksize,
            ..
        } = &self.absmax
        {
            let want = self.absmax.len().div_ceil((*nested_blocksize).max(1));
            if *nested_blocksize == 0 || nested_absmax.len() != want {
                return bad(format!(
                    "{} nested absmax values for {} blocks in groups of {nested_blocksize}; expected {want}",
                    nested_absmax.len(),
                    self.absmax.len()
                ));
            }
            if nested_quant_map.len() != 256 {
                return bad(format!(
                    "nested quant map has {} entries, expected 256",
                    nested_quant_map.len()
                ));
            }
        }
        Ok(())
    }
}
