//! The memory of the tiled attention path (`rtune_ops::attention::tiled`, FlashAttention-2 on the
//! CPU), and which path a run takes ([`attn_path`]: as the model picks it).
//!
//! What the tiled path holds, against the plain one (`rtune_ops::attention`):
//! - no `T × T` tensor at all: no kept probabilities, no per-row scores in the backward; the
//!   layer keeps the log-sum-exp `(B, T, H)` f32 (the plain path's per-row log-sum-exp, the same
//!   size) and the output `O`, which is the tensor the output projection keeps anyway;
//! - the visible-key starts `(B or 1, T)` u32 instead of the dense additive mask
//!   `(B or 1, 1, 1, T, T)` f32 (never built on this path);
//! - in the backward, per task (batch row, head, chunk of query tiles) a partial dK and dV in f32
//!   over the keys the chunk sees (`lo..q_end`: `0..q_end` under the causal mask, less with a
//!   sliding window), all alive until they are reduced per kv head into dK and dV; dQ is written
//!   in place. The reduction adds one `T × Dh` f32 pair per thread at work.
//!
//! The task split mirrors `flash::backward`: `want = ⌈BWD_TASKS / (B·H)⌉` chunks per (row, head),
//! `tiles = ⌈ntiles / want⌉` query tiles of [`BR`] rows per chunk.

use rtune_model::ModelConfig;
use rtune_ops::attention::tiled::BR;
use rtune_ops::AttnPath;

use crate::{item, names, Dims, Item, Phase, Settings};

/// `flash::BWD_TASKS`: backward tasks the split aims for.
const BWD_TASKS: usize = 32;

/// The attention path the model takes for rows of `t` tokens on the CPU: `RTUNE_ATTN`
/// (`plain`, `tiled`, `auto`) or, by default, tiled from `rtune_ops::TILED_MIN_T` tokens
/// on ([`AttnPath::for_device`] itself, so the two cannot disagree). An invalid `RTUNE_ATTN`
/// (which the run itself refuses) counts as the default.
pub fn attn_path(t: usize) -> AttnPath {
    AttnPath::for_device(&candle_core::Device::Cpu, t).unwrap_or(if t >= rtune_ops::TILED_MIN_T {
        AttnPath::Tiled
    } else {
        AttnPath::Plain
    })
}

/// Bytes of each partial dK (and dV) buffer of the tiled backward, one entry per chunk of query
/// tiles of one (batch row, head): `(q_end − lo)·Dh·4`. `window`: the last layer's sliding window.
pub fn partial_bytes(t: usize, b: usize, h: usize, dh: usize, window: Option<usize>) -> Vec<u64> {
    let ntiles = t.div_ceil(BR);
    let want = BWD_TASKS.div_ceil((b * h).max(1));
    let tiles = ntiles.div_ceil(want.clamp(1, ntiles.max(1))).max(1);
    let chunks = ntiles.div_ceil(tiles);
    (0..chunks)
        .map(|c| {
            let (q0, q_end) = (c * tiles * BR, ((c + 1) * tiles * BR).min(t));
            // The first key any query of the chunk sees: 0 (causal; packed rows start later, so
            // 0 is their worst case), or the window's start for the chunk's first query.
            let lo = window.map_or(0, |w| (q0 + 1).saturating_sub(w.max(1)));
            ((q_end - lo) * dh * 4) as u64
        })
        .collect()
}

/// The last layer's sliding window, when it has one shorter than the rows.
fn last_window(c: &ModelConfig, t: usize) -> Option<usize> {
    match c.sliding_window {
        Some(w) if w < t && c.window_layers.last().copied().unwrap_or(false) => Some(w),
        _ => None,
    }
}

/// The attention part of the backward phases on the tiled path (replacing the plain path's
/// per-row scores and gradient lists). Alive in both: `d_out` (N, Dq), the gradient of the
/// attention output (a view as `(B, T, H, Dh)`: no copy, unlike the plain path's transpose).
/// - [`Phase::AttentionBackward`], at the reduction (the peak inside `flash_attn_bwd`): dQ
///   `(B, H, T, Dh)`, every partial dK/dV, dK and dV `(B, Hkv, T, Dh)`, and each working thread's
///   f32 `T × Dh` pair;
/// - [`Phase::RopeBackward`], as `attention_backward` returns: dQ and dK, their rotary backward and
///   their `(N, ·)` copies, dV and its copy (`3·Dq + 5·Dkv` per token).
pub(crate) fn backward_items(c: &ModelConfig, s: &Settings, k: &Dims, phase: Phase) -> Vec<Item> {
    let (n, e) = (k.n, k.e);
    let mut v = vec![item(names::WORKSPACE, n * k.dq * e, 1)]; // d_out
    match phase {
        Phase::AttentionBackward => {
            v.push(item(names::WORKSPACE, n * k.dq * e, 1)); // dQ
            v.push(item(names::WORKSPACE, n * k.dkv * e, 2)); // dK, dV
            let (b, t, h) = (s.micro_batch_size, s.seq_len, c.num_heads);
            for each in partial_bytes(t, b, h, c.head_dim, last_window(c, t)) {
                v.push(item(names::PARTIALS, each, 2 * (b * h) as u64)); // dK and dV partials
            }
            let threads = candle_core::utils::get_num_threads()
                .min(b * c.num_kv_heads)
                .max(1);
            v.push(item(
                names::PARTIALS,
                (t * c.head_dim * 4) as u64,
                2 * threads as u64,
            ));
        }
        Phase::RopeBackward => {
            v.push(item(names::WORKSPACE, n * k.dq * e, 3));
            v.push(item(names::WORKSPACE, n * k.dkv * e, 5));
        }
        _ => unreachable!("only the attention's backward phases differ"),
    }
    v
}
