//! Integration tests, one module per concern:
//! - `parity`: the model, LoRA gradients and AdamW against transformers + PEFT goldens;
//! - `cli`: `rtune train` / `rtune generate` end to end, the embedded smoke run, bad-input errors.

mod bad_inputs;
mod check;
mod cli;
mod common;
mod data;
mod packing;
mod parity;
mod qlora;
mod resume;
mod scan;
