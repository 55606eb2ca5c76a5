//! Grouped dequantization (issue 48, item 4): the weights that read one input — a layer's q/k/v,
//! its gate/up — dequantized by ONE launch of `kernels/nf4.cu`'s `nf4_dequant_group_*` into one
//! buffer, each weight at its own offset (`slots: [(offset, numel)]` in elements, each offset a
//! multiple of 16 bytes at least: `rtune-model`'s `group/nf4.rs` plans them 256 bytes apart),
//! instead of one launch and one allocation per weight.
//!
//! - [`GroupTable`] / [`GroupEntry`]: the kernel's parameter, `#[repr(C)]` as the `.cu` declares it
//!   (80 bytes an entry, asserted on both sides), built by [`table`] from device or host addresses;
//!   CUDA block `b` belongs to entry `i` when `block_start[i] <= b < block_start[i+1]`.
//! - [`dequantize_group_bf16`] and friends: the CPU reference, which is the per-tensor CPU
//!   dequantization (`cpu.rs`) applied to each entry at its offset; the padding between entries is
//!   left as it was. The grouped kernel runs the per-tensor kernel's body on each entry, so the two
//!   agree bit for bit (`tests/kernels_emulated.rs`, and `rtune selftest` on a card).

use half::{bf16, f16};

use super::{Nf4Weight, Result};

/// Entries of one grouped launch (the kernel's `NF4_GROUP_MAX`).
pub const MAX_ENTRIES: usize = 8;
/// Outputs per thread of the dequantize kernels (`PER_THREAD` in `kernels/nf4.cu`).
pub const PER_THREAD: usize = 16;
/// `(offset, numel)` of each weight in the group's buffer, in elements.
pub type Slots = [(usize, usize)];

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
/// `slots[i]`, its blocks `ceil(numel / (16·threads))` after the previous entry's.
pub fn table(
    weights: &[&Nf4Weight],
    addrs: &[Addresses],
    slots: &Slots,
    threads: usize,
) -> std::result::Result<GroupTable, String> {
    if weights.len() != slots.len() || addrs.len() != slots.len() || slots.len() > MAX_ENTRIES {
        return Err(format!(
            "{} weights, {} address sets, {} slots (at most {MAX_ENTRIES})",
            weights.len(),
            addrs.len(),
            slots.len()
        ));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(i, w)| w.numel() != slots[*i].1)
    {
        return Err(format!("weight {i} {:?} is not its slot's size", w.shape));
    }
    let mut t = GroupTable {
        count: weights.len() as i32,
        ..Default::default()
    };
    let mut blocks = 0usize;
    for (i, ((w, a), &(offset, n))) in weights.iter().zip(addrs).zip(slots).enumerate() {
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
        /// path into `out[offset..offset + numel]`; whatever lies between the slots untouched.
        pub fn $name(weights: &[&Nf4Weight], slots: &Slots, out: &mut [$T]) -> Result<()> {
            let want = slots.iter().map(|&(o, n)| o + n).max().unwrap_or(0);
            if out.len() < want || weights.len() != slots.len() {
                return Err(super::QuantError::OutLen {
                    got: out.len(),
                    want,
                });
            }
            for (w, &(offset, n)) in weights.iter().zip(slots) {
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
    use crate::nf4::quantize_nf4;

    fn weight(out: usize, inp: usize, dq: bool, seed: usize) -> Nf4Weight {
        let x: Vec<f32> = (0..out * inp)
            .map(|i| ((i * 7 + seed) as f32 * 0.37).sin() * 0.05)
            .collect();
        quantize_nf4(&x, &[out, inp], dq).unwrap()
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
        let slots = [(0, 4096), (4096, 192), (4352, 2112)];
        let addrs: Vec<Addresses> = ws.iter().map(host_addresses).collect();
        let t = table(&refs, &addrs, &slots, 64).unwrap();
        // 4096 → 4 blocks of 1024; 192 → 1; 2112 → 3.
        let starts: Vec<i32> = t.e[..3].iter().map(|e| e.block_start).collect();
        assert_eq!((starts, t.total_blocks, t.count), (vec![0, 4, 5], 8, 3));
        assert_eq!((t.e[1].is_double, t.e[0].is_double), (1, 0));
        assert_eq!(t.e[2].out_offset, 4352);
        assert_eq!(t.e[1].absmax, 0);
        assert!(table(&refs[..2], &addrs, &slots, 64).is_err());
        assert!(table(&refs, &addrs, &[(0, 4096), (4096, 191), (4352, 2112)], 64).is_err());
    }

    /// The reference writes each weight's own dequantization at its slot and nothing else.
    #[test]
    fn the_reference_is_the_per_tensor_dequant_at_each_offset() {
        let ws = [weight(3, 96, false, 4), weight(5, 96, true, 5)];
        let refs: Vec<&Nf4Weight> = ws.iter().collect();
        let slots = [(0, 288), (384, 480)];
        let sentinel = bf16::from_f32(7.0);
        let mut out = vec![sentinel; 864];
        dequantize_group_bf16(&refs, &slots, &mut out).unwrap();
        for (w, &(o, n)) in ws.iter().zip(&slots) {
            let mut one = vec![bf16::ZERO; n];
            w.dequantize_into_bf16(&mut one).unwrap();
            assert_eq!(&out[o..o + n], &one[..]);
        }
        assert!(out[288..384].iter().all(|&x| x == sentinel));
        assert!(dequantize_group_bf16(&refs, &slots, &mut out[1..]).is_err());
    }
}
