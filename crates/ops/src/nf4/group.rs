//! Grouped dequantization (issue 48, item 4): the weights that read one input — a layer's q/k/v,
//! its gate/up — dequantized by ONE launch of `kernels/nf4.cu`'s `nf4_dequant_group_*` into one
//! buffer, each weight at its own offset, instead of one launch and one allocation per weight.
//!
//! - [`plan`]: where each weight goes (`offset`, in elements, a multiple of [`ALIGN_BYTES`] so the
//!   kernel's 16-byte stores stay aligned) and the buffer's size; or why the weights do not group
//!   ([`Ungrouped`]). When every weight's size in bytes is a multiple of the alignment (every
//!   Llama/Qwen/Gemma projection: `in` a multiple of 128), the offsets are back to back and the
//!   buffer is the row concatenation `[W₁; W₂; …]: (Σout, in)` ([`GroupPlan::tight`]), so the
//!   group's frozen product is one GEMM as for dense weights (`rtune-model`'s `group`).
//! - [`GroupTable`] / [`GroupEntry`]: the kernel's parameter, `#[repr(C)]` as the `.cu` declares it
//!   (80 bytes an entry, asserted on both sides), built by [`table`] from device or host addresses;
//!   CUDA block `b` belongs to entry `i` when `block_start[i] <= b < block_start[i+1]`.
//! - [`dequantize_group_bf16`] and friends: the CPU reference, which is the per-tensor CPU
//!   dequantization (`cpu.rs`) applied to each entry at its offset; the padding between entries is
//!   left as it was. The grouped kernel runs the per-tensor kernel's body on each entry, so the two
//!   agree bit for bit (`tests/kernels_emulated.rs`, and `rtune selftest` on a card).

use half::{bf16, f16};

use super::{Nf4Weight, Result, BLOCKSIZE};

/// Every weight of a group starts at a multiple of this many bytes (the allocator's alignment).
pub const ALIGN_BYTES: usize = 256;
/// Entries of one grouped launch (the kernel's `NF4_GROUP_MAX`).
pub const MAX_ENTRIES: usize = 8;
/// Outputs per thread of the dequantize kernels (`PER_THREAD` in `kernels/nf4.cu`).
pub const PER_THREAD: usize = 16;

/// Why weights are not dequantized as one group (each then takes the per-tensor path).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ungrouped {
    /// One weight or none: nothing to group.
    TooFew(usize),
    /// More than [`MAX_ENTRIES`] weights.
    TooMany(usize),
    /// A weight is not `(out, in)` or its `in` differs from the first one's (not one input).
    Shape { index: usize, shape: Vec<usize> },
    /// A blocksize other than 64 (the kernels' only one).
    Blocksize { index: usize, blocksize: usize },
}

impl std::fmt::Display for Ungrouped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ungrouped::TooFew(n) => write!(f, "{n} weight(s): nothing to group"),
            Ungrouped::TooMany(n) => write!(f, "{n} weights: at most {MAX_ENTRIES} a launch"),
            Ungrouped::Shape { index, shape } => {
                write!(
                    f,
                    "weight {index} has shape {shape:?}, not (out, in) of the group's in"
                )
            }
            Ungrouped::Blocksize { index, blocksize } => {
                write!(
                    f,
                    "weight {index} has blocksize {blocksize} (the kernels read 64)"
                )
            }
        }
    }
}

/// Where each weight of a group lies in the group's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlan {
    /// `[(offset, numel)]` in elements, in the members' order.
    pub slots: Vec<(usize, usize)>,
    /// Elements of the buffer (the last slot's end).
    pub total: usize,
    /// The slots are back to back: the buffer is `[W₁; W₂; …]: (Σout, in)`.
    pub tight: bool,
    /// `(Σout, in)`.
    pub rows: usize,
    pub cols: usize,
}

/// The layout of `weights` in one buffer of `elem_bytes`-byte elements (2 for bf16/f16, 4 for f32):
/// each weight at the next multiple of [`ALIGN_BYTES`].
pub fn plan(
    weights: &[&Nf4Weight],
    elem_bytes: usize,
) -> std::result::Result<GroupPlan, Ungrouped> {
    if weights.len() < 2 {
        return Err(Ungrouped::TooFew(weights.len()));
    }
    if weights.len() > MAX_ENTRIES {
        return Err(Ungrouped::TooMany(weights.len()));
    }
    let cols = match weights[0].shape.as_slice() {
        [_, i] => *i,
        s => {
            return Err(Ungrouped::Shape {
                index: 0,
                shape: s.to_vec(),
            })
        }
    };
    let align = ALIGN_BYTES / elem_bytes;
    let (mut slots, mut at, mut rows, mut tight) = (Vec::new(), 0usize, 0usize, true);
    for (index, w) in weights.iter().enumerate() {
        if !matches!(w.shape.as_slice(), [_, i] if *i == cols) {
            return Err(Ungrouped::Shape {
                index,
                shape: w.shape.clone(),
            });
        }
        if w.blocksize != BLOCKSIZE {
            return Err(Ungrouped::Blocksize {
                index,
                blocksize: w.blocksize,
            });
        }
        let start = at.next_multiple_of(align);
        tight &= start == at;
        slots.push((start, w.numel()));
        at = start + w.numel();
        rows += w.shape[0];
    }
    Ok(GroupPlan {
        slots,
        total: at,
        tight,
        rows,
        cols,
    })
}

/// One weight of a grouped launch, as `kernels/nf4.cu`'s `Nf4GroupEntry` (device addresses as
/// `u64`; null where the scale kind does not use them).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupEntry {
    pub packed: u64,
    pub absmax: u64,
    pub codes: u64,
    pub nested_absmax: u64,
    pub nested_map: u64,
    pub quant_map: u64,
    pub n: i64,
    pub out_offset: i64,
    pub offset: f32,
    pub nested_blocksize: i32,
    pub is_double: i32,
    pub block_start: i32,
}

/// The grouped kernel's one parameter, as `Nf4GroupTable`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GroupTable {
    pub e: [GroupEntry; MAX_ENTRIES],
    pub count: i32,
    pub total_blocks: i32,
}

const _: () = assert!(std::mem::size_of::<GroupEntry>() == 80);
const _: () = assert!(std::mem::size_of::<GroupTable>() == MAX_ENTRIES * 80 + 8);

/// The addresses of one weight's buffers (device pointers on a GPU, host ones under emulation).
#[derive(Debug, Clone, Copy, Default)]
pub struct Addresses {
    pub packed: u64,
    pub quant_map: u64,
    /// Plain scales: `absmax`; double: `codes`, `nested_absmax`, `nested_map`.
    pub absmax: u64,
    pub codes: u64,
    pub nested_absmax: u64,
    pub nested_map: u64,
}

/// The table of a grouped launch with `threads` threads a block: entry `i` is `weights[i]` at
/// `plan.slots[i]`, its blocks `ceil(numel / (16·threads))` after the previous entry's.
pub fn table(
    weights: &[&Nf4Weight],
    addrs: &[Addresses],
    plan: &GroupPlan,
    threads: usize,
) -> std::result::Result<GroupTable, String> {
    if weights.len() != plan.slots.len() || addrs.len() != plan.slots.len() {
        return Err(format!(
            "{} weights, {} address sets, {} slots",
            weights.len(),
            addrs.len(),
            plan.slots.len()
        ));
    }
    let mut t = GroupTable {
        count: weights.len() as i32,
        ..Default::default()
    };
    let mut blocks = 0usize;
    for (i, ((w, a), &(offset, n))) in weights.iter().zip(addrs).zip(&plan.slots).enumerate() {
        let e = &mut t.e[i];
        e.packed = a.packed;
        e.quant_map = a.quant_map;
        e.n = n as i64;
        e.out_offset = offset as i64;
        e.block_start = i32::try_from(blocks).map_err(|_| format!("{blocks} blocks"))?;
        match &w.absmax {
            super::Absmax::Plain(_) => e.absmax = a.absmax,
            super::Absmax::Double {
                offset,
                nested_blocksize,
                ..
            } => {
                e.is_double = 1;
                e.codes = a.codes;
                e.nested_absmax = a.nested_absmax;
                e.nested_map = a.nested_map;
                e.offset = *offset;
                e.nested_blocksize = *nested_blocksize as i32;
            }
        }
        blocks += n.div_ceil(PER_THREAD).div_ceil(threads);
    }
    t.total_blocks = i32::try_from(blocks).map_err(|_| format!("{blocks} blocks"))?;
    Ok(t)
}

/// Host addresses of `w`'s buffers (the emulated kernel's arguments).
pub fn host_addresses(w: &Nf4Weight) -> Addresses {
    let mut a = Addresses {
        packed: w.packed.as_ptr() as u64,
        quant_map: w.quant_map.as_ptr() as u64,
        ..Default::default()
    };
    match &w.absmax {
        super::Absmax::Plain(v) => a.absmax = v.as_ptr() as u64,
        super::Absmax::Double {
            codes,
            nested_absmax,
            nested_quant_map,
            ..
        } => {
            a.codes = codes.as_ptr() as u64;
            a.nested_absmax = nested_absmax.as_ptr() as u64;
            a.nested_map = nested_quant_map.as_ptr() as u64;
        }
    }
    a
}

macro_rules! group_reference {
    ($name:ident, $T:ty, $one:ident) => {
        /// The CPU reference of the grouped kernel: each weight dequantized by the per-tensor CPU
        /// path into `out[offset..offset + numel]` (`out: [plan.total]`); padding untouched.
        pub fn $name(weights: &[&Nf4Weight], plan: &GroupPlan, out: &mut [$T]) -> Result<()> {
            if out.len() != plan.total || weights.len() != plan.slots.len() {
                return Err(super::QuantError::OutLen {
                    got: out.len(),
                    want: plan.total,
                });
            }
            for (w, &(offset, n)) in weights.iter().zip(&plan.slots) {
                w.$one(&mut out[offset..offset + n])?;
            }
            Ok(())
        }
    };
}
group_reference!(dequantize_group_bf16, bf16, dequantize_into_bf16);
group_reference!(dequantize_group_f16, f16, dequantize_into_f16);
group_reference!(dequantize_group_f32, f32, dequantize_into_f32);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nf4::{quantize_nf4, QuantType, FP4};

    fn weight(out: usize, inp: usize, dq: bool, seed: usize) -> Nf4Weight {
        let x: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7 + seed) as f32 * 0.37).sin() * 0.05)
            .collect();
        quantize_nf4(&x, &[out, inp], dq).unwrap()
    }

    /// q/k/v of a GQA layer whose `in` is a multiple of 128: back to back, the buffer is
    /// `(Σout, in)`; `in` = 96 (192 bytes a row in bf16): each weight at the next 256 bytes.
    #[test]
    fn offsets_are_aligned_and_tight_when_sizes_allow() {
        let (q, k, v) = (
            weight(256, 128, true, 1),
            weight(64, 128, false, 2),
            weight(64, 128, true, 3),
        );
        let p = plan(&[&q, &k, &v], 2).unwrap();
        assert_eq!(
            p.slots,
            vec![(0, 256 * 128), (256 * 128, 64 * 128), (320 * 128, 64 * 128)]
        );
        assert!(p.tight);
        assert_eq!((p.rows, p.cols, p.total), (384, 128, 384 * 128));

        let (a, b, c) = (
            weight(3, 96, false, 4),
            weight(5, 96, true, 5),
            weight(1, 96, false, 6),
        );
        let p = plan(&[&a, &b, &c], 2).unwrap();
        // 288 elements → next multiple of 128 (256 bytes of bf16) is 384; 384 + 480 = 864 → 896.
        assert_eq!(p.slots, vec![(0, 288), (384, 480), (896, 96)]);
        assert!(!p.tight);
        assert_eq!(p.total, 992);
        for &(o, _) in &p.slots {
            assert_eq!(o * 2 % ALIGN_BYTES, 0);
        }
        // In f32, 288 elements = 1152 bytes: 1152 → 1280 bytes = 320 elements.
        let p = plan(&[&a, &b], 4).unwrap();
        assert_eq!(p.slots, vec![(0, 288), (320, 480)]);
    }

    #[test]
    fn what_does_not_group_says_why() {
        let a = weight(4, 64, false, 1);
        assert_eq!(plan(&[&a], 2), Err(Ungrouped::TooFew(1)));
        let nine: Vec<&Nf4Weight> = std::iter::repeat_n(&a, 9).collect();
        assert_eq!(plan(&nine, 2), Err(Ungrouped::TooMany(9)));
        let other_in = weight(4, 32, false, 2);
        assert!(matches!(
            plan(&[&a, &other_in], 2),
            Err(Ungrouped::Shape { index: 1, .. })
        ));
        let mut bs = weight(4, 64, false, 3);
        bs.blocksize = 128;
        assert_eq!(
            plan(&[&a, &bs], 2),
            Err(Ungrouped::Blocksize {
                index: 1,
                blocksize: 128
            })
        );
        // Mixed scale kinds and code tables group: both are per entry in the kernel.
        let mut fp4 = weight(4, 64, true, 4);
        fp4.quant_type = QuantType::Fp4;
        fp4.quant_map = FP4;
        assert!(plan(&[&a, &fp4], 2).is_ok());
    }

    /// Entry `i`'s blocks start where entry `i-1`'s end: `ceil(numel / (16·threads))` each.
    #[test]
    fn the_table_maps_blocks_to_entries_by_prefix_sums() {
        let ws = [
            weight(64, 64, false, 1),
            weight(3, 64, true, 2),
            weight(33, 64, false, 3),
        ];
        let refs: Vec<&Nf4Weight> = ws.iter().collect();
        let p = plan(&refs, 2).unwrap();
        let addrs: Vec<Addresses> = ws.iter().map(host_addresses).collect();
        let t = table(&refs, &addrs, &p, 64).unwrap();
        // 4096 → 4 blocks of 1024; 192 → 1; 2112 → 3.
        let starts: Vec<i32> = t.e[..3].iter().map(|e| e.block_start).collect();
        assert_eq!((starts, t.total_blocks, t.count), (vec![0, 4, 5], 8, 3));
        assert_eq!((t.e[1].is_double, t.e[0].is_double), (1, 0));
        assert_eq!(t.e[2].out_offset as usize, p.slots[2].0);
        assert_eq!(t.e[1].absmax, 0);
        assert!(table(&refs[..2], &addrs, &p, 64).is_err());
    }

    /// The reference writes each weight's own dequantization at its slot and nothing else.
    #[test]
    fn the_reference_is_the_per_tensor_dequant_at_each_offset() {
        let ws = [weight(3, 96, false, 4), weight(5, 96, true, 5)];
        let refs: Vec<&Nf4Weight> = ws.iter().collect();
        let p = plan(&refs, 2).unwrap();
        let sentinel = bf16::from_f32(7.0);
        let mut out = vec![sentinel; p.total];
        dequantize_group_bf16(&refs, &p, &mut out).unwrap();
        for (w, &(o, n)) in ws.iter().zip(&p.slots) {
            let mut one = vec![bf16::ZERO; n];
            w.dequantize_into_bf16(&mut one).unwrap();
            assert_eq!(&out[o..o + n], &one[..]);
        }
        assert!(out[288..384].iter().all(|&x| x == sentinel));
        assert!(dequantize_group_bf16(&refs, &p, &mut out[1..]).is_err());
    }
}
