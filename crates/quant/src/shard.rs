//! An NF4 weight split across the ranks of a sharded base (issue 37) and joined again, bit for bit.
//!
//! A piece is the elements `span` of the weight's row-major flattening, itself an [`Nf4Weight`] of
//! shape `[span.len()]` holding exactly those elements' codes and scales. A span starts on a
//! [`unit()`] boundary — whole first-level blocks (64 elements, 32 packed bytes), and with double
//! quantization whole second-level groups (256 blocks) — so every array of the piece is a plain
//! sub-slice of the whole weight's, and [`join`] is concatenation. Only the last piece may end
//! short (a tensor whose size is not a multiple of the unit).
//!
//! Quantizing a piece alone ([`quantize_piece`] then [`double_quantize_piece`]) gives the whole
//! weight's codes: the first level is per block, and the second level's only whole-tensor
//! quantity, the offset (the mean of every absmax), is computed from all ranks' absmax gathered in
//! order ([`crate::torch_mean_f32`], the same summation as one process).

use std::ops::Range;

use crate::quantize::{double_quantize_with, quantize_nf4};
use crate::{Absmax, Nf4Weight, QuantError, Result, BLOCKSIZE, NESTED_BLOCKSIZE};

/// Elements per indivisible unit of a sharded NF4 weight: a first-level block, or with double
/// quantization a second-level group of blocks.
pub fn unit(double_quant: bool) -> usize {
    if double_quant {
        BLOCKSIZE * NESTED_BLOCKSIZE
    } else {
        BLOCKSIZE
    }
}

/// A weight's pieces (a trait because the weight is the NF4 op's, `rtune_ops::nf4`).
pub trait Pieces {
    /// The piece of this weight holding elements `span` (see the module's overview; `span.start`
    /// a multiple of [`unit()`], `span.end` one too or the end of the weight).
    fn piece(&self, span: Range<usize>) -> Result<Nf4Weight>;
}

impl Pieces for Nf4Weight {
    fn piece(&self, span: Range<usize>) -> Result<Nf4Weight> {
        let n = self.numel();
        let u = unit(self.absmax.is_double());
        if span.start > span.end
            || span.end > n
            || !(span.start.is_multiple_of(u) || span.start == n)
        {
            return Err(QuantError::Input(format!(
                "piece {span:?} of a {n}-element weight: spans start on multiples of {u} elements"
            )));
        }
        if span.end != n && !span.end.is_multiple_of(u) {
            return Err(QuantError::Input(format!(
                "piece {span:?} of a {n}-element weight ends inside a {u}-element unit"
            )));
        }
        // (`div_ceil` at the start too: an empty piece at the end of a weight holds nothing.)
        let blocks = span.start.div_ceil(BLOCKSIZE)..span.end.div_ceil(BLOCKSIZE);
        let absmax = match &self.absmax {
            Absmax::Plain(a) => Absmax::Plain(a[blocks.clone()].to_vec()),
            Absmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                offset,
                nested_blocksize,
            } => {
                let nb = *nested_blocksize;
                let groups = blocks.start.div_ceil(nb)..blocks.end.div_ceil(nb);
                Absmax::Double {
                    codes: codes[blocks.clone()].to_vec(),
                    nested_absmax: nested_absmax[groups].to_vec(),
                    nested_quant_map: nested_quant_map.clone(),
                    offset: *offset,
                    nested_blocksize: *nested_blocksize,
                }
            }
        };
        let piece = Nf4Weight {
            shape: vec![span.len()],
            packed: self.packed[span.start.div_ceil(2)..span.end.div_ceil(2)].to_vec(),
            absmax,
            quant_map: self.quant_map,
            quant_type: self.quant_type,
            blocksize: self.blocksize,
            dtype: self.dtype,
        };
        piece.check()?;
        Ok(piece)
    }
}

/// The weight of `shape` whose pieces, in order, are `pieces` (the inverse of
/// [`Nf4Weight::piece`] over consecutive spans covering the weight).
pub fn join(pieces: &[Nf4Weight], shape: &[usize]) -> Result<Nf4Weight> {
    let first = pieces
        .first()
        .ok_or_else(|| QuantError::Input("joining no pieces".into()))?;
    let n: usize = shape.iter().product();
    let mut packed = Vec::with_capacity(n.div_ceil(2));
    for p in pieces {
        packed.extend_from_slice(&p.packed);
    }
    let absmax = match &first.absmax {
        Absmax::Plain(_) => Absmax::Plain(
            pieces
                .iter()
                .flat_map(|p| match &p.absmax {
                    Absmax::Plain(a) => a.clone(),
                    Absmax::Double { .. } => Vec::new(),
                })
                .collect(),
        ),
        Absmax::Double {
            nested_quant_map,
            offset,
            nested_blocksize,
            ..
        } => {
            let (mut codes, mut nested) = (Vec::new(), Vec::new());
            for p in pieces {
                if let Absmax::Double {
                    codes: c,
                    nested_absmax: a,
                    ..
                } = &p.absmax
                {
                    codes.extend_from_slice(c);
                    nested.extend_from_slice(a);
                }
            }
            Absmax::Double {
                codes,
                nested_absmax: nested,
                nested_quant_map: nested_quant_map.clone(),
                offset: *offset,
                nested_blocksize: *nested_blocksize,
            }
        }
    };
    let w = Nf4Weight {
        shape: shape.to_vec(),
        packed,
        absmax,
        quant_map: first.quant_map,
        quant_type: first.quant_type,
        blocksize: first.blocksize,
        dtype: first.dtype,
    };
    // A piece of the other absmax kind, or pieces that do not add up, fail here.
    w.check()?;
    Ok(w)
}

/// The first level of NF4 for one piece `values` (elements of a weight starting on a block
/// boundary): codes and plain absmax, as [`quantize_nf4`] makes them for those blocks.
pub fn quantize_piece(values: &[f32]) -> Result<Nf4Weight> {
    quantize_nf4(values, &[values.len()], false)
}

/// The second level for a piece from [`quantize_piece`], given the whole weight's offset (the
/// mean of every block's absmax, all pieces gathered in order: [`crate::torch_mean_f32`]). The
/// piece must start on a second-level group boundary ([`unit()`]).
pub fn double_quantize_piece(piece: &mut Nf4Weight, offset: f32) -> Result<()> {
    let Absmax::Plain(a) = &piece.absmax else {
        return Err(QuantError::Input(
            "double quantizing a piece that is double quantized already".into(),
        ));
    };
    piece.absmax = double_quantize_with(a, offset);
    piece.check()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{quantize_nf4, torch_mean_f32};

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * (1.0 + (i / 4096) as f32))
            .collect()
    }

    /// Splits at unit boundaries as the sharded loader does (`k` pieces, the first `n % k` units
    /// one longer), including empty pieces when there are more ranks than units.
    fn spans(n: usize, u: usize, k: usize) -> Vec<Range<usize>> {
        let units = n.div_ceil(u);
        let (q, r) = (units / k, units % k);
        let mut at = 0;
        (0..k)
            .map(|i| {
                let len = q + usize::from(i < r);
                let s = (at * u).min(n)..((at + len) * u).min(n);
                at += len;
                s
            })
            .collect()
    }

    /// Pieces joined give the weight back bit for bit, and pieces quantized alone (the offset
    /// from every piece's absmax in order) are the pieces of the whole weight's quantization —
    /// plain and double quantized, sizes with a short last block and unit, 1 to 5 pieces.
    #[test]
    fn pieces_quantized_alone_join_into_the_whole_weights_codes() {
        for &(rows, cols) in &[(96, 512), (33, 1000), (3, 5), (200, 300)] {
            let n = rows * cols;
            let v = values(n);
            for dq in [false, true] {
                let whole = quantize_nf4(&v, &[rows, cols], dq).unwrap();
                for k in 1..=5 {
                    let sp = spans(n, unit(dq), k);
                    let pieces: Vec<_> =
                        sp.iter().map(|s| whole.piece(s.clone()).unwrap()).collect();
                    assert_eq!(
                        join(&pieces, &[rows, cols]).unwrap(),
                        whole,
                        "{rows}x{cols} dq {dq} k {k}"
                    );
                    let mut alone: Vec<_> = sp
                        .iter()
                        .map(|s| quantize_piece(&v[s.clone()]).unwrap())
                        .collect();
                    if dq {
                        let all: Vec<f32> = alone.iter().flat_map(|p| p.absmax.decode()).collect();
                        let offset = torch_mean_f32(&all);
                        for p in &mut alone {
                            double_quantize_piece(p, offset).unwrap();
                        }
                    }
                    assert_eq!(alone, pieces, "{rows}x{cols} dq {dq} k {k}");
                }
            }
        }
    }

    /// A span off a unit boundary is refused (its codes would not be the whole weight's).
    #[test]
    fn a_piece_off_a_unit_boundary_is_refused() {
        let w = quantize_nf4(&values(64 * 300), &[64, 300], true).unwrap();
        assert!(w.piece(64..16384).is_err());
        assert!(w.piece(0..100).is_err());
        assert!(w.piece(16384..64 * 300).is_ok());
    }
}
