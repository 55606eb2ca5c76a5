//! A Hugging Face Llama directory → a llama GGUF, laid out as convert_hf_to_gguf.py writes it
//! (`LlamaModel`, `_set_vocab_gpt2`): llama.cpp tensor names, q/k rows permuted for GGML's rope,
//! norms in f32 and the matrices in the asked ggml type, the `llama.*` hyper-parameters and the
//! byte-level BPE vocabulary. A Gemma 3 directory → a `gemma3` GGUF as `Gemma3Model` writes it
//! (no permutation, norms stored as `w + 1`, a SentencePiece vocabulary given by the caller:
//! [`SpmVocab`]). For tests and round trips; llama.cpp's converter remains the reference writer.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::Path;

use crate::names::{gguf_name, permute, Family, Rope};
use crate::vocab::{CONTROL, NORMAL, USER_DEFINED};
use crate::{GgufError, Result};

fn read_json(path: &Path) -> Result<Json> {
    // config.json or tokenizer.json: the larger cap of the two.
    let text =
        rtune_fsio::read_string_bounded(path, rtune_fsio::FileKind::Tokenizer).map_err(|e| {
            GgufError::Io {
                path: path.to_path_buf(),
                op: "read",
                source: e.into_io(),
            }
        })?;
    serde_json::from_str(&text).map_err(|e| GgufError::File {
        path: path.to_path_buf(),
        message: format!("not JSON: {e}"),
    })
}

fn load_tensors(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if index.exists() {
        let v = read_json(&index)?;
        let f = rtune_model::weights::index_shards(&v).map_err(|message| GgufError::File {
            path: index.clone(),
            message,
        })?;
        f.into_iter().map(|n| dir.join(n)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let mut all = HashMap::new();
    for f in files {
        let t = candle_core::safetensors::load(&f, &Device::Cpu).map_err(|e| GgufError::File {
            path: f.clone(),
            message: format!("cannot read safetensors: {e}"),
        })?;
        all.extend(t);
    }
    Ok(all)
}

/// `"<s>"` or `{"content": "<s>", ...}` in tokenizer_config.json.
fn token_text(v: &Json) -> Option<&str> {
    v.as_str().or_else(|| v.get("content")?.as_str())
}

/// The `tokenizer.ggml.*` metadata of a byte-level BPE `tokenizer.json`.
fn vocab_metadata(dir: &Path) -> Result<Vec<(String, Value)>> {
    let tpath = dir.join("tokenizer.json");
    let t = read_json(&tpath)?;
    let tc = read_json(&dir.join("tokenizer_config.json")).unwrap_or(Json::Null);
    let unsupported = |what: String| GgufError::Unsupported {
        path: tpath.clone(),
        what,
        hint: "the GGUF writer handles byte-level BPE tokenizers only".into(),
    };
    if t["model"]["type"] != "BPE" {
        return Err(unsupported(format!("model type {}", t["model"]["type"])));
    }
    let pre = match (
        &t["pre_tokenizer"]["type"],
        &t["pre_tokenizer"]["pretokenizers"],
    ) {
        (Json::String(s), _) if s == "ByteLevel" => "gpt-2",
        (Json::String(s), Json::Array(p))
            if s == "Sequence"
                && p.len() == 2
                && p[0]["type"] == "Digits"
                && p[0]["individual_digits"] == true
                && p[1]["type"] == "ByteLevel" =>
        {
            "smollm"
        }
        _ => return Err(unsupported(format!("pre_tokenizer {}", t["pre_tokenizer"]))),
    };
    let mut by_id: HashMap<u64, (String, i64)> = HashMap::new();
    for (tok, id) in t["model"]["vocab"].as_object().into_iter().flatten() {
        if let Some(id) = id.as_u64() {
            by_id.insert(id, (tok.clone(), NORMAL));
        }
    }
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(id), Some(c)) = (a["id"].as_u64(), a["content"].as_str()) {
            let ty = if a["special"] == true {
                CONTROL
            } else {
                USER_DEFINED
            };
            by_id.insert(id, (c.to_string(), ty));
        }
    }
    let n = by_id.keys().max().map_or(0, |m| m + 1);
    let mut tokens = Vec::with_capacity(n as usize);
    let mut types = Vec::with_capacity(n as usize);
    for id in 0..n {
        let (tok, ty) = by_id
            .get(&id)
            .cloned()
            .ok_or_else(|| unsupported(format!("a vocabulary with no token at id {id}")))?;
        tokens.push(Value::String(tok));
        types.push(Value::I32(ty as i32));
    }
    let merges: Vec<Value> = t["model"]["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            Json::String(s) => Some(s.clone()),
            Json::Array(p) => Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?)),
            _ => None,
        })
        .map(Value::String)
        .collect();
    let id_of = |name: &str| -> Option<u32> {
        let text = token_text(tc.get(name)?)?;
        by_id
            .iter()
            .find(|(_, (t, _))| t == text)
            .map(|(id, _)| *id as u32)
    };
    // BOS is added when the post-processor's single template starts with it.
    let bos = id_of("bos_token");
    let post_first = &t["post_processor"]["single"][0]["SpecialToken"]["id"];
    let add_bos = match (tc.get("add_bos_token").and_then(|v| v.as_bool()), bos) {
        (Some(b), _) => b,
        (None, Some(_)) => post_first.as_str() == tc.get("bos_token").and_then(token_text),
        (None, None) => false,
    };
    let mut md = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".to_string(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges)),
        (
            "tokenizer.ggml.add_bos_token".to_string(),
            Value::Bool(add_bos),
        ),
    ];
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Some(id) = id_of(name) {
            md.push((key.to_string(), Value::U32(id)));
        }
    }
    if let Some(ct) = tc.get("chat_template").and_then(|v| v.as_str()) {
        md.push(("tokenizer.chat_template".into(), Value::String(ct.into())));
    }
    Ok(md)
}

/// The model's tensors under llama.cpp's names (the lm_head left out when tied), permuted by
/// `rope`'s rule and shifted by the family's norm shift, matrices as `matrices`, 1-D as F32.
fn quantized_tensors(
    hf_dir: &Path,
    family: Family,
    tied: bool,
    heads: (usize, usize),
    matrices: GgmlDType,
) -> Result<Vec<(String, QTensor)>> {
    let tensors = load_tensors(hf_dir)?;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut q = Vec::new();
    for name in names {
        if tied && name == "lm_head.weight" {
            continue;
        }
        let (g, rope) = gguf_name(family, name).ok_or_else(|| GgufError::Tensor {
            path: hf_dir.to_path_buf(),
            name: name.clone(),
            message: format!("has no llama.cpp name for {family:?}"),
        })?;
        let err = |e: candle_core::Error| GgufError::Tensor {
            path: hf_dir.to_path_buf(),
            name: name.clone(),
            message: e.to_string(),
        };
        let mut t = tensors[name].to_dtype(DType::F32).map_err(err)?;
        t = match rope {
            Rope::Q => permute(&t, heads.0).map_err(err)?,
            Rope::K => permute(&t, heads.1).map_err(err)?,
            Rope::None => t,
        };
        let shift = family.norm_shift(&g);
        if shift != 0.0 {
            t = t.affine(1.0, shift).map_err(err)?;
        }
        let ty = if t.rank() == 1 {
            GgmlDType::F32
        } else {
            matrices
        };
        q.push((g, QTensor::quantize(&t, ty).map_err(err)?));
    }
    Ok(q)
}

/// Writes `md` and `q` as a GGUF at `out` (through `out.tmp`, renamed at the end).
fn write_file(out: &Path, md: &[(String, Value)], q: &[(String, QTensor)]) -> Result<()> {
    let tmp = rtune_fsio::with_suffix(out, ".tmp");
    let res = (|| -> Result<()> {
        // Never through a link planted at `out.tmp` (issue 46).
        let mut file = rtune_fsio::Privacy::SHARED.create(&tmp)?;
        let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut file, &md_refs, &t_refs).map_err(|e| GgufError::File {
            path: tmp.clone(),
            message: format!("cannot write GGUF: {e}"),
        })?;
        file.sync_all().map_err(|source| GgufError::Io {
            path: tmp.clone(),
            op: "fsync",
            source,
        })?;
        std::fs::rename(&tmp, out).map_err(|source| GgufError::Io {
            path: out.to_path_buf(),
            op: "rename",
            source,
        })
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// A SentencePiece vocabulary as llama.cpp's `_set_vocab_sentencepiece` stores it.
#[derive(Debug, Clone, Default)]
pub struct SpmVocab {
    /// The pieces, `▁` for a space (whitespace-only pieces as Gemma's tokenizer.model spells
    /// them: real spaces).
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    /// llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    pub types: Vec<i32>,
    pub bos: u32,
    pub eos: u32,
    pub unk: u32,
    pub pad: u32,
}

/// Writes the Gemma 3 (text) model in `hf_dir` as a `gemma3` GGUF at `out`, as
/// convert_hf_to_gguf.py's `Gemma3Model` does: its hyper-parameters (plus the layer pattern as
/// per-layer flags when it is not llama.cpp's default of every sixth layer global), every
/// `*norm.weight` stored as `w + 1`, no q/k permutation, the lm_head left out when tied, and the
/// SentencePiece `vocab` (`tokenizer.ggml.model = llama`, BOS added, no space prefix).
/// `query_pre_attn_scalar` must be `head_dim` (llama.cpp has no key for it and assumes that).
pub fn write_gemma3_gguf(
    hf_dir: &Path,
    out: &Path,
    matrices: GgmlDType,
    vocab: &SpmVocab,
) -> Result<()> {
    let cpath = hf_dir.join("config.json");
    let c = read_json(&cpath)?;
    let bad = |message: String| GgufError::File {
        path: cpath.clone(),
        message,
    };
    if c["architectures"][0] != "Gemma3ForCausalLM" {
        return Err(bad(format!(
            "architectures {}: write_gemma3_gguf writes Gemma3ForCausalLM",
            c["architectures"]
        )));
    }
    let num = |k: &str| {
        c[k].as_u64()
            .ok_or_else(|| bad(format!("no integer `{k}`")))
    };
    let (heads, layers) = (num("num_attention_heads")?, num("num_hidden_layers")?);
    let kv = c["num_key_value_heads"].as_u64().unwrap_or(heads);
    let head_dim = c["head_dim"].as_u64().unwrap_or(256);
    let qpas = c["query_pre_attn_scalar"].as_f64().unwrap_or(256.0);
    if qpas != head_dim as f64 {
        return Err(bad(format!(
            "query_pre_attn_scalar {qpas} ≠ head_dim {head_dim}: a gemma3 GGUF cannot carry it \
             (llama.cpp scales by 1/√head_dim)"
        )));
    }
    let tied = c["tie_word_embeddings"].as_bool().unwrap_or(true);
    let f = |v: &Json, d: f64| v.as_f64().unwrap_or(d) as f32;
    let rp = &c["rope_parameters"];
    let (global, local) = if rp.get("full_attention").is_some() {
        (&rp["full_attention"], &rp["sliding_attention"])
    } else {
        (&c, &Json::Null)
    };
    let local_theta = local
        .get("rope_theta")
        .or_else(|| c.get("rope_local_base_freq"))
        .and_then(|v| v.as_f64())
        .unwrap_or(10_000.0);
    let layer_types: Vec<bool> = match c["layer_types"].as_array() {
        Some(a) => a.iter().map(|t| t == "sliding_attention").collect(),
        None => (0..layers).map(|i| (i + 1) % 6 != 0).collect(),
    };
    let mut md: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("gemma3".into()),
        ),
        ("general.name".into(), Value::String("rtune".into())),
        ("gemma3.block_count".into(), Value::U32(layers as u32)),
        (
            "gemma3.context_length".into(),
            Value::U32(c["max_position_embeddings"].as_u64().unwrap_or(131_072) as u32),
        ),
        (
            "gemma3.embedding_length".into(),
            Value::U32(num("hidden_size")? as u32),
        ),
        (
            "gemma3.feed_forward_length".into(),
            Value::U32(num("intermediate_size")? as u32),
        ),
        (
            "gemma3.attention.head_count".into(),
            Value::U32(heads as u32),
        ),
        (
            "gemma3.attention.layer_norm_rms_epsilon".into(),
            Value::F32(f(&c["rms_norm_eps"], 1e-6)),
        ),
        (
            "gemma3.attention.key_length".into(),
            Value::U32(head_dim as u32),
        ),
        (
            "gemma3.attention.value_length".into(),
            Value::U32(head_dim as u32),
        ),
        (
            "gemma3.rope.freq_base".into(),
            Value::F32(f(&global["rope_theta"], 1_000_000.0)),
        ),
        (
            "gemma3.attention.head_count_kv".into(),
            Value::U32(kv as u32),
        ),
    ];
    if let Some(w) = c["sliding_window"].as_u64() {
        md.push((
            "gemma3.attention.sliding_window".into(),
            Value::U32(w as u32),
        ));
        let default: Vec<bool> = (0..layers).map(|i| i % 6 < 5).collect();
        if layer_types != default {
            md.push((
                "gemma3.attention.sliding_window_pattern".into(),
                Value::Array(layer_types.iter().map(|&b| Value::Bool(b)).collect()),
            ));
        }
    }
    if local_theta != 10_000.0 {
        md.push((
            "gemma3.rope.freq_base_swa".into(),
            Value::F32(local_theta as f32),
        ));
    }
    match global["rope_type"].as_str().unwrap_or("default") {
        "default" => {}
        "linear" => {
            md.push((
                "gemma3.rope.scaling.type".into(),
                Value::String("linear".into()),
            ));
            md.push((
                "gemma3.rope.scaling.factor".into(),
                Value::F32(f(&global["factor"], 1.0)),
            ));
        }
        other => return Err(bad(format!("rope_type `{other}` is not written"))),
    }
    if let Some(cap) = c["final_logit_softcapping"].as_f64() {
        md.push((
            "gemma3.final_logit_softcapping".into(),
            Value::F32(cap as f32),
        ));
    }
    let n = vocab.tokens.len();
    if vocab.scores.len() != n || vocab.types.len() != n {
        return Err(bad(format!(
            "the vocabulary has {n} tokens, {} scores and {} types",
            vocab.scores.len(),
            vocab.types.len()
        )));
    }
    md.extend([
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(
                vocab
                    .tokens
                    .iter()
                    .map(|t| Value::String(t.clone()))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.scores".into(),
            Value::Array(vocab.scores.iter().map(|&s| Value::F32(s)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(vocab.types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(vocab.bos)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(vocab.eos)),
        (
            "tokenizer.ggml.unknown_token_id".into(),
            Value::U32(vocab.unk),
        ),
        (
            "tokenizer.ggml.padding_token_id".into(),
            Value::U32(vocab.pad),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
        ("tokenizer.ggml.add_eos_token".into(), Value::Bool(false)),
        ("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)),
    ]);
    let q = quantized_tensors(
        hf_dir,
        Family::Gemma3,
        tied,
        (heads as usize, kv as usize),
        matrices,
    )?;
    write_file(out, &md, &q)
}

/// Writes the Llama model in `hf_dir` as a GGUF at `out` (through `out.tmp`, renamed at the end).
/// Matrices are stored as `matrices` (F32, F16, Q8_0, Q4_1, ...), 1-D tensors as F32.
pub fn write_llama_gguf(hf_dir: &Path, out: &Path, matrices: GgmlDType) -> Result<()> {
    let cpath = hf_dir.join("config.json");
    let c = read_json(&cpath)?;
    let bad = |message: String| GgufError::File {
        path: cpath.clone(),
        message,
    };
    if c["architectures"][0] != "LlamaForCausalLM" {
        return Err(bad(format!(
            "architectures {}: only LlamaForCausalLM is written",
            c["architectures"]
        )));
    }
    if !c["rope_scaling"].is_null() {
        return Err(bad("rope_scaling is not written (plain rope only)".into()));
    }
    let num = |k: &str| {
        c[k].as_u64()
            .ok_or_else(|| bad(format!("no integer `{k}`")))
    };
    let (hidden, heads) = (num("hidden_size")?, num("num_attention_heads")?);
    let kv = c["num_key_value_heads"].as_u64().unwrap_or(heads);
    let head_dim = c["head_dim"].as_u64().unwrap_or(hidden / heads);
    let tied = c["tie_word_embeddings"].as_bool().unwrap_or(false);
    let f = |k: &str, d: f64| c[k].as_f64().unwrap_or(d) as f32;
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("general.name".into(), Value::String("rtune".into())),
        (
            "llama.block_count".into(),
            Value::U32(num("num_hidden_layers")? as u32),
        ),
        (
            "llama.context_length".into(),
            Value::U32(c["max_position_embeddings"].as_u64().unwrap_or(2048) as u32),
        ),
        ("llama.embedding_length".into(), Value::U32(hidden as u32)),
        (
            "llama.feed_forward_length".into(),
            Value::U32(num("intermediate_size")? as u32),
        ),
        (
            "llama.attention.head_count".into(),
            Value::U32(heads as u32),
        ),
        (
            "llama.attention.head_count_kv".into(),
            Value::U32(kv as u32),
        ),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(f("rms_norm_eps", 1e-6)),
        ),
        (
            "llama.rope.freq_base".into(),
            Value::F32(f("rope_theta", 10_000.0)),
        ),
        (
            "llama.rope.dimension_count".into(),
            Value::U32(head_dim as u32),
        ),
        (
            "llama.vocab_size".into(),
            Value::U32(num("vocab_size")? as u32),
        ),
    ];
    if head_dim != hidden / heads {
        md.push((
            "llama.attention.key_length".into(),
            Value::U32(head_dim as u32),
        ));
        md.push((
            "llama.attention.value_length".into(),
            Value::U32(head_dim as u32),
        ));
    }
    md.extend(vocab_metadata(hf_dir)?);
    let q = quantized_tensors(
        hf_dir,
        Family::Llama,
        tied,
        (heads as usize, kv as usize),
        matrices,
    )?;
    write_file(out, &md, &q)
}
