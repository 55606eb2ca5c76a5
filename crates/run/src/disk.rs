//! What a run will write into its output directory, and whether the filesystem has room for it
//! (brief, pre-run checklist: leave headroom for checkpoints, logs and retries). `rtune train`
//! refuses to start without room (`[output] check_disk = false` to skip); `rtune check` reports
//! the same figures.

use rtune_config::RunConfig;
use std::path::{Path, PathBuf};

/// Bytes one metrics.jsonl line takes (~300 measured) plus its TensorBoard scalars (~8 × 40).
const LOG_BYTES_PER_STEP: u64 = 700;

/// The run's outputs, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskNeed {
    /// One checkpoint: the adapter (f32) and AdamW's two moments (f32), plus its JSON files.
    pub checkpoint: u64,
    /// Checkpoints on disk at once: `keep_last` kept + the one being written (every checkpoint
    /// the run makes when `keep_last = 0`).
    pub checkpoints: u64,
    /// The final adapter.
    pub adapter: u64,
    /// metrics.jsonl and the TensorBoard events.
    pub logs: u64,
    /// Everything, plus 10% for run.json, samples, the plot and retries.
    pub total: u64,
}

/// What a run with `lora_params` trainable parameters will write, as configured.
pub fn need(cfg: &RunConfig, lora_params: usize) -> DiskNeed {
    let adapter = 4 * lora_params as u64 + 4096;
    let checkpoint = 3 * 4 * lora_params as u64 + 16 * 1024;
    let made = match cfg.output.save_every {
        0 => 1,
        every => cfg.train.steps.div_ceil(every) as u64 + 1,
    };
    let checkpoints = match cfg.output.keep_last {
        0 => made,
        k => (k as u64 + 1).min(made),
    };
    let logs = LOG_BYTES_PER_STEP * cfg.train.steps as u64;
    let sum = adapter + checkpoints * checkpoint + logs;
    DiskNeed {
        checkpoint,
        checkpoints,
        adapter,
        logs,
        total: sum + sum / 10,
    }
}

/// The output directory, or its nearest existing ancestor (what `statvfs` can measure before the
/// directory is created).
pub fn existing_ancestor(dir: &Path) -> PathBuf {
    let mut at: &Path = dir;
    while !at.exists() {
        at = at
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
    }
    at.to_path_buf()
}

/// Free bytes where the run will write; `RTUNE_FAULT_FREE_BYTES=N` stands in for the filesystem's
/// answer, so tests can play a full disk without mounting one.
pub fn free_bytes(dir: &Path) -> Result<u64, rtune_fsio::IoError> {
    if let Some(n) = std::env::var("RTUNE_FAULT_FREE_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Ok(n);
    }
    rtune_fsio::free_bytes(&existing_ancestor(dir))
}

impl DiskNeed {
    /// "need 6.3 MB (3 checkpoints × 2.0 MB, adapter 0.5 MB, logs 0.1 MB), 2.5 MB free in DIR".
    pub fn describe(&self, free: u64, dir: &Path) -> String {
        let mb = |b: u64| b as f64 / 1e6;
        format!(
            "the run needs {:.1} MB ({} checkpoint(s) × {:.1} MB, adapter {:.1} MB, logs {:.1} MB, \
             10% headroom); {:.1} MB free in {}",
            mb(self.total),
            self.checkpoints,
            mb(self.checkpoint),
            mb(self.adapter),
            mb(self.logs),
            mb(free),
            dir.display()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> RunConfig {
        let text = format!("[model]\npath = \"m\"\n[data]\ntrain = \"d\"\n{extra}");
        rtune_config::ConfigFile::parse(&text, Path::new("c.toml"), &[])
            .and_then(|f| f.validate(Path::new("c.toml")))
            .unwrap()
    }

    #[test]
    fn need_counts_kept_checkpoints_adapter_and_logs() {
        let c = cfg("[train]\nsteps = 100\n[output]\nsave_every = 10\nkeep_last = 3\n");
        let n = need(&c, 1_000_000);
        assert_eq!(n.checkpoints, 4);
        assert_eq!(n.checkpoint, 12_000_000 + 16 * 1024);
        assert_eq!(n.adapter, 4_000_000 + 4096);
        assert_eq!(n.logs, 70_000);
        let sum = n.adapter + 4 * n.checkpoint + n.logs;
        assert_eq!(n.total, sum + sum / 10);
        // keep_last = 0 keeps every checkpoint the run makes: 10 saves + the final one.
        let all = need(
            &cfg("[train]\nsteps = 100\n[output]\nsave_every = 10\nkeep_last = 0\n"),
            10,
        );
        assert_eq!(all.checkpoints, 11);
        // Never more on disk than the run makes.
        let few = need(
            &cfg("[train]\nsteps = 5\n[output]\nsave_every = 0\nkeep_last = 3\n"),
            10,
        );
        assert_eq!(few.checkpoints, 1);
    }
}
