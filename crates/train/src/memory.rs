//! Measured memory: the resident set of this process and the machine's RAM on the CPU (Linux's
//! /proc: `VmHWM`/`VmRSS` of /proc/self/status, `MemTotal`/`MemAvailable` of /proc/meminfo), the
//! device memory pool's high-water mark and the free device memory on CUDA (see
//! `rtune_backend::memory`). Predicted memory is `rtune_estimate`'s.

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

/// `VmHWM` from /proc/self/status in bytes (Linux); 0 where it cannot be read.
pub fn peak_rss_bytes() -> u64 {
    read_status_kib("VmHWM:").map_or(0, |k| k * 1024)
}

/// Current resident set size in bytes (Linux); 0 where it cannot be read.
pub fn current_rss_bytes() -> u64 {
    read_status_kib("VmRSS:").map_or(0, |k| k * 1024)
}

/// `MemTotal` of /proc/meminfo in bytes: the machine's RAM (Linux); `None` where it cannot be read.
pub fn ram_total_bytes() -> Option<u64> {
    read_kib("/proc/meminfo", "MemTotal:").map(|k| k * 1024)
}

/// `MemAvailable` of /proc/meminfo in bytes: what can be allocated without swapping (Linux);
/// `None` where it cannot be read.
pub fn ram_available_bytes() -> Option<u64> {
    read_kib("/proc/meminfo", "MemAvailable:").map(|k| k * 1024)
}

fn read_status_kib(key: &str) -> Option<u64> {
    read_kib("/proc/self/status", key)
}

/// The value of the `key` line of a /proc file written as `Key:   1234 kB`.
fn read_kib(file: &str, key: &str) -> Option<u64> {
    parse_kib(&std::fs::read_to_string(file).ok()?, key)
}

fn parse_kib(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
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
            let (total, avail) = (super::ram_total_bytes(), super::ram_available_bytes());
            assert!(total.is_some_and(|t| t > 0 && avail.is_some_and(|a| a <= t)));
        }
    }

    #[test]
    fn proc_lines_parse_to_kib() {
        let text = "MemTotal:       16318480 kB\nMemFree:  1 kB\nMemAvailable:    9000 kB\n";
        assert_eq!(super::parse_kib(text, "MemTotal:"), Some(16318480));
        assert_eq!(super::parse_kib(text, "MemAvailable:"), Some(9000));
        assert_eq!(super::parse_kib(text, "SwapTotal:"), None);
        assert_eq!(super::parse_kib("VmHWM: lots kB", "VmHWM:"), None);
    }
}
