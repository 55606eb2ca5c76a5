//! Peak memory: resident set size of this process on the CPU, the device memory pool's
//! high-water mark on CUDA (see `rtune_kernels::memory`).

/// The peak memory that matters for a run on `dev`: device memory on CUDA, host RSS on the CPU.
pub fn peak_bytes(dev: &candle_core::Device) -> u64 {
    match dev.location() {
        #[cfg(feature = "cuda")]
        candle_core::DeviceLocation::Cuda { gpu_id } => {
            rtune_kernels::memory::peak_bytes(gpu_id).unwrap_or(0)
        }
        _ => peak_rss_bytes(),
    }
}

/// Free memory of GPU `ordinal` as the driver reports it (`cuMemGetInfo`): the budget
/// `rtune estimate` fits a CUDA run into.
#[cfg(feature = "cuda")]
pub fn device_free_bytes(ordinal: usize) -> Result<u64, crate::TrainError> {
    // The driver answers for the current context: opening the device makes it current.
    let _dev = rtune_model::cuda::open(ordinal)
        .map_err(|e| crate::TrainError::Device(format!("cuda:{ordinal}: {e}")))?;
    rtune_kernels::memory::free_and_total()
        .map(|(free, _)| free as u64)
        .map_err(|e| crate::TrainError::Device(format!("cuda:{ordinal}: {e}")))
}

/// `VmHWM` from /proc/self/status in bytes (Linux); 0 where it cannot be read.
pub fn peak_rss_bytes() -> u64 {
    read_status_kib("VmHWM:").map_or(0, |k| k * 1024)
}

/// Current resident set size in bytes (Linux); 0 where it cannot be read.
pub fn current_rss_bytes() -> u64 {
    read_status_kib("VmRSS:").map_or(0, |k| k * 1024)
}

fn read_status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn peak_is_at_least_current_and_nonzero_on_linux() {
        if cfg!(target_os = "linux") {
            // Current first: the high-water mark read afterwards can only be higher.
            let cur = super::current_rss_bytes();
            let peak = super::peak_rss_bytes();
            assert!(cur > 0 && peak >= cur, "peak {peak} current {cur}");
        }
    }
}
