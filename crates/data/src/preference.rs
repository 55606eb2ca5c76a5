//! Preference data (DPO and kin): a prompt with a chosen and a rejected completion, read from
//! TRL's formats and laid out as TRL's `DataCollatorForPreference` lays them out.
//!
//! Rows (JSONL), as TRL 1.16 takes them:
//! - pre-tokenized: `{"prompt_ids": [..], "chosen_ids": [..], "rejected_ids": [..]}`, taken as
//!   they are;
//! - text: `{"prompt": "..", "chosen": "..", "rejected": ".."}`: the EOS token's text is appended
//!   to a completion that does not end with it, `prompt`, `prompt + chosen` and `prompt +
//!   rejected` are tokenized (special tokens added), and the completions start where the
//!   tokenized prompt and prompt + completion diverge (TRL's `common_prefix_length`);
//! - conversational: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`: the
//!   chat template renders the prompt with the generation prompt, and prompt + chosen (+ rejected)
//!   without; the renders are tokenized as `apply_chat_template` does (no special tokens added:
//!   the template writes them), and split at their common prefix as text rows are;
//! - unpaired (KTO): `{"prompt", "completion", "label"}` in any of the three forms
//!   (`completion_ids` pre-tokenized), `label` a boolean; the completion is held as `chosen`, and
//!   `rejected` becomes its KL completion, another row's ([`assign_kl_completions`]).
//!
//! Truncation as TRL's `keep_start`: a pair whose prompt alone fills `max_seq_len` is dropped;
//! otherwise each completion is cut so prompt + completion fits (or, with `truncation = "drop"`,
//! the pair is dropped). `[data]`'s other row settings apply as to SFT rows ([`PairOptions`]):
//! rows over `max_row_bytes` dropped unread, malformed rows skipped with `on_bad_row = "skip"`,
//! a UTF-8 BOM accepted. A pair with no token to train on is dropped and counted.
//!
//! A micro-batch of `b` pairs is `2b` right-padded rows, the chosen sequences first, then the
//! rejected (TRL's concatenated batch); targets are the completion tokens only.

use serde_json::Value;
use std::path::Path;

use crate::rows::{skip_or_fail, Line, RowError};
use crate::{
    ChatTemplate, Conversation, MicroBatch, OnBadRow, Result, TemplateError, Tokenizer, Truncation,
};

/// One preference pair, tokenized.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub prompt: Vec<u32>,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
    /// The reference policy's log-probabilities of `(chosen, rejected)` given the prompt, once
    /// computed (the trainer fills them in before training).
    pub reference: Option<[f64; 2]>,
    /// LongRoPE: the reference under the long factors, for a pair short enough for the short
    /// ones that a longer pair's batch puts under the long ones (the factors are the batch's:
    /// [`PairBatch::with_rope`] picks this one in such a batch). `None`: `reference` serves all.
    pub reference_long: Option<[f64; 2]>,
    /// An unpaired row (KTO: `{prompt, completion, label}`): whether its completion, held in
    /// `chosen`, is desirable. `rejected` then holds the KL completion, another row's completion
    /// for the same prompt (TRL's mismatched pairs, assigned by [`assign_kl_completions`]).
    pub label: Option<bool>,
}

impl Pair {
    /// Tokens of its longer sequence (prompt + the longer completion): its row length.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.chosen.len().max(self.rejected.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The pairs read from one file, with what was cut or left out on the way.
#[derive(Debug, Clone, Default)]
pub struct PairSet {
    pub pairs: Vec<Pair>,
    /// Non-empty lines read.
    pub rows: usize,
    /// Pairs whose completions were cut to fit `max_seq_len`.
    pub truncated: usize,
    /// Pairs left out at `max_seq_len`: the prompt alone fills it, or (`truncation = "drop"`)
    /// prompt + completion is longer.
    pub dropped: usize,
    /// Pairs left out with no token to train on: a completion (chosen, or rejected) empty, or a
    /// one-token completion after an empty prompt (nothing predicts a sequence's first token).
    /// Their log-probability is an empty sum: DPO learns nothing from them, ORPO's NLL term
    /// divides by zero.
    pub no_target: usize,
    /// Pairs whose chosen and rejected completions are the same tokens (no preference signal:
    /// kept, as TRL keeps them, and reported).
    pub identical: usize,
    /// Rows longer than `max_row_bytes`, dropped unread.
    pub oversized: usize,
    /// Malformed rows passed over (`on_bad_row = "skip"`), and the first few of their
    /// `file:line: what is wrong` messages.
    pub bad_rows: usize,
    pub bad_row_samples: Vec<String>,
}

/// The `[data]` settings that govern how preference rows become pairs.
#[derive(Debug, Clone)]
pub struct PairOptions {
    pub max_seq_len: usize,
    /// Rows longer than this many bytes are dropped unread (counted in [`PairSet::oversized`]).
    pub max_row_bytes: usize,
    /// A pair longer than `max_seq_len`: its completions cut (TRL's `keep_start`) or the pair
    /// dropped.
    pub truncation: Truncation,
    /// A malformed row: an error naming it, or counted and passed over. Problems that are not the
    /// row's (no tokenizer, no chat template) stop the load either way.
    pub on_bad_row: OnBadRow,
    /// Pre-tokenized ids must lie in `0..vocab`.
    pub vocab: usize,
}

impl PairOptions {
    /// Completions cut at `max_seq_len`, bad rows an error, no row-size cap.
    pub fn new(max_seq_len: usize, vocab: usize) -> Self {
        PairOptions {
            max_seq_len,
            max_row_bytes: usize::MAX,
            truncation: Truncation::Truncate,
            on_bad_row: OnBadRow::Error,
            vocab,
        }
    }
}

type RowResult<T> = std::result::Result<T, RowError>;

/// Reads a preference JSONL file (formats above), streamed a line at a time: memory is one row
/// (at most `max_row_bytes`; longer rows are dropped unread) and the pairs, whatever the file's
/// size. Only a regular file is read ([`crate::open_data`]). `tok` is needed for text rows;
/// conversational rows need `template` (the model's or `[data] chat_template`, with
/// `chat_template_kwargs` set).
pub fn load_pairs(
    path: &Path,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    opts: &PairOptions,
) -> Result<PairSet> {
    let mut set = PairSet::default();
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

/// [`load_pairs`] on text already read; `path` labels errors.
pub fn parse_pairs(
    text: &str,
    path: &Path,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    opts: &PairOptions,
) -> Result<PairSet> {
    let mut set = PairSet::default();
    for (i, line) in text.lines().enumerate() {
        if line.len() > opts.max_row_bytes {
            set.rows += 1;
            set.oversized += 1;
            continue;
        }
        set.add_row(line, i + 1, path, tok, template, opts)?;
    }
    Ok(set)
}

impl PairSet {
    /// Reads line `line` of `path` (without its line end) into the set, or counts why not.
    fn add_row(
        &mut self,
        raw: &str,
        line: usize,
        path: &Path,
        tok: Option<&Tokenizer>,
        template: Option<&ChatTemplate>,
        opts: &PairOptions,
    ) -> Result<()> {
        if raw.trim().is_empty() {
            return Ok(());
        }
        self.rows += 1;
        // A UTF-8 byte-order mark (a Windows editor's, or one `cat` carried into the middle of
        // a file) is accepted, as SFT rows accept it.
        let row = crate::formats::strip_bom(raw);
        let max_seq_len = opts.max_seq_len;
        let mut pair = match parse_row(row, tok, template, opts.vocab, max_seq_len) {
            Ok(p) => p,
            Err(e) => {
                let (count, samples) = (&mut self.bad_rows, &mut self.bad_row_samples);
                return skip_or_fail(e, path, line, opts.on_bad_row, count, samples);
            }
        };
        let unpaired = pair.label.is_some();
        if pair.prompt.len() >= max_seq_len {
            self.dropped += 1;
            return Ok(());
        }
        let room = max_seq_len - pair.prompt.len();
        if pair.chosen.len() > room || pair.rejected.len() > room {
            if opts.truncation == Truncation::Drop {
                self.dropped += 1;
                return Ok(());
            }
            self.truncated += 1;
            pair.chosen.truncate(room);
            pair.rejected.truncate(room);
        }
        // Targets of a completion after the shift: position i predicts token i + 1, so after an
        // empty prompt the completion's first token has none.
        let targets = |c: &[u32]| c.len().saturating_sub(usize::from(pair.prompt.is_empty()));
        if targets(&pair.chosen) == 0 || (!unpaired && targets(&pair.rejected) == 0) {
            self.no_target += 1;
            return Ok(());
        }
        if !unpaired && pair.chosen == pair.rejected {
            self.identical += 1;
        }
        self.pairs.push(pair);
        Ok(())
    }
}

/// The id fields a pre-tokenized row may hold.
const ID_FIELDS: [&str; 4] = ["prompt_ids", "chosen_ids", "rejected_ids", "completion_ids"];

/// One row as a [`Pair`]; the error says what is wrong with it (the caller adds file and line).
/// Pre-tokenized rows are read without a parse tree ([`crate::ids`]), at most `max_seq_len` + 1
/// ids a field kept (a longer completion is cut or dropped at `max_seq_len` anyway; a prompt
/// that long drops the pair).
fn parse_row(
    row: &str,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    vocab: usize,
    max_seq_len: usize,
) -> RowResult<Pair> {
    let keys = crate::ids::keys(row)?;
    if ID_FIELDS.iter().any(|k| keys.iter().any(|x| x == k)) {
        let names = ID_FIELDS.map(|k| (k, None));
        let keep = max_seq_len.saturating_add(1);
        let r = crate::ids::read_row(row, &names, vocab, keep)?;
        if r.keys.iter().any(|k| k == "label" || k == "completion_ids") {
            // KTO's pre-tokenized row; its label is read from the parse tree (small without
            // the ids, which are left out of it).
            let v: Value = serde_json::from_str(row).map_err(|e| format!("not valid JSON: {e}"))?;
            let obj = v.as_object().ok_or("a preference row is a JSON object")?;
            let label = unpaired_label(obj)?;
            let ids = |k: &str, at: usize| ids_field(k, &r.fields[at], &r.keys, vocab);
            if !r.keys.iter().any(|k| k == "completion_ids") {
                return Err(format!(
                    "an unpaired preference row needs `completion_ids` (has: {})",
                    r.keys.join(", ")
                )
                .into());
            }
            return Ok(Pair {
                prompt: ids("prompt_ids", 0)?,
                chosen: ids("completion_ids", 3)?,
                rejected: Vec::new(),
                reference: None,
                reference_long: None,
                label: Some(label),
            });
        }
        let ids = |k: &str, at: usize| ids_field(k, &r.fields[at], &r.keys, vocab);
        return Ok(Pair {
            prompt: ids("prompt_ids", 0)?,
            chosen: ids("chosen_ids", 1)?,
            rejected: ids("rejected_ids", 2)?,
            reference: None,
            reference_long: None,
            label: None,
        });
    }
    let v: Value = serde_json::from_str(row).map_err(|e| format!("not valid JSON: {e}"))?;
    parse_value(&v, tok, template)
}

/// A pre-tokenized field's ids, or what is wrong with it.
fn ids_field(k: &str, f: &crate::ids::Field, keys: &[String], vocab: usize) -> RowResult<Vec<u32>> {
    use crate::ids::Field;
    match f {
        Field::Missing => Err(format!(
            "a pre-tokenized preference row needs `{k}` (has: {})",
            keys.join(", ")
        )
        .into()),
        Field::Null | Field::NotArray(_) => {
            Err(format!("`{k}` must be an array of token ids").into())
        }
        Field::Array {
            not_int: Some(x), ..
        } => Err(format!("`{k}` must hold non-negative integers, found {x}").into()),
        Field::Array {
            out_of_range: Some(id),
            ..
        } if *id < 0 => Err(format!("`{k}` must hold non-negative integers, found {id}").into()),
        Field::Array {
            out_of_range: Some(id),
            ..
        } => Err(
            format!("`{k}` holds token id {id}, outside the model's vocabulary of {vocab}").into(),
        ),
        Field::Array { ids, .. } => Ok(ids.iter().map(|&i| i as u32).collect()),
    }
}

/// An unpaired row's boolean `label`.
fn unpaired_label(obj: &serde_json::Map<String, Value>) -> RowResult<bool> {
    match obj.get("label") {
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(format!(
            "`label` must be true (a desirable completion) or false, found {other}"
        )
        .into()),
        None => Err(format!(
            "an unpaired preference row needs `prompt`, `completion` and a boolean `label` \
             (has: {})",
            obj.keys().cloned().collect::<Vec<_>>().join(", ")
        )
        .into()),
    }
}

/// A text or conversational row (pre-tokenized ones are read by [`parse_row`]) as a [`Pair`].
fn parse_value(
    v: &Value,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
) -> RowResult<Pair> {
    let obj = v.as_object().ok_or("a preference row is a JSON object")?;
    let keys = || obj.keys().cloned().collect::<Vec<_>>().join(", ");
    if ["label", "completion"].iter().any(|k| obj.contains_key(*k)) {
        return unpaired_row(obj, tok, template);
    }
    if let Some(Value::Array(prompt)) = obj.get("prompt") {
        let side = |k: &str| match obj.get(k) {
            Some(Value::Array(m)) => Ok(m),
            Some(_) => Err(format!(
                "`prompt` holds chat messages, so `{k}` must too (an array of messages)"
            )),
            None => Err(format!(
                "a conversational preference row needs `chosen` and `rejected` messages; `{k}` \
                 is missing (has: {})",
                keys()
            )),
        };
        let (chosen, rejected) = (side("chosen")?, side("rejected")?);
        let tok = tok.ok_or_else(|| {
            RowError::Fatal("conversational preference rows need the model's tokenizer.json".into())
        })?;
        let template = template.ok_or_else(|| {
            RowError::Fatal(
                "conversational preference rows need a chat template, and the model has none (a \
                 base model?): set [data] chat_template = \"path.jinja\""
                    .into(),
            )
        })?;
        return chat_pair(tok, template, prompt, chosen, rejected);
    }
    let text = |k: &str| -> std::result::Result<&str, String> {
        match obj.get(k) {
            Some(Value::String(s)) => Ok(s),
            Some(Value::Array(_)) => Err(format!(
                "`{k}` holds chat messages while `prompt` is text: give all three as messages \
                 or all three as text"
            )),
            Some(other) => Err(format!("`{k}` must be a string, found {other}")),
            None => Err(format!(
                "a preference row needs `prompt`, `chosen` and `rejected` (or their `_ids` \
                 forms); `{k}` is missing (has: {})",
                keys()
            )),
        }
    };
    let (prompt, chosen, rejected) = (text("prompt")?, text("chosen")?, text("rejected")?);
    let tok = tok.ok_or_else(|| {
        RowError::Fatal(
            "text preference rows need the model's tokenizer.json (or give pre-tokenized \
             `prompt_ids`, `chosen_ids`, `rejected_ids`)"
                .into(),
        )
    })?;
    tokenize_pair(tok, prompt, chosen, rejected).map_err(|e| RowError::Fatal(e.to_string()))
}

/// An unpaired (KTO) row of text or messages: `prompt` and `completion`, and a boolean `label`;
/// tokenized as a pair's side is.
fn unpaired_row(
    obj: &serde_json::Map<String, Value>,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
) -> RowResult<Pair> {
    let keys = || obj.keys().cloned().collect::<Vec<_>>().join(", ");
    let label = unpaired_label(obj)?;
    // Parsed as a pair whose two completions are the row's one (`rejected` replaced below).
    let mut o = obj.clone();
    o.remove("label");
    let c = o.remove("completion").ok_or_else(|| {
        format!(
            "an unpaired preference row needs `completion` (has: {})",
            keys()
        )
    })?;
    for k in ["chosen", "rejected"] {
        o.insert(k.into(), c.clone());
    }
    let mut p = parse_value(&Value::Object(o), tok, template)?;
    p.rejected.clear();
    p.label = Some(label);
    Ok(p)
}

/// TRL's KL completions for unpaired rows, in blocks of `block` rows in order (its dataset map
/// over batches of `per_device_train_batch_size`): each row's `rejected` becomes the previous
/// row's completion, the first row's the block's last, cut so prompt + completion fits
/// `max_seq_len`.
pub fn assign_kl_completions(rows: &mut [Pair], block: usize, max_seq_len: usize) {
    for chunk in rows.chunks_mut(block.max(1)) {
        let completions: Vec<Vec<u32>> = chunk.iter().map(|p| p.chosen.clone()).collect();
        let n = chunk.len();
        for (i, p) in chunk.iter_mut().enumerate() {
            let mut c = completions[(i + n - 1) % n].clone();
            c.truncate(max_seq_len.saturating_sub(p.prompt.len()));
            p.rejected = c;
        }
    }
}

/// TRL's tokenization of a conversational pair (module docs).
fn chat_pair(
    tok: &Tokenizer,
    template: &ChatTemplate,
    prompt: &[Value],
    chosen: &[Value],
    rejected: &[Value],
) -> RowResult<Pair> {
    let render = |msgs: Vec<&Value>, generation_prompt: bool| -> RowResult<Vec<u32>> {
        let row = serde_json::json!({ "messages": msgs }).to_string();
        let conv = Conversation::from_json(&row)?;
        // The template's `raise_exception` refusing the conversation is the row's fault; any
        // other template or tokenizer failure is not.
        let text = conv
            .render(template, conv.len(), generation_prompt)
            .map_err(|e| match e {
                TemplateError::Raised { .. } => RowError::Bad(e.to_string()),
                e => RowError::Fatal(e.to_string()),
            })?;
        tok.encode(&text, false)
            .map_err(|e| RowError::Fatal(e.to_string()))
    };
    let p = render(prompt.iter().collect(), true)?;
    let pc = render(prompt.iter().chain(chosen).collect(), false)?;
    let pr = render(prompt.iter().chain(rejected).collect(), false)?;
    Ok(split_at_prefix(p, pc, pr))
}

/// TRL's split: the completions start where the tokenized prompt and each prompt + completion
/// diverge (the shorter of the two common prefixes).
fn split_at_prefix(p: Vec<u32>, pc: Vec<u32>, pr: Vec<u32>) -> Pair {
    let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let n = common(&p, &pc).min(common(&p, &pr));
    Pair {
        prompt: p[..n].to_vec(),
        chosen: pc[n..].to_vec(),
        rejected: pr[n..].to_vec(),
        reference: None,
        reference_long: None,
        label: None,
    }
}

/// TRL's tokenization of a text pair (module docs).
fn tokenize_pair(tok: &Tokenizer, prompt: &str, chosen: &str, rejected: &str) -> Result<Pair> {
    let eos = tok
        .eos_id
        .map(|id| tok.decode(&[id], false))
        .transpose()?
        .unwrap_or_default();
    let with_eos = |s: &str| match eos.is_empty() || s.ends_with(&eos) {
        true => s.to_string(),
        false => format!("{s}{eos}"),
    };
    let p = tok.encode(prompt, true)?;
    let pc = tok.encode(&format!("{prompt}{}", with_eos(chosen)), true)?;
    let pr = tok.encode(&format!("{prompt}{}", with_eos(rejected)), true)?;
    Ok(split_at_prefix(p, pc, pr))
}

/// A micro-batch of pairs: `2b` rows, the `b` chosen sequences then the `b` rejected ones
/// (prompt + completion, right-padded to the longest), targets on the completion tokens, and on
/// the chosen rows' prompt tokens too when an objective's NLL term covers them (ORPO).
#[derive(Debug, Clone)]
pub struct PairBatch {
    pub batch: MicroBatch,
    /// Per position: its target is a completion token (what the log-probabilities sum).
    pub completion: Vec<bool>,
    /// The pairs' reference log-probabilities `(chosen, rejected)`, when computed.
    pub reference: Vec<Option<[f64; 2]>>,
    /// Unpaired rows' labels (KTO; `None` for pairs).
    pub labels: Vec<Option<bool>>,
    /// Completion tokens of each row (`2b`): IPO and SimPO average over them.
    pub completion_tokens: Vec<usize>,
}

impl PairBatch {
    /// The batch of `pairs`; `prompt_nll`: the chosen rows' prompt tokens are targets too.
    pub fn new(pairs: &[&Pair], pad_id: u32, prompt_nll: bool) -> Self {
        Self::padded(pairs, pad_id, prompt_nll, 1)
    }

    /// The batch of `pairs` as a model whose RoPE factors depend on the batch's length runs it
    /// (LongRoPE: the long factors past `long_past` positions): in a batch that long, each pair
    /// takes its reference under the long factors (`Pair::reference_long`) where it has one,
    /// so a pair's reference is always computed as its policy is (issue 46).
    pub fn with_rope(
        pairs: &[&Pair],
        pad_id: u32,
        prompt_nll: bool,
        long_past: Option<usize>,
    ) -> Self {
        let mut pb = Self::new(pairs, pad_id, prompt_nll);
        if long_past.is_some_and(|past| pb.batch.t > past) {
            for (r, p) in pb.reference.iter_mut().zip(pairs) {
                if p.reference_long.is_some() {
                    *r = p.reference_long;
                }
            }
        }
        pb
    }

    /// [`new`](Self::new) with rows right-padded to at least `min_t` positions (padding after a
    /// row changes none of its causal results, only a length-dependent choice such as LongRoPE's).
    pub fn padded(pairs: &[&Pair], pad_id: u32, prompt_nll: bool, min_t: usize) -> Self {
        let b = pairs.len();
        let seqs: Vec<(&[u32], &[u32])> = pairs
            .iter()
            .map(|p| (p.prompt.as_slice(), p.chosen.as_slice()))
            .chain(
                pairs
                    .iter()
                    .map(|p| (p.prompt.as_slice(), p.rejected.as_slice())),
            )
            .collect();
        let t = seqs
            .iter()
            .map(|(p, c)| p.len() + c.len())
            .max()
            .unwrap_or(1)
            .max(min_t.max(1));
        let mut input_ids = vec![pad_id; 2 * b * t];
        let mut targets = vec![None; 2 * b * t];
        let mut completion = vec![false; 2 * b * t];
        let mut tokens = 0;
        for (r, (p, c)) in seqs.iter().enumerate() {
            let row = &mut input_ids[r * t..];
            row[..p.len()].copy_from_slice(p);
            row[p.len()..p.len() + c.len()].copy_from_slice(c);
            tokens += p.len() + c.len();
            // Position i predicts token i + 1: the completion's tokens are predicted from
            // positions p.len() − 1 .. p.len() + c.len() − 2, the prompt's from 0 .. p.len() − 2.
            for (k, &id) in c.iter().enumerate() {
                if let Some(at) = (p.len() + k).checked_sub(1) {
                    targets[r * t + at] = Some(id);
                    completion[r * t + at] = true;
                }
            }
            if prompt_nll && r < b {
                for (k, &id) in p.iter().enumerate().skip(1) {
                    targets[r * t + k - 1] = Some(id);
                }
            }
        }
        Self {
            batch: MicroBatch {
                b: 2 * b,
                t,
                input_ids,
                positions: (0..2 * b).flat_map(|_| 0..t as u32).collect(),
                targets,
                tokens,
                lens: seqs.iter().map(|(p, c)| p.len() + c.len()).collect(),
                segments: None,
            },
            completion,
            reference: pairs.iter().map(|p| p.reference).collect(),
            labels: pairs.iter().map(|p| p.label).collect(),
            completion_tokens: seqs.iter().map(|(_, c)| c.len()).collect(),
        }
    }

    /// Pairs in the batch.
    pub fn pairs(&self) -> usize {
        self.reference.len()
    }

    /// Each row's summed log-probability of its completion from every position's NLL (`2b`
    /// values, chosen rows first).
    pub fn row_logps(&self, nll: &[f32]) -> Vec<f64> {
        let t = self.batch.t;
        nll.chunks(t)
            .zip(self.completion.chunks(t))
            .map(|(row, c)| {
                -row.iter()
                    .zip(c)
                    .filter(|(_, &c)| c)
                    .map(|(&x, _)| x as f64)
                    .sum::<f64>()
            })
            .collect()
    }

    /// Targets on the chosen rows (completions, and prompts with `prompt_nll`): an NLL term's
    /// tokens.
    pub fn chosen_targets(&self) -> usize {
        let n = self.pairs() * self.batch.t;
        self.batch.targets[..n]
            .iter()
            .filter(|t| t.is_some())
            .count()
    }
}

/// A pair's length in tokens orders it in a [`crate::Batcher`] (length grouping).
impl crate::batch::Row for Pair {
    fn tokens(&self) -> usize {
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(p: &[u32], c: &[u32], r: &[u32]) -> Pair {
        Pair {
            prompt: p.to_vec(),
            chosen: c.to_vec(),
            rejected: r.to_vec(),
            reference: None,
            reference_long: None,
            label: None,
        }
    }

    /// TRL's `DataCollatorForPreference` docstring example: the same rows, the chosen first,
    /// and targets exactly on the completion tokens (its `completion_mask` shifted by one).
    #[test]
    fn pair_batch_lays_out_rows_as_trl() {
        let a = pair(&[1, 2, 3], &[4, 5], &[6]);
        let b = pair(&[7, 8], &[9], &[10, 11]);
        let pb = PairBatch::new(&[&a, &b], 0, false);
        let m = &pb.batch;
        assert_eq!((m.b, m.t), (4, 5));
        #[rustfmt::skip]
        assert_eq!(m.input_ids, vec![
            1, 2, 3, 4, 5,
            7, 8, 9, 0, 0,
            1, 2, 3, 6, 0,
            7, 8, 10, 11, 0,
        ]);
        let s = |x: u32| Some(x);
        #[rustfmt::skip]
        assert_eq!(m.targets, vec![
            None, None, s(4), s(5), None,
            None, s(9), None, None, None,
            None, None, s(6), None, None,
            None, s(10), s(11), None, None,
        ]);
        assert_eq!(pb.completion_tokens, vec![2, 1, 1, 2]);
        assert_eq!(m.tokens, 5 + 3 + 4 + 4);
        let nll: Vec<f32> = (0..20).map(|i| i as f32).collect();
        assert_eq!(pb.row_logps(&nll)[1], -6.0, "the completion's one target");
        // ORPO's NLL term: the chosen rows' prompt tokens are targets too, not completion.
        let pb = PairBatch::new(&[&a, &b], 0, true);
        #[rustfmt::skip]
        assert_eq!(pb.batch.targets[..10], [
            s(2), s(3), s(4), s(5), None,
            s(8), s(9), None, None, None,
        ]);
        assert_eq!(
            pb.batch.targets[10..],
            m.targets[10..],
            "rejected rows unchanged"
        );
        assert_eq!(
            (pb.chosen_targets(), pb.row_logps(&nll)[0]),
            (6, -(2.0 + 3.0))
        );
    }

    #[test]
    fn rows_parse_truncate_drop_and_report() {
        let path = Path::new("prefs.jsonl");
        let text = "{\"prompt_ids\":[1,2],\"chosen_ids\":[3,4,5],\"rejected_ids\":[6]}\n\n\
                    {\"prompt_ids\":[1,2,3,4],\"chosen_ids\":[5],\"rejected_ids\":[6]}\n\
                    {\"prompt_ids\":[1],\"chosen_ids\":[5],\"rejected_ids\":[5]}\n";
        let set = parse_pairs(text, path, None, None, &PairOptions::new(4, 10)).unwrap();
        assert_eq!(
            (set.rows, set.truncated, set.dropped, set.identical),
            (3, 1, 1, 1)
        );
        assert_eq!((set.no_target, set.oversized, set.bad_rows), (0, 0, 0));
        assert_eq!(set.pairs[0], pair(&[1, 2], &[3, 4], &[6]));
        // One-line errors naming the file, the line and the key.
        let bad = "{\"prompt\":\"a\",\"chosen\":\"b\"}\n";
        let e = parse_pairs(bad, path, None, None, &PairOptions::new(8, 10))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("prefs.jsonl:1: ") && e.contains("`rejected` is missing"),
            "{e}"
        );
        let bad = "\n{\"prompt_ids\":[1],\"chosen_ids\":[12],\"rejected_ids\":[3]}";
        let e = parse_pairs(bad, path, None, None, &PairOptions::new(8, 10))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("prefs.jsonl:2: ") && e.contains("token id 12"),
            "{e}"
        );
        let e = parse_pairs(
            "{\"prompt\":\"a\",\"chosen\":\"b\",\"rejected\":\"c\"}",
            path,
            None,
            None,
            &PairOptions::new(8, 10),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("need the model's tokenizer.json"), "{e}");
    }

    /// Issue 46: `[data]`'s row settings apply to pairs: `truncation = "drop"` drops a pair
    /// that does not fit, `on_bad_row = "skip"` counts a malformed row (a missing tokenizer
    /// still stops the load), `max_row_bytes` drops a row unread; a BOM is accepted; a pair
    /// with no token to train on is dropped and counted.
    #[test]
    fn row_settings_bom_and_pairs_without_targets() {
        let path = Path::new("p.jsonl");
        let text = "\u{feff}{\"prompt_ids\":[1],\"chosen_ids\":[2,3,4],\"rejected_ids\":[5]}\n\
                    {\"prompt_ids\":[1],\"chosen_ids\":[2],\"rejected_ids\":[5]}\n\
                    {\"prompt_ids\":[],\"chosen_ids\":[2],\"rejected_ids\":[5,6]}\n\
                    {\"prompt_ids\":[1],\"chosen_ids\":[],\"rejected_ids\":[5]}\n\
                    {\"prompt_ids\":[1],\"chosen_ids\":\n\
                    {\"prompt_ids\":[1],\"chosen_ids\":[2],\"rejected_ids\":[5],\"x\":\"a longer row\"}\n";
        let opts = PairOptions {
            truncation: Truncation::Drop,
            on_bad_row: OnBadRow::Skip,
            max_row_bytes: 64,
            ..PairOptions::new(3, 10)
        };
        let set = parse_pairs(text, path, None, None, &opts).unwrap();
        let counts = (
            set.rows,
            set.dropped,
            set.no_target,
            set.bad_rows,
            set.oversized,
        );
        assert_eq!(counts, (6, 1, 2, 1, 1));
        assert_eq!(set.pairs, [pair(&[1], &[2], &[5])]);
        assert!(set.bad_row_samples[0].starts_with("p.jsonl:5: not valid JSON"));
        // The defaults: the long pair cut (the BOM row kept), the bad row an error.
        let cut = PairOptions::new(3, 10);
        let e = parse_pairs(text, path, None, None, &cut).unwrap_err();
        assert!(
            e.to_string().starts_with("p.jsonl:5: not valid JSON"),
            "{e}"
        );
        let set = parse_pairs(
            &text[..text
                .find("\n{\"prompt_ids\":[1],\"chosen_ids\":\n")
                .unwrap()],
            path,
            None,
            None,
            &cut,
        )
        .unwrap();
        assert_eq!((set.truncated, set.pairs[0].chosen.len()), (1, 2));
        // Not the row's fault: never skipped.
        let e = parse_pairs(
            "{\"prompt\":\"a\",\"chosen\":\"b\",\"rejected\":\"c\"}",
            path,
            None,
            None,
            &opts,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("need the model's tokenizer.json"),
            "{e}"
        );
    }

    /// The file is streamed: a row over `max_row_bytes` is passed over unread (here 64 MiB of
    /// NULs in a sparse file, which the whole-file read held in memory), and a FIFO or a device
    /// is refused at once.
    #[test]
    fn load_pairs_streams_a_regular_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("p.jsonl");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(64 << 20).unwrap();
        drop(f);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .and_then(|mut f| {
                std::io::Write::write_all(
                    &mut f,
                    b"\n{\"prompt_ids\":[1],\"chosen_ids\":[2],\"rejected_ids\":[3]}\r\n",
                )
            })
            .unwrap();
        let opts = PairOptions {
            max_row_bytes: 1 << 20,
            ..PairOptions::new(8, 10)
        };
        let set = load_pairs(&p, None, None, &opts).unwrap();
        assert_eq!((set.rows, set.oversized, set.pairs.len()), (2, 1, 1));
        let e = load_pairs(Path::new("/dev/zero"), None, None, &opts).unwrap_err();
        assert!(e.to_string().contains("is a character device"), "{e}");
    }

    /// KTO's unpaired rows: pre-tokenized `completion_ids` with a boolean `label` (anything else
    /// refused naming the line), the KL completions cycled within blocks as TRL builds them.
    #[test]
    fn unpaired_rows_and_their_kl_completions() {
        let path = Path::new("kto.jsonl");
        let text = "{\"prompt_ids\":[1],\"completion_ids\":[2,3],\"label\":true}\n\
                    {\"prompt_ids\":[1,4],\"completion_ids\":[5],\"label\":false}\n\
                    {\"prompt_ids\":[6],\"completion_ids\":[7,8,9],\"label\":true}\n";
        let mut set = parse_pairs(text, path, None, None, &PairOptions::new(4, 10)).unwrap();
        assert_eq!((set.rows, set.dropped, set.identical), (3, 0, 0));
        let labels: Vec<_> = set.pairs.iter().map(|p| p.label).collect();
        assert_eq!(labels, [Some(true), Some(false), Some(true)]);
        // Blocks of 2: [row 0, row 1], [row 2]; each takes the previous row's completion, cut
        // to fit max_seq_len 4 after its prompt.
        assign_kl_completions(&mut set.pairs, 2, 4);
        let kl: Vec<&[u32]> = set.pairs.iter().map(|p| p.rejected.as_slice()).collect();
        assert_eq!(kl, [&[5][..], &[2, 3][..], &[7, 8, 9][..]]);
        for (bad, want) in [
            (
                "{\"prompt_ids\":[1],\"completion_ids\":[2],\"label\":1}",
                "`label` must be true",
            ),
            (
                "{\"prompt\":\"a\",\"completion\":\"b\"}",
                "a boolean `label`",
            ),
            (
                "{\"prompt_ids\":[1],\"label\":true}",
                "needs `completion_ids`",
            ),
        ] {
            let e = parse_pairs(bad, path, None, None, &PairOptions::new(8, 10))
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("kto.jsonl:1: ") && e.contains(want), "{e}");
        }
    }
}
