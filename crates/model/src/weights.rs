//! Reading a checkpoint's safetensors: one file or shards listed in `model.safetensors.index.json`,
//! memory-mapped, each tensor converted to the compute dtype once as it is taken.

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeSet;
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

    /// `name` (a `*.weight`) when the source holds it pre-quantized (a bnb-4bit checkpoint).
    fn quantized(&self, _name: &str, _shape: &[usize]) -> Result<Option<Nf4Weight>> {
        Ok(None)
    }
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

pub struct Weights {
    dir: PathBuf,
    st: MmapedSafetensors,
    dtype: DType,
    device: Device,
}

impl Weights {
    pub fn open(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::File {
                path: index.clone(),
                message: format!("cannot read: {e}"),
            })?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::File {
                    path: index.clone(),
                    message: format!("not JSON: {e}"),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::File {
                    path: index.clone(),
                    message: "has no `weight_map` object".into(),
                })?;
            let shards: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
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
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.st.get(name).is_ok()
    }

    /// The tensor `name`, checked to have `shape`, as stored (f32, bf16 or f16).
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
        match t.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => {}
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
