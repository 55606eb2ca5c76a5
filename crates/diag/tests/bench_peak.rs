//! `rtune bench`'s measured peak is the steps', not the GEMM-ceiling probe's that runs after them.
//!
//! Its own test binary: the peak is the process's (VmHWM), so no other test may run beside it.

use rtune_diag::bench::{run, BenchOptions};
use rtune_diag::DiagError;

/// Here the probe's lm_head product (2048 × 32000 f32, 262 MB) is several times what a step adds
/// (a 64-wide model; the cross-entropy never holds the full logits). Failed at 290 MB of growth
/// when the peak was read after the probe.
#[test]
fn the_ceiling_probe_is_not_in_the_measured_peak() -> Result<(), DiagError> {
    if !cfg!(target_os = "linux") {
        return Ok(()); // The peak restarts through /proc/self/clear_refs.
    }
    let o = BenchOptions {
        hidden: 64,
        layers: 1,
        heads: 4,
        kv_heads: 2,
        intermediate: 96,
        vocab: 32_000,
        seq: 256,
        batch: 8,
        r: 4,
        steps: 1,
        warmup: 0,
        ..BenchOptions::default()
    };
    let r = run(&o, &mut |_, _, _| {})?;
    assert!(r.ceiling.is_some() && r.peak_reset);
    let probe = (o.batch * o.seq * o.vocab * 4) as u64;
    let grew = r
        .peak_memory_bytes
        .saturating_sub(r.memory_before_steps_bytes);
    assert!(grew < probe / 2, "the steps' peak grew by {grew} B: {r:?}");
    Ok(())
}
