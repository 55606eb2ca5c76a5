//! The tokenizer a GGUF carries (`tokenizer.ggml.*`) as Hugging Face `tokenizer.json` +
//! `tokenizer_config.json`, and back.
//!
//! Read: `tokenizer.ggml.model = "gpt2"` (byte-level BPE: `tokens`, `merges`, `token_type`), with
//! the pre-tokenizer named by `tokenizer.ggml.pre` (llama.cpp's regexes in `llama-vocab.cpp`,
//! written as the `tokenizers` pre-tokenizers that produce the same splits). Token types: 3
//! (control) become special added tokens, 4 (user-defined) plain added tokens. BOS/EOS are added
//! by a `TemplateProcessing` post-processor when `add_bos_token` / `add_eos_token` say so.
//!
//! SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`) are read for Gemma 3 as
//! transformers reads them from a GGUF (`integrations/gguf/gguf_tokenizer_mapping.py`,
//! `gemma_tokenizer`, transformers 5.24), so that encoding is that tokenizer's: `gemma_spm`.
//! Other SentencePiece files are refused with a hint.

use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};

use crate::merges;
use crate::meta::Meta;
use crate::names::Family;
use crate::{GgufError, Result};

/// llama.cpp's token types (`llama_token_type`).
pub const NORMAL: i64 = 1;
pub const CONTROL: i64 = 3;
pub const USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values read, with the pre-tokenizer each stands for.
pub const PRE_SUPPORTED: &str =
    "default, gpt-2, gpt2, smollm, starcoder, refact, codeshell, llama-bpe, llama3";

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

/// The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre`, and whether merges are skipped for
/// whole-vocabulary words (`ignore_merges`, Llama 3).
fn pre_tokenizer(pre: &str) -> Option<(Value, bool)> {
    Some(match pre {
        // GPT-2's regex, which ByteLevel applies itself.
        "default" | "gpt-2" | "gpt2" => (byte_level(true), false),
        // llama.cpp: "\p{N}" then GPT-2's regex: every digit alone, then GPT-2.
        "smollm" | "starcoder" | "refact" | "codeshell" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            false,
        ),
        "llama-bpe" | "llama3" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ]}),
            true,
        ),
        _ => return None,
    })
}

/// `tokenizer.json` and `tokenizer_config.json` built from the metadata.
pub struct TokenizerFiles {
    pub tokenizer: Value,
    pub config: Value,
    /// `tokenizer.ggml.pre` as read (for reports).
    pub pre: String,
    /// What the tokenizer is, in words (for reports).
    pub kind: String,
}

fn added(id: usize, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": false, "special": special})
}

/// Python's `str.isspace` (Rust's `char::is_whitespace` plus the separators U+001C..U+001F).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The tokenizer.json parts of a SentencePiece vocabulary.
struct SpmParts {
    model: Value,
    normalizer: Value,
    pre_tokenizer: Value,
    decoder: Value,
    /// (id, content, special), by id.
    added: Vec<(usize, String, bool)>,
}

/// Gemma's SentencePiece vocabulary as transformers 5.24 builds it from a GGUF
/// (`gemma_tokenizer` → `GemmaTokenizer(vocab, merges)`, then `add_gguf_special_tokens`):
///
/// 1. A token of whitespace containing a space (`"  "`) is respelled `"▁"` × its length in
///    characters (the file stores real spaces, GemmaTokenizer looks up `▁`).
/// 2. The file has no merges: `generate_merges(vocab, {token: -index})` rebuilds them from the
///    vocabulary ([`merges::rebuild`], linear in the vocabulary's bytes, capped) — every split
///    `token = l + r` (at a character) with both halves in the vocabulary, ordered by the token's index (Gemma's scores do not follow the merge order; the
///    file's order does), then by `len(l)` descending (Python's stable sort on
///    `(score, len(l), len(r))`, reversed).
/// 3. BPE with byte fallback, `fuse_unk`, unk `<unk>`; normalizer `" "` → `"▁"`; the
///    pre-tokenizer GemmaTokenizer sets (a split on `" "` that the normalizer has already removed);
///    decoder `▁` → space, byte fallback, fuse.
/// 4. Control tokens (type 3) become special added tokens; user-defined ones (type 4) plain added
///    tokens when their spelling is in the vocabulary (so not the respelled whitespace runs).
///
/// Refused (the reason) when the merges pass [`merges::CAPS`].
fn gemma_spm(
    tokens: &[&str],
    types: &[i64],
    unk: Option<&str>,
) -> std::result::Result<SpmParts, String> {
    let respelled: Vec<String> = tokens
        .iter()
        .map(|t| {
            if t.contains(' ') && t.chars().all(py_isspace) {
                "\u{2581}".repeat(t.chars().count())
            } else {
                t.to_string()
            }
        })
        .collect();
    // Python's `{token: index}`: the last index of a repeated token wins.
    let mut vocab: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (i, t) in respelled.iter().enumerate() {
        vocab.insert(t.as_str(), i);
    }
    // generate_merges iterates the score dict in first-insertion order and sorts by score
    // (-last index) descending, i.e. by last index ascending.
    let mut seen = HashSet::with_capacity(tokens.len());
    let mut order: Vec<(usize, &str)> = Vec::with_capacity(tokens.len());
    for t in &respelled {
        if seen.insert(t.as_str()) {
            order.push((vocab[t.as_str()], t.as_str()));
        }
    }
    order.sort_by_key(|&(i, _)| i);
    let order: Vec<&str> = order.into_iter().map(|(_, t)| t).collect();
    let merges: Vec<Value> = merges::rebuild(&order, &vocab, merges::CAPS)?
        .into_iter()
        .map(|(l, r)| json!([l, r]))
        .collect();
    let mut vocab_json = serde_json::Map::with_capacity(vocab.len());
    for (i, t) in respelled.iter().enumerate() {
        if vocab[t.as_str()] == i {
            vocab_json.insert(t.clone(), json!(i));
        }
    }
    let mut added = Vec::new();
    for (i, (&t, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == CONTROL {
            added.push((vocab.get(t).copied().unwrap_or(i), t.to_string(), true));
        } else if ty == USER_DEFINED {
            if let Some(&id) = vocab.get(t) {
                added.push((id, t.to_string(), false));
            }
        }
    }
    added.sort_by_key(|a| a.0);
    added.dedup_by_key(|a| a.0);
    let model = json!({
        "type": "BPE", "dropout": null, "unk_token": unk.unwrap_or("<unk>"),
        "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
        "byte_fallback": true, "ignore_merges": false, "vocab": vocab_json, "merges": merges,
    });
    let normalizer = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let pre = json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false});
    let decoder = json!({"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]});
    Ok(SpmParts {
        model,
        normalizer,
        pre_tokenizer: pre,
        decoder,
        added,
    })
}

/// Builds the Hugging Face tokenizer files; `context_length` becomes `model_max_length`.
pub fn tokenizer_files(
    m: &Meta,
    family: Family,
    context_length: Option<u64>,
) -> Result<TokenizerFiles> {
    let unsupported = |what: String, hint: &str| GgufError::Unsupported {
        path: m.path.to_path_buf(),
        what,
        hint: hint.into(),
    };
    let model = m.opt_str("tokenizer.ggml.model")?.unwrap_or("");
    match model {
        "gpt2" => {}
        "llama" if family == Family::Gemma3 => {}
        "" => {
            return Err(unsupported(
                "a GGUF without a tokenizer (no tokenizer.ggml.model)".into(),
                "put the model's tokenizer.json next to the converted model",
            ))
        }
        "llama" => {
            return Err(unsupported(
                "a SentencePiece tokenizer (tokenizer.ggml.model = llama)".into(),
                "only byte-level BPE (gpt2) vocabularies and Gemma 3's SentencePiece one are \
                 converted; copy tokenizer.json and tokenizer_config.json from the original \
                 Hugging Face model into the converted directory",
            ))
        }
        other => {
            return Err(unsupported(
                format!("tokenizer.ggml.model `{other}`"),
                "only byte-level BPE (gpt2) vocabularies are converted",
            ))
        }
    }
    let spm = model == "llama";
    let pre = m.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    // A SentencePiece vocabulary splits as GemmaTokenizer does, whatever `pre` says.
    let (pre_tok, ignore_merges) = match spm {
        true => (Value::Null, false),
        false => pre_tokenizer(pre).ok_or_else(|| {
            unsupported(
                format!("tokenizer.ggml.pre `{pre}`"),
                &format!("supported: {PRE_SUPPORTED}"),
            )
        })?,
    };
    let meta_err = |key: &str, message: String| GgufError::Metadata {
        path: m.path.to_path_buf(),
        key: key.into(),
        message,
    };
    let tokens = m
        .opt_strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| meta_err("tokenizer.ggml.tokens", "missing".into()))?;
    let types = m
        .opt_ints("tokenizer.ggml.token_type")?
        .unwrap_or_else(|| vec![NORMAL; tokens.len()]);
    if types.len() != tokens.len() {
        return Err(meta_err(
            "tokenizer.ggml.token_type",
            format!("{} entries for {} tokens", types.len(), tokens.len()),
        ));
    }
    let tok_of = |key: &str| -> Result<Option<(usize, String)>> {
        Ok(match m.opt_u64(key)? {
            Some(id) => {
                let t = tokens.get(id as usize).ok_or_else(|| {
                    meta_err(
                        key,
                        format!("id {id} is outside the {}-token vocabulary", tokens.len()),
                    )
                })?;
                Some((id as usize, t.to_string()))
            }
            None => None,
        })
    };
    let bos = tok_of("tokenizer.ggml.bos_token_id")?;
    let eos = tok_of("tokenizer.ggml.eos_token_id")?;
    let pad = tok_of("tokenizer.ggml.padding_token_id")?;
    let unk = tok_of("tokenizer.ggml.unknown_token_id")?;
    let mut added_tokens = Vec::new();
    let mut added_decoder = serde_json::Map::new();
    let mut push_added = |id: usize, tok: &str, special: bool| {
        let mut a = added(id, tok, special);
        added_tokens.push(a.clone());
        a.as_object_mut().expect("object").remove("id");
        added_decoder.insert(id.to_string(), a);
    };
    let (model, normalizer, pre_tok, decoder) = if spm {
        let p = gemma_spm(&tokens, &types, unk.as_ref().map(|(_, t)| t.as_str()))
            .map_err(|m| meta_err("tokenizer.ggml.tokens", m))?;
        for (id, tok, special) in p.added {
            push_added(id, &tok, special);
        }
        (p.model, p.normalizer, p.pre_tokenizer, p.decoder)
    } else {
        let mut vocab = serde_json::Map::with_capacity(tokens.len());
        for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
            if vocab.insert(tok.to_string(), json!(id)).is_some() {
                return Err(meta_err(
                    "tokenizer.ggml.tokens",
                    format!("token {tok:?} appears twice (again at id {id})"),
                ));
            }
            if ty == CONTROL || ty == USER_DEFINED {
                push_added(id, tok, ty == CONTROL);
            }
        }
        let merges = bpe_merges(m)?;
        let model = json!({
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
        });
        let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
        (model, Value::Null, pre_tok, decoder)
    };
    // llama.cpp (and transformers' GGUF reader) add BOS to a SentencePiece vocabulary that does
    // not say otherwise.
    let add_bos = m.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(spm) && bos.is_some();
    let add_eos = m.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false) && eos.is_some();
    let post = post_processor(add_bos, add_eos, &bos, &eos, !spm);
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tok,
        "post_processor": post,
        "decoder": decoder,
        "model": model,
    });
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": added_decoder,
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    let o = config.as_object_mut().expect("object");
    for (name, t) in [
        ("bos_token", &bos),
        ("eos_token", &eos),
        ("pad_token", &pad),
        ("unk_token", &unk),
    ] {
        if let Some((_, t)) = t {
            o.insert(name.into(), json!(t));
        }
    }
    if let Some(n) = context_length {
        o.insert("model_max_length".into(), json!(n));
    }
    if let Some(t) = m.opt_str("tokenizer.chat_template")? {
        o.insert("chat_template".into(), json!(t));
    }
    let kind = if spm {
        format!(
            "SentencePiece ({} tokens) as Gemma's BPE with byte fallback",
            tokens.len()
        )
    } else {
        format!("byte-level BPE (pre-tokenizer {pre})")
    };
    Ok(TokenizerFiles {
        tokenizer,
        config,
        pre: pre.to_string(),
        kind,
    })
}

/// `tokenizer.ggml.merges` as `[left, right]` pairs.
fn bpe_merges(m: &Meta) -> Result<Vec<Value>> {
    let meta_err = |key: &str, message: String| GgufError::Metadata {
        path: m.path.to_path_buf(),
        key: key.into(),
        message,
    };
    let merges = m.opt_strings("tokenizer.ggml.merges")?.unwrap_or_default();
    merges
        .iter()
        .enumerate()
        .map(|(i, s)| {
            // llama.cpp splits at the first space after the first character.
            let at = s
                .char_indices()
                .skip(1)
                .find(|(_, c)| *c == ' ')
                .map(|(p, _)| p)
                .ok_or_else(|| {
                    meta_err(
                        "tokenizer.ggml.merges",
                        format!("entry {i} {s:?} has no space"),
                    )
                })?;
            Ok(json!([&s[..at], &s[at + 1..]]))
        })
        .collect::<Result<_>>()
}

/// BOS/EOS added by a `TemplateProcessing` post-processor when the file asks for them; else
/// byte-level BPE's `ByteLevel` one (none for SentencePiece).
fn post_processor(
    add_bos: bool,
    add_eos: bool,
    bos: &Option<(usize, String)>,
    eos: &Option<(usize, String)>,
    byte_level: bool,
) -> Value {
    if add_bos || add_eos {
        let mut special = serde_json::Map::new();
        let mut single = Vec::new();
        let mut pair = Vec::new();
        let piece = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
        let seq = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
        for (seg, type_id, out) in [("A", 0, 0), ("A", 0, 1), ("B", 1, 1)] {
            let v = if out == 0 { &mut single } else { &mut pair };
            if let (true, Some((id, t))) = (add_bos, &bos) {
                v.push(piece(t, type_id));
                special.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
            }
            v.push(seq(seg, type_id));
            if let (true, Some((id, t))) = (add_eos, &eos) {
                v.push(piece(t, type_id));
                special.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
            }
        }
        json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special})
    } else if byte_level {
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
    } else {
        Value::Null
    }
}
