//! Training data: the model's tokenizer, JSONL examples, and right-padded micro-batches.
//!
//! An [`Example`] is `input_ids` with `labels` aligned to them as in transformers (`-100` = no loss;
//! the model shifts labels by one). Rows are read from JSONL in one of three shapes, detected from the
//! first row and required of every row:
//! - `{"text": ...}`: loss on every token;
//! - `{"prompt": ..., "completion": ...}`: loss on the completion (and the EOS that ends it);
//! - `{"input_ids": [...], "labels": [...]}`: pre-tokenized, used as-is (`labels` optional).
//!
//! [`Batcher`] walks the examples epoch after epoch (shuffled per epoch by seed, or in file order)
//! and cuts micro-batches.

mod batch;
mod tokenizer;

pub use batch::{Batcher, MicroBatch};
pub use tokenizer::Tokenizer;

use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}:{line}: {message}")]
    Row {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("tokenizer {op}: {message}")]
    Tokenizer { op: &'static str, message: String },
}

pub type Result<T> = std::result::Result<T, DataError>;

pub const IGNORE: i64 = -100;

#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub input_ids: Vec<u32>,
    /// Same length as `input_ids`; `-100` = no loss.
    pub labels: Vec<i64>,
}

impl Example {
    /// Tokens that carry a loss after the shift (label at positions 1..).
    pub fn target_tokens(&self) -> usize {
        self.labels.iter().skip(1).filter(|&&l| l != IGNORE).count()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    PromptCompletion,
    Tokens,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Text => "text",
            Format::PromptCompletion => "prompt/completion",
            Format::Tokens => "input_ids/labels",
        }
    }
}

/// Examples read from one file, with what was cut on the way.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub examples: Vec<Example>,
    pub format: Format,
    /// Rows longer than `max_seq_len`, cut to it.
    pub truncated: usize,
    /// Rows left with no target token (e.g. a prompt that fills `max_seq_len`), skipped.
    pub skipped: usize,
}

fn detect(obj: &serde_json::Map<String, Value>) -> Option<Format> {
    if obj.contains_key("input_ids") {
        Some(Format::Tokens)
    } else if obj.contains_key("prompt") || obj.contains_key("completion") {
        Some(Format::PromptCompletion)
    } else if obj.contains_key("text") {
        Some(Format::Text)
    } else {
        None
    }
}

/// Reads a JSONL file. `tok` is needed for text rows; `vocab` bounds pre-tokenized ids.
pub fn load_jsonl(
    path: &Path,
    tok: Option<&Tokenizer>,
    max_seq_len: usize,
    vocab: usize,
) -> Result<Dataset> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::File {
        path: path.to_path_buf(),
        message: format!("cannot read data: {e}"),
    })?;
    parse_jsonl(&text, path, tok, max_seq_len, vocab)
}

/// [`load_jsonl`] on text already read; `path` labels errors.
pub fn parse_jsonl(
    text: &str,
    path: &Path,
    tok: Option<&Tokenizer>,
    max_seq_len: usize,
    vocab: usize,
) -> Result<Dataset> {
    let row_err = |line: usize, message: String| DataError::Row {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut examples = Vec::new();
    let mut format = None;
    let (mut truncated, mut skipped) = (0, 0);
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let v: Value =
            serde_json::from_str(raw).map_err(|e| row_err(line, format!("not valid JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| row_err(line, "a row must be a JSON object".into()))?;
        let f = detect(obj).ok_or_else(|| {
            row_err(
                line,
                "row has none of `text`, `prompt`+`completion`, `input_ids`".into(),
            )
        })?;
        match format {
            None => format = Some(f),
            Some(prev) if prev != f => {
                return Err(row_err(
                    line,
                    format!("row is {} but earlier rows are {}", f.name(), prev.name()),
                ))
            }
            _ => {}
        }
        let mut ex = match f {
            Format::Tokens => tokens_row(obj, vocab).map_err(|m| row_err(line, m))?,
            Format::Text | Format::PromptCompletion => {
                let tok = tok.ok_or_else(|| {
                    row_err(line, "text rows need the model's tokenizer.json".into())
                })?;
                text_row(obj, f, tok).map_err(|m| row_err(line, m))?
            }
        };
        if ex.input_ids.len() > max_seq_len {
            ex.input_ids.truncate(max_seq_len);
            ex.labels.truncate(max_seq_len);
            truncated += 1;
        }
        if ex.target_tokens() == 0 {
            skipped += 1;
            continue;
        }
        examples.push(ex);
    }
    let Some(format) = format else {
        return Err(DataError::File {
            path: path.to_path_buf(),
            message: "no rows".into(),
        });
    };
    if examples.is_empty() {
        return Err(DataError::File {
            path: path.to_path_buf(),
            message: format!("all {skipped} rows have no token to train on (max_seq_len {max_seq_len} too short?)"),
        });
    }
    Ok(Dataset {
        examples,
        format,
        truncated,
        skipped,
    })
}

fn str_field<'a>(
    obj: &'a serde_json::Map<String, Value>,
    key: &str,
) -> std::result::Result<&'a str, String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(format!("`{key}` must be a string, got {}", kind(other))),
        None => Err(format!("missing `{key}`")),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn text_row(
    obj: &serde_json::Map<String, Value>,
    f: Format,
    tok: &Tokenizer,
) -> std::result::Result<Example, String> {
    let eos = tok.eos_id.ok_or("the tokenizer has no EOS token")?;
    let (mut ids, mut labels) = match f {
        Format::Text => {
            let ids = tok
                .encode(str_field(obj, "text")?, true)
                .map_err(|e| e.to_string())?;
            let labels = ids.iter().map(|&i| i as i64).collect();
            (ids, labels)
        }
        _ => {
            let prompt = tok
                .encode(str_field(obj, "prompt")?, true)
                .map_err(|e| e.to_string())?;
            let completion = tok
                .encode(str_field(obj, "completion")?, false)
                .map_err(|e| e.to_string())?;
            let mut labels = vec![IGNORE; prompt.len()];
            labels.extend(completion.iter().map(|&i| i as i64));
            let mut ids = prompt;
            ids.extend(completion);
            (ids, labels)
        }
    };
    // EOS in the labels, so the model learns to stop.
    ids.push(eos);
    labels.push(eos as i64);
    Ok(Example {
        input_ids: ids,
        labels,
    })
}

fn tokens_row(
    obj: &serde_json::Map<String, Value>,
    vocab: usize,
) -> std::result::Result<Example, String> {
    let ints = |key: &str| -> std::result::Result<Option<Vec<i64>>, String> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_i64()
                        .ok_or_else(|| format!("`{key}` must hold integers, found {x}"))
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(Some),
            Some(other) => Err(format!(
                "`{key}` must be an array of integers, got {}",
                kind(other)
            )),
        }
    };
    let ids = ints("input_ids")?.unwrap_or_default();
    if ids.is_empty() {
        return Err("`input_ids` is empty".into());
    }
    let input_ids = ids
        .iter()
        .map(|&i| {
            if i >= 0 && (i as usize) < vocab {
                Ok(i as u32)
            } else {
                Err(format!(
                    "token id {i} is outside the vocabulary (0..{vocab})"
                ))
            }
        })
        .collect::<std::result::Result<Vec<u32>, String>>()?;
    let labels = match ints("labels")? {
        None => ids.clone(),
        Some(l) if l.len() != ids.len() => {
            return Err(format!(
                "`labels` has {} entries, `input_ids` {}",
                l.len(),
                ids.len()
            ))
        }
        Some(l) => {
            if let Some(bad) = l
                .iter()
                .find(|&&x| x != IGNORE && (x < 0 || x as usize >= vocab))
            {
                return Err(format!(
                    "label {bad} is neither -100 nor a token id (0..{vocab})"
                ));
            }
            l
        }
    };
    Ok(Example { input_ids, labels })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, body: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("rtune-data-{}-{name}", std::process::id()));
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn tokens_rows_and_errors_name_the_line() {
        let p = write(
            "ok.jsonl",
            "{\"input_ids\":[1,5,6],\"labels\":[-100,5,6]}\n\n{\"input_ids\":[1,7]}\n",
        );
        let d = load_jsonl(&p, None, 16, 10).unwrap();
        assert_eq!(d.examples.len(), 2);
        assert_eq!(d.examples[1].labels, vec![1, 7]);
        for (body, needle) in [
            (
                "{\"input_ids\":[1,2]}\n{\"input_ids\":[1,2\n",
                ":2: not valid JSON",
            ),
            (
                "{\"input_ids\":[1,2],\"labels\":[1]}\n",
                ":1: `labels` has 1",
            ),
            ("{\"input_ids\":[1,20]}\n", "outside the vocabulary"),
            ("{\"foo\":1}\n", ":1: row has none"),
            (
                "{\"input_ids\":[1,2]}\n{\"text\":\"a\"}\n",
                ":2: row is text",
            ),
            ("", "no rows"),
        ] {
            let p = write("bad.jsonl", body);
            let e = load_jsonl(&p, None, 16, 10).unwrap_err().to_string();
            assert!(e.contains(needle), "{body:?}: {e}");
        }
    }

    #[test]
    fn truncation_and_skipping_are_counted() {
        let p = write(
            "long.jsonl",
            "{\"input_ids\":[1,2,3,4,5]}\n{\"input_ids\":[1,2,3],\"labels\":[-100,-100,-100]}\n",
        );
        let d = load_jsonl(&p, None, 3, 10).unwrap();
        assert_eq!((d.examples.len(), d.truncated, d.skipped), (1, 1, 1));
        assert_eq!(d.examples[0].input_ids, vec![1, 2, 3]);
    }
}
