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
    reader: RefCell<BufReader<File>>,
    content: Content,
}

impl Source {
    fn open(path: &Path) -> Result<Self> {
        let gguf = rtune_fsio::FileKind::Sized {
            cap: u64::MAX,
            name: "GGUF model",
        };
        let f = rtune_fsio::open_regular(path, gguf).map_err(|e| GgufError::Io {
            path: path.to_path_buf(),
            op: "open",
            source: e.into_io(),
        })?;
        let mut reader = BufReader::new(f);
        let content = Content::read(&mut reader).map_err(|e| GgufError::File {
            path: path.to_path_buf(),
            message: format!("not a readable GGUF file: {e}"),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
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
    Ok(out)
}

/// A tensor read, dequantized and un-permuted only when the safetensors writer asks for its bytes,
/// so one tensor at a time is in memory. A failure is kept in `failed` (the writer's `data()`
/// cannot fail) and turns the whole conversion into an error.
struct Lazy<'a> {
    src: &'a Source,
    p: &'a Planned<'a>,
    heads: usize,
    failed: &'a RefCell<Option<GgufError>>,
}

impl Lazy<'_> {
    fn load(&self) -> Result<Tensor> {
        let err = |e: candle_core::Error| GgufError::Tensor {
            path: self.src.path.clone(),
            name: self.p.gguf.to_string(),
            message: e.to_string(),
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
        match self.load() {
            Ok(t) => Cow::Owned(View::data(&t).into_owned()),
            Err(e) => {
                self.failed.borrow_mut().get_or_insert(e);
                Cow::Owned(vec![0; self.data_len()])
            }
        }
    }
    fn data_len(&self) -> usize {
        self.p.shape.iter().product::<usize>() * self.p.dtype.size_in_bytes()
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
    let tok = tokenizer_files(&meta, fam, ctx)?;
    let gen = generation_config(&meta, fam)?;
    let planned = plan(&src, fam, &cfg)?;
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
    // Removed by the binary's signal thread if SIGINT or SIGTERM stops the conversion.
    let staging =
        rtune_fsio::Staging::register(parent.join(format!(".{name}.tmp-{}", std::process::id())));
    let tmp = staging.path().to_path_buf();
    let _ = std::fs::remove_dir_all(&tmp);
    let res = (|| -> Result<u64> {
        std::fs::create_dir_all(&tmp).map_err(|source| GgufError::Io {
            path: tmp.clone(),
            op: "create directory",
            source,
        })?;
        write_json(&tmp.join("config.json"), &cfg)?;
        write_json(&tmp.join("generation_config.json"), &gen)?;
        write_json(&tmp.join("tokenizer.json"), &tok.tokenizer)?;
        write_json(&tmp.join("tokenizer_config.json"), &tok.config)?;
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
            return Err(e);
        }
    };
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
