//! Every fused kernel against its reference once, for `rtune selftest` (each op folder's
//! `check.rs`, and `rtune_backend::cast`'s): one group per element type.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use rtune_backend::check::{CheckResult, SelfTestGroup};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Result;

use crate::attention::check::check_attn_softmax;
use crate::ce::check::check_ce;
use crate::glu::check::{check_geglu, check_swiglu};
use crate::norm::check::check_rms_norm;
use crate::rope::check::check_rope;
use rtune_backend::cast::check::check_widen;

/// Every kernel once per type (f32, bf16, f16) on fresh random inputs against the reference:
/// `(name, max relative error, pass)` per kernel, seeded from the clock (see [`self_test_seeded`]
/// for the shapes). A few hundred ms on an H100, most of it the CPU reference.
pub fn self_test(stream: &Arc<CudaStream>) -> Result<Vec<(String, f64, bool)>> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut all = Vec::new();
    for (_, group) in self_test_seeded(stream, seed) {
        all.extend(group?);
    }
    Ok(all)
}

/// [`self_test`] under a given seed, one result per group (an op pair on one shape and type), so
/// a failing launch loses only its own group. Shapes: RMSNorm (64, 4096), (7, 4097) at offset 1
/// and (3, 97) at offset 3; SwiGLU 2^20 + 3 and 1001 at offset 5; RoPE (2, 8, 65, 128) and
/// (1, 3, 33, 64) at offset 1; cross-entropy (16, 32000), (4, 128256) and (5, 1001) at offset 3;
/// attention softmax (32·128, 128), (2·3, 16384) (rows too long for shared memory) and (3·7, 333)
/// at offset 1; the widening cast 2^20 + 5 and 1001 at offset 3. The odd sizes are multiples of
/// none of 4, 32, 64; the odd offsets take the kernels' unaligned paths.
pub fn self_test_seeded(stream: &Arc<CudaStream>, seed: u64) -> Vec<SelfTestGroup> {
    let mut all = self_test_type::<f32>(stream, seed);
    all.extend(self_test_type::<half::bf16>(stream, seed));
    all.extend(self_test_type::<half::f16>(stream, seed));
    all
}

fn self_test_type<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> Vec<SelfTestGroup> {
    let t = T::SUFFIX;
    let groups: Vec<(String, Result<Vec<CheckResult>>)> = vec![
        (
            format!("rms_norm_{t} (64, 4096)"),
            check_rms_norm::<T>(s, 64, 4096, 0, seed),
        ),
        (
            format!("rms_norm_{t} (7, 4097)+1"),
            check_rms_norm::<T>(s, 7, 4097, 1, seed + 1),
        ),
        (
            format!("rms_norm_{t} (3, 97)+3"),
            check_rms_norm::<T>(s, 3, 97, 3, seed + 8),
        ),
        (
            format!("swiglu_{t} (2^20+3)"),
            check_swiglu::<T>(s, (1 << 20) + 3, 0, seed + 2),
        ),
        (
            format!("swiglu_{t} (1001)+5"),
            check_swiglu::<T>(s, 1001, 5, seed + 9),
        ),
        (
            format!("geglu_{t} (2^20+3)"),
            check_geglu::<T>(s, (1 << 20) + 3, 0, seed + 21),
        ),
        (
            format!("geglu_{t} (1001)+5"),
            check_geglu::<T>(s, 1001, 5, seed + 22),
        ),
        (
            format!("widen_{t} (2^20+5)"),
            check_widen::<T>(s, (1 << 20) + 5, 0, seed + 13),
        ),
        (
            format!("widen_{t} (1001)+3"),
            check_widen::<T>(s, 1001, 3, seed + 14),
        ),
        (
            format!("rope_{t} (2, 8, 65, 128)"),
            check_rope::<T>(s, (2, 8, 65, 128), 0, seed + 3),
        ),
        (
            format!("rope_{t} (1, 3, 33, 64)+1"),
            check_rope::<T>(s, (1, 3, 33, 64), 1, seed + 10),
        ),
        (
            format!("ce_{t} (16, 32000)"),
            check_ce::<T>(s, 16, 32000, 0, seed + 4),
        ),
        (
            format!("ce_{t} (4, 128256)"),
            check_ce::<T>(s, 4, 128256, 0, seed + 5),
        ),
        (
            format!("ce_{t} (5, 1001)+3"),
            check_ce::<T>(s, 5, 1001, 3, seed + 11),
        ),
        (
            format!("attn_softmax_{t} (32·128, 128)"),
            check_attn_softmax::<T>(s, (32, 128, 128), 0, seed + 6),
        ),
        (
            format!("attn_softmax_{t} (2·3, 16384)"),
            check_attn_softmax::<T>(s, (2, 3, 16384), 0, seed + 7),
        ),
        (
            format!("attn_softmax_{t} (3·7, 333)+1"),
            check_attn_softmax::<T>(s, (3, 7, 333), 1, seed + 12),
        ),
    ];
    groups
        .into_iter()
        .map(|(label, r)| {
            let r = r.map(|v| {
                v.into_iter()
                    .map(|c| (c.name, c.cmp.max_rel_err, c.cmp.pass))
                    .collect()
            });
            (label, r)
        })
        .collect()
}
