//! GGUF metadata: typed access that names the key in every error, and the hyper-parameters as a
//! Hugging Face `config.json`: `llama.*` → `LlamaForCausalLM`, `gemma3.*` → `Gemma3ForCausalLM`.
//!
//! Gemma 3 follows what llama.cpp's converter writes (`Gemma3Model.set_gguf_parameters`) and what
//! its runtime assumes where the file is silent (`src/models/gemma3.cpp`): sliding layers by
//! `attention.sliding_window_pattern` (default 6: every sixth layer global, as transformers'
//! `sliding_window_pattern`), the local RoPE base `rope.freq_base_swa` (default 10000, transformers'
//! `rope_local_base_freq`), attention scaled by `1/√head_dim` (`query_pre_attn_scalar = head_dim`;
//! `hidden/heads` for the 62-layer 27B, as llama.cpp's `LLM_TYPE_27B`), linear RoPE scaling on the
//! global layers only.

use candle_core::quantized::gguf_file::Value;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::names::Family;
use crate::{GgufError, Result};

/// A GGUF file's metadata with its path, for errors.
pub struct Meta<'a> {
    pub path: &'a Path,
    pub md: &'a HashMap<String, Value>,
}

fn as_i128(v: &Value) -> Option<i128> {
    Some(match v {
        Value::U8(x) => *x as i128,
        Value::I8(x) => *x as i128,
        Value::U16(x) => *x as i128,
        Value::I16(x) => *x as i128,
        Value::U32(x) => *x as i128,
        Value::I32(x) => *x as i128,
        Value::U64(x) => *x as i128,
        Value::I64(x) => *x as i128,
        _ => return None,
    })
}

/// An f32 as the f64 with the same shortest decimal form (`1e-5f32` → `1e-5`, not
/// `9.99999974737875e-6`): GGUF stores hyper-parameters as f32, config.json as decimal.
pub fn f32_decimal(x: f32) -> f64 {
    format!("{x}").parse().unwrap_or(x as f64)
}

impl<'a> Meta<'a> {
    fn err(&self, key: &str, message: impl Into<String>) -> GgufError {
        GgufError::Metadata {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            message: message.into(),
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.md.get(key)
    }

    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => as_i128(v)
                .and_then(|x| u64::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.err(key, format!("expected a non-negative integer, got {v:?}"))
                }),
        }
    }

    pub fn u64(&self, key: &str) -> Result<u64> {
        self.opt_u64(key)?
            .ok_or_else(|| self.err(key, "missing (llama.cpp's converter writes it)"))
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.err(key, format!("expected a float, got {v:?}"))),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(key, format!("expected a bool, got {v:?}"))),
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.err(key, format!("expected a string, got {v:?}"))),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.err(key, format!("expected an array, got {:?}", v.value_type()))),
        }
    }

    pub fn opt_strings(&self, key: &str) -> Result<Option<Vec<&'a str>>> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(self.err(key, format!("element {i} is {other:?}, not a string"))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn opt_ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(a) = self.array(key)? else {
            return Ok(None);
        };
        a.iter()
            .enumerate()
            .map(|(i, v)| {
                as_i128(v)
                    .map(|x| x as i64)
                    .ok_or_else(|| self.err(key, format!("element {i} is {v:?}, not an integer")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

/// What config.json is built from besides the metadata: which tensors the file has.
pub struct TensorFacts {
    pub names: HashSet<String>,
    /// Rows of `token_embd.weight` (the vocabulary size when `llama.vocab_size` is absent).
    pub embed_rows: Option<usize>,
}

/// The file's `general.architecture` as a [`Family`], refused naming the ones read.
pub fn family(m: &Meta) -> Result<Family> {
    let arch = m.opt_str("general.architecture")?.unwrap_or("");
    Family::of(arch).ok_or_else(|| GgufError::Unsupported {
        path: m.path.to_path_buf(),
        what: format!("general.architecture `{arch}`"),
        hint: "`llama` (Llama, SmolLM, Mistral converted as llama) and `gemma3` (Gemma 3 text) \
               GGUFs are read"
            .into(),
    })
}

/// `config.json` for the file's architecture; `path` labels errors.
pub fn hf_config(m: &Meta, t: &TensorFacts) -> Result<serde_json::Value> {
    match family(m)? {
        Family::Llama => llama_config(m, t),
        Family::Gemma3 => gemma3_config(m, t),
    }
}

/// The most layers a GGUF may declare: far above any released model (Llama 3.1 405B has 126),
/// and what keeps a hostile `block_count` (2³¹ in a 3.6 KB file, the fuzz target's find) from
/// spelling out a `layer_types` entry per layer.
const MAX_LAYERS: u64 = 4096;

/// `<arch>.block_count`: 1 to [`MAX_LAYERS`].
fn block_count(m: &Meta, key: &str) -> Result<u64> {
    let layers = m.u64(key)?;
    if layers == 0 || layers > MAX_LAYERS {
        return Err(m.err(key, format!("{layers} layers (expected 1 to {MAX_LAYERS})")));
    }
    Ok(layers)
}

/// The vocabulary size: `<arch>.vocab_size`, else the tokens listed, else the embedding's rows.
fn vocab_size(m: &Meta, t: &TensorFacts, key: &str) -> Result<usize> {
    let tokens = m.opt_strings("tokenizer.ggml.tokens")?.map(|v| v.len());
    Ok(match (m.opt_u64(key)?, tokens, t.embed_rows) {
        (Some(v), _, _) => v as usize,
        (None, Some(n), _) => n,
        (None, None, Some(r)) => r,
        _ => return Err(m.err(key, "missing, and there is no tokenizer.ggml.tokens")),
    })
}

/// BOS/EOS/pad ids from `tokenizer.ggml.*` into config.json.
fn special_ids(m: &Meta, o: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    for (key, name) in [
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ] {
        if let Some(v) = m.opt_u64(key)? {
            o.insert(name.into(), json!(v));
        }
    }
    Ok(())
}

/// `gemma3.*` → a transformers 5 `Gemma3TextConfig` (`rope_parameters` per layer type,
/// `layer_types` spelled out).
fn gemma3_config(m: &Meta, t: &TensorFacts) -> Result<serde_json::Value> {
    let path: PathBuf = m.path.to_path_buf();
    let k = |s: &str| format!("gemma3.{s}");
    let hidden = m.u64(&k("embedding_length"))?;
    let layers = block_count(m, &k("block_count"))?;
    let ff = m.u64(&k("feed_forward_length"))?;
    let heads = m.u64(&k("attention.head_count"))?;
    let kv = m.opt_u64(&k("attention.head_count_kv"))?.unwrap_or(heads);
    if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
        return Err(m.err(
            &k("attention.head_count_kv"),
            format!("{kv} must divide attention.head_count {heads}"),
        ));
    }
    // convert_hf_to_gguf.py writes both (head_dim, default 256).
    let head_dim = m.opt_u64(&k("attention.key_length"))?.unwrap_or(256);
    if let Some(v) = m.opt_u64(&k("attention.value_length"))? {
        if v != head_dim {
            return Err(GgufError::Unsupported {
                path,
                what: format!("attention.value_length {v} ≠ key_length {head_dim}"),
                hint: "Gemma 3 has one head_dim for keys and values".into(),
            });
        }
    }
    if let Some(rot) = m.opt_u64(&k("rope.dimension_count"))? {
        if rot != head_dim {
            return Err(GgufError::Unsupported {
                path,
                what: format!(
                    "partial rotary embeddings (rope.dimension_count {rot}, head dim {head_dim})"
                ),
                hint: "Gemma 3 applies rope to the whole head".into(),
            });
        }
    }
    let eps = m
        .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| m.err(&k("attention.layer_norm_rms_epsilon"), "missing"))?;
    let theta = m.opt_f32(&k("rope.freq_base"))?.unwrap_or(1_000_000.0);
    let local_theta = m.opt_f32(&k("rope.freq_base_swa"))?.unwrap_or(10_000.0);
    let mut global = json!({"rope_type": "default", "rope_theta": f32_decimal(theta)});
    match m.opt_str(&k("rope.scaling.type"))? {
        None | Some("none") => {}
        Some("linear") => {
            let f = m
                .opt_f32(&k("rope.scaling.factor"))?
                .ok_or_else(|| m.err(&k("rope.scaling.factor"), "missing for linear scaling"))?;
            global["rope_type"] = json!("linear");
            global["factor"] = json!(f32_decimal(f));
        }
        Some(other) => {
            return Err(GgufError::Unsupported {
                path,
                what: format!("rope scaling `{other}`"),
                hint: "none and linear are read for Gemma 3".into(),
            })
        }
    }
    // llama.cpp: no (or a zero) sliding_window → every layer global; else the pattern, an array
    // of per-layer flags or a period n (layer i slides when i % n < n - 1).
    let window = m
        .opt_u64(&k("attention.sliding_window"))?
        .filter(|&w| w > 0);
    let pattern_key = k("attention.sliding_window_pattern");
    let sliding: Vec<bool> = match (window, m.get(&pattern_key)) {
        (None, _) => vec![false; layers as usize],
        (Some(_), Some(Value::Array(a))) => {
            let flags = a
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::Bool(b) => Ok(*b),
                    other => Err(m.err(
                        &pattern_key,
                        format!("element {i} is {other:?}, not a bool"),
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            if flags.len() != layers as usize {
                return Err(m.err(
                    &pattern_key,
                    format!("{} flags for {layers} layers", flags.len()),
                ));
            }
            flags
        }
        (Some(_), _) => {
            let n = m.opt_u64(&pattern_key)?.unwrap_or(6);
            (0..layers).map(|i| n == 0 || i % n < n - 1).collect()
        }
    };
    let layer_types: Vec<&str> = sliding
        .iter()
        .map(|&s| {
            if s {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    // llama.cpp's f_attention_scale: 1/√(hidden/heads) for the 27B (62 layers), else 1/√head_dim.
    let query_pre_attn_scalar = if layers == 62 {
        hidden / heads
    } else {
        head_dim
    };
    let softcap = m
        .opt_f32(&k("final_logit_softcapping"))?
        .filter(|&c| c != 0.0)
        .map(f32_decimal);
    let vocab = match t.embed_rows {
        Some(r) => r,
        None => vocab_size(m, t, &k("vocab_size"))?,
    };
    let mut c = json!({
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": hidden,
        "intermediate_size": ff,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": f32_decimal(eps),
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": window,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": global,
            "sliding_attention": {"rope_type": "default", "rope_theta": f32_decimal(local_theta)},
        },
        "attn_logit_softcapping": null,
        "final_logit_softcapping": softcap,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": false,
        "tie_word_embeddings": !t.names.contains("output.weight"),
        "torch_dtype": "float32",
    });
    let o = c.as_object_mut().expect("object");
    if let Some(n) = m.opt_u64(&k("context_length"))? {
        o.insert("max_position_embeddings".into(), json!(n));
    }
    special_ids(m, o)?;
    Ok(c)
}

/// `config.json` for the `llama` architecture.
fn llama_config(m: &Meta, t: &TensorFacts) -> Result<serde_json::Value> {
    let path: PathBuf = m.path.to_path_buf();
    let k = |s: &str| format!("llama.{s}");
    let hidden = m.u64(&k("embedding_length"))?;
    let layers = block_count(m, &k("block_count"))?;
    let ff = m.u64(&k("feed_forward_length"))?;
    let heads = m.u64(&k("attention.head_count"))?;
    let kv = m.opt_u64(&k("attention.head_count_kv"))?.unwrap_or(heads);
    if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
        return Err(m.err(
            &k("attention.head_count_kv"),
            format!("{kv} must divide attention.head_count {heads}"),
        ));
    }
    let head_dim = match m.opt_u64(&k("attention.key_length"))? {
        Some(d) => d,
        None => hidden / heads,
    };
    if let Some(rot) = m.opt_u64(&k("rope.dimension_count"))? {
        if rot != head_dim {
            return Err(GgufError::Unsupported {
                path,
                what: format!(
                    "partial rotary embeddings (rope.dimension_count {rot}, head dim {head_dim})"
                ),
                hint: "rtune's Llama applies rope to the whole head".into(),
            });
        }
    }
    if m.opt_u64(&k("expert_count"))?.unwrap_or(0) > 0 {
        return Err(GgufError::Unsupported {
            path,
            what: "a mixture-of-experts llama GGUF".into(),
            hint: "only dense models are read".into(),
        });
    }
    if t.names.contains("rope_freqs.weight") {
        return Err(GgufError::Unsupported {
            path,
            what: "Llama 3.1-style rope scaling (tensor `rope_freqs.weight`)".into(),
            hint: "convert the original Hugging Face checkpoint instead".into(),
        });
    }
    let rope_scaling = match m.opt_str(&k("rope.scaling.type"))? {
        None | Some("none") => serde_json::Value::Null,
        Some("linear") => {
            let f = m
                .opt_f32(&k("rope.scaling.factor"))?
                .ok_or_else(|| m.err(&k("rope.scaling.factor"), "missing for linear scaling"))?;
            json!({"rope_type": "linear", "factor": f32_decimal(f)})
        }
        Some(other) => {
            return Err(GgufError::Unsupported {
                path,
                what: format!("rope scaling `{other}`"),
                hint: "none and linear are read".into(),
            })
        }
    };
    let vocab = vocab_size(m, t, &k("vocab_size"))?;
    let theta = m.opt_f32(&k("rope.freq_base"))?.unwrap_or(10_000.0);
    let eps = m
        .opt_f32(&k("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| m.err(&k("attention.layer_norm_rms_epsilon"), "missing"))?;
    let mut c = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": ff,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": f32_decimal(eps),
        "rope_theta": f32_decimal(theta),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": !t.names.contains("output.weight"),
        "attention_bias": t.names.contains("blk.0.attn_q.bias"),
        "mlp_bias": false,
        "torch_dtype": "float32",
    });
    let o = c.as_object_mut().expect("object");
    if let Some(n) = m.opt_u64(&k("context_length"))? {
        o.insert("max_position_embeddings".into(), json!(n));
    }
    special_ids(m, o)?;
    Ok(c)
}

/// `generation_config.json`: the BOS/EOS/pad ids, with the end-of-turn token (`eot_token_id`,
/// e.g. Llama 3's `<|eot_id|>`) as a second stop token. Gemma 3 files carry no `eot_token_id`;
/// its `<end_of_turn>` is added as llama.cpp adds it (`llama-vocab.cpp` makes any token spelled
/// `<end_of_turn>` an end-of-generation token) and as Google's generation_config.json lists it
/// (`eos_token_id: [1, 106]`).
pub fn generation_config(m: &Meta, family: Family) -> Result<serde_json::Value> {
    let mut c = serde_json::Map::new();
    if let Some(b) = m.opt_u64("tokenizer.ggml.bos_token_id")? {
        c.insert("bos_token_id".into(), json!(b));
    }
    let mut eos: Vec<u64> = m
        .opt_u64("tokenizer.ggml.eos_token_id")?
        .into_iter()
        .collect();
    let mut eot = m.opt_u64("tokenizer.ggml.eot_token_id")?;
    if eot.is_none() && family == Family::Gemma3 {
        eot = m
            .opt_strings("tokenizer.ggml.tokens")?
            .and_then(|t| t.iter().position(|&t| t == "<end_of_turn>"))
            .map(|i| i as u64);
    }
    if let Some(e) = eot {
        if !eos.contains(&e) {
            eos.push(e);
        }
    }
    match eos.len() {
        0 => {}
        1 => {
            c.insert("eos_token_id".into(), json!(eos[0]));
        }
        _ => {
            c.insert("eos_token_id".into(), json!(eos));
        }
    }
    if let Some(p) = m.opt_u64("tokenizer.ggml.padding_token_id")? {
        c.insert("pad_token_id".into(), json!(p));
    }
    Ok(serde_json::Value::Object(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_hyperparameters_read_as_their_decimal() {
        assert_eq!(f32_decimal(1e-5), 1e-5);
        assert_eq!(f32_decimal(1e-6), 1e-6);
        assert_eq!(f32_decimal(100000.0), 100000.0);
        assert_ne!(1e-5f32 as f64, 1e-5);
    }
}
