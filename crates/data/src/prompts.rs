//! Prompt rows for online RL (`objective = "grpo"`, issue 44): the completions are sampled during
//! training, so a row is a prompt and the columns its rewards read. Tokenized as TRL 1.16's
//! `GRPOTrainer._tokenize_prompts` tokenizes them:
//! - text: `{"prompt": "..", ...}`: the tokenizer with its special tokens (BOS where the model
//!   adds one);
//! - conversational: `{"prompt": [messages], ...}`: the chat template with the generation prompt
//!   (`chat_template_kwargs` set), tokenized without special tokens (the template writes them);
//! - pre-tokenized: `{"prompt_ids": [..], ...}`, taken as they are.
//!
//! Every other column is kept for the reward functions (an `answer` reward's column, a command's
//! `columns`). `[data]`'s row settings apply as to other rows: rows over `max_row_bytes` dropped
//! unread, malformed rows skipped with `on_bad_row = "skip"`, a UTF-8 BOM accepted. A prompt of
//! `max_prompt_len` tokens or more leaves no room to sample and is dropped, counted.

use serde_json::{Map, Value};
use std::path::Path;

use crate::rows::{skip_or_fail, Line, RowError};
use crate::{ChatTemplate, Conversation, OnBadRow, Result, TemplateError, Tokenizer};

/// One prompt, tokenized, with the row's other columns.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    /// The row's `prompt` as written (text or messages), what TRL hands reward functions;
    /// `null` for a pre-tokenized row.
    pub prompt: Value,
    /// Every other column of the row.
    pub columns: Map<String, Value>,
}

/// The prompts read from one file, with what was left out on the way.
#[derive(Debug, Clone, Default)]
pub struct PromptSet {
    pub prompts: Vec<Prompt>,
    /// Non-empty lines read.
    pub rows: usize,
    /// Prompts of `max_prompt_len` tokens or more: no room left to sample.
    pub too_long: usize,
    /// Rows longer than `max_row_bytes`, dropped unread.
    pub oversized: usize,
    /// Malformed rows passed over (`on_bad_row = "skip"`), and the first few messages.
    pub bad_rows: usize,
    pub bad_row_samples: Vec<String>,
}

/// The `[data]` settings that govern how rows become prompts.
#[derive(Debug, Clone)]
pub struct PromptOptions {
    /// A prompt this long or longer is dropped (the run's `max_seq_len` less its
    /// `max_completion_length`).
    pub max_prompt_len: usize,
    pub max_row_bytes: usize,
    pub on_bad_row: OnBadRow,
    /// Pre-tokenized ids must lie in `0..vocab`.
    pub vocab: usize,
}

/// Reads a prompt JSONL file, streamed a line at a time (memory: one row, at most
/// `max_row_bytes`, and the prompts). Only a regular file is read ([`crate::open_data`]).
pub fn load_prompts(
    path: &Path,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    opts: &PromptOptions,
) -> Result<PromptSet> {
    let mut set = PromptSet::default();
    crate::rows::for_each_line(path, opts.max_row_bytes, |l, line| match l {
        Line::Oversized => {
            set.rows += 1;
            set.oversized += 1;
            Ok(())
        }
        Line::Text(text) => set.add_row(text, line, path, tok, template, opts),
    })?;
    Ok(set)
}

impl PromptSet {
    fn add_row(
        &mut self,
        raw: &str,
        line: usize,
        path: &Path,
        tok: Option<&Tokenizer>,
        template: Option<&ChatTemplate>,
        opts: &PromptOptions,
    ) -> Result<()> {
        if raw.trim().is_empty() {
            return Ok(());
        }
        self.rows += 1;
        let row = crate::formats::strip_bom(raw);
        let prompt = match parse_row(row, tok, template, opts.vocab) {
            Ok(p) => p,
            Err(e) => {
                let (count, samples) = (&mut self.bad_rows, &mut self.bad_row_samples);
                return skip_or_fail(e, path, line, opts.on_bad_row, count, samples);
            }
        };
        if prompt.ids.len() >= opts.max_prompt_len {
            self.too_long += 1;
            return Ok(());
        }
        self.prompts.push(prompt);
        Ok(())
    }
}

/// One row as a [`Prompt`]; the error says what is wrong with it (the caller adds file and line).
fn parse_row(
    row: &str,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    vocab: usize,
) -> std::result::Result<Prompt, RowError> {
    let v: Value = serde_json::from_str(row).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(mut columns) = v else {
        return Err("a prompt row is a JSON object".into());
    };
    let keys = |c: &Map<String, Value>| c.keys().cloned().collect::<Vec<_>>().join(", ");
    if let Some(ids) = columns.remove("prompt_ids") {
        if columns.contains_key("prompt") {
            return Err("give `prompt` or `prompt_ids`, not both".into());
        }
        let ids = token_ids(&ids, vocab)?;
        if ids.is_empty() {
            return Err("`prompt_ids` is empty: there is nothing to sample from".into());
        }
        return Ok(Prompt {
            ids,
            prompt: Value::Null,
            columns,
        });
    }
    let prompt = columns.remove("prompt").ok_or_else(|| {
        format!(
            "a prompt row needs `prompt` (text or messages) or `prompt_ids` (has: {})",
            keys(&columns)
        )
    })?;
    let tok = tok.ok_or_else(|| {
        RowError::Fatal(
            "text and conversational prompts need the model's tokenizer.json (or give \
             pre-tokenized `prompt_ids`)"
                .into(),
        )
    })?;
    let ids = match &prompt {
        Value::String(text) => tok
            .encode(text, true)
            .map_err(|e| RowError::Fatal(e.to_string()))?,
        Value::Array(messages) => {
            let template = template.ok_or_else(|| {
                RowError::Fatal(
                    "conversational prompts need a chat template, and the model has none (a base \
                     model?): set [data] chat_template = \"path.jinja\""
                        .into(),
                )
            })?;
            let conv =
                Conversation::from_json(&serde_json::json!({ "messages": messages }).to_string())?;
            let text = conv
                .render(template, conv.len(), true)
                .map_err(|e| match e {
                    TemplateError::Raised { .. } => RowError::Bad(e.to_string()),
                    e => RowError::Fatal(e.to_string()),
                })?;
            tok.encode(&text, false)
                .map_err(|e| RowError::Fatal(e.to_string()))?
        }
        other => {
            return Err(
                format!("`prompt` must be text or an array of messages, found {other}").into(),
            )
        }
    };
    if ids.is_empty() {
        return Err("the prompt tokenizes to nothing: there is nothing to sample from".into());
    }
    Ok(Prompt {
        ids,
        prompt,
        columns,
    })
}

/// A `prompt_ids` value: non-negative integers below `vocab`.
fn token_ids(v: &Value, vocab: usize) -> std::result::Result<Vec<u32>, RowError> {
    let Value::Array(items) = v else {
        return Err("`prompt_ids` must be an array of token ids".into());
    };
    items
        .iter()
        .map(|x| match x.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            Some(id) => Err(format!(
                "`prompt_ids` holds token id {id}, outside the model's vocabulary of {vocab}"
            )
            .into()),
            None => Err(format!("`prompt_ids` must hold non-negative integers, found {x}").into()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> PromptOptions {
        PromptOptions {
            max_prompt_len: 8,
            max_row_bytes: 1 << 20,
            on_bad_row: OnBadRow::Skip,
            vocab: 100,
        }
    }

    fn load(text: &str, o: &PromptOptions) -> Result<PromptSet> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("prompts.jsonl");
        std::fs::write(&p, text).unwrap();
        load_prompts(&p, None, None, o)
    }

    #[test]
    fn pre_tokenized_rows_keep_their_columns() {
        let set = load(
            "{\"prompt_ids\": [1, 5, 7], \"answer\": \"42\", \"n\": 3}\n\n\u{feff}{\"prompt_ids\": [2]}\n",
            &opts(),
        )
        .unwrap();
        assert_eq!(set.rows, 2);
        assert_eq!(set.prompts[0].ids, [1, 5, 7]);
        assert_eq!(set.prompts[0].prompt, Value::Null);
        assert_eq!(
            Value::Object(set.prompts[0].columns.clone()),
            serde_json::json!({"answer": "42", "n": 3})
        );
        assert_eq!(set.prompts[1].ids, [2]);
    }

    #[test]
    fn bad_rows_are_skipped_or_refused_and_long_prompts_dropped() {
        let rows = [
            "{\"prompt_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}",
            "{\"prompt_ids\": [1, 200]}",
            "{\"prompt_ids\": []}",
            "{\"prompt_ids\": [1], \"prompt\": \"x\"}",
            "{\"question\": \"x\"}",
            "[1, 2]",
            "{\"prompt_ids\": [-1]}",
        ];
        let set = load(&rows.join("\n"), &opts()).unwrap();
        assert_eq!((set.rows, set.too_long, set.bad_rows), (7, 1, 6));
        let samples = set.bad_row_samples.join("\n");
        for want in [
            ":2: `prompt_ids` holds token id 200, outside the model's vocabulary of 100",
            ":3: `prompt_ids` is empty",
            ":4: give `prompt` or `prompt_ids`, not both",
            ":5: a prompt row needs `prompt` (text or messages) or `prompt_ids` (has: question)",
        ] {
            assert!(samples.contains(want), "{want}\n{samples}");
        }
        let strict = PromptOptions {
            on_bad_row: OnBadRow::Error,
            ..opts()
        };
        let e = load(&rows.join("\n"), &strict).unwrap_err().to_string();
        assert!(
            e.contains("prompts.jsonl:2: `prompt_ids` holds token id 200"),
            "{e}"
        );
        // Text without a tokenizer is not the row's fault: refused even with skip.
        let e = load("{\"prompt\": \"hi\"}", &opts())
            .unwrap_err()
            .to_string();
        assert!(e.contains("need the model's tokenizer.json"), "{e}");
        // Oversized rows are counted, unread.
        let small = PromptOptions {
            max_row_bytes: 20,
            ..opts()
        };
        let set = load(
            "{\"prompt_ids\": [1, 2, 3, 4]}\n{\"prompt_ids\":[1]}",
            &small,
        )
        .unwrap();
        assert_eq!((set.oversized, set.prompts.len()), (1, 1));
    }

    /// Text prompts get the tokenizer's special tokens (the tiny fixture adds BOS = 1);
    /// conversational ones are the template's render with the generation prompt, no BOS added.
    #[test]
    fn text_and_conversational_prompts_tokenize_as_trl() {
        let dir = std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny-llama3"
        ));
        let tok = Tokenizer::load(dir, None).unwrap();
        let template = ChatTemplate::from_tokenizer(&tok)
            .unwrap()
            .expect("fixture has a template");
        let o = PromptOptions {
            max_prompt_len: 4096,
            ..opts()
        };
        let o = PromptOptions {
            vocab: tok.vocab_size(),
            ..o
        };
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("p.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": \"Q: 2+2?\", \"answer\": \"4\"}\n\
             {\"prompt\": [{\"role\": \"user\", \"content\": \"2+2?\"}], \"answer\": 4}\n",
        )
        .unwrap();
        let set = load_prompts(&p, Some(&tok), Some(&template), &o).unwrap();
        assert_eq!(set.prompts[0].ids, tok.encode("Q: 2+2?", true).unwrap());
        assert_eq!(set.prompts[0].ids[0], 1, "BOS");
        assert_eq!(set.prompts[0].prompt, Value::String("Q: 2+2?".into()));
        let conv =
            Conversation::from_json(r#"{"messages": [{"role": "user", "content": "2+2?"}]}"#)
                .unwrap();
        let text = conv.render(&template, 1, true).unwrap();
        assert_eq!(set.prompts[1].ids, tok.encode(&text, false).unwrap());
        assert!(
            text.len() > conv.render(&template, 1, false).unwrap().len(),
            "generation prompt"
        );
        assert_eq!(set.prompts[1].columns["answer"], 4);
    }
}
