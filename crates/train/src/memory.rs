//! Measured memory of a run: the peak on its device (the memory pool's high-water mark on CUDA,
//! `rtune_backend::memory`; the resident set on the CPU, `rtune_backend::host_memory`) and the
//! free device memory on CUDA. Predicted memory is `rtune_estimate`'s.

pub use rtune_backend::host_memory::{current_rss_bytes, peak_rss_bytes, ram_available_bytes};

/// The peak memory that matters for a run on `dev`: device memory on CUDA, host RSS on the CPU.
pub fn peak_bytes(dev: &candle_core::Device) -> u64 {
    match dev.location() {
        #[cfg(feature = "cuda")]
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            rtune_backend::memory::peak_bytes(gpu_id).unwrap_or(0)
        }
        _ => peak_rss_bytes(),
    }
}

/// Free memory of GPU `ordinal` as the driver reports it (`cuMemGetInfo`): the budget
/// `rtune estimate` fits a CUDA run into.
#[cfg(feature = "cuda")]
pub fn device_free_bytes(ordinal: usize) -> Result<u64, crate::TrainError> {
    use crate::TrainError;
    // The driver answers for the current context: opening the device makes it current.
    let _dev = rtune_backend::cuda::open(ordinal)
        .map_err(|source| TrainError::DeviceOpen { ordinal, source })?;
    rtune_backend::memory::free_and_total()
        .map(|(free, _)| free as u64)
        .map_err(|source| TrainError::Kernel { ordinal, source })
}
