//! Reading a checkpoint's safetensors: one file or shards listed in `model.safetensors.index.json`,
//! memory-mapped, each tensor converted to the compute dtype once as it is taken.

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use rtune_quant::{Nf4Weight, RawTensor};

use crate::{ModelError, Result};

/// Where a model's tensors come from: a checkpoint, or (for benches) a generator.
pub trait TensorSource {
    /// The tensor `name`, checked to have `shape`, in the compute dtype.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor>;

    /// The tensor in the dtype it is stored in: quantizing from it (not from a bf16 rounding of
    /// it) gives bitsandbytes' codes.
    fn stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.tensor(name, shape)
    }

    /// Whether the source holds tensor `name` (a generator: every name it is asked for).
    fn has(&self, _name: &str) -> bool {
        true
    }
    /// `name` (a `*.weight`) when the source holds it pre-quantized (a bnb-4bit checkpoint).
    fn quantized(&self, _name: &str, _shape: &[usize]) -> Result<Option<Nf4Weight>> {
        Ok(None)
    }

    /// Elements `span` of the row-major flattening of tensor `name` (checked to have `shape`),
    /// 1-D in the compute dtype: a sharded base's piece (`crate::shard`). This default reads the
    /// whole tensor; a checkpoint reads only the piece's bytes.
    fn piece(&self, name: &str, shape: &[usize], span: Range<usize>) -> Result<Tensor> {
        narrow_flat(name, &self.tensor(name, shape)?, span)
    }

    /// [`piece`](Self::piece) in the dtype the tensor is stored in (quantizing from it).
    fn stored_piece(&self, name: &str, shape: &[usize], span: Range<usize>) -> Result<Tensor> {
        narrow_flat(name, &self.stored(name, shape)?, span)
    }
}

fn narrow_flat(name: &str, t: &Tensor, span: Range<usize>) -> Result<Tensor> {
    t.flatten_all()
        .and_then(|t| t.narrow(0, span.start, span.len()))
        .map_err(|e| ModelError::candle(format!("piece {span:?} of {name}"), e))
}

impl TensorSource for Weights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get(name, shape)?
            .to_dtype(self.dtype)
            .map_err(|e| ModelError::candle(format!("convert {name}"), e))
    }

    fn stored(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get(name, shape)
    }

    fn piece(&self, name: &str, shape: &[usize], span: Range<usize>) -> Result<Tensor> {
        self.get_piece(name, shape, span)?
            .to_dtype(self.dtype)
            .map_err(|e| ModelError::candle(format!("convert a piece of {name}"), e))
    }

    fn stored_piece(&self, name: &str, shape: &[usize], span: Range<usize>) -> Result<Tensor> {
        self.get_piece(name, shape, span)
    }

    fn has(&self, name: &str) -> bool {
        self.contains(name)
    }

    fn quantized(&self, name: &str, shape: &[usize]) -> Result<Option<Nf4Weight>> {
        if !rtune_quant::bnb::is_bnb_4bit(name, |n| self.contains(n)) {
            return Ok(None);
        }
        let q = rtune_quant::load_bnb_4bit(name, |n| {
            self.st.get(n).ok().map(|v| RawTensor::from_view(&v))
        })
        .map_err(|source| ModelError::Quant {
            path: self.dir.clone(),
            source,
        })?;
        if q.shape != shape {
            return Err(ModelError::TensorShape {
                path: self.dir.clone(),
                name: name.to_string(),
                got: q.shape.clone(),
                want: shape.to_vec(),
            });
        }
        Ok(Some(q))
    }
}

/// The shard files a `model.safetensors.index.json` names in its `weight_map`, sorted, each once.
/// Every one must be a plain file name inside the model directory ([`rtune_fsio::plain_file_name`]):
/// an index is untrusted input, and `../outside.safetensors` or `/etc/x` would read (or, for a hub
/// download, write) outside it. The error names the entry.
pub fn index_shards(index: &serde_json::Value) -> std::result::Result<Vec<String>, String> {
    let map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or("has no `weight_map` object")?;
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| format!("weight_map entry `{tensor}`: the file is not a string"))?;
        rtune_fsio::plain_file_name(file)
            .map_err(|why| format!("weight_map entry `{tensor}`: `{file}` {why}"))?;
        shards.insert(file.to_string());
    }
    Ok(shards.into_iter().collect())
}

pub struct Weights {
    dir: PathBuf,
    st: MmapedSafetensors,
    dtype: DType,
    device: Device,
    /// The files, for [`Weights::get_piece`]'s byte-range reads.
    files: Vec<PathBuf>,
    /// Each tensor's file and the file offset of its data, read from the headers on the first
    /// piece asked for.
    offsets: std::sync::OnceLock<std::result::Result<DataOffsets, String>>,
}

/// Tensor name → (index of its file, file offset of its data).
type DataOffsets = HashMap<String, (usize, u64)>;

impl Weights {
    pub fn open(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = rtune_fsio::read_string_bounded(&index, rtune_fsio::FileKind::ShardIndex)
                .map_err(|e| ModelError::File {
                    path: index.clone(),
                    message: format!("cannot read: {e}"),
                })?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::File {
                    path: index.clone(),
                    message: format!("not JSON: {e}"),
                })?;
            let shards = index_shards(&v).map_err(|message| ModelError::File {
                path: index.clone(),
                message,
            })?;
            shards.into_iter().map(|f| dir.join(f)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            let pickle = ["pytorch_model.bin", "model.pt", "model.bin"]
                .iter()
                .find(|f| dir.join(f).exists());
            let message = match pickle {
                Some(f) => format!(
                    "only `{f}` (a pickle checkpoint) is here; rtune reads safetensors only. Convert it \
                     with transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
                ),
                None => "no model.safetensors or model.safetensors.index.json".into(),
            };
            return Err(ModelError::File {
                path: dir.to_path_buf(),
                message,
            });
        };
        for f in &files {
            if !f.exists() {
                return Err(ModelError::File {
                    path: f.clone(),
                    message: "shard listed in the index is missing".into(),
                });
            }
            // A device or FIFO behind the name is refused before it is mapped (issue 35).
            let shard = rtune_fsio::FileKind::Sized {
                cap: u64::MAX,
                name: "safetensors shard",
            };
            rtune_fsio::open_regular(f, shard).map_err(|e| ModelError::File {
                path: f.clone(),
                message: format!("cannot read: {e}"),
            })?;
        }
        // SAFETY: the files are mapped read-only; rtune never writes to a checkpoint it is reading.
        let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| ModelError::File {
            path: dir.to_path_buf(),
            message: format!("bad safetensors: {e}"),
        })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            st,
            dtype,
            device: device.clone(),
            files,
            offsets: Default::default(),
        })
    }

    /// The compute dtype [`TensorSource::tensor`] converts to.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Where tensors are loaded.
    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn contains(&self, name: &str) -> bool {
        self.st.get(name).is_ok()
    }

    /// Elements `span` of tensor `name`'s flattening (checked to have `shape`), as stored:
    /// only those bytes of the mapped file are read (a sharded base's piece).
    pub fn get_piece(&self, name: &str, shape: &[usize], span: Range<usize>) -> Result<Tensor> {
        let view = self.st.get(name).map_err(|_| ModelError::MissingTensor {
            path: self.dir.clone(),
            name: name.to_string(),
        })?;
        if view.shape() != shape {
            return Err(ModelError::TensorShape {
                path: self.dir.clone(),
                name: name.to_string(),
                got: view.shape().to_vec(),
                want: shape.to_vec(),
            });
        }
        use safetensors::Dtype as S;
        // MXFP4 experts' codes and exponents are u8 (as in `Weights::get`).
        let mxfp4 = name.ends_with("_blocks") || name.ends_with("_scales");
        let dtype = match view.dtype() {
            S::F32 => DType::F32,
            S::BF16 => DType::BF16,
            S::F16 => DType::F16,
            S::U8 if mxfp4 => DType::U8,
            other => {
                return Err(ModelError::File {
                    path: self.dir.clone(),
                    message: format!("tensor `{name}` is {other:?}; expected f32, bf16 or f16"),
                })
            }
        };
        let n: usize = shape.iter().product();
        if span.start > span.end || span.end > n {
            return Err(ModelError::File {
                path: self.dir.clone(),
                message: format!("tensor `{name}` has {n} elements; no piece {span:?}"),
            });
        }
        // Read with pread, not through the mapping: faulting the mapped pages would map whole
        // page-cache folios (the kernel maps a large folio at once), most of the file in the end.
        let offsets = self
            .offsets
            .get_or_init(|| data_offsets(&self.files))
            .as_ref()
            .map_err(|message| ModelError::File {
                path: self.dir.clone(),
                message: message.clone(),
            })?;
        let &(file, start) = offsets.get(name).ok_or_else(|| ModelError::MissingTensor {
            path: self.dir.clone(),
            name: name.to_string(),
        })?;
        let s = dtype.size_in_bytes();
        let mut bytes = vec![0u8; span.len() * s];
        let path = &self.files[file];
        std::fs::File::open(path)
            .and_then(|f| {
                use std::os::unix::fs::FileExt;
                f.read_exact_at(&mut bytes, start + (span.start * s) as u64)
            })
            .map_err(|e| ModelError::File {
                path: path.clone(),
                message: format!("cannot read a piece of `{name}`: {e}"),
            })?;
        Tensor::from_raw_buffer(&bytes, dtype, &[span.len()], &self.device)
            .map_err(|e| ModelError::candle(format!("load a piece of {name}"), e))
    }

    /// The tensor `name`, checked to have `shape`, as stored (f32, bf16 or f16; u8 for MXFP4's
    /// `*_blocks` and `*_scales`).
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if !self.contains(name) {
            return Err(ModelError::MissingTensor {
                path: self.dir.clone(),
                name: name.to_string(),
            });
        }
        let t = self
            .st
            .load(name, &self.device)
            .map_err(|e| ModelError::candle(format!("load {name}"), e))?;
        if t.dims() != shape {
            return Err(ModelError::TensorShape {
                path: self.dir.clone(),
                name: name.to_string(),
                got: t.dims().to_vec(),
                want: shape.to_vec(),
            });
        }
        // MXFP4 experts' codes and exponents (`*_blocks`, `*_scales`: gpt-oss's release) are u8.
        let mxfp4 = name.ends_with("_blocks") || name.ends_with("_scales");
        match t.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => {}
            DType::U8 if mxfp4 => {}
            other => {
                return Err(ModelError::File {
                    path: self.dir.clone(),
                    message: format!("tensor `{name}` is {other:?}; expected f32, bf16 or f16"),
                })
            }
        }
        Ok(t)
    }
}

/// Every tensor's file (index into `files`) and the absolute offset of its data: a safetensors
/// file is an 8-byte little-endian header length, the JSON header (each tensor's `data_offsets`
/// relative to the data that follows it), then the data. (The mapping already validated the files.)
fn data_offsets(files: &[PathBuf]) -> std::result::Result<DataOffsets, String> {
    use std::io::Read;
    let mut out = HashMap::new();
    for (i, path) in files.iter().enumerate() {
        let err = |e: &dyn std::fmt::Display| format!("{}: header: {e}", path.display());
        let mut f = std::fs::File::open(path).map_err(|e| err(&e))?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(|e| err(&e))?;
        let len = u64::from_le_bytes(len);
        if len > 100 << 20 {
            return Err(err(&format!("{len} bytes")));
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header).map_err(|e| err(&e))?;
        let v: serde_json::Value = serde_json::from_slice(&header).map_err(|e| err(&e))?;
        let tensors = v.as_object().ok_or_else(|| err(&"not a JSON object"))?;
        for (name, t) in tensors {
            if name == "__metadata__" {
                continue;
            }
            let begin = t
                .get("data_offsets")
                .and_then(|o| o.get(0))
                .and_then(|b| b.as_u64())
                .ok_or_else(|| err(&format!("`{name}` has no data_offsets")))?;
            out.insert(name.clone(), (i, 8 + len + begin));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model index is untrusted: a shard name that leaves the model directory is refused, with
    /// the entry named, before any file is opened.
    #[test]
    fn index_shards_stay_inside_the_model_directory() {
        let index = |file: &str| serde_json::json!({"weight_map": {"a.weight": "ok.safetensors", "b.weight": file}});
        assert_eq!(
            index_shards(&index("ok2.safetensors")).unwrap(),
            ["ok.safetensors", "ok2.safetensors"]
        );
        for bad in [
            "../outside.safetensors",
            "/tmp/abs.safetensors",
            "sub/x.safetensors",
            "..",
        ] {
            let e = index_shards(&index(bad)).unwrap_err();
            assert!(e.contains("`b.weight`") && e.contains(bad), "{bad}: {e}");
        }
        assert!(index_shards(&serde_json::json!({"weight_map": {"a": 3}})).is_err());
        assert!(index_shards(&serde_json::json!({})).is_err());

        // Through the loader: the outside file exists and is valid, and is still not read.
        let root = std::env::temp_dir().join(format!("rtune-index-{}", std::process::id()));
        let dir = root.join("model");
        std::fs::create_dir_all(&dir).unwrap();
        let t = Tensor::zeros((2, 2), DType::F32, &Device::Cpu).unwrap();
        candle_core::safetensors::save(
            &std::collections::HashMap::from([("w".to_string(), t)]),
            root.join("outside.safetensors"),
        )
        .unwrap();
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map": {"w": "../outside.safetensors"}}"#,
        )
        .unwrap();
        let e = Weights::open(&dir, DType::F32, &Device::Cpu)
            .err()
            .expect("traversal refused")
            .to_string();
        assert!(
            e.contains("../outside.safetensors") && e.contains("path separator"),
            "{e}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
