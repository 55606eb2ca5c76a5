//! Row formats, the options that govern them ([`DataOptions`]), and the parser that turns JSONL
//! rows into [`Example`]s ([`RowParser`]).
//!
//! A file holds one format: set, or detected from its first row (`format = "auto"`) and then
//! required of every row. Each row either becomes an example or is a bad row, reported as
//! `file:line: what is wrong`; with `on_bad_row = "skip"` bad rows are counted and passed over.
//! Problems that are not the row's fault (no tokenizer, a chat template that cannot be masked)
//! stop the load whatever `on_bad_row` says: skipping would silently drop every row.

use serde_json::{Map, Value};
use std::path::Path;

use crate::chat::{self, ChatError, Conversation};
use crate::settings::{Format, OnBadRow, TrainOn, Truncation};
use crate::template::{ChatTemplate, TemplateError};
use crate::{DataError, Dataset, Example, Result, Tokenizer, IGNORE};

/// Everything that decides how rows become examples (and so belongs in a cache key).
#[derive(Debug, Clone)]
pub struct DataOptions {
    /// `None`: detect from the first row (`format = "auto"`).
    pub format: Option<Format>,
    pub train_on: TrainOn,
    pub truncation: Truncation,
    pub on_bad_row: OnBadRow,
    pub max_seq_len: usize,
    /// Replaces the model's own template (e.g. [`ChatTemplate::from_file`] for a base model).
    pub chat_template: Option<ChatTemplate>,
    /// Extra template variables for every render (`[data] chat_template_kwargs`, e.g.
    /// `enable_thinking`), set on whichever template chat rows use ([`ChatTemplate::with_var`]).
    pub chat_template_kwargs: Vec<(String, serde_json::Value)>,
}

impl DataOptions {
    /// Auto-detected format, loss on assistant turns, over-long rows cut, bad rows an error.
    pub fn new(max_seq_len: usize) -> Self {
        DataOptions {
            format: None,
            train_on: TrainOn::default(),
            truncation: Truncation::default(),
            on_bad_row: OnBadRow::default(),
            max_seq_len,
            chat_template: None,
            chat_template_kwargs: Vec::new(),
        }
    }
}

/// Why a row gave no example.
enum RowError {
    /// The row is malformed: skippable.
    Bad(String),
    /// The chat template's `raise_exception` refused the conversation: skippable.
    Raised(TemplateError),
    /// Not the row's fault (setup or template): never skipped.
    Fatal(String),
}

/// The format a row's keys say (`has(key)`).
fn detect(has: impl Fn(&str) -> bool) -> Option<Format> {
    if has("input_ids") {
        Some(Format::Tokens)
    } else if has("messages") {
        Some(Format::Chat)
    } else if has("instruction") {
        Some(Format::Alpaca)
    } else if has("prompt") || has("completion") {
        Some(Format::PromptCompletion)
    } else if has("text") {
        Some(Format::Text)
    } else {
        None
    }
}

const NO_FORMAT: &str =
    "row has none of `messages`, `instruction`, `prompt`+`completion`, `text`, `input_ids`";

/// One line of a JSONL file as a JSON object. A UTF-8 byte-order mark at its start (Windows
/// editors write one at the top of a file; `cat a.jsonl b.jsonl` carries it into the middle) is
/// accepted, as are CRLF endings (`str::lines` drops the `\r`); when the row is bad for another
/// reason, a stray carriage return that may be the cause is named.
fn object(raw: &str) -> std::result::Result<Map<String, Value>, String> {
    let row = strip_bom(raw);
    let parsed: Value =
        serde_json::from_str(row).map_err(|e| cr_note(row, format!("not valid JSON: {e}")))?;
    match parsed {
        Value::Object(o) => Ok(o),
        _ => Err("a row must be a JSON object".into()),
    }
}

/// A row without the UTF-8 byte-order mark it may start with.
pub(crate) fn strip_bom(raw: &str) -> &str {
    raw.strip_prefix('\u{feff}').unwrap_or(raw)
}

/// `message` about `row`, with the likely cause named when the row holds a stray carriage return.
fn cr_note(row: &str, mut message: String) -> String {
    if row.contains('\r') && message.starts_with("not valid JSON") {
        message.push_str(
            " (the line holds a carriage return: line endings must be LF or CRLF, not CR alone)",
        );
    }
    message
}

/// A row's keys, its values skipped unread (format detection: a long row costs no parse tree).
fn row_keys(raw: &str) -> std::result::Result<Vec<String>, String> {
    let row = strip_bom(raw);
    crate::ids::keys(row).map_err(|m| cr_note(row, m))
}

/// The format a row's keys say.
fn detect_keys(keys: &[String]) -> Option<Format> {
    detect(|k| keys.iter().any(|x| x == k))
}

/// The file's format: `opts.format`, or that of the first row of `text` (`first_line` is its line
/// number). With `on_bad_row = "skip"`, unreadable rows before it are passed over.
pub fn detect_format(
    text: &str,
    first_line: usize,
    path: &Path,
    opts: &DataOptions,
) -> Result<Format> {
    if let Some(f) = opts.format {
        return Ok(f);
    }
    let mut first_problem = None;
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let line = first_line + i;
        match row_keys(raw).and_then(|k| detect_keys(&k).ok_or_else(|| NO_FORMAT.to_string())) {
            Ok(f) => return Ok(f),
            Err(message) if opts.on_bad_row == OnBadRow::Error => {
                return Err(DataError::Row {
                    path: path.to_path_buf(),
                    line,
                    message,
                })
            }
            Err(message) => {
                first_problem.get_or_insert(format!("line {line}: {message}"));
            }
        }
    }
    Err(DataError::File {
        path: path.to_path_buf(),
        message: match first_problem {
            None => "no rows".into(),
            Some(p) => format!("no row could be read (first problem: {p})"),
        },
    })
}

/// Turns rows of one file into examples. `Sync`: chunks of a file can be parsed in parallel.
pub struct RowParser<'a> {
    path: &'a Path,
    tok: Option<&'a Tokenizer>,
    opts: &'a DataOptions,
    vocab: usize,
    format: Format,
    /// Chat only: the template and the tokenizer's special tokens (where turns end).
    template: Option<ChatTemplate>,
    specials: Vec<String>,
}

impl<'a> RowParser<'a> {
    /// `tok` is needed for every format but `tokens`; `vocab` bounds pre-tokenized ids. Chat rows
    /// use `opts.chat_template`, else the model's own template (an error if it has none).
    pub fn new(
        path: &'a Path,
        format: Format,
        tok: Option<&'a Tokenizer>,
        opts: &'a DataOptions,
        vocab: usize,
    ) -> Result<Self> {
        let (mut template, mut specials) = (None, Vec::new());
        if format == Format::Chat {
            let need = |message: &str| DataError::File {
                path: path.to_path_buf(),
                message: message.into(),
            };
            let tok = tok.ok_or_else(|| need("chat rows need the model's tokenizer.json"))?;
            template = match &opts.chat_template {
                Some(t) => Some(t.clone()),
                None => ChatTemplate::from_tokenizer(tok)?,
            };
            template = template.map(|t| {
                opts.chat_template_kwargs
                    .iter()
                    .fold(t, |t, (k, v)| t.with_var(k, v))
            });
            if template.is_none() {
                return Err(need(
                    "chat rows need a chat template, and the model's tokenizer_config.json has none (a base model?): set [data] chat_template = \"path.jinja\"",
                ));
            }
            specials = tok.special_tokens();
        }
        Ok(RowParser {
            path,
            tok,
            opts,
            vocab,
            format,
            template,
            specials,
        })
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// Parses the rows of `text`, whose first line is line `first_line` of the file. The result
    /// may hold no example (the caller decides whether the whole file is empty).
    pub fn parse_chunk(&self, text: &str, first_line: usize) -> Result<Dataset> {
        let mut d = Dataset::empty(self.format);
        let max = self.opts.max_seq_len;
        for (i, raw) in text.lines().enumerate() {
            if raw.trim().is_empty() {
                continue;
            }
            let line = first_line + i;
            d.rows += 1;
            let mut ex = match self.row(raw) {
                Ok(ex) => ex,
                Err(e) => {
                    let skippable = !matches!(e, RowError::Fatal(_));
                    let err = match e {
                        RowError::Bad(message) | RowError::Fatal(message) => DataError::Row {
                            path: self.path.to_path_buf(),
                            line,
                            message,
                        },
                        RowError::Raised(source) => DataError::RowTemplate {
                            path: self.path.to_path_buf(),
                            line,
                            source,
                        },
                    };
                    if !skippable || self.opts.on_bad_row == OnBadRow::Error {
                        return Err(err);
                    }
                    d.bad_rows += 1;
                    if d.bad_row_samples.len() < Dataset::BAD_ROW_SAMPLES {
                        d.bad_row_samples.push(err.to_string());
                    }
                    continue;
                }
            };
            if ex.input_ids.len() > max {
                match self.opts.truncation {
                    Truncation::Drop => {
                        d.dropped += 1;
                        continue;
                    }
                    Truncation::Truncate => {
                        ex.input_ids.truncate(max);
                        ex.labels.truncate(max);
                        d.truncated += 1;
                    }
                }
            }
            if ex.target_tokens() == 0 {
                d.skipped += 1;
                continue;
            }
            d.examples.push(ex);
        }
        Ok(d)
    }

    /// With `format = "auto"`, a row must be of the file's format (`has`: the row's keys).
    fn same_format(&self, has: impl Fn(&str) -> bool) -> std::result::Result<(), RowError> {
        if self.opts.format.is_none() {
            let f = detect(has).ok_or_else(|| RowError::Bad(NO_FORMAT.into()))?;
            if f != self.format {
                return Err(RowError::Bad(format!(
                    "row is {} but earlier rows are {}",
                    f.name(),
                    self.format.name()
                )));
            }
        }
        Ok(())
    }

    fn row(&self, raw: &str) -> std::result::Result<Example, RowError> {
        // Tokens worth keeping or computing: `max_seq_len`, and one more to tell "too long"
        // (truncate or drop).
        let keep = self.opts.max_seq_len.saturating_add(1);
        if self.format == Format::Tokens {
            // Ids streamed, not a `Value` each (`ids`): memory is the row's text and `keep` ids.
            let names = [("input_ids", None), ("labels", Some(IGNORE))];
            let row = strip_bom(raw);
            let r = crate::ids::read_row(row, &names, self.vocab, keep)
                .map_err(|m| RowError::Bad(cr_note(row, m)))?;
            self.same_format(|k| r.keys.iter().any(|x| x == k))?;
            return tokens_row(&r.fields, self.vocab).map_err(RowError::Bad);
        }
        let obj = object(raw).map_err(RowError::Bad)?;
        self.same_format(|k| obj.contains_key(k))?;
        let tok = self.tok.ok_or_else(|| {
            RowError::Fatal(format!(
                "{} rows need the model's tokenizer.json",
                self.format.name()
            ))
        })?;
        let fatal = |e: DataError| RowError::Fatal(e.to_string());
        // A longer row's text is cut before tokenizing (`Tokenizer::encode_prefix`), which yields
        // the same first `keep` tokens, so `parse_chunk` cuts or drops it as before.
        let ex = match self.format {
            Format::Text => {
                let text = str_field(&obj, "text").map_err(RowError::Bad)?;
                let (ids, _) = tok.encode_prefix(text, true, keep).map_err(fatal)?;
                let labels = ids.iter().map(|&i| i as i64).collect();
                with_eos(tok, ids, labels)
            }
            Format::PromptCompletion => {
                let p = str_field(&obj, "prompt").map_err(RowError::Bad)?;
                let c = str_field(&obj, "completion").map_err(RowError::Bad)?;
                completion_example(tok, p, c, keep)
            }
            Format::Alpaca => {
                let (p, c) = alpaca(&obj).map_err(RowError::Bad)?;
                completion_example(tok, &p, c, keep)
            }
            Format::Chat => {
                let t = self
                    .template
                    .as_ref()
                    .expect("RowParser::new sets it for chat");
                let conv = Conversation::from_json(raw).map_err(RowError::Bad)?;
                conv.check_trainable().map_err(RowError::Bad)?;
                let r = chat::render_spans(t, &conv, self.opts.train_on, &self.specials).map_err(
                    |e| match e {
                        ChatError::Template(te @ TemplateError::Raised { .. }) => {
                            RowError::Raised(te)
                        }
                        e @ ChatError::Prefix { .. } => RowError::Bad(e.to_string()),
                        other => RowError::Fatal(other.to_string()),
                    },
                )?;
                chat::tokenize(tok, t, &r, self.opts.train_on, keep).map_err(fatal)
            }
            Format::Tokens => unreachable!("handled above"),
        }?;
        // A tokenizer with ids past the model's embedding (added tokens config.json does not
        // count) fails here, before the run directory exists, not at step 0 (issue 35).
        if let Some(&id) = ex.input_ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(RowError::Fatal(format!(
                "the tokenizer gives token id {id}, outside the model's vocabulary (0..{}, \
                 vocab_size in config.json): tokenizer.json does not match the model",
                self.vocab
            )));
        }
        Ok(ex)
    }
}

fn str_field<'a>(obj: &'a Map<String, Value>, key: &str) -> std::result::Result<&'a str, String> {
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

/// The Stanford Alpaca prompt (`PROMPT_DICT` in tatsu-lab/stanford_alpaca's train.py), with and
/// without an input; an empty `input` counts as none, as there.
const ALPACA_WITH_INPUT: &str = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
const ALPACA_NO_INPUT: &str = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";

/// `(prompt, output)` of an Alpaca row.
fn alpaca(obj: &Map<String, Value>) -> std::result::Result<(String, &str), String> {
    let instruction = str_field(obj, "instruction")?;
    let input = match obj.get("input") {
        None | Some(Value::Null) => "",
        Some(Value::String(s)) => s,
        Some(other) => return Err(format!("`input` must be a string, got {}", kind(other))),
    };
    let output = str_field(obj, "output")?;
    if output.trim().is_empty() {
        return Err("`output` is empty".into());
    }
    let prompt = if input.is_empty() {
        ALPACA_NO_INPUT.replace("{instruction}", instruction)
    } else {
        ALPACA_WITH_INPUT
            .replacen("{instruction}", instruction, 1)
            .replacen("{input}", input, 1)
    };
    Ok((prompt, output))
}

/// `prompt` (with the tokenizer's BOS) then `completion` (and EOS), loss on the completion and EOS.
/// The two are tokenised apart, so the prompt's tokens are the same with or without an answer.
/// Only the first `keep` tokens are sure to be computed: a prompt of `keep` tokens or more leaves
/// the completion untokenized, and a long completion is tokenized up to `keep` in all (the
/// tokens and labels that `keep` covers are those of the whole row; the caller cuts at `keep - 1`).
fn completion_example(
    tok: &Tokenizer,
    prompt: &str,
    completion: &str,
    keep: usize,
) -> std::result::Result<Example, RowError> {
    let fatal = |e: DataError| RowError::Fatal(e.to_string());
    let (mut ids, _) = tok.encode_prefix(prompt, true, keep).map_err(fatal)?;
    let completion = match keep.saturating_sub(ids.len()) {
        0 => Vec::new(),
        rest => tok.encode_prefix(completion, false, rest).map_err(fatal)?.0,
    };
    let mut labels = vec![IGNORE; ids.len()];
    labels.extend(completion.iter().map(|&i| i as i64));
    ids.extend(completion);
    with_eos(tok, ids, labels)
}

/// EOS appended and kept in the labels, so the model learns to stop.
fn with_eos(
    tok: &Tokenizer,
    mut ids: Vec<u32>,
    mut labels: Vec<i64>,
) -> std::result::Result<Example, RowError> {
    let eos = tok
        .eos_id
        .ok_or_else(|| RowError::Fatal("the tokenizer has no EOS token".into()))?;
    ids.push(eos);
    labels.push(eos as i64);
    Ok(Example {
        input_ids: ids,
        labels,
    })
}

/// A pre-tokenized row from its `input_ids` and `labels` fields as [`crate::ids::read_row`] read
/// them: at most `keep` of each stored, every id checked.
fn tokens_row(fields: &[crate::ids::Field], vocab: usize) -> std::result::Result<Example, String> {
    use crate::ids::Field;
    let ints = |key: &str, f: &Field| -> std::result::Result<Option<(Vec<i64>, usize)>, String> {
        match f {
            Field::Missing | Field::Null => Ok(None),
            Field::NotArray(what) => {
                Err(format!("`{key}` must be an array of integers, got {what}"))
            }
            Field::Array {
                not_int: Some(x), ..
            } => Err(format!("`{key}` must hold integers, found {x}")),
            Field::Array { ids, len, .. } => Ok(Some((ids.clone(), *len))),
        }
    };
    let (ids, len) = ints("input_ids", &fields[0])?.unwrap_or_default();
    if len == 0 {
        return Err("`input_ids` is empty".into());
    }
    if let Field::Array {
        out_of_range: Some(i),
        ..
    } = &fields[0]
    {
        return Err(format!(
            "token id {i} is outside the vocabulary (0..{vocab})"
        ));
    }
    let input_ids = ids.iter().map(|&i| i as u32).collect();
    let labels = match ints("labels", &fields[1])? {
        None => ids,
        Some((_, n)) if n != len => {
            return Err(format!("`labels` has {n} entries, `input_ids` {len}"))
        }
        Some((l, _)) => {
            if let Field::Array {
                out_of_range: Some(bad),
                ..
            } = &fields[1]
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
mod tests;
