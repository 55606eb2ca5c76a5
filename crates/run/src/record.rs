//! `run.json`, the run record: what was run, on what, from which inputs, and how it ended — the
//! reproducibility list of the product brief (pinned versions, full config and seeds, data manifest,
//! hardware). Rewritten atomically at start and at the end of every attempt; a resumed run appends an
//! attempt.

use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::SystemTime;

use rtune_backend::host_memory::read_proc;
use rtune_config::RunConfig;
use rtune_fsio::{sha256_file, write_atomic, Privacy};

use crate::RunError;

pub const RUN_JSON: &str = "run.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileHash {
    pub path: String,
    pub bytes: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Attempt {
    pub started: String,
    pub ended: Option<String>,
    /// running | completed | stopped (signal; checkpoint written) | `failed: <message>`
    pub status: String,
    pub resumed_from_step: Option<usize>,
    pub steps_done: usize,
    /// Gradient checkpointing as this attempt decided it (`auto` resolved), with the reason;
    /// absent in records written before `auto` existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_checkpointing: Option<rtune_estimate::CheckpointingChoice>,
    /// The f32 CBLAS and the bf16 GEMM's library this attempt ran on, as `hardware` words them
    /// (a resume keeps the first attempt's: `rtune_backend::pin`); absent in records written
    /// before they were recorded per attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blas: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16_gemm: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub rtune_version: String,
    pub git_commit: String,
    pub cargo_lock_sha256: String,
    pub config: toml::Value,
    pub seed: u64,
    pub model_path: String,
    pub model_files: Vec<FileHash>,
    /// Training files, then the validation file (the data manifest of the run).
    pub data: Vec<FileHash>,
    pub hardware: Hardware,
    /// `[model] dtype` as resolved, with the reason when it was `auto` (`bf16 (auto: the CPU has
    /// AVX-512 BF16, oneDNN in use)`). Absent in records written before `auto` existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    pub attempts: Vec<Attempt>,
    /// A data-parallel run (issue 16): the world size and each rank's host and device, as of the
    /// latest attempt. Absent for a single process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world: Option<WorldRecord>,
    /// The final adapter's files (`adapter_model.safetensors`, `adapter_config.json`, paths
    /// relative to the run directory), hashed when an attempt completes: what `rtune export`
    /// checks the final adapter against (a checkpoint has its own manifest.json). Absent until
    /// the run has completed, and in records written before it was recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapter_files: Vec<FileHash>,
}

/// The ranks of a data-parallel attempt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorldRecord {
    pub size: usize,
    pub ranks: Vec<rtune_dist::RankInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hardware {
    pub cpu_model: String,
    pub cores: usize,
    pub ram_bytes: u64,
    pub simd: Vec<String>,
    pub os: String,
    pub device: String,
    /// The CBLAS the CPU matmuls went through (`libopenblas.so.0 (skylakex)`), if any.
    #[serde(default)]
    pub blas: Option<String>,
    /// What bf16 GEMMs go through: `oneDNN (libdnnl.so.2, oneDNN 2.6.3)` or `candle's gemm
    /// (why)`; absent in records written before it was recorded.
    #[serde(default)]
    pub bf16_gemm: Option<String>,
}

pub fn now() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

fn hash(path: &Path) -> Result<FileHash, RunError> {
    let bytes = std::fs::metadata(path)
        .map_err(|e| RunError::Output {
            path: path.into(),
            message: e.to_string(),
        })?
        .len();
    Ok(FileHash {
        path: path.display().to_string(),
        bytes,
        sha256: sha256_once(path)?,
    })
}

/// A file's sha256, computed once per process for a given (path, size, mtime): a preference
/// run's reference cache key and run.json hash the same model files at start.
pub fn sha256_once(path: &Path) -> Result<String, RunError> {
    type Seen = std::collections::HashMap<(std::path::PathBuf, u64, Option<SystemTime>), String>;
    static SEEN: std::sync::Mutex<Option<Seen>> = std::sync::Mutex::new(None);
    let meta = std::fs::metadata(path).ok();
    let id = (
        path.to_path_buf(),
        meta.as_ref().map_or(0, |m| m.len()),
        meta.and_then(|m| m.modified().ok()),
    );
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(h) = seen.get_or_insert_with(Default::default).get(&id) {
        return Ok(h.clone());
    }
    let h = sha256_file(path).map_err(RunError::from)?;
    seen.get_or_insert_with(Default::default)
        .insert(id, h.clone());
    Ok(h)
}

/// The model's files that determine its numbers: config, weights (and their index), tokenizer.
/// Hashed into run.json; also what data-parallel ranks compare at start.
pub fn model_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            n.ends_with(".safetensors")
                || n == "config.json"
                || n.starts_with("tokenizer")
                || n.ends_with(".index.json")
        })
        .collect();
    files.sort();
    files
}

pub fn hardware(device: &str) -> Hardware {
    let cpuinfo = read_proc("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let ram_bytes = rtune_backend::host_memory::ram_total_bytes().unwrap_or(0);
    // The one CPU-feature detection (rtune_backend::cpu_features), as the kernels see it.
    let simd = rtune_backend::cpu_features::get()
        .list()
        .into_iter()
        .map(String::from)
        .collect();
    Hardware {
        cpu_model,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        ram_bytes,
        simd,
        os: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        device: device.to_string(),
        blas: rtune_backend::blas::loaded().map(str::to_string),
        bf16_gemm: Some(rtune_backend::onednn::describe()),
    }
}

impl RunRecord {
    /// A new record (hashing every model and data file), or the existing one with a new attempt.
    pub fn begin(
        cfg: &RunConfig,
        dir: &Path,
        resumed_from_step: Option<usize>,
    ) -> Result<Self, RunError> {
        let attempt = Attempt {
            started: now(),
            ended: None,
            status: "running".into(),
            resumed_from_step,
            steps_done: 0,
            gradient_checkpointing: None,
            blas: rtune_backend::blas::loaded().map(str::to_string),
            bf16_gemm: Some(rtune_backend::onednn::describe()),
        };
        if resumed_from_step.is_some() {
            if let Some(mut r) = Self::read(dir) {
                r.attempts.push(attempt);
                return Ok(r);
            }
        }
        let files = model_files(&cfg.model.path);
        let total: u64 = files
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum();
        if total > 256 << 20 {
            tracing::info!(
                "hashing {:.1} GB of model files for run.json",
                total as f64 / 1e9
            );
        }
        let model_files = files.iter().map(|p| hash(p)).collect::<Result<_, _>>()?;
        Ok(Self {
            rtune_version: env!("CARGO_PKG_VERSION").to_string(),
            git_commit: env!("RTUNE_GIT_COMMIT").to_string(),
            cargo_lock_sha256: env!("RTUNE_CARGO_LOCK_SHA256").to_string(),
            config: toml::Value::try_from(&cfg.file).expect("config serialises"),
            seed: cfg.train.seed,
            model_path: cfg.model.path.display().to_string(),
            model_files,
            data: cfg
                .data
                .train
                .iter()
                .map(|f| &f.path)
                .chain(&cfg.data.valid)
                .map(|p| hash(p))
                .collect::<Result<_, _>>()?,
            hardware: hardware("cpu"),
            dtype: Some(cfg.model.dtype_said()),
            attempts: vec![attempt],
            world: None,
            adapter_files: Vec::new(),
        })
    }

    /// The run.json in `dir`, if there is one that parses.
    pub fn read(dir: &Path) -> Option<Self> {
        rtune_fsio::read_bounded(&dir.join(RUN_JSON), rtune_fsio::FileKind::RunRecord)
            .ok()
            .and_then(|b| serde_json::from_slice::<RunRecord>(&b).ok())
    }

    /// The record a data-parallel rank other than 0 keeps (it writes no run.json): nothing hashed.
    pub fn placeholder(cfg: &RunConfig) -> Self {
        Self {
            rtune_version: env!("CARGO_PKG_VERSION").to_string(),
            git_commit: String::new(),
            cargo_lock_sha256: String::new(),
            config: toml::Value::Table(Default::default()),
            seed: cfg.train.seed,
            model_path: cfg.model.path.display().to_string(),
            model_files: Vec::new(),
            data: Vec::new(),
            hardware: hardware("cpu"),
            dtype: Some(cfg.model.dtype_said()),
            attempts: Vec::new(),
            world: None,
            adapter_files: Vec::new(),
        }
    }

    /// Records the world of this attempt (nothing for a single process).
    pub fn set_world(&mut self, size: usize, ranks: &[rtune_dist::RankInfo]) {
        if size > 1 {
            self.world = Some(WorldRecord {
                size,
                ranks: ranks.to_vec(),
            });
        }
    }

    /// Hashes the final adapter's files in `dir` into [`RunRecord::adapter_files`].
    pub fn record_adapter(&mut self, dir: &Path) -> Result<(), RunError> {
        self.adapter_files = [rtune_lora::ADAPTER_WEIGHTS, rtune_lora::ADAPTER_CONFIG]
            .into_iter()
            .map(|f| {
                let mut h = hash(&dir.join(f))?;
                h.path = f.to_string();
                Ok(h)
            })
            .collect::<Result<_, RunError>>()?;
        Ok(())
    }

    pub fn end(&mut self, status: &str, steps_done: usize) {
        if let Some(a) = self.attempts.last_mut() {
            a.ended = Some(now());
            a.status = status.to_string();
            a.steps_done = steps_done;
        }
    }

    pub fn write(&self, dir: &Path, privacy: Privacy) -> Result<(), RunError> {
        let text = serde_json::to_vec_pretty(self).expect("record serialises");
        write_atomic(&dir.join(RUN_JSON), &text, privacy).map_err(RunError::from)
    }
}
