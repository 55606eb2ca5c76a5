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
//! under every scale (`0 · 2^128 = 0`, not NaN). [`dequantize`] lays the result out `(E, C, R)`
//! as transformers does (it transposes the last two axes, the layout its `GptOssExperts`
//! multiplies with, `x @ W`) or `(E, R, C)`, the stored rows, which rtune's experts take.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

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

/// Where [`dequantize`] puts element `(e, row, col)` of the stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `(E, C, R)`: transformers' (it transposes the last two axes for `x @ W`).
    Transformers,
    /// `(E, R, C)`: the stored rows in order, each row's `C` values contiguous (rtune's experts
    /// take `(E, out, in)`, which is this: no transpose and no second copy at load).
    Rows,
}

/// The 16 values of one block's codes under its exponent `scale`, converted by `conv`.
fn block_values<T>(scale: u8, conv: &impl Fn(f32) -> T) -> [T; 16] {
    std::array::from_fn(|code| conv(ldexp_f32(FP4_VALUES[code], scale)))
}

/// Dequantizes into `T` (each value `conv(ldexp(FP4[code], scale − 127))`) laid out as `layout`
/// says, the experts over rayon's threads.
fn fill<T: Copy + Default + Send>(
    blocks: &[u8],
    scales: &[u8],
    shape: Mxfp4Shape,
    layout: Layout,
    conv: impl Fn(f32) -> T + Sync,
) -> Result<Vec<T>> {
    let n_blocks = shape.experts * shape.rows * shape.groups;
    if blocks.len() != n_blocks * 16 || scales.len() != n_blocks {
        return Err(QuantError::Input(format!(
            "mxfp4 dequantize: {shape:?} needs {} block bytes and {n_blocks} scales, got {} and {}",
            n_blocks * 16,
            blocks.len(),
            scales.len()
        )));
    }
    let (r, c, groups) = (shape.rows, shape.cols(), shape.groups);
    let mut out = vec![T::default(); shape.len()];
    if out.is_empty() {
        return Ok(out);
    }
    // One expert's (R, C) or (C, R) output a job; its blocks are (R, G, 16) in order.
    out.par_chunks_mut(r * c).enumerate().for_each(|(e, dst)| {
        for row in 0..r {
            for g in 0..groups {
                let b = (e * r + row) * groups + g;
                let vals = block_values(scales[b], &conv);
                let codes = &blocks[b * 16..(b + 1) * 16];
                match layout {
                    Layout::Rows => {
                        let at = row * c + g * BLOCK;
                        for (pair, byte) in dst[at..at + BLOCK].chunks_exact_mut(2).zip(codes) {
                            pair[0] = vals[usize::from(byte & 0x0F)];
                            pair[1] = vals[usize::from(byte >> 4)];
                        }
                    }
                    Layout::Transformers => {
                        for (j, byte) in codes.iter().enumerate() {
                            let col = g * BLOCK + 2 * j;
                            dst[col * r + row] = vals[usize::from(byte & 0x0F)];
                            dst[(col + 1) * r + row] = vals[usize::from(byte >> 4)];
                        }
                    }
                }
            }
        }
    });
    Ok(out)
}

/// Dequantizes into f32, laid out `(E, C, R)` (transformers').
pub fn dequantize_f32(blocks: &[u8], scales: &[u8], shape: Mxfp4Shape) -> Result<Vec<f32>> {
    fill(blocks, scales, shape, Layout::Transformers, |x| x)
}

/// A u8 tensor's bytes: borrowed when it is a contiguous host tensor (the blocks of a large
/// stack are not copied), else copied out.
fn with_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    if let (candle_core::Storage::Cpu(candle_core::CpuStorage::U8(v)), Some((a, b))) =
        (&*storage, layout.contiguous_offsets())
    {
        return f(&v[a..b]);
    }
    drop(storage);
    let v = t
        .flatten_all()
        .and_then(|t| t.to_vec1::<u8>())
        .map_err(|source| QuantError::Candle {
            op: "mxfp4 dequantize",
            source,
        })?;
    f(&v)
}

/// The stored tensors (u8) to a tensor of `dtype` (f32, bf16 or f16) on `device`, laid out as
/// `layout` says: `(E, C, R)` or `(E, R, C)`. The values are made in `dtype` on the host (no f32
/// copy of a bf16 stack): each is the f32 value cast as candle's `to_dtype` casts it
/// (`bf16::from_f32`, `f16::from_f32`), exact for bf16 (every finite value has at most two
/// mantissa bits), rounded as torch's cast for f16.
pub fn dequantize(
    name: &str,
    blocks: &Tensor,
    scales: &Tensor,
    layout: Layout,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let shape = Mxfp4Shape::from_dims(name, blocks.dims(), scales.dims())?;
    for (t, what) in [(blocks, "blocks"), (scales, "scales")] {
        if t.dtype() != DType::U8 {
            return Err(QuantError::BadTensor {
                tensor: name.to_string(),
                message: format!("mxfp4 {what} are {:?}, not u8", t.dtype()),
            });
        }
    }
    let dims = match layout {
        Layout::Transformers => (shape.experts, shape.cols(), shape.rows),
        Layout::Rows => (shape.experts, shape.rows, shape.cols()),
    };
    // The values made in `T` by `conv`, as a `dims` tensor on `device`.
    fn make<T: candle_core::WithDType + Default>(
        (b, s): (&[u8], &[u8]),
        (shape, layout): (Mxfp4Shape, Layout),
        (dims, device): ((usize, usize, usize), &Device),
        conv: impl Fn(f32) -> T + Sync,
    ) -> Result<Tensor> {
        let values = fill(b, s, shape, layout, conv)?;
        Tensor::from_vec(values, dims, device).map_err(|source| QuantError::Candle {
            op: "mxfp4 dequantize",
            source,
        })
    }
    with_bytes(blocks, |b| {
        with_bytes(scales, |s| {
            let (codes, how, to) = ((b, s), (shape, layout), (dims, device));
            match dtype {
                DType::F32 => make(codes, how, to, |x| x),
                DType::BF16 => make(codes, how, to, half::bf16::from_f32),
                DType::F16 => make(codes, how, to, half::f16::from_f32),
                other => Err(QuantError::BadTensor {
                    tensor: name.to_string(),
                    message: format!("mxfp4 dequantized to {other:?}: f32, bf16 or f16 only"),
                }),
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtune_ops::test_util::bits;

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

    /// [`Layout::Rows`] is the transpose of [`Layout::Transformers`], and each dtype's values are
    /// candle's `to_dtype` of the f32 ones, bit for bit: every byte value, and scales from
    /// subnormal (0, 1) through 1 (127) to overflow (254, 255), on 3 experts of 5 rows of 2 blocks.
    #[test]
    fn rows_layout_and_dtypes_are_the_f32_transposed_and_cast() {
        let shape = Mxfp4Shape {
            experts: 3,
            rows: 5,
            groups: 2,
        };
        let n = shape.experts * shape.rows * shape.groups;
        let blocks: Vec<u8> = (0..n * 16).map(|i| (i * 37 + 11) as u8).collect();
        let scales: Vec<u8> = (0..n)
            .map(|i| [0u8, 1, 100, 127, 130, 200, 254, 255][i % 8])
            .collect();
        let dev = Device::Cpu;
        let t = |b: &[u8], dims: &[usize]| Tensor::from_slice(b, dims, &dev).unwrap();
        let (bt, st) = (t(&blocks, &[3, 5, 2, 16]), t(&scales, &[3, 5, 2]));
        let f32_t = dequantize("w", &bt, &st, Layout::Transformers, DType::F32, &dev).unwrap();
        assert_eq!(f32_t.dims(), [3, 64, 5]);
        assert!(bits(&f32_t)
            .iter()
            .any(|&b| f32::from_bits(b).is_infinite()));
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let want = f32_t.to_dtype(dtype).unwrap();
            let got = dequantize("w", &bt, &st, Layout::Transformers, dtype, &dev).unwrap();
            assert_eq!(got.dtype(), dtype);
            assert_eq!(bits(&got), bits(&want), "{dtype:?} (E, C, R)");
            let rows = dequantize("w", &bt, &st, Layout::Rows, dtype, &dev).unwrap();
            assert_eq!(rows.dims(), [3, 5, 64]);
            let want_rows = want.transpose(1, 2).unwrap().contiguous().unwrap();
            assert_eq!(bits(&rows), bits(&want_rows), "{dtype:?} (E, R, C)");
        }
        let e = dequantize("w", &bt, &st, Layout::Rows, DType::F64, &dev).unwrap_err();
        assert!(e.to_string().contains("f32, bf16 or f16 only"), "{e}");
    }
}
