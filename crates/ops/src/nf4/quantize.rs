//! f32 values → [`Nf4Weight`], as bitsandbytes 0.50.2's CPU backend does it.
//!
//! First level (`bitsandbytes/backends/default/ops.py`, `quantize_4bit`), per block of 64 elements:
//! `absmax = max|x|`; `s = clamp(x * (1 / max(absmax, 1e-38)), -1, 1)`; `code = #{t in T : t < s}` where
//! `T` are the 15 midpoints `(NF4[i] + NF4[i+1]) / 2` (a value exactly on a midpoint takes the lower
//! code). A last, shorter block stores `max(absmax, 1e-38)` and divides (`x / absmax`) instead of
//! multiplying by the reciprocal. An odd element count pads the last low nibble with the code of 0.0.
//!
//! Double quantization (`functional.quantize_4bit(compress_statistics=True)`):
//! `offset = mean(absmax)` in torch's CPU summation order ([`torch_mean_f32`]), then
//! `absmax - offset` is quantized to 8 bits in blocks of 256 against [`DYNAMIC_SIGNED`] by
//! `csrc/cpu_ops.cpp`: per block `m = max|c|`, `v = clamp(c * (1/m), -1, 1)`, then a 65536-entry
//! table indexed by `trunc((v + 1) * 0.5 * 65535 + 0.5)` gives the code whose midpoint interval holds
//! the table bin's value. (That table is an approximation of "nearest code": near 0, where codes are
//! closer than 2/65535, it picks a farther one. bitsandbytes' CUDA kernel searches exactly, so a
//! checkpoint quantized on a GPU can differ in those rare codes; loading uses the stored codes as-is.)

use candle_core::{DType, Tensor};
use rayon::prelude::*;
use std::sync::OnceLock;

use super::{Absmax, Nf4Weight, QuantError, QuantType, Result};
use super::{BLOCKSIZE, DYNAMIC_SIGNED, NESTED_BLOCKSIZE, NF4};

/// torch `clamp(min=1e-38)` on an f32 absmax (a subnormal; its reciprocal 1e38 is finite).
const TINY: f32 = 1e-38;
/// Blocks per parallel work item (64 KiB of f32 input).
const CHUNK_BLOCKS: usize = 256;

/// Quantize `values` (the row-major flattening of a tensor of `shape`) to NF4 with blocksize 64,
/// optionally double-quantizing the absmax. Records `dtype = F32`; set [`Nf4Weight::dtype`] to the
/// source dtype if the values were upcast (bf16/f16 → f32 is exact, so the codes are the same).
pub fn quantize_nf4(values: &[f32], shape: &[usize], double_quant: bool) -> Result<Nf4Weight> {
    let n: usize = shape.iter().product();
    if values.len() != n {
        return Err(QuantError::Input(format!(
            "{} values for shape {shape:?} ({n} elements)",
            values.len()
        )));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::Input(format!(
            "element {i} of the {shape:?} tensor is {} (NF4 needs finite values)",
            values[i]
        )));
    }
    let n_blocks = n.div_ceil(BLOCKSIZE);
    let mut packed = vec![0u8; n.div_ceil(2)];
    let mut absmax = vec![0f32; n_blocks];
    let chunk = CHUNK_BLOCKS * BLOCKSIZE;
    // Chunks start on block (and so byte) boundaries: 64 elements = 32 bytes.
    values
        .par_chunks(chunk)
        .zip(packed.par_chunks_mut(chunk / 2))
        .zip(absmax.par_chunks_mut(CHUNK_BLOCKS))
        .for_each(|((v, p), a)| quantize_chunk(v, p, a));
    let absmax = if double_quant {
        double_quantize(&absmax)
    } else {
        Absmax::Plain(absmax)
    };
    let w = Nf4Weight {
        shape: shape.to_vec(),
        packed,
        absmax,
        quant_map: NF4,
        quant_type: QuantType::Nf4,
        blocksize: BLOCKSIZE,
        dtype: DType::F32,
    };
    w.check()?;
    Ok(w)
}

/// [`quantize_nf4`] of a tensor (any float dtype, any device), recording its dtype.
pub fn quantize_tensor(t: &Tensor, double_quant: bool) -> Result<Nf4Weight> {
    let cerr = |op| move |source| QuantError::Candle { op, source };
    let values = t
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(cerr("quantize: reading the tensor"))?;
    let mut w = quantize_nf4(&values, t.dims(), double_quant)?;
    w.dtype = t.dtype();
    Ok(w)
}

/// The 15 decision thresholds between consecutive NF4 values, `(a + b) / 2` in f32.
fn thresholds() -> [f32; 15] {
    std::array::from_fn(|i| (NF4[i] + NF4[i + 1]) / 2.0)
}

/// Index of the NF4 code for a scaled value `s` in [-1, 1]: the number of thresholds below it.
#[inline(always)]
fn nf4_code(s: f32, t: &[f32; 15]) -> u8 {
    t.iter().map(|&b| (b < s) as u8).sum()
}

/// One chunk of whole blocks (the last may be short). `v: [len]`, `p: [ceil(len/2)]`,
/// `a: [ceil(len/64)]`.
fn quantize_chunk(v: &[f32], p: &mut [u8], a: &mut [f32]) {
    let t = thresholds();
    let mut codes = [0u8; BLOCKSIZE];
    for ((blk, pb), am) in v.chunks(BLOCKSIZE).zip(p.chunks_mut(BLOCKSIZE / 2)).zip(a) {
        let m = blk.iter().fold(0f32, |m, x| m.max(x.abs()));
        if blk.len() == BLOCKSIZE {
            *am = m;
            let inv = 1.0 / m.max(TINY);
            for (c, &x) in codes.iter_mut().zip(blk) {
                *c = nf4_code((x * inv).clamp(-1.0, 1.0), &t);
            }
        } else {
            // bnb's remainder block: clamped absmax is stored, and values are divided by it.
            let m = m.max(TINY);
            *am = m;
            for (c, &x) in codes.iter_mut().zip(blk) {
                *c = nf4_code((x / m).clamp(-1.0, 1.0), &t);
            }
            codes[blk.len()] = nf4_code(0.0, &t); // odd length: pad nibble (bnb pads with 0.0)
        }
        for (i, b) in pb.iter_mut().enumerate() {
            *b = (codes[2 * i] << 4) | codes[2 * i + 1];
        }
    }
}

/// Second level: `absmax - mean` to u8 codes of [`DYNAMIC_SIGNED`], blocks of 256.
fn double_quantize(absmax: &[f32]) -> Absmax {
    double_quantize_with(absmax, torch_mean_f32(absmax))
}

/// Double quantization (as [`quantize_nf4`] does it) with the offset given: a sharded weight's
/// piece (`rtune_quant::shard`), whose offset is the mean over every piece's absmax.
pub fn double_quantize_with(absmax: &[f32], offset: f32) -> Absmax {
    let lut = dynamic_lut();
    let mut codes = vec![0u8; absmax.len()];
    let mut nested = vec![0f32; absmax.len().div_ceil(NESTED_BLOCKSIZE)];
    for ((a, c), m_out) in absmax
        .chunks(NESTED_BLOCKSIZE)
        .zip(codes.chunks_mut(NESTED_BLOCKSIZE))
        .zip(nested.iter_mut())
    {
        let m = a.iter().fold(0f32, |m, &x| m.max((x - offset).abs()));
        *m_out = m;
        if m == 0.0 {
            continue; // bnb writes code 0 for an all-zero block
        }
        let inv = 1.0 / m;
        for (ci, &x) in c.iter_mut().zip(a) {
            let v = ((x - offset) * inv).clamp(-1.0, 1.0);
            *ci = lut[(((v + 1.0) * 0.5) * 65535.0 + 0.5) as u16 as usize];
        }
    }
    Absmax::Double {
        codes,
        nested_absmax: nested,
        nested_quant_map: DYNAMIC_SIGNED.to_vec(),
        offset,
        nested_blocksize: NESTED_BLOCKSIZE,
    }
}

/// bitsandbytes' 8-bit quantization table: bin `i` covers the value `-1 + 2i/65535`, and maps to the
/// code whose midpoint interval contains it.
fn dynamic_lut() -> &'static [u8; 65536] {
    static LUT: OnceLock<Box<[u8; 65536]>> = OnceLock::new();
    LUT.get_or_init(|| {
        let c = &DYNAMIC_SIGNED;
        let mids: Vec<f32> = (0..255).map(|j| 0.5 * (c[j] + c[j + 1])).collect();
        let mut lut = Box::new([0u8; 65536]);
        let mut code = 0usize;
        for (i, slot) in lut.iter_mut().enumerate() {
            let val = -1.0f32 + (2.0f32 * i as f32) / 65535.0;
            while code < 255 && mids[code] < val {
                code += 1;
            }
            *slot = code as u8;
        }
        lut
    })
}

/// `torch.mean` of a contiguous 1-D f32 tensor on the CPU with one thread, bit for bit: torch's
/// cascade sum (`aten/src/ATen/native/cpu/SumKernel.cpp`) over 8-lane vectors (the AVX2 kernel, which
/// torch also runs on AVX-512 CPUs), four interleaved rows, four cascade levels, then `/ n` in f32.
/// (With several threads and ≥ 32768 values torch splits the sum per thread; the last bit can differ.)
pub fn torch_mean_f32(a: &[f32]) -> f32 {
    if a.is_empty() {
        return f32::NAN;
    }
    torch_sum_f32(a) / a.len() as f32
}

const LANES: usize = 8;

fn torch_sum_f32(a: &[f32]) -> f32 {
    if a.len() < LANES {
        return row_sum::<1>(a)[0];
    }
    let nvec = a.len() / LANES;
    let lanes = row_sum::<LANES>(&a[..nvec * LANES]);
    let mut total = a[nvec * LANES..].iter().fold(0f32, |s, &x| s + x);
    for l in lanes {
        total += l;
    }
    total
}

/// torch's `row_sum` over `a.len() / W` items of `W` lanes each (W = 1: scalars).
fn row_sum<const W: usize>(a: &[f32]) -> [f32; W] {
    const ILP: usize = 4;
    let item = |i: usize| -> [f32; W] { std::array::from_fn(|l| a[i * W + l]) };
    let add = |x: &mut [f32; W], y: [f32; W]| x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
    let size = a.len() / W;
    let size_ilp = size / ILP;
    let mut partial = multi_row_sum::<W>(&item, size_ilp);
    for i in size_ilp * ILP..size {
        add(&mut partial[0], item(i));
    }
    let [mut p0, p1, p2, p3] = partial;
    for p in [p1, p2, p3] {
        add(&mut p0, p);
    }
    p0
}

/// torch's `multi_row_sum`: rows of 4 items summed column-wise with a 4-level cascade.
fn multi_row_sum<const W: usize>(item: &dyn Fn(usize) -> [f32; W], rows: usize) -> [[f32; W]; 4] {
    const LEVELS: usize = 4;
    let ceil_log2 = |x: usize| -> usize {
        if x <= 2 {
            1
        } else {
            (usize::BITS - (x - 1).leading_zeros()) as usize
        }
    };
    let level_power = 4.max(ceil_log2(rows) / LEVELS);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0f32; W]; 4]; LEVELS];
    let add_row = |acc: &mut [[f32; W]; 4], i: usize| {
        for (k, a) in acc.iter_mut().enumerate() {
            let v = item(i * 4 + k);
            a.iter_mut().zip(v).for_each(|(a, v)| *a += v);
        }
    };
    let mut i = 0;
    while i + level_step <= rows {
        for _ in 0..level_step {
            add_row(&mut acc[0], i);
            i += 1;
        }
        for j in 1..LEVELS {
            let lower = std::mem::replace(&mut acc[j - 1], [[0f32; W]; 4]);
            for (a, l) in acc[j].iter_mut().zip(lower) {
                a.iter_mut().zip(l).for_each(|(a, l)| *a += l);
            }
            if i & (level_mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    while i < rows {
        add_row(&mut acc[0], i);
        i += 1;
    }
    let [mut a0, a1, a2, a3] = acc;
    for aj in [a1, a2, a3] {
        for (a, l) in a0.iter_mut().zip(aj) {
            a.iter_mut().zip(l).for_each(|(a, l)| *a += l);
        }
    }
    a0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_ties_take_the_lower_code() {
        let t = thresholds();
        for (i, &b) in t.iter().enumerate() {
            assert_eq!(
                nf4_code(b, &t) as usize,
                i,
                "value exactly on threshold {i}"
            );
            assert_eq!(nf4_code(b.next_up(), &t) as usize, i + 1);
        }
        assert_eq!(nf4_code(-1.0, &t), 0);
        assert_eq!(nf4_code(1.0, &t), 15);
        assert_eq!(nf4_code(0.0, &t), 7);
    }

    #[test]
    fn torch_sum_small_sizes_are_sequential_in_lanes() {
        // Below 8 values torch keeps 4 partial sums p_k = x_k, adds the remainder x4 to p0, then
        // p0 + p1 + p2 + p3: here (1e8 + -1e8) + 1 + 1 + 1 = 3, where left-to-right order gives 0.
        let a = [1e8f32, 1.0, 1.0, 1.0, -1e8];
        assert_eq!(torch_sum_f32(&a), 3.0);
    }
}
