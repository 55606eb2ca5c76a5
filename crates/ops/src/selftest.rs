//! Every fused kernel against its reference once, for `rtune selftest`: each op folder's
//! `check::self_test_groups` (found at build time by `build.rs`: none is listed here) and
//! `rtune_backend::cast`'s widening cast; one group per kernel, type and shape.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use rtune_backend::cast::check::check_widen;
use rtune_backend::check::{CheckGroups, SelfTestGroup};
use rtune_backend::launch::FusedFloat;
use rtune_backend::Result;

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
/// at offset 1; the widening cast 2^20 + 5 and 1001 at offset 3; the residual add + RMSNorm
/// (64, 4096) and (7, 4097) at offset 1 with a weight of the type, (64, 3072) and (3, 97) at
/// offset 3 with an f32 one; RoPE on q/k in place (2, 32/8 heads, 65, 128) and, partial (96 of
/// 128) with f32 tables of batch 1, (1, 24/8, 33, 128) at offset 1; the soft-capped
/// cross-entropy (16, 256000) and (5, 1001) at offset 3, cap 30. The odd sizes are multiples of
/// none of 4, 32, 64; the odd offsets take the kernels' unaligned paths.
pub fn self_test_seeded(stream: &Arc<CudaStream>, seed: u64) -> Vec<SelfTestGroup> {
    let mut all = self_test_type::<f32>(stream, seed);
    all.extend(self_test_type::<half::bf16>(stream, seed));
    all.extend(self_test_type::<half::f16>(stream, seed));
    all
}

// `op_groups`: each op folder's `check::self_test_groups`, found by build.rs (an op registers its
// checks from its own folder).
include!(concat!(env!("OUT_DIR"), "/selftest_groups.rs"));

fn self_test_type<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> Vec<SelfTestGroup> {
    let t = T::SUFFIX;
    let mut groups = op_groups::<T>(s, seed);
    // The widening cast is the backend's (its GEMM's autocast needs it), not an op folder's.
    groups.push((
        format!("widen_{t} (2^20+5)"),
        check_widen::<T>(s, (1 << 20) + 5, 0, seed + 13),
    ));
    groups.push((
        format!("widen_{t} (1001)+3"),
        check_widen::<T>(s, 1001, 3, seed + 14),
    ));
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
