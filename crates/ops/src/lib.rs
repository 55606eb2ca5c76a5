//! The ops of the training step, one folder an op: each holds the op's public functions (forward
//! and hand-written backward), its candle custom op (`op.rs`: shape and dtype checks, `cpu_fwd`,
//! and with the `cuda` feature `cuda_fwd` on candle's stream), the CPU row loops (`cpu.rs`), the
//! plain reference (`reference.rs`: a chain of candle ops, and the f32-slice formulation the CUDA
//! kernels round like), the CUDA launcher on cudarc views (`cuda.rs`, feature `kernels`; the
//! source is `kernels/<op>.cuh` or `kernels/<op>.cu`), the `rtune selftest` check of the kernel
//! against its reference (`check.rs`) and the tests (`tests.rs`).
//!
//! - [`norm`]: RMSNorm (and Gemma's `(1 + w)` form). [`add_norm`]: the residual add fused into
//!   the RMSNorm after it (CUDA kernels; [`fused`]: which fused CUDA paths run). [`swiglu`]: SwiGLU. [`geglu`]: Gemma's
//!   tanh-GELU gate (fused like SwiGLU). [`rope`]: rotate-half RoPE. [`ce`]: the cross-entropy
//!   over the lm_head in chunks of tokens. [`attention`]: causal attention, GQA, windows, packed
//!   rows — materialized (with the fused softmax) or tiled (FlashAttention-2 on the CPU and on
//!   CUDA). [`add`]: sums that round once. [`lora`]: the LoRA up-projection added into the frozen
//!   product. [`adamw`]: the CPU optimizer and the multi-tensor optimizer kernel. [`nf4`]: NF4/FP4 dequantization on CUDA (the CPU's is `rtune-quant`).
//! - Mixture-of-experts routing and the experts' grouped GEMMs are `rtune-experts`.
//! - The engines under them (BLAS, oneDNN, the CPU dispatch, kernel images, the launch preamble,
//!   float casts, dropout masks) are `rtune-backend`.
//!
//! The model calls the ops by name through the re-exports below (`crate::rms_norm`,
//! `crate::attention`, ...). Why hand-written backward: candle's fused `rms_norm`,
//! `softmax_last_dim` and `rope` have no backward, its matmul backward always forms the frozen
//! weight's gradient, and its autograd keeps every intermediate alive; each op here returns exactly
//! what its backward needs, and `tests::*_matches_autograd` checks each backward against candle's
//! autograd on the plain formulation.
//!
//! The candle ops carry no autograd (`apply_op*_no_bwd`): each backward is its own op. Storage may
//! be f32, bf16 or f16 (all tensors of an op the same, except u32 targets and the f32 log-sum-exp,
//! mask and probabilities); arithmetic is f32. The ops need contiguous inputs (an offset into a
//! larger buffer is fine): the public functions make their inputs contiguous, and the raw ops
//! return an error naming the op and the layout.
//!
//! Imports run one way: `rtune-backend` ← each op folder (`cpu`, `reference` ← `op` ← `mod`;
//! `reference` ← `check`) ← `selftest`.

// Without `kernels` the items the overview links to do not exist; the links resolve with it.
#![cfg_attr(not(feature = "kernels"), allow(rustdoc::broken_intra_doc_links))]

pub mod adamw;
pub mod add;
pub mod add_norm;
pub mod attention;
pub mod ce;
pub mod fused;
pub mod geglu;
pub mod glu;
pub mod lora;
pub mod nf4;
pub mod norm;
pub mod rope;
#[cfg(feature = "kernels")]
pub mod selftest;
pub mod softcap;
pub mod swiglu;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;
#[cfg(test)]
mod tests;

pub use add::{add, add_wide};
pub use attention::mask::{causal_mask, causal_mask_from, segment_mask};
pub use attention::{
    attend, attend_after, attention, attention_backward, attention_keeping, attention_tiled,
    attention_tiled_kept, keep_probs, AttnCache, AttnMask, AttnPath, AttnShape, KeptAttn,
    TILED_MIN_T,
};
pub use ce::{
    chunked_cross_entropy, chunked_cross_entropy_loss, chunked_cross_entropy_loss_with,
    chunked_cross_entropy_rows, chunked_cross_entropy_rows_entropy, chunked_cross_entropy_with,
    HeadRows,
};
pub use geglu::{geglu, geglu_backward};
pub use lora::lora_up;
pub use norm::{
    rms_norm, rms_norm_backward, rms_norm_plus_one, rms_norm_plus_one_backward, NormCache,
};
pub use softcap::softcap_logits;
pub use swiglu::{swiglu, swiglu_backward};
