//! Fused ops of the training step, each forward and backward as one candle custom op, one file per
//! op: RMSNorm (`norm.rs`), SwiGLU (`swiglu.rs`), rotate-half RoPE (`rope.rs`), the cross-entropy of
//! a chunk of rows (`ce.rs`), the attention softmax (`attn_softmax.rs`), and on the CPU only float casts (`cast.rs`) and sums
//! (`add.rs`), where candle's CUDA ops are kernels already. Each op's file holds the
//! functions the model calls, the op structs with their shape and dtype checks, `cpu_fwd`, and with
//! the `cuda` feature `cuda_fwd` (launching `rtune_kernels`' kernels on candle's stream, so they are
//! ordered with every other candle op). What the ops share — reading contiguous storage, the dtype
//! rule, shape checks, CUDA buffers — is `common.rs`; the CPU row loops (SIMD-friendly, AVX-512F /
//! AVX2 builds picked at run time) are `cpu.rs`.
//!
//! The plain formulation of each (a chain of candle elementwise ops: one allocation and one memory
//! pass per step) stays beside its call site as the reference — [`crate::ops::rms_norm_reference`],
//! [`crate::ops::swiglu_reference`], [`crate::rope::apply_reference`], ... — and `tests.rs`
//! compares every op here with it on fresh random inputs, f32 and bf16.
//!
//! The ops carry no autograd (`apply_op*_no_bwd`): the model has its own backward, so each backward
//! is a separate op. Storage may be f32, bf16 or f16 (all tensors of an op the same, except the u32
//! targets, the f32 log-sum-exp, mask and probabilities); arithmetic is f32. The ops require
//! contiguous inputs (an offset into a larger buffer is fine): the functions make their inputs
//! contiguous, and the raw ops return an error naming the op and the layout.
//!
//! Imports run one way: `common`, `cpu` ← each op file ← this file.

mod add;
mod attn_softmax;
mod cast;
mod ce;
pub(crate) mod common;
mod cpu;
pub mod flash;
#[cfg(feature = "cuda")]
mod flash_cuda;
mod lora;
mod norm;
mod rope;
mod swiglu;
#[cfg(test)]
mod tests;

pub use add::{add, add_wide};
pub use attn_softmax::{attn_softmax, attn_softmax_bwd};
pub use cast::{cast, round_bf16};
pub use ce::{ce_bwd, ce_fwd};
pub use lora::lora_up;
pub use norm::{rms_norm, rms_norm_bwd};
pub use rope::{rope, rope_bwd};
pub use swiglu::{swiglu, swiglu_bwd};

// The CPU loops' ISA dispatch and output buffers, for the LoRA dropout's mask passes too
// (`crate::dropout`: outside this module, it imports them from here).
#[cfg(test)]
pub(crate) use cpu::ISA_CAP;
pub(crate) use cpu::{dispatch, filled, Kernel};
