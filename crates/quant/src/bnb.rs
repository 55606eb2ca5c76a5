//! Reading (and writing) the tensors bitsandbytes stores for a 4-bit linear layer: what a bnb-4bit
//! checkpoint (`quantization_config.load_in_4bit`) holds next to `<layer>.weight`.
//!
//! | tensor | dtype, shape | |
//! |---|---|---|
//! | `<w>` | u8 (or any `quant_storage` dtype), `[ceil(n/2), 1]` or flat | packed codes, used as raw bytes |
//! | `<w>.absmax` | f32 `[n_blocks]`, or u8 `[n_blocks]` with double quant | |
//! | `<w>.quant_map` | f32 `[16]` | must be bitsandbytes' table for the quant type |
//! | `<w>.nested_absmax` | f32 `[ceil(n_blocks/256)]` | double quant only |
//! | `<w>.nested_quant_map` | f32 `[256]` | double quant only |
//! | `<w>.quant_state.bitsandbytes__nf4` (or `__fp4`) | u8 `[len]` | JSON: `quant_type`, `blocksize`, `dtype`, `shape`, and with double quant `nested_blocksize`, `nested_dtype`, `nested_offset` |
//!
//! bitsandbytes dequantizes with its built-in table and ignores the stored `quant_map`; rtune does the
//! same and refuses a file whose `quant_map` differs (it would mean a format this code does not know).

use candle_core::DType;
use safetensors::Dtype;
use serde_json::Value;
use std::borrow::Cow;

use crate::{Absmax, Nf4Weight, QuantError, QuantType, Result, BLOCKSIZE};

pub const QUANT_STATE_NF4: &str = "quant_state.bitsandbytes__nf4";
pub const QUANT_STATE_FP4: &str = "quant_state.bitsandbytes__fp4";
/// Suffixes (after `<weight>.`) of the tensors stored next to a bnb-4bit weight.
pub const BNB_SUFFIXES: [&str; 6] = [
    "absmax",
    "quant_map",
    "nested_absmax",
    "nested_quant_map",
    QUANT_STATE_NF4,
    QUANT_STATE_FP4,
];

/// One stored tensor: dtype, shape and little-endian bytes (borrowed from an mmap, or owned).
#[derive(Debug, Clone)]
pub struct RawTensor<'a> {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

impl<'a> RawTensor<'a> {
    pub fn new(dtype: Dtype, shape: Vec<usize>, data: impl Into<Cow<'a, [u8]>>) -> Self {
        RawTensor {
            dtype,
            shape,
            data: data.into(),
        }
    }

    pub fn from_view(v: &safetensors::tensor::TensorView<'a>) -> Self {
        RawTensor::new(v.dtype(), v.shape().to_vec(), v.data())
    }

    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values of an f32 tensor with `want` elements.
    fn f32s(&self, name: &str, want: usize) -> Result<Vec<f32>> {
        self.expect(name, Dtype::F32, want)?;
        Ok(self
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    fn expect(&self, name: &str, dtype: Dtype, want: usize) -> Result<()> {
        let size = self.dtype.bitsize() / 8;
        if self.dtype != dtype || self.numel() != want || self.data.len() != want * size {
            return Err(QuantError::BadTensor {
                tensor: name.into(),
                message: format!(
                    "is {:?} {:?} ({} bytes); expected {dtype:?} with {want} elements",
                    self.dtype,
                    self.shape,
                    self.data.len()
                ),
            });
        }
        Ok(())
    }
}

/// The stored tensors of one bnb-4bit weight, each `None` when absent.
#[derive(Debug, Clone, Default)]
pub struct BnbParts<'a> {
    pub weight: Option<RawTensor<'a>>,
    pub absmax: Option<RawTensor<'a>>,
    pub quant_map: Option<RawTensor<'a>>,
    pub nested_absmax: Option<RawTensor<'a>>,
    pub nested_quant_map: Option<RawTensor<'a>>,
    /// The JSON tensor and the suffix it was found under (`QUANT_STATE_NF4` or `QUANT_STATE_FP4`).
    pub quant_state: Option<(&'static str, RawTensor<'a>)>,
}

impl<'a> BnbParts<'a> {
    /// Collects the parts of `weight` (e.g. `model.layers.0.mlp.up_proj.weight`) through `fetch`,
    /// which returns a checkpoint tensor by full name.
    pub fn fetch(weight: &str, fetch: impl Fn(&str) -> Option<RawTensor<'a>>) -> Self {
        let get = |s: &str| fetch(&format!("{weight}.{s}"));
        let quant_state = [QUANT_STATE_NF4, QUANT_STATE_FP4]
            .into_iter()
            .find_map(|s| get(s).map(|t| (s, t)));
        BnbParts {
            weight: fetch(weight),
            absmax: get("absmax"),
            quant_map: get("quant_map"),
            nested_absmax: get("nested_absmax"),
            nested_quant_map: get("nested_quant_map"),
            quant_state,
        }
    }
}

/// Whether `weight` is stored bnb-4bit, i.e. `has` reports one of its quant-state tensors.
pub fn is_bnb_4bit(weight: &str, has: impl Fn(&str) -> bool) -> bool {
    [QUANT_STATE_NF4, QUANT_STATE_FP4]
        .iter()
        .any(|s| has(&format!("{weight}.{s}")))
}

/// Whether a checkpoint tensor name is one of the companions of a bnb-4bit weight (not a weight
/// itself), e.g. `...q_proj.weight.absmax`.
pub fn is_bnb_companion(name: &str) -> bool {
    BNB_SUFFIXES.iter().any(|s| {
        name.strip_suffix(s)
            .is_some_and(|p| p.ends_with(".weight."))
    })
}

/// Reads the bnb-4bit weight `weight` through `fetch` (see [`BnbParts::fetch`]) and checks it.
pub fn load_bnb_4bit<'a>(
    weight: &str,
    fetch: impl Fn(&str) -> Option<RawTensor<'a>>,
) -> Result<Nf4Weight> {
    Nf4Weight::from_bnb(weight, BnbParts::fetch(weight, fetch))
}

/// An [`Nf4Weight`] to and from the tensors of a bnb-4bit checkpoint (a trait because the weight
/// is the NF4 op's, `rtune_ops::nf4`; the format is this crate's).
pub trait Bnb: Sized {
    /// Builds the weight named `weight` from its stored parts, checking every size and field.
    fn from_bnb(weight: &str, parts: BnbParts<'_>) -> Result<Self>;
    /// The tensors bitsandbytes would store for this weight under `weight`
    /// (`QuantState.as_dict(packed=True)` plus the packed codes, flat `[ceil(n/2)]`).
    fn to_bnb(&self, weight: &str) -> Vec<(String, RawTensor<'static>)>;
}

impl Bnb for Nf4Weight {
    fn from_bnb(weight: &str, parts: BnbParts<'_>) -> Result<Self> {
        let name = |s: &str| format!("{weight}.{s}");
        let missing = |s: &str, hint: &str| QuantError::MissingTensor {
            layer: weight.into(),
            tensor: if s.is_empty() { weight.into() } else { name(s) },
            hint: hint.into(),
        };
        let (qs_suffix, qs) = parts.quant_state.ok_or_else(|| {
            missing(
                QUANT_STATE_NF4,
                "every bnb-4bit weight stores its quant state as JSON bytes; the checkpoint is \
                 incomplete or was not saved by bitsandbytes",
            )
        })?;
        let qs_name = name(qs_suffix);
        let state = QuantState::parse(&qs_name, &qs)?;
        if !qs_suffix.ends_with(state.quant_type.name()) {
            return Err(state_err(
                &qs_name,
                format!("says quant_type `{}`", state.quant_type.name()),
            ));
        }
        let n: usize = state.shape.iter().product();
        let n_blocks = n.div_ceil(BLOCKSIZE);

        let w = parts
            .weight
            .ok_or_else(|| missing("", "the packed 4-bit codes"))?;
        if w.data.len() != n.div_ceil(2) {
            return Err(QuantError::BadTensor {
                tensor: weight.into(),
                message: format!(
                    "holds {} bytes ({:?} {:?}); the quant state's shape {:?} needs {} (two codes per byte)",
                    w.data.len(),
                    w.dtype,
                    w.shape,
                    state.shape,
                    n.div_ceil(2)
                ),
            });
        }

        let qm = parts
            .quant_map
            .ok_or_else(|| missing("quant_map", "the 16-entry code table"))?;
        let quant_map = qm.f32s(&name("quant_map"), 16)?;
        let table = state.quant_type.table();
        if let Some(i) = (0..16).find(|&i| quant_map[i].to_bits() != table[i].to_bits()) {
            return Err(QuantError::BadTensor {
                tensor: name("quant_map"),
                message: format!(
                    "entry {i} is {}, bitsandbytes' {} table has {}; this is not a file bitsandbytes wrote",
                    quant_map[i],
                    state.quant_type.name(),
                    table[i]
                ),
            });
        }

        let am = parts
            .absmax
            .ok_or_else(|| missing("absmax", "one scale per 64 elements"))?;
        let absmax = match &state.nested {
            None => {
                if am.dtype == Dtype::U8 {
                    return Err(state_err(
                        &qs_name,
                        "has no nested_offset/nested_blocksize, but `absmax` is uint8 (double \
                         quantized)"
                            .into(),
                    ));
                }
                Absmax::Plain(am.f32s(&name("absmax"), n_blocks)?)
            }
            Some((nested_blocksize, offset)) => {
                am.expect(&name("absmax"), Dtype::U8, n_blocks)?;
                let hint = "double-quant checkpoints store the second-level scales";
                let na = parts
                    .nested_absmax
                    .ok_or_else(|| missing("nested_absmax", hint))?;
                let nq = parts
                    .nested_quant_map
                    .ok_or_else(|| missing("nested_quant_map", hint))?;
                Absmax::Double {
                    codes: am.data.to_vec(),
                    nested_absmax: na
                        .f32s(&name("nested_absmax"), n_blocks.div_ceil(*nested_blocksize))?,
                    nested_quant_map: nq.f32s(&name("nested_quant_map"), 256)?,
                    offset: *offset,
                    nested_blocksize: *nested_blocksize,
                }
            }
        };
        let w = Nf4Weight {
            shape: state.shape,
            packed: w.data.into_owned(),
            absmax,
            quant_map: table,
            quant_type: state.quant_type,
            blocksize: state.blocksize,
            dtype: state.dtype,
        };
        w.check()?;
        Ok(w)
    }

    fn to_bnb(&self, weight: &str) -> Vec<(String, RawTensor<'static>)> {
        let f32s = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let t = |dtype, shape: Vec<usize>, data: Vec<u8>| RawTensor::new(dtype, shape, data);
        let mut json = serde_json::json!({
            "quant_type": self.quant_type.name(),
            "blocksize": self.blocksize,
            "dtype": dtype_name(self.dtype),
            "shape": self.shape,
        });
        let name = |s: &str| format!("{weight}.{s}");
        let mut out = vec![(
            weight.to_string(),
            t(Dtype::U8, vec![self.packed.len()], self.packed.clone()),
        )];
        match &self.absmax {
            Absmax::Plain(a) => out.push((name("absmax"), t(Dtype::F32, vec![a.len()], f32s(a)))),
            Absmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                offset,
                nested_blocksize,
            } => {
                json["nested_blocksize"] = (*nested_blocksize).into();
                json["nested_dtype"] = "float32".into();
                json["nested_offset"] = (*offset as f64).into();
                out.push((
                    name("absmax"),
                    t(Dtype::U8, vec![codes.len()], codes.clone()),
                ));
                out.push((
                    name("nested_absmax"),
                    t(Dtype::F32, vec![nested_absmax.len()], f32s(nested_absmax)),
                ));
                out.push((
                    name("nested_quant_map"),
                    t(Dtype::F32, vec![256], f32s(nested_quant_map)),
                ));
            }
        }
        out.push((
            name("quant_map"),
            t(Dtype::F32, vec![16], f32s(&self.quant_map)),
        ));
        let qs = match self.quant_type {
            QuantType::Nf4 => QUANT_STATE_NF4,
            QuantType::Fp4 => QUANT_STATE_FP4,
        };
        let bytes = json.to_string().into_bytes();
        out.push((name(qs), t(Dtype::U8, vec![bytes.len()], bytes)));
        out
    }
}

fn state_err(tensor: &str, message: String) -> QuantError {
    QuantError::QuantState {
        tensor: tensor.into(),
        message,
    }
}

/// The fields of the quant-state JSON rtune uses.
struct QuantState {
    quant_type: QuantType,
    blocksize: usize,
    shape: Vec<usize>,
    dtype: DType,
    /// `(nested_blocksize, nested_offset)` with double quantization.
    nested: Option<(usize, f32)>,
}

impl QuantState {
    fn parse(tensor: &str, raw: &RawTensor) -> Result<Self> {
        let err = |m: String| state_err(tensor, m);
        if raw.dtype != Dtype::U8 {
            return Err(err(format!(
                "is {:?}; expected uint8 bytes of JSON",
                raw.dtype
            )));
        }
        let text = std::str::from_utf8(&raw.data).map_err(|e| err(format!("not UTF-8: {e}")))?;
        let v: Value =
            serde_json::from_str(text).map_err(|e| err(format!("not JSON ({e}): {text:?}")))?;
        let field = |k: &str| {
            v.get(k)
                .ok_or_else(|| err(format!("has no `{k}` field: {text}")))
        };
        let usize_of = |k: &str, x: &Value| {
            x.as_u64()
                .map(|u| u as usize)
                .ok_or_else(|| err(format!("`{k}` is {x}, expected a non-negative integer")))
        };
        let quant_type = match field("quant_type")?.as_str() {
            Some("nf4") => QuantType::Nf4,
            Some("fp4") => QuantType::Fp4,
            other => {
                return Err(QuantError::QuantType {
                    tensor: tensor.into(),
                    quant_type: other.map_or_else(|| v["quant_type"].to_string(), str::to_string),
                })
            }
        };
        let blocksize = usize_of("blocksize", field("blocksize")?)?;
        if blocksize != BLOCKSIZE {
            return Err(QuantError::Blocksize {
                tensor: tensor.into(),
                blocksize,
            });
        }
        let shape = field("shape")?
            .as_array()
            .ok_or_else(|| err(format!("`shape` is not a list: {text}")))?
            .iter()
            .map(|d| usize_of("shape", d))
            .collect::<Result<Vec<_>>>()?;
        let dtype = match field("dtype")?.as_str() {
            Some("float32") => DType::F32,
            Some("bfloat16") => DType::BF16,
            Some("float16") => DType::F16,
            _ => {
                return Err(err(format!(
                    "`dtype` is {}, expected \"float32\", \"bfloat16\" or \"float16\"",
                    v["dtype"]
                )))
            }
        };
        let nested = match (v.get("nested_blocksize"), v.get("nested_offset")) {
            (None, None) => None,
            (Some(bs), Some(off)) => {
                let bs = usize_of("nested_blocksize", bs)?;
                if bs == 0 {
                    return Err(err("`nested_blocksize` is 0".into()));
                }
                let off = off
                    .as_f64()
                    .ok_or_else(|| err(format!("`nested_offset` is {off}, expected a number")))?;
                Some((bs, off as f32))
            }
            _ => {
                return Err(err(format!(
                    "has only one of `nested_blocksize` and `nested_offset`: {text}"
                )))
            }
        };
        Ok(QuantState {
            quant_type,
            blocksize,
            shape,
            dtype,
            nested,
        })
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}
