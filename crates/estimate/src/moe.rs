//! The memory of a mixture-of-experts model's sparse layers (issue 45: `rtune_model::moe`,
//! `rtune_experts::moe`, `rtune_experts::route`), and its total vs active parameters.
//!
//! A sparse layer has no dense MLP: its router `(E, D)` and its two expert stacks, gate_up
//! `(E, 2I, D)` and down `(E, D, I)`, are frozen in the compute dtype, under `quant = "nf4"` too
//! (bitsandbytes' `load_in_4bit` quantizes `nn.Linear`s only, not the fused 3-D stacks, and rtune
//! loads as it does), unless `[model] quantize_experts` holds the stacks in NF4 too: each expert's
//! `(out, in)` as one NF4 weight ([`crate::frozen_bytes`] per expert, ≈ 0.56 byte a parameter),
//! and while its products run one expert dequantized to f32 per compute thread
//! ([`dequant_bytes`]). LoRA on a stack (`target_parameters`, PEFT's `ParamWrapper`) is
//! `A: (E·r, in)` and `B: (out, r·E)` f32.
//!
//! What one sparse layer's forward keeps for its backward (`MoeLayerCache`), with `N` tokens,
//! `k` experts a token and so `N·k` routed rows over all experts:
//! - the routing: the chosen ids and weights `(N·k)` u32/f32, the weights rounded to the compute
//!   dtype, the softmax `(N, E)` f32 (softmax-first routers), the groups' token ids and slots
//!   `(N·k)` u32/usize;
//! - per expert, over its rows: the gathered input `(n_e, D)`, the gate/up output `(n_e, 2I)`,
//!   the down output `(n_e, D)`, and `x·Aᵀ (n_e, r)` per adapted stack, in the compute dtype.
//!
//! The router logits `(N, E)` f32 of every sparse layer are taken out of the caches for the
//! load-balancing loss, and with `output_router_logits` each layer's gradient of it `(N, E)` f32
//! is alive from the cross-entropy to that layer's backward.

use rtune_experts::route::Routing;
use rtune_model::ModelConfig;

use crate::{item, names, Dims, Item, Settings};

/// Sparse layer `l`'s expert stacks as `(experts, in, out, adapted)`; none on a dense layer.
pub(crate) fn stacks_of(c: &ModelConfig, s: &Settings, l: usize) -> Vec<(u64, u64, u64, bool)> {
    let Some(moe) = c.moe.as_ref().filter(|_| c.is_sparse(l)) else {
        return Vec::new();
    };
    moe.stacks(c.hidden_size)
        .iter()
        .map(|st| {
            let adapted = s.target_parameters.iter().any(|p| p == st.param);
            let (i, o) = (st.in_features as u64, st.out_features as u64);
            (moe.experts as u64, i, o, adapted)
        })
        .collect()
}

/// Sparse layer `l`'s frozen bytes on the first rank of a base sharded over `world` (1: the
/// whole base; `rtune_model::moe::MoeShards`): the router in the compute dtype split into
/// `world` pieces as a dense linear's, and the stacks split by whole experts, the first rank
/// holding `ceil(E / world)` of them: in the compute dtype, or with `quantize_experts` NF4 expert
/// by expert (packed codes, scales and tables of each).
pub(crate) fn frozen_bytes(c: &ModelConfig, s: &Settings, l: usize, e: u64, world: u64) -> u64 {
    let world = world.max(1);
    let weights = weights_of(c, s, l);
    let Some((router, _)) = weights.split_first() else {
        return 0;
    };
    let stacks: u64 = stacks_of(c, s, l)
        .iter()
        .map(|&(x, i, o, _)| {
            let expert = match s.quantize.experts() {
                true => {
                    let (w, k) = crate::frozen_bytes(i * o, e, s.quantize);
                    w + k
                }
                false => i * o * e,
            };
            x.div_ceil(world) * expert
        })
        .sum();
    stacks + (router * e).div_ceil(world)
}

/// Sparse layer `l`'s frozen weights' element counts: the router, gate_up, down (none on a
/// dense layer).
pub(crate) fn weights_of(c: &ModelConfig, s: &Settings, l: usize) -> Vec<u64> {
    let stacks = stacks_of(c, s, l);
    if stacks.is_empty() {
        return Vec::new();
    }
    let router = c.moe.as_ref().map_or(0, |m| m.experts as u64) * c.hidden_size as u64;
    std::iter::once(router)
        .chain(stacks.iter().map(|(x, i, o, _)| x * i * o))
        .collect()
}

/// With `quantize_experts`: the experts dequantized while their products run, one a compute
/// thread (`rtune_experts::moe::stack`: the grouped f32 path's jobs each dequantize their expert
/// to f32 and drop it after; the per-expert path one at a time in the compute dtype), the
/// largest `(out, in)` of any stack. 0 otherwise.
pub(crate) fn dequant_bytes(c: &ModelConfig, s: &Settings) -> u64 {
    if !s.quantize.experts() {
        return 0;
    }
    let largest = (0..c.num_layers)
        .flat_map(|l| stacks_of(c, s, l))
        .map(|(_, i, o, _)| i * o)
        .max()
        .unwrap_or(0);
    let threads = candle_core::utils::get_num_threads().max(1) as u64;
    largest * 4 * threads
}

/// Sparse layer `l`'s LoRA parameters: `r·E·(in + out)` per adapted stack.
pub(crate) fn lora_params(c: &ModelConfig, s: &Settings, l: usize) -> u64 {
    stacks_of(c, s, l)
        .iter()
        .filter(|st| st.3)
        .map(|(x, i, o, _)| s.r as u64 * x * (i + o))
        .sum()
}

/// The trained tensors of sparse layer `l` as `(bytes each, how many)`: each adapted stack's
/// `A: (E·r, in)` and `B: (out, r·E)` f32.
pub(crate) fn lora_tensors(c: &ModelConfig, s: &Settings, l: usize) -> Vec<(u64, u64)> {
    let r = s.r as u64;
    stacks_of(c, s, l)
        .iter()
        .filter(|st| st.3)
        .flat_map(|&(x, i, o, _)| [(x * r * i * 4, 1), (x * r * o * 4, 1)])
        .collect()
}

/// What one sparse layer's loading holds besides the weights already counted, on the first rank
/// of `world` (1: unsharded), the largest over the layers (`rtune_model::moe::MoeMlp::load`,
/// `moe/stacks.rs`; `e`: bytes per element of the compute dtype):
/// - unsharded, the stacks in the compute dtype: the weights themselves, nothing more (the
///   released per-expert layout is copied into the stacks expert by expert), except the stored
///   copy of a fused stack being converted from another dtype (`file_e`), and for gpt-oss's
///   `(E, in, out)` stacks one stack more in the compute dtype: an upper bound of what loading
///   one holds besides it (its MXFP4 codes, 17/32 of a byte an element, or one expert's piece
///   and its transpose), kept so since the mapped checkpoint is counted whole while a 16-bit
///   stack is read by pieces (synthetic 4-layer gpt-oss, 32 experts, bf16: estimate 1195 MB
///   MXFP4 and 1787 MB 16-bit, measured peak RSS 1115 and 1105 MB);
/// - unsharded with `quantize_experts`: the larger dense stack (each quantized expert by expert
///   as soon as it is read, before the other is; `crates/model/tests/moe_load_memory.rs`), and
///   the same copies;
/// - a sharded base's rank: its experts' largest stack read, then copied into its shard (two
///   copies of it at once).
///
/// benches/moe_vs_peft.sh's model (per-expert f32, 128 experts, D 512, I 192) with NF4 experts:
/// the load peaks with layer 1's dense gate/up stack (101 MB) read (tests.rs).
pub(crate) fn loading_bytes(c: &ModelConfig, s: &Settings, e: u64, world: u64) -> u64 {
    let world = world.max(1);
    let file_e = match s.checkpoint_elem_bytes {
        0 => e,
        b => b,
    };
    let transposed = c.moe.as_ref().is_some_and(|m| m.transposed);
    (0..c.num_layers)
        .map(|l| {
            let elems: Vec<u64> = stacks_of(c, s, l)
                .iter()
                .map(|&(x, i, o, _)| x.div_ceil(world) * i * o)
                .collect();
            let largest = elems.iter().copied().max().unwrap_or(0);
            let converted = if file_e == e { 0 } else { file_e };
            let staging = largest * (converted + if transposed { e } else { 0 });
            match (world, s.quantize.experts()) {
                (1, true) => largest * e + staging,
                (1, false) => staging,
                _ => 2 * largest * e,
            }
        })
        .max()
        .unwrap_or(0)
}

/// What sparse layer `l`'s forward keeps for its backward (see the module's doc), under `name`.
pub(crate) fn layer_cache(
    c: &ModelConfig,
    s: &Settings,
    k: &Dims,
    l: usize,
    name: &'static str,
) -> Vec<Item> {
    let Some(moe) = c.moe.as_ref().filter(|_| c.is_sparse(l)) else {
        return Vec::new();
    };
    let (n, e, d) = (k.n, k.e, k.d);
    let (x, top, i) = (
        moe.experts as u64,
        moe.top_k as u64,
        moe.intermediate as u64,
    );
    let rows = n * top;
    // ids, weights (f32), the weights in the compute dtype, token ids and slots.
    let mut v = vec![item(name, rows * (4 + 4 + e + 4 + 8), 1)];
    match grouped(k) {
        // The grouped path's `Cache`, each its own allocation: gate/up's output (R, 2I), the
        // activation (R, I) and down's output (R, D) f32; the rows' order (token and
        // `rows_of` u32, slot usize). Its input is the layer's normed h (shared).
        true => {
            v.push(item(name, rows * 2 * i * 4, 1));
            v.push(item(name, rows * i * 4, 1));
            v.push(item(name, rows * d * 4, 1));
            v.push(item(name, rows * (4 + 4 + 8), 1));
        }
        // Per expert: gathered x and down output (n_e, D), gate/up output (n_e, 2I).
        false => v.push(item(name, rows * (2 * d + 2 * i) * e, 1)),
    }
    if matches!(moe.routing, Routing::SoftmaxTopK { .. }) {
        v.push(item(name, n * x * 4, 1)); // the softmax (N, E) f32
    }
    let adapted: Vec<_> = stacks_of(c, s, l).into_iter().filter(|st| st.3).collect();
    // x·Aᵀ (n_e, r) per adapted stack.
    v.push(item(name, rows * s.r as u64 * e, adapted.len() as u64));
    if grouped(k) {
        // The grouped path's `Cache` keeps each adapted stack's `lora_B` repacked `(E, out, r)`
        // f32 for the backward.
        for (x, _, out, _) in adapted {
            v.push(item(name, x * out * s.r as u64 * 4, 1));
        }
    }
    v
}

/// Whether the experts take `rtune_experts::moe`'s grouped path: f32 activations on the CPU
/// (f32, and bf16 autocast, whose experts stay f32), NF4 experts dequantized to f32 a job.
fn grouped(k: &Dims) -> bool {
    k.e == 4
}

/// What the last sparse layer's experts' backward holds at its high-water mark, `R = N·k` rows.
///
/// On the grouped path (`grouped::backward`, f32), at its end, all alive at once: each row's
/// input gradient `(R, D)`, `∂L/∂w` by row and by slot `(R)`, the input gradient summed per token
/// and with the router's added `(N, D)` each, `∂L/∂logits` `(N, E)`; per adapted stack its
/// LoRA gradients `E·r·(in + out)` and the `dB` permuted into PEFT's layout `(out, r·E)` (its
/// `lora_B` repacked `(E, out, r)` is the forward's, in [`layer_cache`]); and each compute
/// thread's scratch (kept across jobs, layers and steps): one expert's `dy·w`, activation and
/// gate/up gradients, gathered input and `dy·B`, `n_e·(2D + 3I + r)` f32 for its largest expert,
/// taken as 4 times the mean `R/E` rows (at most `N`: an expert takes a token once).
///
/// On the per-expert path (other dtypes), per-expert tensors of the same sizes as the
/// grouped path's `(R, ·)` buffers plus `dy` gathered by row, `w·dy`, the recomputed
/// activation and its gradient: `(R, 3D + 4I)` in the compute dtype, `dy·B` `(R, r)` per
/// adapted stack.
///
/// Measured on `benches/moe_vs_peft.sh`'s shape (128 experts top-8, D 512, I 192, B 4 × T 512,
/// f32, LoRA r 16): see `tests.rs`.
pub(crate) fn backward_items(c: &ModelConfig, s: &Settings, k: &Dims, l: usize) -> Vec<Item> {
    let Some(moe) = c.moe.as_ref().filter(|_| c.is_sparse(l)) else {
        return Vec::new();
    };
    let (n, e, d) = (k.n, k.e, k.d);
    let (x, top, i, r) = (
        moe.experts as u64,
        moe.top_k as u64,
        moe.intermediate as u64,
        s.r as u64,
    );
    let rows = n * top;
    let w = names::WORKSPACE;
    let adapted: Vec<_> = stacks_of(c, s, l).into_iter().filter(|st| st.3).collect();
    if grouped(k) {
        let threads = candle_core::utils::get_num_threads().max(1) as u64;
        let busiest = (4 * rows).div_ceil(x.max(1)).min(n);
        let r_max = if adapted.is_empty() { 0 } else { r };
        let mut v = vec![
            item(w, rows * d * 4, 1),
            item(w, rows * 4, 2),
            item(w, n * d * 4, 2),
            item(w, n * x * 4, 1),
            item(w, busiest * (2 * d + 3 * i + r_max) * 4, threads),
        ];
        for (x, inp, out, _) in adapted {
            v.push(item(w, x * out * r * 4, 1));
            v.push(item(w, x * r * (inp + out) * 4, 1));
        }
        return v;
    }
    let mut v = vec![
        item(w, rows * (3 * d + 4 * i) * e, 1),
        item(w, rows * 4, 2),
        item(w, n * d * e, 2),
        item(w, n * x * 4, 1),
    ];
    for (x, inp, out, _) in adapted {
        v.push(item(w, rows * r * e, 1));
        v.push(item(w, x * out * r * e, 1));
        v.push(item(w, x * r * (inp + out) * 4, 1));
    }
    v
}

/// The router logits `(N, E)` f32 of every sparse layer, and with the load-balancing loss each
/// one's gradient, alive through the backward.
pub(crate) fn router_items(c: &ModelConfig, k: &Dims) -> Vec<Item> {
    let Some(moe) = &c.moe else {
        return Vec::new();
    };
    let sparse = moe.sparse_layers.iter().filter(|&&x| x).count() as u64;
    let per = if moe.aux_coef.is_some() { 2 } else { 1 };
    vec![item(
        names::ROUTER,
        k.n * moe.experts as u64 * 4,
        per * sparse,
    )]
}

/// The base's parameters in all and those one token uses (its `k` experts of each sparse
/// layer's `E`): `(total, active)`. Embeddings, the lm_head, the linear and expert weights, the
/// routers and the layers' RMSNorm weights; biases and q/k norms (a few thousand) left out.
pub fn parameters(c: &ModelConfig) -> (u64, u64) {
    let (d, v) = (c.hidden_size as u64, c.vocab_size as u64);
    let mut total = v * d * if c.tie_word_embeddings { 1 } else { 2 };
    total += (2 * c.num_layers as u64 + 1) * d;
    let mut active = total;
    for l in 0..c.num_layers {
        let dense: u64 = c
            .linears_of(l)
            .iter()
            .map(|m| (m.in_features * m.out_features) as u64)
            .sum();
        total += dense;
        active += dense;
        if let Some(moe) = c.moe.as_ref().filter(|_| c.is_sparse(l)) {
            let (x, top, i) = (
                moe.experts as u64,
                moe.top_k as u64,
                moe.intermediate as u64,
            );
            let router = x * d;
            total += router + x * 3 * i * d;
            active += router + top * 3 * i * d;
        }
    }
    (total, active)
}
