//! The model's tokenizer (`tokenizer.json`) and its special tokens (`tokenizer_config.json`).

use rtune_fsio::{read_bounded, FileKind};
use serde_json::Value;
use std::path::{Path, PathBuf};

use crate::{DataError, Result};

/// The special-token variables transformers passes (`special_tokens_map`), in its order.
const SPECIAL_TOKEN_VARS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

pub(crate) fn special_token_names() -> &'static [&'static str] {
    &SPECIAL_TOKEN_VARS
}

/// A token's `(start, end)` byte offsets in the text it was encoded from.
pub type ByteRange = (usize, usize);

/// Bytes before a cut within which [`Tokenizer::encode_prefix`] does not trust a prefix's tokens
/// (a cut can change the last words' tokens; 256 bytes is far more than any pre-token look-ahead
/// or BPE merge chain seen in the test tokenizers, and the two-cut check guards the rest).
pub const PREFIX_MARGIN: usize = 256;

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
        let bytes = read_bounded(&path, FileKind::Tokenizer).map_err(|e| DataError::File {
            path: path.clone(),
            message: format!("cannot load tokenizer: {e}"),
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| DataError::File {
            path: path.clone(),
            message: format!("cannot load tokenizer: {e}"),
        })?;
        drop(bytes);
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = match crate::read_optional(&cfg_path, FileKind::TokenizerConfig)? {
            Some(text) => serde_json::from_str(&text).map_err(|e| DataError::File {
                path: cfg_path.clone(),
                message: format!("not JSON: {e}"),
            })?,
            None => Value::Null,
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
        special_token_names()
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

    /// The first `need` tokens of `encode_with_offsets(text, add_special)`, found without
    /// tokenizing all of a long `text` (issue 19: a 5 MB row of which `max_seq_len` tokens are
    /// kept). Returns either the whole encoding (when `text` is short, or when the cut could not be
    /// shown harmless) or exactly its first `need` tokens, so the caller also learns the whole has
    /// at least `need` tokens.
    ///
    /// How a cut is shown harmless: the prefix `text[..b]` (cut on a char boundary) is encoded, and
    /// its *settled* tokens are those that end at least [`PREFIX_MARGIN`] bytes before the cut (the
    /// pre-tokenizer's last words, a whitespace run's look-ahead, a BPE merge chain and a
    /// normalizer's window all sit inside that margin). When the prefix has `need` settled tokens,
    /// a second, twice-as-long prefix is encoded and must give the same first `need` ids and
    /// offsets: two cuts far apart that agree are not seeing the cut. Otherwise `b` doubles; past
    /// half the text, the whole text is encoded. Cost: about 3× the bytes the kept tokens cover.
    pub fn encode_prefix(
        &self,
        text: &str,
        add_special: bool,
        need: usize,
    ) -> Result<(Vec<u32>, Vec<ByteRange>)> {
        // ~4 bytes a token for prose; 8 leaves room for code and non-Latin scripts.
        let mut budget = need.saturating_mul(8).saturating_add(2 * PREFIX_MARGIN);
        while budget.saturating_mul(2) < text.len() {
            let (ids, offsets) = self.settled(text, budget, add_special)?;
            if ids.len() >= need {
                let (ids2, offsets2) = self.settled(text, 2 * budget, add_special)?;
                if ids2.len() >= need
                    && ids2[..need] == ids[..need]
                    && offsets2[..need] == offsets[..need]
                {
                    let (mut ids, mut offsets) = (ids, offsets);
                    ids.truncate(need);
                    offsets.truncate(need);
                    return Ok((ids, offsets));
                }
                break;
            }
            budget = budget.saturating_mul(2);
        }
        self.encode_with_offsets(text, add_special)
    }

    /// The settled tokens of `text[..cut]` (cut moved back to a char boundary): the leading tokens
    /// that end at least [`PREFIX_MARGIN`] bytes before the cut. Empty unless some token ends past
    /// that line, so tokens a post-processor appends (an EOS with empty offsets) never count.
    fn settled(
        &self,
        text: &str,
        cut: usize,
        add_special: bool,
    ) -> Result<(Vec<u32>, Vec<ByteRange>)> {
        let mut cut = cut.min(text.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let line = cut.saturating_sub(PREFIX_MARGIN);
        let (mut ids, mut offsets) = self.encode_with_offsets(&text[..cut], add_special)?;
        match offsets.iter().position(|&(_, end)| end > line) {
            Some(n) => {
                ids.truncate(n);
                offsets.truncate(n);
            }
            None => {
                ids.clear();
                offsets.clear();
            }
        }
        Ok((ids, offsets))
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

    /// The id of `token` as the vocabulary spells it (added tokens included), if it is one.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The repository's tokenizers, and tiny-llama with no pre-tokenizer split (the whole text one
    /// BPE word, the hardest case for a cut).
    fn tokenizers(tmp: &Path) -> Vec<Tokenizer> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("tests/chat/models"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        let tiny = root.join("../../tests/fixtures/tiny-llama");
        dirs.push(tiny.clone());
        let mut j: Value =
            serde_json::from_str(&std::fs::read_to_string(tiny.join("tokenizer.json")).unwrap())
                .unwrap();
        j["pre_tokenizer"]["use_regex"] = Value::Bool(false);
        std::fs::write(tmp.join("tokenizer.json"), j.to_string()).unwrap();
        dirs.push(tmp.to_path_buf());
        dirs.iter()
            .map(|d| Tokenizer::load(d, Some(2)).unwrap())
            .collect()
    }

    /// The settled tokens of a prefix are the whole text's first tokens, wherever the cut falls
    /// (inside a word, a space run, a multi-byte character, a literal `</s>`). Fails without the
    /// margin: a cut inside a word changes that word's tokens.
    #[test]
    fn settled_tokens_of_any_cut_are_the_whole_texts() {
        let tmp = tempfile::tempdir().unwrap();
        let text =
            "The quick brown fox   jumps\n\nover 12345 日本語 😀 don't </s>aaaaaaaaaaaaaaaa \
                    fn main() { let x = 1; }\t"
                .repeat(60);
        for tok in tokenizers(tmp.path()) {
            let (whole, whole_off) = tok.encode_with_offsets(&text, true).unwrap();
            let mut settled = 0;
            for cut in (0..text.len()).step_by(7) {
                let (ids, off) = tok.settled(&text, cut, true).unwrap();
                assert_eq!(ids[..], whole[..ids.len()], "cut at {cut}");
                assert_eq!(off[..], whole_off[..ids.len()], "cut at {cut}");
                settled += ids.len();
            }
            assert!(settled > 10_000, "{settled} tokens settled in all");
        }
    }
}
