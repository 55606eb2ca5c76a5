//! Loading a sparse layer from the released per-expert layout (`experts.N.gate_proj` ...: what
//! transformers 5.24 itself saves, and every released Qwen3-MoE and Mixtral) holds, besides the
//! layer's stacks, only one expert's matrix at a time (`rtune_model::moe::MoeMlp::load`,
//! `moe/stacks.rs`: each expert copied into the stacks as it is read). Joining and stacking
//! per-expert tensors held every expert's gate/up and down next to the gate/up stack: the whole
//! gate/up stack more at the peak (benches/moe_vs_peft.sh's model: +100 MB a layer, 649.6 MB
//! peak RSS with NF4 experts). `rtune_estimate`'s loading item counts what is measured here.
//!
//! Measured with a counting global allocator: the bytes live at the peak of `MoeMlp::load`
//! minus those live after it (the layer's own tensors). One test in this binary, so that no
//! other test allocates meanwhile.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering::SeqCst};

use candle_core::{DType, Device};
use rtune_model::moe::MoeMlp;
use rtune_model::weights::Weights;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

/// `delta` bytes more live (or fewer), the peak kept.
fn count(delta: isize) {
    let now = LIVE.fetch_add(delta, SeqCst) + delta;
    PEAK.fetch_max(now, SeqCst);
}

// SAFETY: every call is passed on to the system allocator unchanged (same pointer and layout,
// the caller's contract passed through); only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size() as isize);
        // SAFETY: as the caller's contract for `alloc`.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count(l.size() as isize);
        // SAFETY: as the caller's contract for `alloc_zeroed`.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        count(-(l.size() as isize));
        // SAFETY: `p` was allocated by `System` with `l` (every allocation goes through here).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        count(new as isize - l.size() as isize);
        // SAFETY: as the caller's contract for `realloc`; `p` is `System`'s, with `l`.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Per fixture (Qwen3-MoE's and Mixtral's per-expert checkpoints, f32, 8 experts, H 64, I 32):
/// the first sparse layer loaded in f32 holds at its peak at most two experts' `(I, H)`
/// matrices (one being copied, candle's read of the next) and 8 KiB of names more than its
/// tensors; with NF4 experts, its dense gate/up stack `(E, 2I, H)` besides (quantized before
/// down is read, then freed) and the same. Before, 131 KiB (the gate/up stack) more in f32, and
/// with NF4 experts both dense stacks, 196 KiB.
#[test]
fn a_per_expert_layer_loads_with_one_expert_beside_its_stacks() {
    for name in ["tiny-qwen3-moe", "tiny-mixtral"] {
        let (dir, cfg) = common::fixture_config(name);
        let mc = cfg.moe.as_ref().unwrap();
        let (e, i, h) = (mc.experts, mc.intermediate, cfg.hidden_size);
        let l = mc.sparse_layers.iter().position(|&s| s).unwrap();
        let w = Weights::open(&dir, DType::F32, &Device::Cpu).unwrap();
        let layer = format!("model.layers.{l}");
        for nf4 in [None, Some(false)] {
            let before = LIVE.load(SeqCst);
            PEAK.store(before, SeqCst);
            let m = MoeMlp::load(&w, &layer, mc, h, nf4, None).unwrap();
            let (peak, after) = (PEAK.load(SeqCst), LIVE.load(SeqCst));
            assert!(after - before >= m.resident_bytes() as isize);
            let dense = match nf4 {
                None => 0,
                Some(_) => 2 * e * i * h * 4,
            };
            let bound = (dense + 2 * i * h * 4 + (8 << 10)) as isize;
            let extra = peak - after;
            eprintln!("{name} nf4 {nf4:?}: {extra} B beside the layer's tensors (bound {bound})");
            assert!(extra <= bound, "{name} nf4 {nf4:?}: {extra} B > {bound} B");
            drop(m);
        }
    }
}
