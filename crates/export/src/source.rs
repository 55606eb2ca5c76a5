//! What an export reads: the adapter directory of a run (final or `checkpoint-N`), the base model
//! the run was trained on, and the run's file privacy.
//!
//! The base comes from `run.json` (`model_path`, as the user wrote it in the config: usually
//! relative to the directory `rtune train` ran in). It is looked for as given and then relative to
//! each directory above the run, and accepted only if its `config.json` has the SHA-256 the run
//! recorded — so an export never silently merges into a different model. `--base DIR` overrides
//! the search (a differing config.json is then reported as a warning). A directory without
//! `run.json` (a bare PEFT adapter) takes its base from `adapter_config.json`.
//!
//! [`RunSource::verify`] checks the adapter's files before anything is exported: a checkpoint's
//! against its `manifest.json`, a run's final adapter against the `adapter_files` hashes run.json
//! records when the run completes. Either record missing is a refusal, not a skipped check.

use serde::Deserialize;
use std::path::{Path, PathBuf};

use rtune_fsio::{sha256_file, Privacy};
use rtune_lora::{ADAPTER_CONFIG, ADAPTER_WEIGHTS};

use crate::{ExportError, Result};

const RUN_JSON: &str = "run.json";

/// The parts of `run.json` an export reads; anything else in it is ignored.
#[derive(Debug, Deserialize)]
struct RecordView {
    model_path: String,
    #[serde(default)]
    model_files: Vec<FileHashView>,
    #[serde(default)]
    config: serde_json::Value,
    /// The final adapter's files as the run hashed them on completing (absent before).
    #[serde(default)]
    adapter_files: Vec<ManifestFile>,
}

/// A file with its size and SHA-256, as run.json's `adapter_files` lists it.
#[derive(Debug, Clone, Deserialize)]
struct ManifestFile {
    path: String,
    bytes: u64,
    sha256: String,
}

#[derive(Debug, Deserialize)]
struct FileHashView {
    path: String,
    sha256: String,
}

#[derive(Debug, Clone, Deserialize)]
struct ManifestView {
    files: std::collections::BTreeMap<String, ManifestEntry>,
}

#[derive(Debug, Clone, Deserialize)]
struct ManifestEntry {
    bytes: u64,
    sha256: String,
}

/// A run directory resolved for export.
#[derive(Debug, Clone)]
pub struct RunSource {
    pub run: PathBuf,
    /// The directory holding `adapter_model.safetensors` + `adapter_config.json`.
    pub adapter: PathBuf,
    /// The base as recorded (run.json's `model_path`, or the adapter config's base name).
    pub recorded_base: Option<String>,
    /// The base model directory found (or given with `--base`).
    pub base: Option<PathBuf>,
    pub privacy: Privacy,
    pub warnings: Vec<String>,
    /// The hub id the run's config named (`org/name`), if it did.
    pub hub_id: Option<String>,
    /// The run trained on an NF4 base (`[model] quantize = "nf4"`): `Some(double_quant)`.
    pub trained_nf4: Option<bool>,
    /// With it, the expert stacks were NF4 too (`[model] quantize_experts`).
    pub trained_nf4_experts: bool,
    /// Where the recorded base was looked for, and why each place was not taken.
    tried: Vec<String>,
    /// What the adapter's files are checked against before anything is exported.
    check: Check,
    /// The run directory above `run` when `run` is one of its `checkpoint-N` directories.
    run_above: Option<PathBuf>,
}

/// What [`RunSource::verify`] checks the adapter's files against.
#[derive(Debug, Clone)]
enum Check {
    /// A checkpoint (or any directory with a manifest.json): its manifest, required.
    Manifest,
    /// A run's final adapter: the hashes run.json recorded when the run completed (none: refused).
    Recorded(Vec<ManifestFile>),
    /// A bare PEFT adapter directory, no run around it: nothing to check against.
    Nothing,
}

/// Steps of the `checkpoint-N` directories in `run`, ascending.
fn checkpoint_steps(run: &Path) -> Vec<usize> {
    let mut steps: Vec<usize> = std::fs::read_dir(run)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_prefix("checkpoint-")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort_unstable();
    steps
}

fn list(steps: &[usize]) -> String {
    if steps.is_empty() {
        "it has none".into()
    } else {
        let s: Vec<String> = steps.iter().map(|s| s.to_string()).collect();
        format!("available: {}", s.join(", "))
    }
}

/// Checks `dir/name` has the size and SHA-256 recorded in `source` (`manifest.json`, `run.json`).
fn check_file(dir: &Path, name: &str, bytes: u64, sha256: &str, source: &str) -> Result<()> {
    let path = dir.join(name);
    let len = std::fs::metadata(&path)
        .map_err(|e| ExportError::input(&path, format!("cannot read: {e}")))?
        .len();
    if len != bytes || sha256_file(&path)? != sha256 {
        return Err(ExportError::input(
            &path,
            format!(
                "does not match its size or SHA-256 in {source} (corrupt or changed since \
                 training); not exported"
            ),
        ));
    }
    Ok(())
}

/// Checks a checkpoint's adapter files against its manifest.json (written by the trainer): the
/// manifest and an entry for each file are required.
fn verify_manifest(dir: &Path) -> Result<()> {
    let path = dir.join("manifest.json");
    let text = rtune_fsio::read_bounded(&path, rtune_fsio::FileKind::RunRecord).map_err(|e| {
        ExportError::input(
            &path,
            format!(
                "cannot read ({e}): the checkpoint's files cannot be verified, so it is not \
                 exported; export another one with --checkpoint N"
            ),
        )
    })?;
    let m: ManifestView = serde_json::from_slice(&text)
        .map_err(|e| ExportError::input(&path, format!("not a checkpoint manifest: {e}")))?;
    for f in [ADAPTER_WEIGHTS, ADAPTER_CONFIG] {
        let entry = m.files.get(f).ok_or_else(|| {
            ExportError::input(
                &path,
                format!("lists no {f}: the checkpoint cannot be verified, so it is not exported"),
            )
        })?;
        check_file(dir, f, entry.bytes, &entry.sha256, "manifest.json")?;
    }
    Ok(())
}

/// Checks a run's final adapter against the hashes run.json recorded when the run completed.
fn verify_recorded(run: &Path, adapter: &Path, files: &[ManifestFile]) -> Result<()> {
    for f in [ADAPTER_WEIGHTS, ADAPTER_CONFIG] {
        let Some(entry) = files.iter().find(|e| e.path == f) else {
            return Err(ExportError::input(
                &run.join(RUN_JSON),
                format!(
                    "records no SHA-256 for the final {f} (written by an older rtune, or the run's \
                     end was not recorded), so it cannot be verified and is not exported; export a \
                     checkpoint with --checkpoint N, or copy {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG} \
                     into a directory of their own and export that"
                ),
            ));
        };
        check_file(adapter, f, entry.bytes, &entry.sha256, "run.json")?;
    }
    Ok(())
}

/// `org/name` that is not a local path (a Hugging Face hub id, as `[model] path` accepts).
fn looks_like_hub_id(p: &str) -> bool {
    let parts: Vec<&str> = p.split('/').collect();
    parts.len() == 2
        && parts
            .iter()
            .all(|s| !s.is_empty() && !s.starts_with('.') && !s.starts_with('~'))
        && !p.ends_with(".gguf")
        && !Path::new(p).exists()
}

fn read_record(path: &Path) -> Result<Option<RecordView>> {
    match rtune_fsio::read_bounded(path, rtune_fsio::FileKind::RunRecord) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| ExportError::input(path, format!("not a run record: {e}"))),
        Err(_) => Ok(None),
    }
}

/// A checkpoint of a PiSSA / OLoRA run (`[lora] init`, issue 17) holds the adapter trained against
/// the residual base `W − s·B₀·A₀`, which no other tool has; only the final adapter is converted to
/// the original base. Refused rather than exported wrong.
fn refuse_residual_checkpoint(record: Option<&RecordView>, dir: &Path, step: usize) -> Result<()> {
    let init = record.and_then(|r| r.config.get("lora")?.get("init")?.as_str());
    match init.and_then(|i| i.parse::<rtune_lora::Init>().ok()) {
        Some(i) if i.mutates_base() => Err(ExportError::input(
            dir,
            format!(
                "checkpoint-{step} of an init = \"{i}\" run is relative to the residual base, which \
                 only rtune rebuilds; export the finished run, whose adapter is converted to the \
                 original base (`rtune train --resume` finishes an interrupted one)"
            ),
        )),
        _ => Ok(()),
    }
}

impl RunSource {
    /// Resolves `run` (a run directory, or any PEFT adapter directory) for export.
    pub fn open(run: &Path, checkpoint: Option<usize>, base: Option<&Path>) -> Result<Self> {
        if !run.is_dir() {
            return Err(ExportError::input(
                run,
                "not a directory (expected the [output] dir of an `rtune train` run)",
            ));
        }
        let adapter = match checkpoint {
            Some(n) => {
                let dir = run.join(format!("checkpoint-{n}"));
                if !dir.is_dir() {
                    return Err(ExportError::input(
                        run,
                        format!("has no checkpoint-{n} ({})", list(&checkpoint_steps(run))),
                    ));
                }
                dir
            }
            None => run.to_path_buf(),
        };
        for f in [ADAPTER_WEIGHTS, ADAPTER_CONFIG] {
            if adapter.join(f).is_file() {
                continue;
            }
            let steps = checkpoint_steps(run);
            let message = if checkpoint.is_some() {
                format!("checkpoint has no {f}")
            } else if run.join(RUN_JSON).exists() {
                format!(
                    "no final adapter ({f}): the run has not finished; export a checkpoint with \
                     --checkpoint N ({})",
                    list(&steps)
                )
            } else {
                format!("no {f}: not a run directory or PEFT adapter directory")
            };
            return Err(ExportError::input(&adapter, message));
        }
        // run.json: in the run dir, or above a checkpoint dir given as --run.
        let mut record = read_record(&run.join(RUN_JSON))?;
        let mut run_above = None;
        if record.is_none()
            && run
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("checkpoint-"))
        {
            if let Some(parent) = run.parent() {
                record = read_record(&parent.join(RUN_JSON))?;
                run_above = record.as_ref().map(|_| parent.to_path_buf());
            }
        }
        let check = if checkpoint.is_some()
            || run_above.is_some()
            || adapter.join("manifest.json").exists()
        {
            Check::Manifest
        } else {
            match &record {
                Some(r) => Check::Recorded(r.adapter_files.clone()),
                None => Check::Nothing,
            }
        };
        if let Some(n) = checkpoint {
            refuse_residual_checkpoint(record.as_ref(), &adapter, n)?;
        }
        let privacy = record
            .as_ref()
            .and_then(|r| r.config.get("output")?.get("private")?.as_bool())
            .map_or(Privacy::PRIVATE, |p| Privacy { private: p });
        // The model as the config named it: a hub id there (resolved to a local snapshot, which is
        // what model_path records) is the portable base name.
        let hub_id = record.as_ref().and_then(|r| {
            let named = r.config.get("model")?.get("path")?.as_str()?;
            (named != r.model_path && looks_like_hub_id(named)).then(|| named.to_string())
        });
        // As the config resolves it: `nf4` with its `double_quant` key, or `nf4-dq`.
        let trained_nf4 = record.as_ref().and_then(|r| {
            let m = r.config.get("model")?;
            let name = m.get("quantize")?.as_str()?;
            let double_quant = m.get("double_quant").and_then(|d| d.as_bool());
            match name.parse::<rtune_quant::Quantize>().ok()? {
                rtune_quant::Quantize::Nf4 { .. } if name == "nf4" => {
                    Some(double_quant.unwrap_or(true))
                }
                q => q.nf4(),
            }
        });
        let trained_nf4_experts = trained_nf4.is_some()
            && record.as_ref().is_some_and(|r| {
                let m = r.config.get("model");
                let key = m.and_then(|m| m.get("quantize_experts")?.as_bool());
                let name = m.and_then(|m| m.get("quantize")?.as_str());
                key == Some(true)
                    || name
                        .and_then(|n| n.parse::<rtune_quant::Quantize>().ok())
                        .is_some_and(|q| q.experts())
            });
        let recorded_base = match &record {
            Some(r) => Some(r.model_path.clone()),
            None => rtune_lora::read_adapter_config(&adapter)?
                .base_model_name_or_path
                .filter(|s| !s.is_empty()),
        };
        let want_sha = record.as_ref().and_then(|r| {
            r.model_files
                .iter()
                .find(|f| {
                    Path::new(&f.path)
                        .file_name()
                        .is_some_and(|n| n == "config.json")
                })
                .map(|f| f.sha256.clone())
        });
        let mut src = Self {
            run: run.to_path_buf(),
            adapter,
            recorded_base,
            base: None,
            privacy,
            warnings: Vec::new(),
            hub_id,
            trained_nf4,
            trained_nf4_experts,
            tried: Vec::new(),
            check,
            run_above,
        };
        match base {
            Some(b) => {
                if !b.join("config.json").is_file() {
                    return Err(ExportError::input(
                        b,
                        "--base: no config.json here (a Hugging Face model directory is needed)",
                    ));
                }
                if let Some(want) = &want_sha {
                    if sha256_file(&b.join("config.json"))? != *want {
                        src.warnings.push(format!(
                            "{}: config.json differs from the one the run was trained on",
                            b.display()
                        ));
                    }
                }
                src.base = Some(b.to_path_buf());
            }
            None => src.find_base(want_sha.as_deref())?,
        }
        Ok(src)
    }

    fn find_base(&mut self, want_sha: Option<&str>) -> Result<()> {
        let Some(rec) = self.recorded_base.clone() else {
            return Ok(());
        };
        let p = PathBuf::from(&rec);
        let mut candidates = vec![p.clone()];
        if p.is_relative() {
            if let Ok(abs) = self.run.canonicalize() {
                candidates.extend(abs.ancestors().skip(1).map(|a| a.join(&p)));
            }
        }
        for c in candidates {
            let cfg = c.join("config.json");
            if !cfg.is_file() {
                continue;
            }
            match want_sha {
                Some(want) if sha256_file(&cfg)? != want => self.tried.push(format!(
                    "{} (its config.json differs from the run's)",
                    c.display()
                )),
                _ => {
                    self.base = Some(c);
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The base model directory, or an error saying why there is none and what to do.
    pub fn require_base(&self, format: &str) -> Result<&Path> {
        if let Some(b) = &self.base {
            return Ok(b);
        }
        let what = match &self.recorded_base {
            None => "the run records no base model".to_string(),
            Some(r) if r.ends_with(".gguf") => format!(
                "the base `{r}` is a GGUF file; convert it to a Hugging Face directory \
                 (`rtune convert gguf`) and pass that with --base DIR"
            ),
            Some(r) if self.tried.is_empty() => {
                format!("the base `{r}` is not a local model directory from here")
            }
            Some(r) => format!("the base `{r}` was not found: {}", self.tried.join("; ")),
        };
        Err(ExportError::input(
            &self.run,
            format!("--format {format} needs the base model's weights: {what}; pass --base DIR"),
        ))
    }

    /// `base_model_name_or_path` for a PEFT export: the hub id the run was configured with, else the
    /// base's absolute path when it is here, else what the run recorded.
    pub fn base_name(&self, warnings: &mut Vec<String>) -> String {
        if let Some(id) = &self.hub_id {
            return id.clone();
        }
        if let Some(b) = &self.base {
            return b
                .canonicalize()
                .unwrap_or_else(|_| b.clone())
                .to_string_lossy()
                .into_owned();
        }
        let rec = self.recorded_base.clone().unwrap_or_default();
        warnings.push(format!(
            "base model `{rec}` not found from here; base_model_name_or_path keeps it as recorded \
             (set it with --base DIR or --base-name NAME)"
        ));
        rec
    }

    /// Checks every adapter file the export reads: a checkpoint's against its manifest.json
    /// (required), a run's final adapter against the hashes in run.json (required); only a bare
    /// PEFT adapter directory, with no run around it, has nothing to check against.
    pub fn verify(&self) -> Result<()> {
        match &self.check {
            Check::Manifest => verify_manifest(&self.adapter),
            Check::Recorded(files) => verify_recorded(&self.run, &self.adapter, files),
            Check::Nothing => Ok(()),
        }
    }

    /// Paths an export must never write into: the run (and the run above a checkpoint given as
    /// `--run`), the adapter, the base.
    pub fn protected(&self) -> Vec<PathBuf> {
        [
            Some(&self.run),
            self.run_above.as_ref(),
            Some(&self.adapter),
            self.base.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(|p| p.canonicalize().unwrap_or_else(|_| p.clone()))
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtune_fsio::sha256_bytes;

    #[test]
    fn hub_ids_and_paths() {
        assert!(looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct"));
        for p in [
            "tests/fixtures/tiny-llama",
            "./a/b",
            "/abs/x",
            "model.gguf",
            "a/b.gguf",
            "x",
        ] {
            assert!(!looks_like_hub_id(p), "{p}");
        }
    }

    #[test]
    fn base_found_above_the_run_only_with_the_recorded_config() {
        let t = std::env::temp_dir().join(format!("rtune-export-src-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&t);
        // Training ran in `t`, with `[model] path = "models/base"`; the run is t/runs/a.
        let (base, run) = (t.join("models/base"), t.join("runs/a"));
        std::fs::create_dir_all(&base).unwrap();
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(base.join("config.json"), "{\"x\": 1}").unwrap();
        for f in [ADAPTER_WEIGHTS, ADAPTER_CONFIG] {
            std::fs::write(run.join(f), "").unwrap();
        }
        let record = |sha: &str| {
            let r = serde_json::json!({
                "model_path": "models/base",
                "model_files": [{"path": "models/base/config.json", "bytes": 8, "sha256": sha}],
                "config": {"model": {"path": "models/base"}, "output": {"private": false}},
            });
            std::fs::write(run.join(RUN_JSON), r.to_string()).unwrap();
        };
        record(&sha256_bytes(b"{\"x\": 1}"));
        let src = RunSource::open(&run, None, None).unwrap();
        assert_eq!(
            src.base.as_deref().unwrap().canonicalize().unwrap(),
            base.canonicalize().unwrap()
        );
        assert!(!src.privacy.private);
        assert_eq!(src.hub_id, None);
        let mut w = Vec::new();
        assert_eq!(
            src.base_name(&mut w),
            base.canonicalize().unwrap().to_string_lossy()
        );
        // Another model's config.json at that path: not taken, and the error says why.
        record(&sha256_bytes(b"other"));
        let src = RunSource::open(&run, None, None).unwrap();
        assert!(src.base.is_none());
        let e = src.require_base("merged").unwrap_err().to_string();
        assert!(
            e.contains("differs from the run's") && e.contains("--base DIR"),
            "{e}"
        );
        std::fs::remove_dir_all(&t).unwrap();
    }
}
