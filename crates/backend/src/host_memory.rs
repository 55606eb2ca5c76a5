//! The host's memory as Linux's /proc reports it: this process's resident set (`VmHWM`/`VmRSS`
//! of /proc/self/status) and the machine's RAM (`MemTotal`/`MemAvailable` of /proc/meminfo).
//! Device memory is [`crate::memory`]'s (CUDA); the peak that matters for a run is
//! `rtune_train::memory::peak_bytes`.

/// The resident set's high-water mark in bytes (Linux); 0 where it cannot be read.
///
/// `max(VmHWM, VmRSS)` of one read of /proc/self/status: the kernel folds the per-CPU RSS
/// counters into `VmHWM` lazily (on unmap and exit), so `VmHWM` alone can trail a `VmRSS` read a
/// moment earlier by a few pages (seen in CI: 5,500,928 < 5,529,600).
pub fn peak_rss_bytes() -> u64 {
    let Some(text) = read_proc("/proc/self/status") else {
        return 0;
    };
    let (hwm, rss) = (parse_kib(&text, "VmHWM:"), parse_kib(&text, "VmRSS:"));
    hwm.max(rss).map_or(0, |k| k * 1024)
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
    parse_kib(&read_proc(file)?, key)
}

/// A /proc file, at most 1 MiB of it (they report a size of 0, so no read of them is bounded by
/// their length; /proc/self/status and /proc/meminfo are a few kB, /proc/cpuinfo ~2 kB a core).
pub fn read_proc(file: &str) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(file)
        .ok()?
        .take(1 << 20)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
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
            let cur = super::current_rss_bytes();
            assert!(cur > 0, "VmRSS unread");
            // Grow the resident set by 64 MiB (touched pages) and hold it: the peak read while
            // it is held is at least the current size before it plus most of the 64 MiB
            // (others may free some concurrently: 32 MiB of slack).
            let held = vec![1u8; 64 << 20];
            let peak = super::peak_rss_bytes();
            assert!(peak >= cur + (32 << 20), "peak {peak} current before {cur}");
            drop(std::hint::black_box(held));
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
