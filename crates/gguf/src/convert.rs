//! A llama or Gemma 3 GGUF → a Hugging Face model directory.

use candle_core::quantized::gguf_file::{Content, TensorInfo};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype, View};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use rtune_fsio::{write_atomic, Privacy};

use crate::meta::{family, generation_config, hf_config, Meta, TensorFacts};
use crate::names::{hf_name, unpermute, Family, Rope};
use crate::shapes::{required, Dims};
use crate::vocab::tokenizer_files;
use crate::{GgufError, Result};

/// What [`convert`] wrote.
#[derive(Debug, Clone)]
pub struct Converted {
    pub dir: PathBuf,
    pub tensors: usize,
    /// Size of `model.safetensors`.
    pub bytes: u64,
    /// How many tensors of each ggml type the GGUF held (`Q4_1`: 210, `F32`: 61, ...).
    pub ggml_types: BTreeMap<String, usize>,
    /// `tokenizer.ggml.pre`.
    pub tokenizer_pre: String,
    /// The tokenizer built, in words ("byte-level BPE (pre-tokenizer gpt-2)", ...).
    pub tokenizer: String,
    pub chat_template: bool,
    pub tied_embeddings: bool,
}

struct Source {
    path: PathBuf,
    /// Bytes in the file (every tensor's data must lie inside).
    size: u64,
    reader: RefCell<BufReader<File>>,
    content: Content,
}

impl Source {
    fn open(path: &Path) -> Result<Self> {
        // The bounded walk first (magic, caps, alignment): candle's reader trusts what it finds.
        let (f, _) = crate::scan::open(path)?;
        let size = f.metadata().map(|m| m.len()).unwrap_or(0);
        let mut reader = BufReader::new(f);
        let content = Content::read(&mut reader).map_err(|e| GgufError::File {
            path: path.to_path_buf(),
            message: format!("not a readable GGUF file: {}", crate::candle_message(&e)),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            size,
            reader: RefCell::new(reader),
            content,
        })
    }

    fn meta(&self) -> Meta<'_> {
        Meta {
            path: &self.path,
            md: &self.content.metadata,
        }
    }

    fn facts(&self) -> TensorFacts {
        TensorFacts {
            names: self.content.tensor_infos.keys().cloned().collect(),
            embed_rows: self
                .content
                .tensor_infos
                .get("token_embd.weight")
                .and_then(|t| t.shape.dims().first().copied()),
        }
    }
}

/// One output tensor: where it comes from and what it becomes.
struct Planned<'a> {
    gguf: &'a str,
    info: &'a TensorInfo,
    hf: String,
    rope: Rope,
    /// Subtracted after dequantizing: what the converter added (Gemma's norms: 1).
    shift: f64,
    shape: Vec<usize>,
    dtype: DType,
}

fn plan<'a>(src: &'a Source, fam: Family, cfg: &serde_json::Value) -> Result<Vec<Planned<'a>>> {
    let mut names: Vec<&String> = src.content.tensor_infos.keys().collect();
    names.sort();
    if names.is_empty() {
        return Err(GgufError::File {
            path: src.path.clone(),
            message: "holds no tensors: there is no model to convert".into(),
        });
    }
    let dims = Dims::of(cfg);
    let heads = |k: &str| cfg[k].as_u64().unwrap_or(0) as usize;
    let (q_heads, kv_heads) = (heads("num_attention_heads"), heads("num_key_value_heads"));
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let info = &src.content.tensor_infos[name];
        let bad = |message: String| GgufError::Tensor {
            path: src.path.clone(),
            name: name.clone(),
            message,
        };
        let (hf, rope) = hf_name(fam, name).ok_or_else(|| {
            bad(format!(
                "not a tensor of a {fam:?} model (token_embd, output_norm, output, blk.N.{{attn,ffn}}_*)"
            ))
        })?;
        let shape = info.shape.dims().to_vec();
        check_tensor(src, info, &shape, &dims, &hf).map_err(bad)?;
        let h = match rope {
            Rope::Q => q_heads,
            Rope::K => kv_heads,
            Rope::None => 0,
        };
        if rope != Rope::None && (h == 0 || !shape[0].is_multiple_of(2 * h)) {
            return Err(bad(format!(
                "shape {shape:?}: rows do not split into {h} heads of even size"
            )));
        }
        let dtype = match info.ggml_dtype {
            GgmlDType::F16 => DType::F16,
            GgmlDType::BF16 => DType::BF16,
            _ => DType::F32,
        };
        out.push(Planned {
            gguf: name,
            info,
            hf,
            rope,
            shift: fam.norm_shift(name),
            shape,
            dtype,
        });
    }
    // Every tensor the model needs is there. Past `tensors + 1` layers one is missing for sure:
    // a hostile block_count of 10¹² is not walked.
    let have = &src.content.tensor_infos;
    let layers = dims.layers.min(have.len() + 1);
    let missing = ["token_embd.weight".to_string(), "output_norm.weight".into()]
        .into_iter()
        .chain((0..layers).flat_map(|l| required(fam, l)))
        .find(|n| !have.contains_key(n));
    if let Some(name) = missing {
        return Err(GgufError::Tensor {
            path: src.path.clone(),
            name,
            message: format!("missing (a {fam:?} model of {} layers has it)", dims.layers),
        });
    }
    Ok(out)
}

/// One tensor against what the model expects: dimensions, the shape config.json gives it, its
/// layer among the model's, and its data inside the file.
fn check_tensor(
    src: &Source,
    info: &TensorInfo,
    shape: &[usize],
    dims: &Dims,
    hf: &str,
) -> std::result::Result<(), String> {
    if shape.is_empty() || shape.contains(&0) {
        return Err(format!(
            "shape {shape:?}: a model's tensor has at least one dimension and none of size 0"
        ));
    }
    if let Some(layer) = hf
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(l, _)| l.parse::<usize>().ok())
    {
        if layer >= dims.layers {
            return Err(format!(
                "layer {layer}, but the metadata's block_count is {}",
                dims.layers
            ));
        }
    }
    match dims.expected(hf) {
        Some(want) if want != shape => {
            return Err(format!(
                "shape {shape:?}, but the metadata (sizes, heads, vocabulary) makes it {want:?}"
            ))
        }
        _ => {}
    }
    // The scan bounded the element count (≤ i64::MAX); the data must lie inside the file.
    let elements = shape.iter().map(|&d| d as u64).product::<u64>();
    let (block, unit) = (
        info.ggml_dtype.block_size() as u64,
        info.ggml_dtype.type_size() as u64,
    );
    if !elements.is_multiple_of(block) {
        return Err(format!(
            "{elements} values do not fill whole {:?} blocks of {block}",
            info.ggml_dtype
        ));
    }
    let bytes = (elements / block).saturating_mul(unit);
    let start = src.content.tensor_data_offset.saturating_add(info.offset);
    if start.saturating_add(bytes) > src.size {
        return Err(format!(
            "its {bytes} bytes of data at offset {start} run past the end of the file ({} bytes)",
            src.size
        ));
    }
    Ok(())
}

/// A tensor read, dequantized and un-permuted only when the safetensors writer asks for its bytes,
/// so one tensor at a time is in memory. A failure is kept in `failed` (the writer's `data()`
/// cannot fail) and turns the whole conversion into an error; so does a SIGINT/SIGTERM held back by
/// `deferred`. After either, the remaining tensors are neither read nor written (the file is
/// discarded).
struct Lazy<'a> {
    src: &'a Source,
    p: &'a Planned<'a>,
    heads: usize,
    failed: &'a RefCell<Option<GgufError>>,
    deferred: &'a rtune_fsio::Deferred,
}

impl Lazy<'_> {
    fn load(&self) -> Result<Tensor> {
        let err = |e: candle_core::Error| GgufError::Tensor {
            path: self.src.path.clone(),
            name: self.p.gguf.to_string(),
            message: crate::candle_message(&e),
        };
        let q = self
            .p
            .info
            .read(
                &mut *self.src.reader.borrow_mut(),
                self.src.content.tensor_data_offset,
                &Device::Cpu,
            )
            .map_err(err)?;
        let mut t = q.dequantize(&Device::Cpu).map_err(err)?;
        if self.p.rope != Rope::None {
            t = unpermute(&t, self.heads).map_err(err)?;
        }
        if self.p.shift != 0.0 {
            // In f32 like transformers' GGUF loader (`weights - 1` on the dequantized array).
            t = t
                .to_dtype(DType::F32)
                .and_then(|t| t.affine(1.0, -self.p.shift))
                .map_err(err)?;
        }
        t.to_dtype(self.p.dtype).map_err(err)
    }
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.p.dtype.into()
    }
    fn shape(&self) -> &[usize] {
        &self.p.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        if self.failed.borrow().is_some() {
            return Cow::Borrowed(&[]);
        }
        if let Some(signal) = self.deferred.pending() {
            *self.failed.borrow_mut() = Some(GgufError::Interrupted {
                path: self.src.path.clone(),
                signal,
            });
            return Cow::Borrowed(&[]);
        }
        fault_pause();
        match self.load() {
            Ok(t) => Cow::Owned(View::data(&t).into_owned()),
            Err(e) => {
                *self.failed.borrow_mut() = Some(e);
                Cow::Borrowed(&[])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.p.shape.iter().product::<usize>() * self.p.dtype.size_in_bytes()
    }
}

/// Tests interrupt a conversion mid-way: `RTUNE_FAULT_CONVERT_PAUSE_MS=<ms>` sleeps that long
/// before each tensor is read.
fn fault_pause() {
    if let Some(ms) = std::env::var("RTUNE_FAULT_CONVERT_PAUSE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// Bytes the converted directory takes (safetensors data plus room for the JSON files).
pub fn planned_bytes(gguf: &Path) -> Result<u64> {
    let src = Source::open(gguf)?;
    let cfg = hf_config(&src.meta(), &src.facts())?;
    Ok(plan(&src, family(&src.meta())?, &cfg)?
        .iter()
        .map(|p| (p.shape.iter().product::<usize>() * p.dtype.size_in_bytes()) as u64)
        .sum::<u64>()
        + (16 << 20))
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_vec_pretty(v).expect("JSON serialises");
    write_atomic(path, &text, Privacy::SHARED)?;
    Ok(())
}

/// Removes `dir`'s temporaries `.<stem>.tmp-<pid>` (with `ours(stem)`) that a conversion killed
/// before it could clean up left behind (SIGKILL, a second SIGINT): those of a process that is
/// gone and that no live conversion holds locked (a cache shared between machines: a pid of
/// another host). Best effort: what cannot be removed stays.
pub fn sweep_stale(dir: &Path, ours: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some((stem, pid)) = name
            .to_str()
            .and_then(|n| n.strip_prefix('.'))
            .and_then(|n| n.rsplit_once(".tmp-"))
        else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        // A directory, not a link to one; its process gone; nobody holding it.
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if !ours(stem) || !is_dir || pid == std::process::id() || rtune_fsio::process_alive(pid) {
            continue;
        }
        let path = e.path();
        let free = File::open(&path).is_ok_and(|d| d.try_lock().is_ok());
        if free {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// The nearest existing directory at or above `p` (where free space is measured).
fn existing_ancestor(p: &Path) -> PathBuf {
    let mut p = p.to_path_buf();
    while !p.exists() {
        if !p.pop() {
            return PathBuf::from(".");
        }
    }
    if p.as_os_str().is_empty() {
        PathBuf::from(".")
    } else {
        p
    }
}

/// Refuses `out` before anything is read: it must not exist or be an empty directory of its own —
/// not `/`, not the home directory (issue 46: an empty `$HOME` was replaced), not a symlink (one to
/// an empty directory was converted into, then failed at the rename).
fn check_output(out: &Path) -> Result<()> {
    let refuse = |message: String| GgufError::File {
        path: out.to_path_buf(),
        message,
    };
    if let Some(why) = rtune_fsio::refuse_output(out) {
        return Err(refuse(format!("{why} (the output directory)")));
    }
    if std::fs::symlink_metadata(out).is_ok() {
        let empty = out.is_dir()
            && std::fs::read_dir(out)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
        if !empty {
            return Err(refuse(
                "already exists; remove it or choose another output directory".into(),
            ));
        }
    }
    Ok(())
}

/// Converts the llama or Gemma 3 GGUF at `gguf` into a Hugging Face directory `out`, which must not exist
/// (or be empty). Everything is written into `out`'s sibling `.<name>.tmp-<pid>` first and renamed
/// into place at the end; a failure removes it. Refuses before writing when the disk cannot hold
/// the result.
pub fn convert(gguf: &Path, out: &Path) -> Result<Converted> {
    check_output(out)?;
    let src = Source::open(gguf)?;
    let meta = src.meta();
    let cfg = hf_config(&meta, &src.facts())?;
    let ctx = cfg.get("max_position_embeddings").and_then(|v| v.as_u64());
    let fam = family(&meta)?;
    // The tensors against the metadata before the (larger) vocabulary is built.
    let planned = plan(&src, fam, &cfg)?;
    let tok = tokenizer_files(&meta, fam, ctx)?;
    let gen = generation_config(&meta, fam)?;
    let tok_bytes = serde_json::to_vec(&tok.tokenizer).expect("JSON serialises");
    tokenizers::Tokenizer::from_bytes(&tok_bytes).map_err(|e| GgufError::File {
        path: gguf.to_path_buf(),
        message: format!("the tokenizer built from its metadata does not load: {e}"),
    })?;

    let needed: u64 = planned
        .iter()
        .map(|p| (p.shape.iter().product::<usize>() * p.dtype.size_in_bytes()) as u64)
        .sum::<u64>()
        + (16 << 20);
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let free = rtune_fsio::free_bytes(&existing_ancestor(parent))?;
    if needed > free {
        return Err(GgufError::DiskFull {
            path: out.to_path_buf(),
            needed,
            free,
        });
    }
    std::fs::create_dir_all(parent).map_err(|source| GgufError::Io {
        path: parent.to_path_buf(),
        op: "create directory",
        source,
    })?;
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into());
    sweep_stale(parent, |stem| stem == name);
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    // From here a SIGINT/SIGTERM is held back until the temporary is gone (then raised again).
    let deferred = rtune_fsio::Deferred::new();
    let interrupted = |signal| GgufError::Interrupted {
        path: gguf.to_path_buf(),
        signal,
    };
    let res = (|| -> Result<u64> {
        std::fs::create_dir_all(&tmp).map_err(|source| GgufError::Io {
            path: tmp.clone(),
            op: "create directory",
            source,
        })?;
        // Held while we write: another run's sweep leaves a locked temporary alone.
        let _held = File::open(&tmp).inspect(|d| {
            let _ = d.try_lock();
        });
        write_json(&tmp.join("config.json"), &cfg)?;
        write_json(&tmp.join("generation_config.json"), &gen)?;
        write_json(&tmp.join("tokenizer.json"), &tok.tokenizer)?;
        write_json(&tmp.join("tokenizer_config.json"), &tok.config)?;
        if let Some(signal) = deferred.pending() {
            return Err(interrupted(signal));
        }
        let failed = RefCell::new(None);
        let heads = |k: &str| cfg[k].as_u64().unwrap_or(0) as usize;
        let views: Vec<(String, Lazy)> = planned
            .iter()
            .map(|p| {
                let h = match p.rope {
                    Rope::Q => heads("num_attention_heads"),
                    _ => heads("num_key_value_heads"),
                };
                (
                    p.hf.clone(),
                    Lazy {
                        src: &src,
                        p,
                        heads: h,
                        failed: &failed,
                        deferred: &deferred,
                    },
                )
            })
            .collect();
        let st = tmp.join("model.safetensors");
        let info = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(info), &st).map_err(|e| GgufError::File {
            path: st.clone(),
            message: format!("cannot write: {e}"),
        })?;
        if let Some(e) = failed.into_inner() {
            return Err(e);
        }
        let f = File::open(&st).map_err(|source| GgufError::Io {
            path: st.clone(),
            op: "open",
            source,
        })?;
        f.sync_all().map_err(|source| GgufError::Io {
            path: st.clone(),
            op: "fsync",
            source,
        })?;
        // The safetensors writer's temporary file is 0600; a model is as readable as its JSON files.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&st, std::fs::Permissions::from_mode(0o644)).map_err(
            |source| GgufError::Io {
                path: st.clone(),
                op: "chmod",
                source,
            },
        )?;
        rtune_fsio::fsync_dir(&tmp)?;
        if let Some(signal) = deferred.pending() {
            return Err(interrupted(signal));
        }
        if std::fs::symlink_metadata(out).is_ok() {
            std::fs::remove_dir(out).map_err(|source| GgufError::Io {
                path: out.to_path_buf(),
                op: "remove empty directory",
                source,
            })?;
        }
        std::fs::rename(&tmp, out).map_err(|source| GgufError::Io {
            path: out.to_path_buf(),
            op: "rename into place",
            source,
        })?;
        rtune_fsio::fsync_dir(parent)?;
        Ok(f.metadata().map(|m| m.len()).unwrap_or(0))
    })();
    let bytes = match res {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            // A signal held back is raised again here, the temporary gone.
            drop(deferred);
            return Err(e);
        }
    };
    drop(deferred);
    let mut ggml_types = BTreeMap::new();
    for t in src.content.tensor_infos.values() {
        *ggml_types.entry(format!("{:?}", t.ggml_dtype)).or_insert(0) += 1;
    }
    Ok(Converted {
        dir: out.to_path_buf(),
        tensors: planned.len(),
        bytes,
        ggml_types,
        tokenizer_pre: tok.pre,
        tokenizer: tok.kind,
        chat_template: tok.config.get("chat_template").is_some(),
        tied_embeddings: cfg["tie_word_embeddings"].as_bool() == Some(true),
    })
}
