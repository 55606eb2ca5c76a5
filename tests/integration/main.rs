//! Integration tests: one binary, one module per concern, most of them running the `rtune` binary.
//! - `parity`: the model, LoRA gradients and AdamW against transformers + PEFT goldens
//!   (`tests/parity/`), with and without checkpointing, rsLoRA, llama3 rope and sharded bf16;
//! - `qlora`: NF4 and NF4 double-quant bases against PEFT + bitsandbytes goldens, bnb-4bit
//!   checkpoints as stored, QLoRA smoke run and merges;
//! - `packing`: packed rows give the loss and LoRA gradients of the same samples one by one;
//! - `cli`: `rtune train` / `rtune generate` end to end, the embedded smoke run, one-line errors;
//! - `resume`: exact resume after SIGTERM and kill -9, corrupt checkpoints, a full disk, changed
//!   settings refused, private files, run.json;
//! - `data`: `rtune data inspect`, chat masks, packing with validation, the tokenized cache,
//!   `[data]` config errors;
//! - `data_hostile`: issue 46's data cases: FIFO and device data refused at once, the preference
//!   loader streamed and following `[data]`'s row settings, absurd weights refused, long
//!   pre-tokenized rows bounded;
//! - `scan`: `rtune data scan` finds planted secrets and personal data, nothing in clean data;
//! - `check`: `rtune check` runs every pre-flight check and exits 1 when one fails;
//! - `diag`: `rtune selftest` reports every check when one fails; `benches/gpu/run.sh --dry-run`;
//! - `dora`: DoRA / QDoRA against PEFT goldens (model and `rtune train`), bad `init_from`, exports;
//! - `families`: Qwen3, Gemma 2, Gemma 3 and Phi-3 (fused, and Phi-4-mini's RoPE) through
//!   `rtune train` against PEFT goldens; Phi-3's split-name targets refused;
//! - `preference`: DPO (each loss type), SimPO and ORPO through `rtune train` against TRL's trainers;
//! - `grpo`: GRPO through `rtune train` (regex and command rewards), rollouts.jsonl, TRL's metric
//!   names, kill -9 and resume bitwise;
//! - `export`: `rtune export` (merged = base + adapter, GGUF LoRA in llama.cpp's layout, PEFT);
//! - `gguf`: `rtune convert gguf` and `.gguf` model paths against hostile and broken files (caps,
//!   one line, magic before hashing, no temporary left by a signal);
//! - `hardening`: one process per run directory (lock), disk headroom at start, model indexes that
//!   point outside the model directory, an oversized rank, Windows-saved data, a 50 MB row; `/`,
//!   `$HOME` and a foreign directory refused as `[output] dir`, overwrite of only what rtune wrote;
//! - `links`: issue 46's data-loss cases: planted symlinks in a run directory refused, `export
//!   --force` replaces only what an export wrote, `$HOME` and symlinked outputs refused, a signal
//!   during an export removes its staging directory;
//! - `limits`: issue 35's start-up refusals beyond the corpus: a resume below its checkpoint's
//!   step, `rtune check` reporting every check when some error, contradicting `rtune bench` flags;
//! - `bad_inputs`: the bad-input corpus `tests/bad_inputs/*` (message and exit status each);
//! - `remote`: `[output] remote` against a real S3 server (s3s-fs): mirrored checkpoints and final
//!   files, resume from the store after kill -9, a store that goes away, bad credentials, the
//!   prefix claimed by one run (a finished run's kept, a second run refused, a lease taken over);
//! - `mlflow`: `[output] mlflow` against a real `mlflow server`: params, metrics, artifacts, status,
//!   and a server killed mid-run;
//! - `smollm2`: the real-model recipe (SmolLM2-135M from GGUF), cut to a few steps;
//! - `variants`: LoRA+, PiSSA, pissa_niter_N and OLoRA through `rtune train` against PEFT goldens;
//!   bad variant settings;
//! - `autocast`: `dtype = "bf16-autocast"` against PEFT under torch.autocast (model and `rtune train`);
//! - `moe`: Qwen3-MoE, Mixtral and gpt-oss (experts, routing, aux loss, QLoRA, MXFP4, export) against
//!   transformers + PEFT; `moe_bf16`: the three in bf16 (model and `rtune train`); `moe_autocast`:
//!   Qwen3-MoE under bf16 autocast against PEFT under torch.autocast; `moe_nf4`: NF4 expert stacks
//!   (`quantize_experts`) against their dequantized stacks, through `rtune train`;
//! - `readme`: the README's crate diagram, crate table and one step's file trace against the tree
//!   (the trace measured by callgrind);
//! - `layering`: the sources' layering, read from the files: no import circle between the files of a
//!   crate, no crate over 18% of the project's Rust lines;
//! - `common`: shared helpers (paths, running the binary, golden files, relative errors).

mod autocast;
mod bad_inputs;
mod check;
mod cli;
mod common;
mod data;
mod data_hostile;
mod diag;
mod dora;
mod export;
mod families;
mod gguf;
mod grpo;
mod hardening;
mod layering;
mod limits;
mod links;
mod mlflow;
mod moe;
mod moe_autocast;
mod moe_bf16;
mod moe_nf4;
mod packing;
mod parity;
mod preference;
mod preference_moe;
mod qlora;
mod readme;
mod remote;
mod resume;
mod scan;
mod smollm2;
mod variants;
