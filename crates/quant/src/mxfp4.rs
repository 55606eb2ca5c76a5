//! gpt-oss's MXFP4 expert weights as its released checkpoints store them, dequantized bit for bit
//! as transformers 5.24 does (`integrations/mxfp4.py`, `convert_moe_packed_tensors`).
//!
//! A fused expert tensor `W` of shape `(E, R, C)` (`E` experts; `gate_up_proj`: `R = 2I` rows of
//! `C = H` columns, `down_proj`: `R = H`, `C = I`) is stored as
//! - `<name>_blocks`: u8 `(E, R, C/32, 16)`, two FP4 (E2M1) codes a byte: element `2j` of a
//!   32-element block is the LOW nibble of byte `j`, element `2j + 1` the high nibble;
//! - `<name>_scales`: u8 `(E, R, C/32)`, each block's shared exponent biased by 127 (E8M0).
//!
//! `value = ldexp(FP4[code], scale − 127)` exactly, as torch's `ldexp` gives it: a power-of-two
//! multiple of a value with at most two mantissa bits is exact in f32 and bf16 down to their
//! subnormals, a product past the largest finite value is ±∞ (`6 · 2^127`), and zero stays zero
//! under every scale (`0 · 2^128 = 0`, not NaN). The result is laid out `(E, C, R)` — transformers transposes the last two axes, the layout its `GptOssExperts`
//! multiplies with (`x @ W`).

use candle_core::{DType, Device, Tensor};

use crate::{QuantError, Result};

/// The 16 E2M1 values, indexed by the 4-bit code (sign in bit 3).
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Elements sharing one exponent.
pub const BLOCK: usize = 32;

/// The sizes of a stored expert tensor: `experts × rows` blocks rows of `groups` blocks each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mxfp4Shape {
    pub experts: usize,
    pub rows: usize,
    pub groups: usize,
}

impl Mxfp4Shape {
    /// Reads the shape from the two stored tensors' dims, checking they agree.
    pub fn from_dims(name: &str, blocks: &[usize], scales: &[usize]) -> Result<Self> {
        let bad = |message: String| QuantError::BadTensor {
            tensor: name.to_string(),
            message,
        };
        match (blocks, scales) {
            ([e, r, g, 16], [se, sr, sg]) if (e, r, g) == (se, sr, sg) => Ok(Mxfp4Shape {
                experts: *e,
                rows: *r,
                groups: *g,
            }),
            _ => Err(bad(format!(
                "mxfp4 blocks {blocks:?} and scales {scales:?} are not (E, R, G, 16) and (E, R, G)"
            ))),
        }
    }

    /// The dequantized tensor's columns (`C = 32 · groups`).
    pub fn cols(&self) -> usize {
        self.groups * BLOCK
    }

    fn len(&self) -> usize {
        self.experts * self.rows * self.cols()
    }
}

/// `ldexp(v, scale − 127)` rounded to f32: exact in f64 (every such product is), then exact in
/// f32 unless it overflows to ±∞ (as torch's `ldexp`).
fn ldexp_f32(v: f32, scale: u8) -> f32 {
    (f64::from(v) * 2f64.powi(i32::from(scale) - 127)) as f32
}

/// Dequantizes into f32, laid out `(E, C, R)`.
pub fn dequantize_f32(blocks: &[u8], scales: &[u8], shape: Mxfp4Shape) -> Result<Vec<f32>> {
    let n_blocks = shape.experts * shape.rows * shape.groups;
    if blocks.len() != n_blocks * 16 || scales.len() != n_blocks {
        return Err(QuantError::Input(format!(
            "mxfp4 dequantize: {shape:?} needs {} block bytes and {n_blocks} scales, got {} and {}",
            n_blocks * 16,
            blocks.len(),
            scales.len()
        )));
    }
    let (r, c) = (shape.rows, shape.cols());
    let mut out = vec![0f32; shape.len()];
    // One expert's (C, R) output at a time; its blocks are (R, G, 16) in order.
    for (e, dst) in out.chunks_mut(r * c).enumerate() {
        for row in 0..r {
            for g in 0..shape.groups {
                let b = (e * r + row) * shape.groups + g;
                let s = scales[b];
                for (j, byte) in blocks[b * 16..(b + 1) * 16].iter().enumerate() {
                    let col = g * BLOCK + 2 * j;
                    dst[col * r + row] = ldexp_f32(FP4_VALUES[usize::from(byte & 0x0F)], s);
                    dst[(col + 1) * r + row] = ldexp_f32(FP4_VALUES[usize::from(byte >> 4)], s);
                }
            }
        }
    }
    Ok(out)
}

/// The stored tensors (u8) to a `(E, C, R)` tensor of `dtype` (f32, bf16 or f16) on `device`.
pub fn dequantize(
    name: &str,
    blocks: &Tensor,
    scales: &Tensor,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let shape = Mxfp4Shape::from_dims(name, blocks.dims(), scales.dims())?;
    let candle = |source| QuantError::Candle {
        op: "mxfp4 dequantize",
        source,
    };
    for (t, what) in [(blocks, "blocks"), (scales, "scales")] {
        if t.dtype() != DType::U8 {
            return Err(QuantError::BadTensor {
                tensor: name.to_string(),
                message: format!("mxfp4 {what} are {:?}, not u8", t.dtype()),
            });
        }
    }
    let bytes = |t: &Tensor| {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<u8>())
            .map_err(candle)
    };
    let values = dequantize_f32(&bytes(blocks)?, &bytes(scales)?, shape)?;
    // Every finite value has at most two mantissa bits: the cast is exact (as torch's).
    Tensor::from_vec(values, (shape.experts, shape.cols(), shape.rows), device)
        .and_then(|t| t.to_dtype(dtype))
        .map_err(candle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldexp_is_torch_ldexp() {
        // Values from torch 2.15's ldexp in f32.
        assert_eq!(ldexp_f32(0.5, 255), 2f32.powi(127));
        assert_eq!(ldexp_f32(6.0, 254), f32::INFINITY);
        assert_eq!(ldexp_f32(-6.0, 254), f32::NEG_INFINITY);
        assert_eq!(ldexp_f32(0.0, 255), 0.0);
        assert_eq!(ldexp_f32(-0.0, 255).to_bits(), (-0.0f32).to_bits());
        assert_eq!(
            ldexp_f32(0.5, 0).to_bits(),
            0x0020_0000,
            "2^-128, a subnormal"
        );
        assert_eq!(ldexp_f32(1.5, 127), 1.5);
    }

    /// One expert, two rows of one block: low nibble first, the transpose, overflow to ±∞.
    #[test]
    fn nibbles_and_layout() {
        let mut blocks = [0u8; 32];
        // Block 0 (row 0): bytes 0x21 → elements 1.0 (code 2) ... low nibble first.
        blocks[0] = 0x21; // elements 0, 1: FP4[1] = 0.5, FP4[2] = 1.0
        blocks[16] = 0xF7; // row 1: FP4[7] = 6.0, FP4[15] = -6.0
        let shape = Mxfp4Shape {
            experts: 1,
            rows: 2,
            groups: 1,
        };
        let out = dequantize_f32(&blocks, &[128, 255], shape).unwrap();
        // (C = 32, R = 2): element (c, r) at c * 2 + r.
        assert_eq!(&out[0..4], &[1.0, f32::INFINITY, 2.0, f32::NEG_INFINITY]);
        assert_eq!((out[4], out[5]), (0.0, 0.0), "zero under any scale");
        let e = Mxfp4Shape::from_dims("w", &[1, 2, 1, 16], &[1, 2, 2]).unwrap_err();
        assert!(e.to_string().contains("are not (E, R, G, 16)"), "{e}");
    }
}
