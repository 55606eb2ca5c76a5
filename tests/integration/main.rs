//! Integration tests, one module per concern:
//! - `parity`: the model, LoRA gradients and AdamW against transformers + PEFT goldens;
//! - `cli`: `rtune train` / `rtune generate` end to end, the embedded smoke run, bad-input errors;
//! - `export`: `rtune export` (merged = base + adapter, GGUF LoRA in llama.cpp's layout, PEFT).

mod bad_inputs;
mod check;
mod cli;
mod common;
mod data;
mod export;
mod packing;
mod parity;
mod qlora;
mod resume;
mod scan;
mod smollm2;
