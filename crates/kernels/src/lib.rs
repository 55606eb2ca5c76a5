//! rtune's CUDA kernels: the `.cu` sources in the repository's `kernels/`, compiled by nvcc in
//! `build.rs` to PTX and to cubins for sm_80 and sm_90, and loaded through cudarc ([`image`]: the
//! device's cubin, else the PTX) — only with the `cuda` feature. Without it this crate builds
//! anywhere, exports [`CUDA_COMPILED`]` = false`, [`KernelError`], the CPU references and
//! [`image::pick_cubin`].
//!
//! - [`Nf4Kernels`] (`kernels/nf4.cu`): NF4/FP4 dequantization, plain and double quant, to f32, f16
//!   and bf16. [`Nf4WeightCuda::upload`] copies an [`rtune_quant::Nf4Weight`] to the GPU;
//!   [`nf4_dequant_cuda`] / [`nf4_dequant_cuda_into`] run the kernel on a stream. The reference is
//!   rtune-quant's CPU dequantization; `tests/nf4_cuda.rs` compares them bit for bit.
//! - [`fused`] (`kernels/fused.cu`): RMSNorm, SwiGLU, RoPE and chunked cross-entropy, forward and
//!   backward, for f32/bf16/f16 ([`FusedFloat`]); launchers on cudarc views.
//! - [`attn`] (`kernels/attn.cu`): the attention softmax, forward and backward
//!   ([`attn::attn_softmax_fwd`], [`attn::attn_softmax_bwd`]). Both files' kernels are loaded
//!   together and cached per CUDA context by [`FusedKernels`] (`launch.rs`, with the size checks
//!   and launch shapes both launcher files share).
//! - [`fused_ref`]: the references (always compiled, plain Rust on f32 slices, rounding to a
//!   [`Precision`]); [`fused_check`] runs each kernel against its reference — `tests/fused_cuda.rs`
//!   on many shapes, [`fused_check::self_test`] once over every kernel.
//! - [`flash`] (`kernels/flash_attn.cu`): tiled attention (FlashAttention-2), forward and
//!   backward, bf16/f16 on tensor cores and f32; [`flash_ref`] is its CPU reference with the same
//!   tiling (always compiled), [`flash_check`] runs one against the other.
//! - [`adamw`] (`kernels/adamw.cu`): the multi-tensor optimizer (gradient norm, clipping, AdamW);
//!   its CPU reference is always compiled, the launchers and [`adamw::check`] only with `cuda`.
//!
//! Imports run one way: `precision` ← `fused_ref`; `precision` ← `launch` ← `fused`, `attn` ←
//! `fused_check`.

// Without `cuda` the items the overview links to do not exist; the links resolve in a cuda build.
#![cfg_attr(not(feature = "cuda"), allow(rustdoc::broken_intra_doc_links))]

#[cfg(feature = "cuda")]
mod nf4;
#[cfg(feature = "cuda")]
pub use nf4::{
    nf4_dequant_cuda, nf4_dequant_cuda_into, DequantOut, DeviceAbsmax, Nf4Kernels, Nf4WeightCuda,
};

pub mod adamw;
#[cfg(feature = "cuda")]
pub mod attn;
#[cfg(feature = "cuda")]
pub mod dropout;
#[cfg(feature = "cuda")]
pub mod flash;
#[cfg(feature = "cuda")]
pub mod flash_check;
pub mod flash_ref;
#[cfg(feature = "cuda")]
pub mod fused;
#[cfg(feature = "cuda")]
pub mod fused_check;
pub mod fused_ref;
pub mod image;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
pub use launch::{FusedFloat, FusedKernels};
mod precision;
pub use precision::Precision;
#[cfg(feature = "cuda")]
pub mod memory;

/// Whether this build has the CUDA kernels (the `cuda` feature).
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

/// PTX of `kernels/nf4.cu` (for `compute_$CUDA_COMPUTE_CAP`, default 80).
#[cfg(feature = "cuda")]
pub const NF4_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/nf4.ptx"));

/// PTX of `kernels/fused.cu` (for `compute_$CUDA_COMPUTE_CAP`, default 80).
#[cfg(feature = "cuda")]
pub const FUSED_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fused.ptx"));

/// PTX of `kernels/attn.cu` (for `compute_$CUDA_COMPUTE_CAP`, default 80).
#[cfg(feature = "cuda")]
pub const ATTN_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn.ptx"));

/// PTX of `kernels/flash_attn.cu` (for `compute_$CUDA_COMPUTE_CAP`, default 80).
#[cfg(feature = "cuda")]
pub const FLASH_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_attn.ptx"));

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("rtune was built without CUDA kernels; rebuild with `--features cuda`")]
    NotCompiled,
    #[cfg(feature = "cuda")]
    #[error("cuda {op}: {source}")]
    Driver {
        op: &'static str,
        source: cudarc::driver::DriverError,
    },
    #[error("{op}: {message}")]
    Unsupported { op: &'static str, message: String },
}

pub type Result<T> = std::result::Result<T, KernelError>;

/// Maps a driver error to [`KernelError::Driver`] naming the operation.
#[cfg(feature = "cuda")]
pub(crate) fn drv(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> KernelError {
    move |source| KernelError::Driver { op, source }
}
