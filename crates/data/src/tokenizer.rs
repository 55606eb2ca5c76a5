//! The model's tokenizer (`tokenizer.json`) and its special tokens (`tokenizer_config.json`).

use serde_json::Value;
use std::path::{Path, PathBuf};

use crate::{DataError, Result};

/// A token's `(start, end)` byte offsets in the text it was encoded from.
pub type ByteRange = (usize, usize);

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub pad_id: Option<u32>,
    /// The model directory and its `tokenizer_config.json` (`Null` when absent): the chat template
    /// and the special-token texts it is rendered with are read from them.
    pub(crate) dir: PathBuf,
    pub(crate) config: Value,
}

/// `"<s>"` or `{"content": "<s>", ...}`.
fn token_str(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and the special tokens named in `dir/tokenizer_config.json`;
    /// `fallback_eos` (from config.json) is used when the tokenizer config names none.
    pub fn load(dir: &Path, fallback_eos: Option<u32>) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(DataError::File {
                path,
                message: "missing (the model's tokenizer is needed for text data)".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| DataError::File {
            path: path.clone(),
            message: format!("cannot load tokenizer: {e}"),
        })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| DataError::File {
                path: cfg_path.clone(),
                message: format!("not JSON: {e}"),
            })?,
            Err(_) => Value::Null,
        };
        let id = |key: &str| token_str(cfg.get(key)).and_then(|t| inner.token_to_id(&t));
        let bos_id = id("bos_token");
        let eos_id = id("eos_token").or(fallback_eos);
        let pad_id = id("pad_token");
        Ok(Self {
            inner,
            bos_id,
            eos_id,
            pad_id,
            dir: dir.to_path_buf(),
            config: cfg,
        })
    }

    /// `(name, text)` of the special tokens named in `tokenizer_config.json` (`bos_token`, ...),
    /// in the order transformers' `special_tokens_map` lists them: the chat template's variables.
    pub fn special_token_vars(&self) -> Vec<(String, String)> {
        crate::template::special_token_names()
            .iter()
            .filter_map(|&k| Some((k.to_string(), token_str(self.config.get(k))?)))
            .collect()
    }

    /// Texts of the added tokens marked special (`</s>`, `<|im_end|>`, `<|eot_id|>`, ...).
    pub fn special_tokens(&self) -> Vec<String> {
        let mut v: Vec<(u32, String)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        v.sort();
        v.into_iter().map(|(_, t)| t).collect()
    }

    /// Token ids of `text` and each token's byte range in `text` (`(0, 0)`-like empty ranges for
    /// tokens the post-processor adds, e.g. BOS).
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special: bool,
    ) -> Result<(Vec<u32>, Vec<ByteRange>)> {
        let enc = self.encoding(text, add_special)?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Token ids of `text`; `add_special` applies the tokenizer's post-processor (e.g. BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        Ok(self.encoding(text, add_special)?.get_ids().to_vec())
    }

    fn encoding(&self, text: &str, add_special: bool) -> Result<tokenizers::Encoding> {
        self.inner
            .encode(text, add_special)
            .map_err(|e| DataError::Tokenizer {
                op: "encode",
                message: e.to_string(),
            })
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| DataError::Tokenizer {
                op: "decode",
                message: e.to_string(),
            })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
