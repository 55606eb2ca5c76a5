//! NF4/FP4 dequantization on CUDA (`kernels/nf4.cu`), plain and double quant, to f32, f16 and
//! bf16: the launchers on cudarc views (`cuda.rs`, feature `kernels`; [`Nf4WeightCuda::upload`]
//! copies an [`rtune_quant::Nf4Weight`] to the GPU) and, with `cuda`, a QLoRA base weight resident
//! on the device and dequantized straight into a candle tensor (`device.rs`). The reference is
//! rtune-quant's CPU dequantization; `tests/nf4_cuda.rs` compares them bit for bit.

#[cfg(feature = "kernels")]
mod cuda;
#[cfg(feature = "cuda")]
mod device;

#[cfg(feature = "kernels")]
pub use cuda::{
    nf4_dequant_cuda, nf4_dequant_cuda_into, DequantOut, DeviceAbsmax, Nf4Kernels, Nf4WeightCuda,
};
#[cfg(feature = "cuda")]
pub use device::{dequantize, upload, DeviceNf4};
