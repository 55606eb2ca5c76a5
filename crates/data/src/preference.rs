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
//! otherwise each completion is cut so prompt + completion fits.
//!
//! A micro-batch of `b` pairs is `2b` right-padded rows, the chosen sequences first, then the
//! rejected (TRL's concatenated batch); targets are the completion tokens only.

use serde_json::Value;
use std::path::Path;

use crate::{ChatTemplate, Conversation, DataError, MicroBatch, Result, Tokenizer};

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
    /// Pairs left out: the prompt alone fills `max_seq_len`, or a completion is empty.
    pub dropped: usize,
    /// Pairs whose chosen and rejected completions are the same tokens (no preference signal:
    /// kept, as TRL keeps them, and reported).
    pub identical: usize,
}

/// Reads a preference JSONL file (formats above). `tok` is needed for text rows; `vocab` bounds
/// pre-tokenized ids.
/// Conversational rows need `template` (the model's or `[data] chat_template`, with
/// `chat_template_kwargs` set).
pub fn load_pairs(
    path: &Path,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    max_seq_len: usize,
    vocab: usize,
) -> Result<PairSet> {
    // Held whole while parsed: preference sets are small next to SFT corpora (UltraFeedback's
    // 64k pairs are ~0.5 GB as text); a cap keeps a wrong path (a device, a huge file) from
    // filling memory.
    let kind = rtune_fsio::FileKind::Sized {
        cap: 8 << 30,
        name: "preference data",
    };
    let text = rtune_fsio::read_string_bounded(path, kind).map_err(|e| DataError::File {
        path: path.to_path_buf(),
        message: format!("cannot read preference data: {e}"),
    })?;
    parse_pairs(&text, path, tok, template, max_seq_len, vocab)
}

/// [`load_pairs`] on text already read; `path` labels errors.
pub fn parse_pairs(
    text: &str,
    path: &Path,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    max_seq_len: usize,
    vocab: usize,
) -> Result<PairSet> {
    let mut set = PairSet::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        set.rows += 1;
        let row_err = |message: String| DataError::Row {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let v: Value =
            serde_json::from_str(line).map_err(|e| row_err(format!("not valid JSON: {e}")))?;
        let mut pair = parse_row(&v, tok, template, vocab).map_err(row_err)?;
        let unpaired = pair.label.is_some();
        if pair.prompt.len() >= max_seq_len
            || pair.chosen.is_empty()
            || (!unpaired && pair.rejected.is_empty())
        {
            set.dropped += 1;
            continue;
        }
        let room = max_seq_len - pair.prompt.len();
        if pair.chosen.len() > room || pair.rejected.len() > room {
            set.truncated += 1;
            pair.chosen.truncate(room);
            pair.rejected.truncate(room);
        }
        if !unpaired && pair.chosen == pair.rejected {
            set.identical += 1;
        }
        set.pairs.push(pair);
    }
    Ok(set)
}

/// One row as a [`Pair`]; the error says what is wrong with it (the caller adds file and line).
fn parse_row(
    v: &Value,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    vocab: usize,
) -> std::result::Result<Pair, String> {
    let obj = v
        .as_object()
        .ok_or_else(|| "a preference row is a JSON object".to_string())?;
    let keys = || obj.keys().cloned().collect::<Vec<_>>().join(", ");
    if ["label", "completion", "completion_ids"]
        .iter()
        .any(|k| obj.contains_key(*k))
    {
        return unpaired_row(obj, tok, template, vocab);
    }
    if obj.contains_key("prompt_ids") || obj.contains_key("chosen_ids") {
        let ids = |k: &str| -> std::result::Result<Vec<u32>, String> {
            let a = obj
                .get(k)
                .ok_or_else(|| {
                    format!(
                        "a pre-tokenized preference row needs `{k}` (has: {})",
                        keys()
                    )
                })?
                .as_array()
                .ok_or_else(|| format!("`{k}` must be an array of token ids"))?;
            a.iter()
                .map(|x| match x.as_u64() {
                    Some(id) if (id as usize) < vocab => Ok(id as u32),
                    Some(id) => Err(format!(
                        "`{k}` holds token id {id}, outside the model's vocabulary of {vocab}"
                    )),
                    None => Err(format!("`{k}` must hold non-negative integers, found {x}")),
                })
                .collect()
        };
        return Ok(Pair {
            prompt: ids("prompt_ids")?,
            chosen: ids("chosen_ids")?,
            rejected: ids("rejected_ids")?,
            reference: None,
            reference_long: None,
            label: None,
        });
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
        let tok = tok.ok_or("conversational preference rows need the model's tokenizer.json")?;
        let template = template.ok_or(
            "conversational preference rows need a chat template, and the model has none (a \
             base model?): set [data] chat_template = \"path.jinja\"",
        )?;
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
        "text preference rows need the model's tokenizer.json (or give pre-tokenized `prompt_ids`, \
         `chosen_ids`, `rejected_ids`)"
            .to_string()
    })?;
    tokenize_pair(tok, prompt, chosen, rejected).map_err(|e| e.to_string())
}

/// An unpaired (KTO) row: `prompt` and `completion` as text, messages or `_ids`, and a boolean
/// `label`; tokenized as a pair's side is.
fn unpaired_row(
    obj: &serde_json::Map<String, Value>,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    vocab: usize,
) -> std::result::Result<Pair, String> {
    let keys = || obj.keys().cloned().collect::<Vec<_>>().join(", ");
    let label = match obj.get("label") {
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(format!(
                "`label` must be true (a desirable completion) or false, found {other}"
            ))
        }
        None => {
            return Err(format!(
                "an unpaired preference row needs `prompt`, `completion` and a boolean `label` \
                 (has: {})",
                keys()
            ))
        }
    };
    // Parsed as a pair whose two completions are the row's one (`rejected` replaced below):
    // `completion_ids` as `chosen_ids` / `rejected_ids` when pre-tokenized, `completion` as
    // `chosen` / `rejected` otherwise.
    let (from, to) = match obj.contains_key("prompt_ids") {
        true => ("completion_ids", ["chosen_ids", "rejected_ids"]),
        false => ("completion", ["chosen", "rejected"]),
    };
    let mut o = obj.clone();
    o.remove("label");
    let c = o.remove(from).ok_or_else(|| {
        format!(
            "an unpaired preference row needs `{from}` (has: {})",
            keys()
        )
    })?;
    for k in to {
        o.insert(k.into(), c.clone());
    }
    let mut p = parse_row(&Value::Object(o), tok, template, vocab)?;
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
) -> std::result::Result<Pair, String> {
    let render = |msgs: Vec<&Value>, generation_prompt: bool| {
        let row = serde_json::json!({ "messages": msgs }).to_string();
        let conv = Conversation::from_json(&row)?;
        let text = conv
            .render(template, conv.len(), generation_prompt)
            .map_err(|e| e.to_string())?;
        tok.encode(&text, false).map_err(|e| e.to_string())
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
        let set = parse_pairs(text, path, None, None, 4, 10).unwrap();
        assert_eq!(
            (set.rows, set.truncated, set.dropped, set.identical),
            (3, 1, 1, 1)
        );
        assert_eq!(set.pairs[0], pair(&[1, 2], &[3, 4], &[6]));
        // One-line errors naming the file, the line and the key.
        let bad = "{\"prompt\":\"a\",\"chosen\":\"b\"}\n";
        let e = parse_pairs(bad, path, None, None, 8, 10)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("prefs.jsonl:1: ") && e.contains("`rejected` is missing"),
            "{e}"
        );
        let bad = "\n{\"prompt_ids\":[1],\"chosen_ids\":[12],\"rejected_ids\":[3]}";
        let e = parse_pairs(bad, path, None, None, 8, 10)
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
            8,
            10,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("need the model's tokenizer.json"), "{e}");
    }

    /// KTO's unpaired rows: pre-tokenized `completion_ids` with a boolean `label` (anything else
    /// refused naming the line), the KL completions cycled within blocks as TRL builds them.
    #[test]
    fn unpaired_rows_and_their_kl_completions() {
        let path = Path::new("kto.jsonl");
        let text = "{\"prompt_ids\":[1],\"completion_ids\":[2,3],\"label\":true}\n\
                    {\"prompt_ids\":[1,4],\"completion_ids\":[5],\"label\":false}\n\
                    {\"prompt_ids\":[6],\"completion_ids\":[7,8,9],\"label\":true}\n";
        let mut set = parse_pairs(text, path, None, None, 4, 10).unwrap();
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
            let e = parse_pairs(bad, path, None, None, 8, 10)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("kto.jsonl:1: ") && e.contains(want), "{e}");
        }
    }
}
