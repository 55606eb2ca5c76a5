//! The memory model behind `rtune estimate`: the peak resident memory of a training run, predicted
//! from config.json and the run settings before anything is loaded ([`estimate`]), and the largest
//! micro-batch and sequence length that fit a budget ([`largest_fitting`]). The settings come from
//! a run config or the data (`run.rs`: [`settings_for`], [`fit_to_data`]); the trainer records
//! [`for_run`] beside the measured peak.
//!
//! The model mirrors what the code keeps alive (`rtune_model`'s hand-written forward/backward), not a
//! rule of thumb. A run goes through moments ([`Phase`]) at which different tensors are alive: while
//! loading, the mapped checkpoint next to the weights taken from it; in a step, the cross-entropy
//! at the end of the forward and the backward of the last layer. Each phase's tensors are listed
//! with their sizes (a tracking allocator on bench-small agrees within 1%), and the peak is the
//! largest phase. Two allocator effects are modelled, being most of the gap between live bytes and
//! RSS (glibc malloc as `crates/cli/main.rs` tunes it: blocks ≥ [`MMAP_THRESHOLD`] are mmapped and
//! returned on free; smaller ones come from the heap, which is never trimmed):
//! - the heap's high-water mark persists: a later phase pays for the heap an earlier phase grew
//!   (e.g. the cross-entropy chunks before the backward);
//! - with gradient checkpointing, the kept layer inputs leave holes in the heap: each is allocated
//!   after its layer's transients, which are then freed around it. Measured ≈ one input's size per
//!   kept input after the first step; steady state at T=2048 is ~90 MB (5%) more, not modelled.
//!   On the tiled attention path each recomputed layer also keeps its attention's output and
//!   log-sum-exp ([`names::KEPT_ATTN`]; the recompute skips the attention); their holes are not
//!   modelled either (bench-small, batch 4, seq 2048: estimate/measured 1.05 after one step).
//!
//! The mapped checkpoint counts because RSS counts it, though the kernel can reclaim those pages.
//! CPU only: on CUDA the activations live in device memory (not modelled yet).
//!
//! The attention path is the model's ([`attn_path`]: `RTUNE_ATTN`, by default tiled on the CPU from
//! 64 tokens); the tiled path's terms are in `tiled.rs` (no `T × T` tensor, dK/dV partials).
//!
//! Shapes: `B` micro-batch rows, `T` sequence length, `N = B·T` tokens, `D` hidden, `Dq = H·Dh`,
//! `Dkv = Hkv·Dh`, `I` intermediate, `V` vocab, `L` layers, `e` bytes per element of the compute
//! dtype. Checked against measured peaks by `benches/estimate_vs_measured.sh` (±10%).

use rtune_config::DType;
use rtune_model::ModelConfig;
use rtune_ops::{keep_probs, AttnPath, AttnShape};

mod checkpointing;
mod moe;
mod run;
mod sampling;
mod tiled;
pub use checkpointing::{choose_checkpointing, Budget, CheckpointingChoice, HEADROOM};
pub use moe::parameters;
pub use run::{
    checkpointing_for, fit_to_data, for_run, matmul_workspace_bytes, rows_per_example, settings_for,
};
pub use sampling::{kv_bytes_per_slot, Sampling};
pub use tiled::{attn_path, partial_bytes};

/// glibc's `M_MMAP_THRESHOLD` as the binary sets it: blocks at least this big are mmapped.
pub const MMAP_THRESHOLD: u64 = 32 << 20;

/// The process before any model tensor: binary and shared libraries, Rust and glibc runtime, the
/// thread pool's stacks, the config. Measured: `rtune bench` RSS after building a model minus the
/// model's bytes, 7.1–7.3 MB.
pub const RUNTIME_BYTES: u64 = 8 << 20;

/// What `rtune train` adds to [`RUNTIME_BYTES`]: the code and buffers of tokenizer, data cache,
/// metrics, TensorBoard and loss-plot writers, and the heap they creep over a run. Measured on the
/// smoke config: RSS minus live heap bytes 10.7 MB after 150 steps (8.3 MB before the writers).
pub const TRAIN_RUNTIME_BYTES: u64 = 5 << 19;

/// Logits rows per cross-entropy chunk, as `Model::forward_backward` picks them (6 Mi f32 a chunk).
pub fn ce_chunk_rows(vocab: usize) -> usize {
    ((6usize << 20) / vocab.max(1)).clamp(16, 4096)
}

/// How the frozen linear layers are held: the one type, from rtune-quant.
pub use rtune_quant::Quantize;

/// The run settings the peak depends on.
#[derive(Debug, Clone)]
pub struct Settings {
    pub dtype: DType,
    pub quantize: Quantize,
    pub r: usize,
    /// Targeted module short names (`q_proj`, ...), `all-linear` already expanded.
    pub targets: Vec<String>,
    /// The expert stacks adapted (`[lora] target_parameters`, PEFT's names).
    pub target_parameters: Vec<String>,
    /// LoRA dropout probability. It keeps nothing for the backward (the model regenerates each
    /// mask from its key: `rtune_backend::dropout`); the dropped inputs a module makes in its
    /// forward and again in its backward live only while its products run, outside the phases
    /// the estimate's peak is taken at.
    pub dropout: f64,
    /// DoRA (`[lora] dora`): a magnitude `(out,)` per module, trained, its cached row norms, and
    /// the `(N, out)` f32 product each layer keeps for its backward (`rtune_model::dora`).
    pub dora: bool,
    /// `[lora] trainable_tokens`: how many `(hidden,)` embedding rows train.
    pub trainable_tokens: usize,
    pub micro_batch_size: usize,
    /// Micro-batches per optimizer step: from the second on, every layer's LoRA gradients exist
    /// during the backward.
    pub grad_accum: usize,
    /// `T`: the padded row length (worst case: `max_seq_len`).
    pub seq_len: usize,
    /// Rows carrying a loss in the largest micro-batch; `None` = all `B·T` (worst case).
    pub target_rows: Option<usize>,
    /// Packed rows: the attention mask is per row, `(B, 1, 1, T, T)`.
    pub packing: bool,
    pub gradient_checkpointing: bool,
    /// The checkpoint's safetensors bytes, mapped while loading (0: unknown or none).
    pub checkpoint_bytes: u64,
    /// Bytes per element of the checkpoint's tensors (0: unknown, taken as the compute dtype's).
    pub checkpoint_elem_bytes: u64,
    /// Process memory besides the model and training tensors: [`RUNTIME_BYTES`], plus tokenizer and
    /// tokenized data for `rtune train`.
    pub runtime_bytes: u64,
    /// The matmul library's per-thread scratch (see [`matmul_workspace_bytes`]).
    pub matmul_workspace: u64,
    /// `[distributed] shard_base` over this many ranks (`rtune_model::shard`): a rank holds
    /// 1/world of the frozen weights (and maps 1/world of the checkpoint while loading), plus the
    /// one layer gathered whole while it computes and, at the cross-entropy, the lm_head.
    /// `None`: the whole base.
    pub shard: Option<usize>,
    /// With `shard`: the last layers the forward gathers, kept gathered for the backward
    /// (`[distributed] keep_gathered_layers`), alive from their forward to their backward.
    pub keep_gathered: usize,
    /// With `shard`: the next layer gathered while one computes (`[distributed] prefetch`):
    /// one more layer alive in the backward, unless it is kept already.
    pub prefetch: bool,
    /// Ranks of a data-parallel run (1: one process): from 2 on, a rank also holds the
    /// gradient all-reduce's two flat f32 copies of the LoRA gradients (8 bytes per LoRA
    /// parameter) and MPI's own memory ([`MPI_RUNTIME_BYTES`], in `runtime_bytes`).
    pub world: usize,
    /// GRPO's generation batch (`sampling.rs`): its KV cache while sampling, the completions
    /// and log-probs kept through the step. `None` for the other objectives.
    pub sampling: Option<Sampling>,
}

/// What MPI adds to a rank's memory: measured, a rank's peak 10.8 MB above one process's on the
/// same run (Open MPI 4.1, shared-memory transport, 2 ranks on one host).
pub const MPI_RUNTIME_BYTES: u64 = 12 << 20;

/// The predicted peak and what it is made of (`breakdown` sums to `peak_bytes`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Estimate {
    pub peak_bytes: u64,
    /// The moment of the peak (a [`Phase`] name).
    pub phase: &'static str,
    /// The largest moment of a training step (equal to `peak_bytes` unless loading is larger).
    pub step_peak_bytes: u64,
    pub breakdown: Vec<(String, u64)>,
}

impl Estimate {
    pub fn get(&self, name: &str) -> u64 {
        self.breakdown
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, b)| b)
            .sum()
    }
}

/// Breakdown names (stable: `--json` keys).
pub mod names {
    pub const RUNTIME: &str = "runtime base";
    pub const WEIGHTS: &str = "base weights";
    pub const QUANT: &str = "quantization constants";
    pub const LORA: &str = "LoRA params";
    pub const DORA: &str = "DoRA norms and kept products";
    pub const GRADS: &str = "LoRA grads";
    pub const GRADS_HOST: &str = "LoRA grads (flat copy for AdamW)";
    pub const UPDATE: &str = "updated LoRA tensor (transient)";
    pub const SERIALIZED: &str = "checkpoint being serialised (AdamW moments)";
    pub const ADAMW: &str = "AdamW states";
    pub const MASTER: &str = "optimizer master copy";
    pub const INPUTS: &str = "kept checkpoints (layer inputs)";
    pub const KEPT_ATTN: &str = "kept checkpoints (attention outputs)";
    pub const ACTS: &str = "layer activations (all layers)";
    pub const ACTS_ONE: &str = "one layer's activations (recomputed)";
    pub const PROBS: &str = "attention probabilities (kept)";
    pub const SCORES: &str = "attention scores (transient)";
    pub const PARTIALS: &str = "attention dK/dV partials (tiled)";
    pub const LOGITS: &str = "logits chunks (cross-entropy)";
    pub const WORKSPACE: &str = "workspace (gradients, transients)";
    pub const MATMUL: &str = "matmul workspace (per thread)";
    pub const BATCH: &str = "batch constants (mask, rope)";
    pub const DEQUANT: &str = "dequantized weight (transient)";
    pub const HEAP_HWM: &str = "allocator: heap high-water";
    pub const FRAG: &str = "allocator: checkpoint holes";
    pub const MAPPED: &str = "checkpoint mapped (loading)";
    pub const CONVERT: &str = "tensor being converted (loading)";
    pub const GATHERED: &str = "gathered weights (sharded base)";
    pub const ALL_REDUCE: &str = "all-reduce buffers (data parallel)";
    pub const ROUTER: &str = "router logits and aux-loss gradients (experts)";
    pub const KV_CACHE: &str = "KV cache (sampling: the last step's and the one it makes)";
    pub const SAMPLING_LOGITS: &str = "logits of a decoding step (sampling)";
    pub const GENERATION: &str = "generation batch (completions, old/reference log-probs)";
}

/// The moments of a step the estimate compares, in time order (within the backward of the last
/// layer: SwiGLU, the attention's batch rows, the rotary backward after them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Loading,
    /// GRPO's sampling before the training pass: the KV cache at the last decoding step.
    Sampling,
    CrossEntropy,
    SwigluBackward,
    AttentionBackward,
    RopeBackward,
    /// After the backward: every LoRA gradient, their host copy for AdamW, and each updated
    /// tensor made before the old one is dropped (`LoraOptimizer::step`).
    OptimizerStep,
    /// A checkpoint: AdamW's moments serialised into one buffer before it is written.
    Checkpoint,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Loading => "loading weights",
            Phase::Sampling => "sampling completions (GRPO, KV cache)",
            Phase::CrossEntropy => "cross-entropy (end of forward)",
            Phase::SwigluBackward => "backward of the last layer: SwiGLU",
            Phase::AttentionBackward => "backward of the last layer: attention",
            Phase::RopeBackward => "backward of the last layer: rotary",
            Phase::OptimizerStep => "optimizer step (AdamW)",
            Phase::Checkpoint => "writing a checkpoint",
        }
    }
}

/// `count` tensors of `each` bytes under one breakdown name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item {
    name: &'static str,
    each: u64,
    count: u64,
}

pub(crate) fn item(name: &'static str, each: u64, count: u64) -> Item {
    Item { name, each, count }
}

/// Bytes held by one frozen `(out, in)` weight of `n` elements: `(values, constants)`.
/// NF4 as `rtune_quant::Nf4Weight::resident_bytes`: packed nibbles `n/2`; scales one f32 per 64
/// (or, double-quantized, one u8 per 64 + one f32 per 256·64 + a 256-entry f32 map + the offset);
/// the 16-entry code table.
pub fn frozen_bytes(n: u64, e: u64, q: Quantize) -> (u64, u64) {
    match q {
        Quantize::None => (n * e, 0),
        Quantize::Nf4 { double_quant, .. } => {
            let blocks = n.div_ceil(64);
            let scales = if double_quant {
                blocks + 4 * blocks.div_ceil(256) + 4 * 256 + 4
            } else {
                4 * blocks
            };
            (n.div_ceil(2), scales + 4 * 16)
        }
    }
}

/// The linear layers of decoder layer `l` (seven; Phi-3's four fused; a sparse layer's
/// attention only: its experts are `moe.rs`'s): `(short name, in, out)`.
fn linears(c: &ModelConfig, l: usize) -> Vec<(&'static str, u64, u64)> {
    c.linears_of(l)
        .iter()
        .map(|m| (m.short(), m.in_features as u64, m.out_features as u64))
        .collect()
}

/// Trained parameters of the whole model: `r·(in + out)` per targeted module and layer (`+ out`
/// with DoRA: the magnitude), `r·E·(in + out)` per adapted expert stack, and `hidden` per
/// trainable token row.
pub fn lora_params(c: &ModelConfig, s: &Settings) -> u64 {
    let layer = |l: usize| -> u64 {
        let dense: u64 = linears(c, l)
            .iter()
            .filter(|(n, _, _)| s.targets.iter().any(|t| t == n))
            .map(|(_, i, o)| s.r as u64 * (i + o) + if s.dora { *o } else { 0 })
            .sum();
        dense + moe::lora_params(c, s, l)
    };
    (0..c.num_layers).map(layer).sum::<u64>() + s.trainable_tokens as u64 * c.hidden_size as u64
}

/// DoRA's `out` features summed over the targeted modules of layer `l` (0 without DoRA).
fn dora_outs(c: &ModelConfig, s: &Settings, l: usize) -> u64 {
    if !s.dora {
        return 0;
    }
    linears(c, l)
        .iter()
        .filter(|(n, _, _)| s.targets.iter().any(|t| t == n))
        .map(|(_, _, o)| o)
        .sum()
}

/// Everything alive the whole run: weights and the LoRA/optimizer state.
fn static_items(c: &ModelConfig, s: &Settings) -> Vec<Item> {
    let e = elem(s.dtype);
    let (d, v, l) = (
        c.hidden_size as u64,
        c.vocab_size as u64,
        c.num_layers as u64,
    );
    // A sharded base divides the tables and the linear weights (not the norms and biases) by the
    // world, each rank's pieces keeping their own code tables.
    let world = s.shard.unwrap_or(1).max(1) as u64;
    let mut values = (v * d * e).div_ceil(world); // embed_tokens (V, D)
    if !c.tie_word_embeddings {
        values += (v * d * e).div_ceil(world); // lm_head (V, D): never quantized
    }
    values += (2 * l + 1) * d * e; // RMSNorm weights
    let mut consts = 0;
    for layer in 0..c.num_layers {
        for (name, i, o) in linears(c, layer) {
            let (w, k) = frozen_bytes(i * o, e, s.quantize);
            values += w.div_ceil(world);
            consts += shard_consts(k, world, s.quantize);
            let bias = match name {
                "q_proj" | "k_proj" | "v_proj" | "qkv_proj" => c.qkv_bias,
                "o_proj" => c.o_bias,
                _ => c.mlp_bias,
            };
            if bias {
                values += o * e;
            }
        }
        values += moe::frozen_bytes(c, s, layer, e, world);
    }
    let dora: u64 = (0..c.num_layers).map(|x| dora_outs(c, s, x)).sum();
    // LoRA A (r, in) and B (out, r) in f32; AdamW's m and v; and the optimizer's flat f32 copy of
    // the parameters it updates (`LoraOptimizer`). The gradients depend on the phase.
    let lora = lora_params(c, s) * 4;
    // Data parallelism: the gradients' send and receive copies for the all-reduce.
    let all_reduce = if s.world > 1 { 2 * lora } else { 0 };
    vec![
        item(names::WEIGHTS, values, 1),
        item(names::QUANT, consts, 1),
        item(names::ALL_REDUCE, all_reduce, 1),
        item(names::LORA, lora, 1),
        // DoRA: each module's row norms `‖W + s·B·A‖: (out,)` f32, cached for the whole step.
        item(names::DORA, dora * 4, 1),
        item(names::ADAMW, lora, 2),
        item(names::MASTER, lora, 1),
        item(names::MATMUL, s.matmul_workspace, 1),
    ]
    .into_iter()
    .chain(sampling::generation_items(s))
    .collect()
}

/// One rank's share of a weight's NF4 constants `k`: the scales divided, the code tables (16
/// f32, and with double quantization 256 f32 and the offset) whole in every piece.
fn shard_consts(k: u64, world: u64, q: Quantize) -> u64 {
    let tables = match q {
        Quantize::None => return 0,
        Quantize::Nf4 { double_quant, .. } => 4 * 16 + if double_quant { 4 * 256 + 4 } else { 0 },
    };
    (k - tables).div_ceil(world) + tables
}

/// A sharded base's gathered weights at `phase`: in the last layer's backward that layer (its
/// frozen weights at full size) plus one weight's gathered bytes while they become a tensor, or
/// all the layers kept gathered from the forward (`keep_gathered`, the computing one among
/// them), and with `prefetch` the next layer unless it is kept; at the cross-entropy the lm_head
/// `(V, D)` and the kept layers (no gather is in flight there). Nothing without sharding.
fn gathered_items(c: &ModelConfig, s: &Settings, phase: Phase) -> Vec<Item> {
    if s.shard.is_none() {
        return Vec::new();
    }
    let e = elem(s.dtype);
    let kept = s.keep_gathered.min(c.num_layers) as u64;
    // The last layer's weights stand for each gathered layer's.
    let last = c.num_layers.saturating_sub(1);
    // A sparse layer's router and expert stacks are gathered with it, whole, in the compute dtype.
    let experts = moe::weights_of(c, s, last);
    let layer = |v: &mut Vec<Item>, count: u64| {
        for (_, i, o) in linears(c, last).into_iter().filter(|_| count > 0) {
            let (w, k) = frozen_bytes(i * o, e, s.quantize);
            v.push(item(names::GATHERED, w + k, count));
        }
        for n in experts.iter().filter(|_| count > 0) {
            v.push(item(names::GATHERED, n * e, count));
        }
    };
    let mut v = Vec::new();
    match phase {
        Phase::CrossEntropy => {
            let table = c.vocab_size as u64 * c.hidden_size as u64 * e;
            v.push(item(names::GATHERED, table, 1));
            layer(&mut v, kept);
        }
        Phase::SwigluBackward | Phase::AttentionBackward | Phase::RopeBackward => {
            let ahead = u64::from(s.prefetch && kept < 2 && c.num_layers > 1);
            layer(&mut v, kept.max(1) + ahead);
            let largest = (linears(c, last).iter().map(|(_, i, o)| i * o))
                .chain(experts.iter().copied())
                .max()
                .map(|n| n * e);
            if s.quantize == Quantize::None && kept == 0 {
                v.push(item(names::GATHERED, largest.unwrap_or(0), 1));
            }
        }
        _ => {}
    }
    v
}

fn elem(d: DType) -> u64 {
    match d {
        DType::F32 => 4,
        DType::BF16 | DType::F16 => 2,
        // Activations f32; the frozen weights (bf16 in the model) are counted as f32 (they are
        // loaded so, then rounded): an upper bound.
        DType::Bf16Autocast => 4,
    }
}

/// The sizes one micro-batch works with.
pub(crate) struct Dims {
    b: u64,
    t: u64,
    n: u64,
    d: u64,
    dq: u64,
    dkv: u64,
    i: u64,
    h: u64,
    e: u64,
    l: u64,
    /// One batch row's attention scores, f32: `(1, Hkv, G·T, T)`.
    score: u64,
    keep: bool,
}

fn dims(c: &ModelConfig, s: &Settings, path: AttnPath) -> Dims {
    let (b, t) = (s.micro_batch_size as u64, s.seq_len as u64);
    // The tiled path keeps no probabilities.
    let keep = path == AttnPath::Plain
        && keep_probs(&AttnShape::new(
            s.micro_batch_size,
            s.seq_len,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
        ));
    Dims {
        b,
        t,
        n: b * t,
        d: c.hidden_size as u64,
        dq: (c.num_heads * c.head_dim) as u64,
        dkv: (c.num_kv_heads * c.head_dim) as u64,
        i: c.intermediate_size as u64,
        h: c.num_heads as u64,
        e: elem(s.dtype),
        l: c.num_layers as u64,
        score: c.num_heads as u64 * t * t * 4,
        keep,
    }
}

/// What `Layer::forward` keeps for the backward of layer `l` (`LayerCache`), besides its input.
fn layer_cache(c: &ModelConfig, s: &Settings, k: &Dims, l: usize, name: &'static str) -> Vec<Item> {
    let (n, e) = (k.n, k.e);
    // gate, up: (N, I); silu(gate)·up too in a recomputed layer's cache (a full forward's
    // backward makes it again when it needs it).
    let gate_up_m = if name == names::ACTS_ONE { 3 } else { 2 };
    let mut v = vec![
        item(name, n * k.d * e, 2),     // h1 = norm(x), h2 = norm(h): (N, D)
        item(name, n * k.dq * e, 2),    // rotated q (B, Hkv, G·T, Dh), o_in (N, Dq)
        item(name, n * k.dkv * e, 2),   // rotated k, contiguous v: (B, Hkv, T, Dh)
        item(name, n * k.d * 4, 1),     // post-norm input h in f32 (NormCache; `h` itself in f32)
        item(name, n * 4, 2),           // the two norms' 1/rms: (N, 1) f32
        item(name, k.h * k.t * 4, k.b), // log-sum-exp per row: (1, Hkv, G·T, 1) f32
    ];
    if e != 4 {
        v.push(item(name, n * k.d * 4, 1)); // pre-norm input in f32 (shared with x in f32)
    }
    if c.is_sparse(l) {
        v.extend(moe::layer_cache(c, s, k, l, name));
    } else {
        v.push(item(name, n * k.i * e, gate_up_m));
    }
    if c.variant.sandwich_norms {
        // Gemma's post-attention and post-feed-forward norms keep their inputs (o_proj's and
        // down_proj's outputs, (N, D) each) and their 1/rms (N, 1) f32.
        v.push(item(name, n * k.d * e, 2));
        v.push(item(name, n * 4, 2));
    }
    if c.variant.qk_norm {
        // Qwen3's and Gemma 3's q/k norms keep q and k before the norm, (N, Dq) and (N, Dkv).
        v.push(item(name, n * (k.dq + k.dkv) * e, 1));
    }
    // DoRA (`DoraCache`): z = base + s·l (N, out) f32, and k, n (1, out) f32, per module.
    let outs = dora_outs(c, s, l);
    if outs > 0 {
        v.push(item(names::DORA, n * outs * 4 + 2 * outs * 4, 1));
    }
    for (module, _, _) in linears(c, l) {
        if s.targets.iter().any(|t| t == module) {
            v.push(item(name, n * s.r as u64 * 4, 1)); // x·Aᵀ: (N, r) f32
        }
    }
    if k.keep {
        v.push(item(names::PROBS, k.score, k.b)); // softmax per row: (1, Hkv, G·T, T) f32
    }
    v
}

/// The tensors of each phase besides the static ones.
fn phase_items(c: &ModelConfig, s: &Settings, phase: Phase, path: AttnPath) -> Vec<Item> {
    use names::*;
    match phase {
        Phase::OptimizerStep => return optimizer_items(c, s),
        // One safetensors buffer of m and v (the moments themselves are borrowed).
        Phase::Checkpoint => return vec![item(SERIALIZED, 2 * lora_params(c, s) * 4, 1)],
        Phase::Sampling => return with_dequant(c, s, sampling::sampling_items(c, s)),
        _ => {}
    }
    let k = dims(c, s, path);
    let (n, e, d) = (k.n, k.e, k.d);
    let mut v = gathered_items(c, s, phase);
    // LoRA gradients (f32): each step starts without any; the first micro-batch's backward has
    // made the last layer's by its first phases, later micro-batches add into all of them.
    let grads = lora_params(c, s) * 4;
    let grads = match (s.grad_accum > 1, phase) {
        (true, _) => grads,
        (false, Phase::CrossEntropy) => 0,
        (false, _) => grads / k.l.max(1),
    };
    v.push(item(GRADS, grads, 1));
    // Batch constants: causal mask (1 or B, 1, 1, T, T) f32, a second one for sliding-window
    // layers when the window is shorter than the batch, cos and sin (B, 1, T, Dh).
    let masks = match c.sliding_window {
        Some(w) if (w as u64) < k.t && c.window_layers.iter().any(|&x| x) => 2,
        _ => 1,
    };
    let mask_rows = if s.packing { k.b } else { 1 };
    // The tiled path reads the visible-key starts, (1 or B, T) u32, and never builds the mask.
    let mask_cols = if path == AttnPath::Tiled { 1 } else { k.t };
    v.push(item(BATCH, mask_rows * k.t * mask_cols * 4, masks));
    v.push(item(BATCH, n * c.head_dim as u64 * e, 2));
    // ids, positions, targets on the host.
    v.push(item(BATCH, n * 16, 1));
    // Layer inputs (the checkpoints) for all L layers; without checkpointing every layer's cache
    // too, with it one layer's (the last layer's, then the one being recomputed).
    v.push(item(INPUTS, n * d * e, k.l));
    // With checkpointing on the tiled path, the L − 1 recomputed layers also keep their
    // attention's output (N, Dq) and log-sum-exp (B, T, H) f32 (`Model::forward_backward`: the
    // recompute skips the attention).
    if s.gradient_checkpointing && path == AttnPath::Tiled {
        let lse = k.n * c.num_heads as u64 * 4;
        v.push(item(KEPT_ATTN, n * k.dq * e + lse, k.l.saturating_sub(1)));
    }
    // With checkpointing the last layer keeps its activations from the forward (it is the first
    // the backward needs: `Model::forward_backward` recomputes only the L − 1 others), so one
    // cache is alive at the cross-entropy too. Counted on the tiled path, where the measured peak
    // needs it (bench-small with 2 layers, batch 1, seq 2048: 377.8 MB measured, 379.0 estimated
    // with it, 329.8 without); not yet on the plain path, where bench-small at seq 512 measured
    // 501.5 MB, 499 estimated without it and 544 with it (the forward's freed per-row scores
    // likely leave the heap room the cross-entropy reuses; not modelled).
    let caches = match (s.gradient_checkpointing, phase, path) {
        (false, _, _) => k.l,
        (true, Phase::CrossEntropy, AttnPath::Plain) => 0,
        (true, _, _) => 1,
    };
    let acts = if s.gradient_checkpointing {
        ACTS_ONE
    } else {
        ACTS
    };
    // Every layer's cache, or the last layer's (kept, then each recomputed one: the last stands
    // for them).
    let last = c.num_layers.saturating_sub(1);
    let cached = if caches == k.l {
        0..c.num_layers
    } else {
        last..last + caches as usize
    };
    for l in cached {
        v.extend(layer_cache(c, s, &k, l.min(last), acts));
    }
    v.extend(moe::router_items(c, &k));
    // After the last layer: the final norm's f32 input (its cache; the last layer's output) and
    // the CE gradient dh (N, D), both alive to the end of the backward.
    v.push(item(WORKSPACE, n * d * 4, 1));
    v.push(item(WORKSPACE, n * d * e, 1));
    match phase {
        Phase::Loading | Phase::Sampling | Phase::OptimizerStep | Phase::Checkpoint => {
            unreachable!(
                "loading, sampling, the optimizer step and a checkpoint have their own items"
            )
        }
        Phase::CrossEntropy => {
            // The normed h (N, D). Per chunk of (rows, V) f32: five at once while the gradient
            // is formed (logits, z = logits − max, p = exp(z − lse), one-hot targets,
            // p − onehot), or three when dh (N, D) is re-made by index_add (old and new alive).
            v.push(item(WORKSPACE, n * d * e, 1));
            let rows = s.target_rows.map_or(n, |r| r as u64);
            let chunk = rows.min(ce_chunk_rows(c.vocab_size) as u64) * c.vocab_size as u64 * 4;
            if 2 * chunk >= n * d * e {
                v.push(item(LOGITS, chunk, 5));
            } else {
                v.push(item(LOGITS, chunk, 3));
                v.push(item(WORKSPACE, n * d * e, 1));
            }
        }
        Phase::SwigluBackward if c.is_sparse(last) => {
            // A sparse layer's MLP is its experts: their backward's buffers (`moe.rs`).
            v.push(item(WORKSPACE, n * d * e, 1)); // d_out (N, D)
            v.extend(moe::backward_items(c, s, &k, last));
        }
        Phase::SwigluBackward => {
            v.push(item(WORKSPACE, n * d * e, 1)); // d_out (N, D)
            if e == 4 {
                // dm and, at most at once, sigmoid, du, dsilu, dm·u, its product with dsilu.
                v.push(item(WORKSPACE, n * k.i * 4, 6));
            } else {
                // dm, du in the compute dtype; f32 copies of g and dm, sigmoid, dsilu, u in f32,
                // dm·u in f32.
                v.push(item(WORKSPACE, n * k.i * e, 2));
                v.push(item(WORKSPACE, n * k.i * 4, 6));
            }
        }
        Phase::AttentionBackward | Phase::RopeBackward => {
            // d_out, dh2 and dh (N, D); a dense MLP's dm, dg, du (N, I) alive to the layer's end
            // (a sparse layer's experts free theirs when their backward returns).
            v.push(item(WORKSPACE, n * d * e, 3));
            if !c.is_sparse(last) {
                v.push(item(WORKSPACE, n * k.i * e, 3));
            }
            if path == AttnPath::Tiled {
                v.extend(tiled::backward_items(c, s, &k, phase));
                return with_dequant(c, s, v);
            }
            // d_o and its (B, Hkv, G·T, Dh) copy.
            v.push(item(WORKSPACE, n * k.dq * e, 2));
            if phase == Phase::AttentionBackward {
                // At the last batch row (measured peak): its p (kept, or recomputed by the fused
                // softmax: raw scores and p), dp and the fused softmax backward's ds, all f32 (and
                // p in the compute dtype when that is not f32); dq, dk, dv of the rows before,
                // (1, Hkv, ·, Dh) each. (The plain chain this replaced needed one more when
                // recomputing; seq 2048 with checkpointing then measured 1.129 × the estimate.)
                let scores = 3;
                v.push(item(SCORES, k.score, scores));
                let rows_before = (k.n - k.t) * (k.dq + 2 * k.dkv) * e;
                v.push(item(WORKSPACE, rows_before, 1));
                if e != 4 {
                    v.push(item(SCORES, k.score / 4 * e, 1));
                }
            } else {
                // After the rows: per-row dq, dk, dv lists and their concatenations, and rotary
                // backward of dq: dy·sin, its rotation, dy·cos, the sum.
                v.push(item(WORKSPACE, n * k.dq * e, 2 + 4));
                v.push(item(WORKSPACE, n * k.dkv * e, 4));
            }
        }
    }
    with_dequant(c, s, v)
}

/// The trained tensors as `(bytes each, how many)`: A `(r, in)` and B `(out, r)` f32 per targeted
/// module and layer, DoRA's magnitude `(out,)`, the trainable token rows `(n, hidden)`. Each is
/// its own allocation, so whether it is mapped or on the heap follows its own size.
fn lora_tensors(c: &ModelConfig, s: &Settings) -> Vec<(u64, u64)> {
    let (r, l) = (s.r as u64, c.num_layers as u64);
    let mut v = Vec::new();
    for layer in 0..l as usize {
        for (name, i, o) in linears(c, layer) {
            if s.targets.iter().any(|t| t == name) {
                v.push((r * i * 4, 1));
                v.push((r * o * 4, 1));
                if s.dora {
                    v.push((o * 4, 1));
                }
            }
        }
        v.extend(moe::lora_tensors(c, s, layer));
    }
    if s.trainable_tokens > 0 {
        v.push((s.trainable_tokens as u64 * c.hidden_size as u64 * 4, 1));
    }
    v
}

/// The optimizer step (`LoraOptimizer::step` on the host), after the backward has freed the
/// activations: the gradients of every layer (f32), their flat f32 copy that is unscaled, clipped
/// and handed to AdamW, and one parameter's new tensor made while the old one is alive. With the
/// static params, master copy and two moments that is 6× the LoRA parameters at once, and a
/// checkpoint's serialised moments come on top of that high-water mark: what dominates at a large
/// rank (issue 35).
fn optimizer_items(c: &ModelConfig, s: &Settings) -> Vec<Item> {
    let tensors = lora_tensors(c, s);
    let largest = tensors.iter().map(|&(b, _)| b).max().unwrap_or(0);
    let mut v = Vec::new();
    for &(bytes, n) in &tensors {
        v.push(item(names::GRADS, bytes, n));
        v.push(item(names::GRADS_HOST, bytes, n));
    }
    v.push(item(names::UPDATE, largest, 1));
    v
}

/// `v` and, for NF4, the one dequantized weight a use makes in the compute dtype (the largest is
/// (I, D)), or with NF4 experts their dequantized experts ([`moe::dequant_bytes`]) if larger.
fn with_dequant(c: &ModelConfig, s: &Settings, mut v: Vec<Item>) -> Vec<Item> {
    if let Quantize::Nf4 { .. } = s.quantize {
        let largest = (0..c.num_layers)
            .flat_map(|l| linears(c, l))
            .map(|(_, i, o)| i * o)
            .max()
            .unwrap_or(0);
        let bytes = (largest * elem(s.dtype)).max(moe::dequant_bytes(c, s));
        v.push(item(names::DEQUANT, bytes, 1));
    }
    v
}

/// Loading: the mapped safetensors pages count in RSS until the files are unmapped (all of them
/// are read), next to the weights already taken and the copies of the one being taken: as stored
/// when its dtype is converted (freed after), and for NF4 the stored copy plus an f32 vector of
/// its values (`rtune_quant::quantize::quantize_tensor`; an f32 conversion first for 16-bit files).
fn loading_items(c: &ModelConfig, s: &Settings) -> Vec<Item> {
    let e = elem(s.dtype);
    let file_e = if s.checkpoint_elem_bytes == 0 {
        e
    } else {
        s.checkpoint_elem_bytes
    };
    let embed = c.vocab_size as u64 * c.hidden_size as u64;
    let linear = (0..c.num_layers)
        .flat_map(|l| linears(c, l))
        .map(|(_, i, o)| i * o)
        .max()
        .unwrap_or(0);
    let convert = |n: u64| if file_e == e { 0 } else { n * file_e };
    let staging = match s.quantize {
        Quantize::None => convert(embed.max(linear)),
        Quantize::Nf4 { .. } => {
            let f32_copy = if file_e == 4 { 0 } else { 4 };
            convert(embed).max(linear * (file_e + 4 + f32_copy))
        }
    };
    // A sharded base's rank reads its pieces with pread (nothing mapped), each read into a
    // buffer, copied into a tensor and from it into the piece's bytes: three copies of the
    // largest piece at once. A sparse layer's expert stacks: only this rank's experts are read
    // (`MoeMlp::load`), their loading copies instead when larger.
    if let Some(world) = s.shard {
        let world = world.max(1) as u64;
        let piece = (embed.max(linear) * file_e.max(e)).div_ceil(world);
        let experts = moe::loading_bytes(c, s, e, world);
        return match experts > 3 * piece {
            true => vec![item(names::CONVERT, experts, 1)],
            false => vec![item(names::CONVERT, piece, 3)],
        };
    }
    vec![
        item(names::MAPPED, s.checkpoint_bytes, 1),
        item(
            names::CONVERT,
            staging.max(moe::loading_bytes(c, s, e, 1)),
            1,
        ),
    ]
}

/// Sums items by name, in first-seen order.
fn add_up(items: &[Item], out: &mut Vec<(String, u64)>) {
    for it in items {
        let bytes = it.each * it.count;
        match out.iter_mut().find(|(n, _)| n == it.name) {
            Some(slot) => slot.1 += bytes,
            None => out.push((it.name.to_string(), bytes)),
        }
    }
}

/// Bytes of the items the heap serves (below the mmap threshold) and of those mmapped.
fn split(items: &[Item]) -> (u64, u64) {
    items.iter().fold((0, 0), |(heap, mapped), it| {
        if it.each < MMAP_THRESHOLD {
            (heap + it.each * it.count, mapped)
        } else {
            (heap, mapped + it.each * it.count)
        }
    })
}

/// Predicts the peak resident memory of training `c` with `s` on the CPU, on the attention path
/// the model takes for rows of `s.seq_len` tokens ([`attn_path`]; soft-capped scores, Gemma 2's,
/// take it too: the tiled kernels cap them).
pub fn estimate(c: &ModelConfig, s: &Settings) -> Estimate {
    estimate_on(c, s, attn_path(s.seq_len))
}

/// [`estimate`] on the attention path `path`.
pub fn estimate_on(c: &ModelConfig, s: &Settings, path: AttnPath) -> Estimate {
    let fixed = static_items(c, s);
    let base: u64 = s.runtime_bytes + fixed.iter().map(|i| i.each * i.count).sum::<u64>();
    let k = dims(c, s, path);
    // With checkpointing, L − 1 kept inputs each pin a hole of their size in the heap (measured on
    // bench-small: 20 MB at T=512, 118 MB at T=2048; L−1 inputs: 29 MB, 117 MB). Inputs big
    // enough to be mmapped leave no hole.
    let hole = k.n * k.d * k.e;
    let frag = if s.gradient_checkpointing && hole < MMAP_THRESHOLD {
        hole * k.l.saturating_sub(1)
    } else {
        0
    };
    let mut best: Option<(u64, Phase, Vec<Item>, u64)> = None;
    let mut heap_hwm = 0;
    // GRPO samples before the training pass: its heap is the pass's high-water mark too.
    let sampling = s.sampling.map(|_| Phase::Sampling);
    for phase in sampling.into_iter().chain([
        Phase::CrossEntropy,
        Phase::SwigluBackward,
        Phase::AttentionBackward,
        Phase::RopeBackward,
        Phase::OptimizerStep,
        Phase::Checkpoint,
    ]) {
        let items = phase_items(c, s, phase, path);
        let (heap, mapped) = split(&items);
        heap_hwm = heap_hwm.max(heap);
        // RSS at this moment: the heap as large as it ever grew, plus what is mmapped now.
        let total = base + heap_hwm + mapped + frag;
        if best.as_ref().is_none_or(|b| total > b.0) {
            best = Some((total, phase, items, heap_hwm - heap));
        }
    }
    let (mut peak, mut phase, mut items, mut slack) = best.expect("phases are not empty");
    let step_peak_bytes = peak;
    let mut frag_now = frag;
    // Loading: only the frozen weights exist yet (the adapter and optimizer come after).
    let mut fixed_now = fixed;
    let mut load = loading_items(c, s);
    load.extend(
        fixed_now
            .iter()
            .filter(|i| i.name == names::WEIGHTS || i.name == names::QUANT),
    );
    let load_total = s.runtime_bytes + load.iter().map(|i| i.each * i.count).sum::<u64>();
    if load_total > peak {
        (peak, phase, items, slack, frag_now) = (load_total, Phase::Loading, load, 0, 0);
        fixed_now.clear();
    }
    let mut breakdown = vec![(names::RUNTIME.to_string(), s.runtime_bytes)];
    add_up(&fixed_now, &mut breakdown);
    add_up(&items, &mut breakdown);
    breakdown.push((names::HEAP_HWM.to_string(), slack));
    breakdown.push((names::FRAG.to_string(), frag_now));
    breakdown.retain(|(_, b)| *b > 0);
    debug_assert_eq!(breakdown.iter().map(|(_, b)| b).sum::<u64>(), peak);
    Estimate {
        peak_bytes: peak,
        phase: phase.name(),
        step_peak_bytes,
        breakdown,
    }
}

/// The largest `micro_batch_size` (at the configured `seq_len`) and the largest `seq_len` (at the
/// configured `micro_batch_size`) whose estimate fits `budget`; 0 when not even 1 fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Fit {
    pub max_micro_batch_size: usize,
    pub max_seq_len: usize,
}

/// Searches upwards by doubling, then bisects (the estimate grows with batch and length).
pub fn largest_fitting(c: &ModelConfig, s: &Settings, budget: u64) -> Fit {
    let fits = |b: usize, t: usize| {
        let mut x = s.clone();
        (x.micro_batch_size, x.seq_len) = (b, t);
        // A larger batch of the same data has more target rows: assume all of them.
        x.target_rows = None;
        estimate(c, &x).peak_bytes <= budget
    };
    Fit {
        max_micro_batch_size: largest(1 << 20, |b| fits(b, s.seq_len)),
        max_seq_len: largest(1 << 24, |t| fits(s.micro_batch_size, t)),
    }
}

/// The largest `x` in `1..=cap` with `ok(x)`, for a monotone `ok`; 0 if none.
fn largest(cap: usize, ok: impl Fn(usize) -> bool) -> usize {
    if !ok(1) {
        return 0;
    }
    let mut lo = 1;
    while lo < cap && ok((lo * 2).min(cap)) {
        lo = (lo * 2).min(cap);
    }
    let mut hi = (lo * 2).min(cap + 1); // ok(lo), !ok(hi) (or hi past the cap)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if ok(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests;
