//! 4-bit NF4/FP4 weights, bit-for-bit as bitsandbytes 0.50.2 makes and reads them (QLoRA, Dettmers
//! et al. 2023, arXiv:2305.14314): the op whole, on the CPU and on CUDA.
//!
//! - [`Nf4Weight`] (`weight.rs`): one quantized weight matrix: packed 4-bit codes, one scale
//!   ("absmax") per block of 64 consecutive elements of the row-major flattening, optionally
//!   double-quantized ([`Absmax`]); the code tables in `tables.rs`.
//! - [`quantize_nf4`] (`quantize.rs`): f32 values → an [`Nf4Weight`], as bitsandbytes' CPU backend.
//! - [`Nf4Weight::dequantize_f32`], [`Nf4Weight::to_tensor`] (`cpu.rs`): back to full precision on
//!   the CPU, multi-threaded: `value = table[code] * absmax` in f32, then rounded to the output dtype.
//! - On CUDA (`kernels/nf4.cu`), plain and double quant, to f32, f16 and bf16: the launchers on
//!   cudarc views (`cuda.rs`, feature `kernels`; `Nf4WeightCuda::upload` copies an [`Nf4Weight`]
//!   to the GPU) and, with `cuda`, a QLoRA base weight resident on the device and dequantized
//!   straight into a candle tensor (`device.rs`). The CPU dequantization is the reference;
//!   `tests/nf4_cuda.rs` compares them bit for bit.
//! - Grouped (issue 48, item 4): a layer's q/k/v or gate/up in one launch into one buffer
//!   ([`group`]: the kernel's table, the CPU reference; the launcher in `cuda.rs`). The layout
//!   (which weights group, at which offsets), the two buffers reused for the run and the next
//!   group prefetched into the other on a side stream are `rtune-model`'s (`group/nf4.rs`, with
//!   `rtune_backend::ring`'s plan).
//!
//! Layout (bitsandbytes'): element `2i` of the flattening is the HIGH nibble of byte `i`, element
//! `2i+1` the low nibble; an odd element count leaves the last low nibble as padding (code 7, i.e.
//! 0.0). A tensor whose size is not a multiple of 64 ends with a shorter block that has its own absmax.
//!
//! The reference is bitsandbytes' CPU backend (`backends/default/ops.py` for 4-bit, `csrc/cpu_ops.cpp`
//! for the 8-bit second level, torch's CPU summation order for the mean); `rtune-quant`'s tests
//! compare against files it wrote. Its CUDA backend makes the same 4-bit codes but may differ in the
//! last bit of the double-quant offset and in rare second-level codes (see `quantize.rs`). The file
//! formats (a bnb-4bit checkpoint's tensors, pieces of a sharded weight) and the `quantize` choice
//! are `rtune-quant`'s.

pub mod cpu;
#[cfg(feature = "kernels")]
mod cuda;
#[cfg(feature = "cuda")]
mod device;
pub mod error;
pub mod group;
pub mod quantize;
pub mod tables;
pub mod weight;

pub use error::{QuantError, Result};
pub use quantize::{double_quantize_with, quantize_nf4, quantize_tensor, torch_mean_f32};
pub use tables::{DYNAMIC_SIGNED, FP4, NF4};
pub use weight::{Absmax, Nf4Weight, QuantType, BLOCKSIZE, NESTED_BLOCKSIZE};

#[cfg(feature = "kernels")]
pub use cuda::{
    nf4_dequant_cuda, nf4_dequant_cuda_into, nf4_dequant_group_into, DequantOut, DeviceAbsmax,
    Nf4Kernels, Nf4WeightCuda,
};
#[cfg(feature = "cuda")]
pub use device::{dequantize, from_device_parts, kernels, upload, DeviceNf4};
