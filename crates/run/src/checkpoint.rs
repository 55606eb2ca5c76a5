//! Checkpoints: `run_dir/checkpoint-<step>/` holds everything a run needs to continue bit for bit —
//! the adapter (PEFT format), AdamW's moments and step count, the data cursor, the accumulated
//! metrics and the settings that must not change — and a manifest of sizes and SHA-256 sums.
//!
//! Written into `.checkpoint-<step>.tmp/` (each file fsynced), renamed, then the run directory
//! fsynced: a kill at any moment leaves either the complete checkpoint or none. Loading verifies the
//! manifest; [`latest`] skips (and reports) a corrupt or incomplete checkpoint in favour of the
//! previous one. The dropout masks and the shuffle order are functions of the seed, the step and the
//! epoch, so no generator state has to be stored beyond those.

use candle_core::{DType, Device, Tensor};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use rtune_fsio::{
    fsync_dir, read_bounded, sha256_bytes, sha256_file, write_atomic, FileKind, Privacy,
};
use rtune_lora::peft::{exp_avg_key, exp_avg_sq_key};
use rtune_lora::{Adapter, LoraSpec, ModuleShape, ADAPTER_CONFIG, ADAPTER_WEIGHTS};

use crate::RunError;

/// Version 2: the trainer's counters are one object under `run` (`rtune_train`'s `RunState`).
pub const FORMAT: &str = "rtune-checkpoint/2";
const STATE: &str = "trainer_state.json";
const OPTIM: &str = "optimizer.safetensors";
const MANIFEST: &str = "manifest.json";

/// trainer_state.json: the trainer's counters, where the optimizer and the data stood, and the
/// settings a resumed run must share.
///
/// `R`: the trainer's counters, saved as they are (`rtune_train`'s `RunState`: step, tokens,
/// speeds, last loss, wall time, loss scale, skipped steps, metrics.jsonl length); [`save`] names
/// the directory by their [`Step`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState<R> {
    pub format: String,
    pub run: R,
    /// AdamW's step count (skipped updates do not advance it).
    pub adamw_step: u64,
    /// Data cursor: epoch and position in that epoch's (seeded) order.
    pub epoch: usize,
    pub cursor: usize,
    pub seed: u64,
    /// The learning rate the next step will use (the scheduler's position is `run.step`).
    pub next_lr: f64,
    /// Settings that a resumed run must share to reproduce the uninterrupted one.
    pub settings: BTreeMap<String, String>,
    /// What the objective's recipe keeps beyond the data cursor (a sampler's RNG state:
    /// `Recipe::state`); absent when it keeps nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe: Option<serde_json::Value>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: String,
    files: BTreeMap<String, FileEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
struct FileEntry {
    bytes: u64,
    sha256: String,
}

/// The optimizer steps a state has done: its checkpoint's `<step>`.
pub trait Step {
    fn step(&self) -> usize;
}

/// One checkpoint, verified and read.
pub struct Loaded<R> {
    pub dir: PathBuf,
    pub state: TrainerState<R>,
    pub adapter: Adapter,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

/// `v` as safetensors stores it (little-endian f32): borrowed, not copied, on a little-endian
/// machine. The moments are 2× the adapter; a copy of them (and a second of their bytes) made a
/// checkpoint the run's memory peak at a large rank (issue 35).
fn le_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the bytes of `v` (initialised f32s, no padding) viewed as u8 (alignment 1), the
        // same memory and length, borrowed for as long as `v`.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v))
        })
    }
    #[cfg(not(target_endian = "little"))]
    std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
}

/// One f32 tensor to serialise: its key, its little-endian bytes ([`le_bytes`]), its shape.
type F32Bytes<'a> = (String, std::borrow::Cow<'a, [u8]>, Vec<usize>);

fn safetensors_bytes(data: &[F32Bytes<'_>]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(k, b, s)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .expect("shape and byte count agree by construction");
            (k.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None).expect("f32 tensors serialise")
}

/// AdamW's first and second moments, one vector per trainable tensor in the adapter's
/// [`Adapter::trainable`] order.
pub struct Moments<'a> {
    pub m: &'a [Vec<f32>],
    pub v: &'a [Vec<f32>],
}

/// Writes `run_dir/checkpoint-<step>/` atomically, then deletes all but the newest `keep_last`.
pub fn save<R: Serialize + Step>(
    run_dir: &Path,
    state: &TrainerState<R>,
    adapter: &Adapter,
    moments: Moments<'_>,
    base_model: &str,
    privacy: Privacy,
    keep_last: usize,
) -> Result<PathBuf, RunError> {
    let step = state.run.step();
    let final_dir = run_dir.join(format!("checkpoint-{step}"));
    let tmp = run_dir.join(format!(".checkpoint-{step}.tmp"));
    let res = (|| -> Result<(), RunError> {
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| out(&tmp, e))?;
        }
        privacy.create_dir_all(&tmp).map_err(RunError::from)?;
        adapter
            .save_peft(&tmp, base_model, privacy)
            .map_err(|e| RunError::Adapter(Box::new(e)))?;
        let (m, v) = (moments.m, moments.v);
        let mut tensors = Vec::new();
        // A0, B0, A1, B1, …, then DoRA's magnitudes: the optimizer's order.
        for (i, (k, t)) in adapter.trainable().into_iter().enumerate() {
            tensors.push((exp_avg_key(&k), le_bytes(&m[i]), t.dims().to_vec()));
            tensors.push((exp_avg_sq_key(&k), le_bytes(&v[i]), t.dims().to_vec()));
        }
        write_atomic(&tmp.join(OPTIM), &safetensors_bytes(&tensors), privacy)
            .map_err(RunError::from)?;
        let text = serde_json::to_vec_pretty(state).expect("state serialises");
        write_atomic(&tmp.join(STATE), &text, privacy).map_err(RunError::from)?;
        let mut files = BTreeMap::new();
        for f in [ADAPTER_WEIGHTS, ADAPTER_CONFIG, OPTIM, STATE] {
            let p = tmp.join(f);
            let bytes = std::fs::metadata(&p).map_err(|e| out(&p, e))?.len();
            files.insert(
                f.to_string(),
                FileEntry {
                    bytes,
                    sha256: sha256_file(&p).map_err(RunError::from)?,
                },
            );
        }
        let manifest = Manifest {
            format: FORMAT.into(),
            files,
        };
        write_atomic(
            &tmp.join(MANIFEST),
            &serde_json::to_vec_pretty(&manifest).expect("manifest"),
            privacy,
        )
        .map_err(RunError::from)?;
        fsync_dir(&tmp).map_err(RunError::from)?;
        if final_dir.exists() {
            if !crate::rundir::is_own_checkpoint(&final_dir) {
                return Err(RunError::OutputDir {
                    path: final_dir.clone(),
                    message: "exists and was not written by rtune; not replaced".into(),
                });
            }
            remove(&final_dir).map_err(|e| out(&final_dir, e))?;
        }
        std::fs::rename(&tmp, &final_dir).map_err(|e| out(&final_dir, e))?;
        fsync_dir(run_dir).map_err(RunError::from)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if keep_last > 0 {
        for (_, old) in list(run_dir).into_iter().skip(keep_last) {
            remove(&old).map_err(|e| out(&old, e))?;
        }
    }
    Ok(final_dir)
}

fn out(path: &Path, e: std::io::Error) -> RunError {
    RunError::Output {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Deletes the checkpoint `dir`: renamed first to `.checkpoint-<step>.old.tmp` (what
/// [`remove_partial`] clears after a kill), so a checkpoint is whole or gone, never a half-deleted
/// directory that no longer shows it is rtune's.
pub fn remove(dir: &Path) -> std::io::Result<()> {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let gone = dir.with_file_name(format!(".{name}.old.tmp"));
    if gone.exists() {
        std::fs::remove_dir_all(&gone)?;
    }
    std::fs::rename(dir, &gone)?;
    std::fs::remove_dir_all(&gone)
}

/// Complete checkpoints in `run_dir` that rtune wrote (`rundir::is_own_checkpoint`), newest first.
pub fn list(run_dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(run_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = crate::rundir::checkpoint_step(&name)?;
            crate::rundir::is_own_checkpoint(&e.path()).then(|| (step, e.path()))
        })
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found
}

/// Removes `.checkpoint-*.tmp` left by a run killed while writing.
pub fn remove_partial(run_dir: &Path) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(run_dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".checkpoint-")
            && name.ends_with(".tmp")
            && std::fs::remove_dir_all(e.path()).is_ok()
        {
            n += 1;
        }
    }
    n
}

/// Verifies and reads one checkpoint; the error says what is wrong with it.
pub fn load<R: DeserializeOwned>(
    dir: &Path,
    spec: &LoraSpec,
    modules: &[ModuleShape],
    dev: &Device,
) -> Result<Loaded<R>, String> {
    let text = read_bounded(&dir.join(MANIFEST), FileKind::RunRecord)
        .map_err(|e| format!("{MANIFEST}: {e}"))?;
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| format!("{MANIFEST}: {e}"))?;
    if manifest.format != FORMAT {
        return Err(format!("format `{}`, expected `{FORMAT}`", manifest.format));
    }
    for f in [ADAPTER_WEIGHTS, ADAPTER_CONFIG, OPTIM, STATE] {
        let entry = manifest
            .files
            .get(f)
            .ok_or_else(|| format!("{MANIFEST} does not list {f}"))?;
        // Read no more than the manifest's size (+1 to tell a longer file).
        let kind = FileKind::Sized {
            cap: entry.bytes.saturating_add(1),
            name: "checkpoint file",
        };
        let bytes = read_bounded(&dir.join(f), kind).map_err(|e| format!("{f}: {e}"))?;
        if bytes.len() as u64 != entry.bytes {
            return Err(format!(
                "{f} has {} bytes, the manifest says {}",
                bytes.len(),
                entry.bytes
            ));
        }
        if sha256_bytes(&bytes) != entry.sha256 {
            return Err(format!("{f} does not match its checksum"));
        }
    }
    let state: TrainerState<R> = serde_json::from_slice(
        &read_bounded(&dir.join(STATE), FileKind::RunRecord)
            .map_err(|e| format!("{STATE}: {e}"))?,
    )
    .map_err(|e| format!("{STATE}: {e}"))?;
    let adapter = Adapter::load_peft(dir, spec, modules, dev).map_err(|e| e.to_string())?;
    let mut opt: HashMap<String, Tensor> = candle_core::safetensors::load(dir.join(OPTIM), dev)
        .map_err(|e| format!("{OPTIM}: {e}"))?;
    let (mut m, mut v) = (Vec::new(), Vec::new());
    {
        for (k, t) in adapter.trainable() {
            for (key, dst) in [(exp_avg_key(&k), &mut m), (exp_avg_sq_key(&k), &mut v)] {
                let x = opt
                    .remove(&key)
                    .ok_or_else(|| format!("{OPTIM} has no `{key}`"))?;
                if x.dims() != t.dims() || x.dtype() != DType::F32 {
                    return Err(format!(
                        "{OPTIM}: `{key}` is {:?} {:?}, expected f32 {:?}",
                        x.dtype(),
                        x.dims(),
                        t.dims()
                    ));
                }
                dst.push(
                    x.flatten_all()
                        .and_then(|x| x.to_vec1::<f32>())
                        .map_err(|e| e.to_string())?,
                );
            }
        }
    }
    Ok(Loaded {
        dir: dir.to_path_buf(),
        state,
        adapter,
        m,
        v,
    })
}

/// The newest checkpoint that verifies; each one skipped is reported through `warn`.
pub fn latest<R: DeserializeOwned>(
    run_dir: &Path,
    spec: &LoraSpec,
    modules: &[ModuleShape],
    dev: &Device,
    warn: &mut dyn FnMut(String),
) -> Option<Loaded<R>> {
    for (_, dir) in list(run_dir) {
        match load(&dir, spec, modules, dev) {
            Ok(l) => return Some(l),
            Err(why) => warn(format!(
                "{}: unusable ({why}); trying the previous checkpoint",
                dir.display()
            )),
        }
    }
    None
}
