//! Mixture-of-experts compute (issue 45), forward and hand-written backward, as transformers
//! 5.24 computes it:
//! - [`route`]: each token's router logits to its `k` experts and their weights (the three
//!   families' routers), and the load-balancing loss, with their backward;
//! - [`moe`]: the experts of a sparse layer, tokens grouped per expert (one GEMM each over its own
//!   rows), gpt-oss's biases and clamped SwiGLU, PEFT's `target_parameters` LoRA on the expert
//!   stacks.
//!
//! The model's sparse layer (`rtune_model::moe`) calls them; the dense ops they build on
//! (SwiGLU) are `rtune-ops`'.

pub mod moe;
pub mod route;

pub use moe::{moe_backward, moe_forward, ExpertLora, Experts, MoeCache, MoeGrads};
