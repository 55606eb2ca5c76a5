//! How rtune computes, below the ops: the engines and the machinery every op shares, with no op's
//! semantics in it (those are `rtune-ops`, one folder per op, and the network is `rtune-model`).
//!
//! - [`blas`]: the training path's GEMM ([`blas::matmul`]): OpenBLAS loaded at run time, candle's
//!   gemm otherwise, cuBLAS on CUDA; [`blas::autocast`] (bf16 products, f32 accumulation, as
//!   `torch.autocast`); [`onednn`]: oneDNN's bf16 GEMMs, loaded at run time; [`cpu_features`]:
//!   what the CPU can do, as the kernels see it; [`served`]: which engine served each product
//!   (`rtune bench`'s report); [`pin`]: a resumed run keeps the two libraries its run recorded.
//! - [`cpu`]: the CPU row loops' machinery: element types ([`cpu::Elem`]), the AVX-512F / AVX2
//!   dispatch ([`cpu::dispatch`]), parallel rows; [`storage`]: reading candle's storage, the
//!   dtype rule and shape checks of every fused op, and with `cuda` its CUDA buffers.
//! - [`cast`]: float casts (an op folder of its own here because [`blas::autocast`] needs it).
//! - [`dropout`]: the LoRA dropout's Philox masks, the same bits on the CPU and on CUDA.
//! - CUDA (feature `kernels`: cudarc and nvcc only): the kernels' images ([`image`]: `build.rs`
//!   compiles every `kernels/*.cu`), the loaded fused kernels and the launch preamble every
//!   launcher shares ([`launch`]), device memory figures ([`memory`]); [`check`] (always built):
//!   the references' rounding ([`Precision`]), tolerances, comparison and seeded inputs of every
//!   kernel check.
//! - [`cudnn`]: cuDNN's fused attention through `kernels/cudnn_sdpa.cpp`, loaded at run time (the
//!   shim built with `kernels` when its headers are given).
//! - With `cuda` (candle's CUDA backend too): device handles ([`cuda`]), offload of kept
//!   activations to pinned host memory ([`offload`], [`host_pool`]).
//!
//! Imports run one way: `cpu_features` ← `cpu`, `storage` ← `cast` ← `blas` (`onednn`) ←
//! `dropout`; `precision` ← `check`; `launch` ← each launcher.

// Without `kernels` the items the overview links to do not exist; the links resolve with it.
#![cfg_attr(not(feature = "kernels"), allow(rustdoc::broken_intra_doc_links))]

pub mod blas;
pub mod cast;
pub mod check;
pub mod cpu;
pub mod cpu_features;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cudnn;
pub mod dl;
pub mod dropout;
pub mod host_memory;
// The pool's bookkeeping is device-agnostic (tested everywhere); only CUDA offload uses it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub mod host_pool;
pub mod image;
#[cfg(feature = "kernels")]
pub mod launch;
#[cfg(feature = "kernels")]
pub mod memory;
#[cfg(feature = "cuda")]
pub mod offload;
pub mod onednn;
pub mod pin;
mod precision;
pub mod ring;
pub mod served;
pub mod storage;

#[cfg(feature = "kernels")]
pub use launch::{FusedFloat, GpuKernel};
pub use precision::Precision;

/// Whether this build has the CUDA kernels (the `kernels` feature).
pub const CUDA_COMPILED: bool = cfg!(feature = "kernels");

/// The compute capability `(major, minor)` of `cuda:ordinal`, asked of the driver without opening
/// a candle device (`dtype = "auto"` is resolved from it when the config is checked); `None`
/// without the `kernels` feature, without a driver or without that device.
pub fn cuda_capability(ordinal: usize) -> Option<(i32, i32)> {
    #[cfg(feature = "kernels")]
    {
        // cudarc panics when it cannot load the driver library: no driver is `None` too.
        let ctx = std::panic::catch_unwind(|| cudarc::driver::CudaContext::new(ordinal))
            .ok()?
            .ok()?;
        ctx.compute_capability().ok()
    }
    #[cfg(not(feature = "kernels"))]
    {
        let _ = ordinal;
        None
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("rtune was built without CUDA kernels; rebuild with `--features cuda`")]
    NotCompiled,
    #[cfg(feature = "kernels")]
    #[error("cuda {op}: {source}")]
    Driver {
        op: &'static str,
        source: cudarc::driver::DriverError,
    },
    #[error("{op}: {message}")]
    Unsupported { op: &'static str, message: String },
    /// A cuDNN graph failed to build or run (not "unsupported": that falls back).
    #[error("cudnn {op}: {message}")]
    Cudnn { op: &'static str, message: String },
}

pub type Result<T> = std::result::Result<T, KernelError>;

/// Maps a driver error to [`KernelError::Driver`] naming the operation.
#[cfg(feature = "kernels")]
pub fn drv(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> KernelError {
    move |source| KernelError::Driver { op, source }
}
