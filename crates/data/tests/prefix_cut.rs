//! Rows cut to a byte budget before tokenizing (issue 19) give exactly the examples that
//! tokenizing the whole row and truncating gives: same ids, same labels (completion-only and
//! assistant-only loss masks included), same truncate/drop/skip decision and counts.
//!
//! Checked on the eight tokenizers the repository holds (six chat-model tokenizers and the two
//! test models, all byte-level BPE split by the GPT-2 regex), on two harder variants of tiny-llama
//! made here (no pre-tokenizer split: the whole row is one BPE word, as in Llama-2's
//! sentencepiece-style tokenizer; and the same with an NFKC normalizer, which changes lengths),
//! over seeded mixed texts: prose, code, runs of spaces and newlines, digits, CJK, emoji, a
//! literal `</s>`, and long runs of one letter.

use rtune_data::chat::{render_spans, tokenize};
use rtune_data::{
    parse_jsonl_with, ChatTemplate, Conversation, DataOptions, Example, Format, RowParser,
    Tokenizer, TrainOn, Truncation, IGNORE,
};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every tokenizer directory in the repository, plus the variants of tiny-llama.
fn tokenizers(tmp: &Path) -> Vec<(String, Tokenizer)> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(manifest().join("tests/chat/models"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    dirs.push(manifest().join("../../tests/fixtures/tiny-llama"));
    dirs.push(manifest().join("../../tests/fixtures/tiny-llama3"));
    let base = manifest().join("../../tests/fixtures/tiny-llama");
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(base.join("tokenizer.json")).unwrap())
            .unwrap();
    for (name, normalizer) in [
        ("one-word", Value::Null),
        ("one-word-nfkc", json!({"type": "NFKC"})),
    ] {
        let mut j = json.clone();
        j["pre_tokenizer"]["use_regex"] = json!(false);
        j["normalizer"] = normalizer;
        let d = tmp.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("tokenizer.json"), j.to_string()).unwrap();
        std::fs::copy(
            base.join("tokenizer_config.json"),
            d.join("tokenizer_config.json"),
        )
        .unwrap();
        dirs.push(d);
    }
    dirs.into_iter()
        .map(|d| {
            let name = d.file_name().unwrap().to_string_lossy().to_string();
            (name, Tokenizer::load(&d, Some(2)).unwrap())
        })
        .collect()
}

/// A seeded mix of the texts tokenizers treat differently, about `bytes` long.
fn text(seed: u64, bytes: usize) -> String {
    const PIECES: [&str; 14] = [
        "The quick brown fox jumps over the lazy dog. ",
        "fn main() {\n    let x = vec![1, 2, 3];\n}\n",
        "      ",
        "\n\n\n",
        "1234567890 3.14159 ",
        "日本語のテキストと中文文本。",
        "😀🚀✨ ",
        "</s>",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "ﬁne ﬂow ①②③ ",
        "\t\tindent\r\n",
        "don't won't it's ",
        "Ünïcödé çàfé ",
        "x",
    ];
    let mut s = String::new();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    while s.len() < bytes {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(PIECES[(state >> 33) as usize % PIECES.len()]);
    }
    s
}

/// `encode_prefix` gives the first `need` tokens of the whole encoding (or all of it), and does
/// cut a long text (the returned count is `need`, not the whole).
#[test]
fn encode_prefix_is_a_prefix_of_the_whole_encoding() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cut = 0;
    for (name, tok) in tokenizers(tmp.path()) {
        for seed in 0..6u64 {
            let t = text(seed, 40_000);
            let (whole, whole_off) = tok.encode_with_offsets(&t, true).unwrap();
            for need in [1usize, 17, 257, 1025] {
                let (ids, off) = tok.encode_prefix(&t, true, need).unwrap();
                let n = ids.len();
                assert!(
                    n == whole.len() || n == need,
                    "{name} seed {seed} need {need}: {n} tokens"
                );
                assert_eq!(ids[..], whole[..n], "{name} seed {seed} need {need}");
                assert_eq!(off[..], whole_off[..n], "{name} seed {seed} need {need}");
                if n < whole.len() {
                    cut += 1;
                }
            }
            // A short text is encoded whole.
            let short = &t[..t.char_indices().nth(40).unwrap().0];
            assert_eq!(
                tok.encode_prefix(short, true, 1000).unwrap().0,
                tok.encode(short, true).unwrap()
            );
        }
    }
    // 10 tokenizers × 6 texts × 4 budgets; every budget needs far less than 40 kB here, so each
    // case must have been cut (a fall-back to the whole text would still be correct, but slow).
    assert_eq!(cut, 10 * 6 * 4, "every long text was cut");
}

/// The example a whole row gives, truncated as `parse_chunk` does: the reference.
fn reference(ex: Example, opts: &DataOptions) -> (Option<Example>, [usize; 3]) {
    let max = opts.max_seq_len;
    let mut ex = ex;
    let mut counts = [0usize; 3]; // truncated, dropped, skipped
    if ex.input_ids.len() > max {
        if opts.truncation == Truncation::Drop {
            counts[1] += 1;
            return (None, counts);
        }
        ex.input_ids.truncate(max);
        ex.labels.truncate(max);
        counts[0] += 1;
    }
    if ex.target_tokens() == 0 {
        counts[2] += 1;
        return (None, counts);
    }
    (Some(ex), counts)
}

/// prompt (with BOS, no loss) + completion (loss) + EOS (loss), all tokenized whole.
fn whole_completion(tok: &Tokenizer, prompt: &str, completion: &str) -> Example {
    let mut ids = tok.encode(prompt, true).unwrap();
    let mut labels = vec![IGNORE; ids.len()];
    let c = tok.encode(completion, false).unwrap();
    labels.extend(c.iter().map(|&i| i as i64));
    ids.extend(c);
    ids.push(tok.eos_id.unwrap());
    labels.push(tok.eos_id.unwrap() as i64);
    Example {
        input_ids: ids,
        labels,
    }
}

fn check_row(row: &Value, want: Example, tok: &Tokenizer, opts: &DataOptions, what: &str) -> usize {
    let line = row.to_string() + "\n";
    let (want, counts) = reference(want, opts);
    let format = rtune_data::detect_format(&line, 1, Path::new("d.jsonl"), opts).unwrap();
    let p = RowParser::new(Path::new("d.jsonl"), format, Some(tok), opts, 1 << 20).unwrap();
    let d = p.parse_chunk(&line, 1).unwrap();
    assert_eq!(d.examples.first(), want.as_ref(), "{what}");
    assert_eq!([d.truncated, d.dropped, d.skipped], counts, "{what}");
    counts[0] + counts[1]
}

/// Prompt/completion, Alpaca and text rows: long prompts (all of `max_seq_len` is prompt: no
/// target, skipped), long completions (the cut falls inside the loss), short rows, under both
/// truncation settings.
#[test]
fn cut_rows_give_the_examples_of_whole_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let mut long = 0;
    for (name, tok) in tokenizers(tmp.path()) {
        for truncation in [Truncation::Truncate, Truncation::Drop] {
            for max in [16usize, 200] {
                let mut opts = DataOptions::new(max);
                opts.truncation = truncation;
                for (seed, (pl, cl)) in [(30_000, 9), (40, 30_000), (300, 30_000), (20, 15)]
                    .into_iter()
                    .enumerate()
                {
                    let (p, c) = (text(seed as u64, pl), text(seed as u64 + 100, cl));
                    let what =
                        format!("{name} {truncation:?} max {max} prompt {pl} completion {cl}");
                    let row = json!({"prompt": p, "completion": c});
                    long += check_row(&row, whole_completion(&tok, &p, &c), &tok, &opts, &what);
                    let row = json!({"instruction": p, "output": c});
                    let prompt = format!("Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{p}\n\n### Response:\n");
                    let want = whole_completion(&tok, &prompt, &c);
                    long += check_row(&row, want, &tok, &opts, &format!("alpaca {what}"));
                    let row = json!({"text": p});
                    let mut ids = tok.encode(&p, true).unwrap();
                    ids.push(tok.eos_id.unwrap());
                    let labels = ids.iter().map(|&i| i as i64).collect();
                    let want = Example {
                        input_ids: ids,
                        labels,
                    };
                    long += check_row(&row, want, &tok, &opts, &format!("text {what}"));
                }
            }
        }
    }
    assert!(long > 200, "the long rows were long: {long}");
}

/// Chat rows through the six model templates and tiny-llama's: a long user turn (no loss before
/// the cut), a long assistant turn (the cut inside the loss), several turns; assistant-only and
/// all-token loss.
#[test]
fn cut_chat_rows_give_the_examples_of_whole_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs: Vec<(String, Tokenizer)> = tokenizers(tmp.path())
        .into_iter()
        .filter(|(n, _)| !n.starts_with("one-word") && n != "tiny-llama3")
        .collect();
    assert_eq!(dirs.len(), 7);
    let mut long = 0;
    for (name, tok) in &dirs {
        let template = ChatTemplate::from_tokenizer(tok).unwrap().unwrap();
        for train_on in [TrainOn::Assistant, TrainOn::All] {
            for (i, (u, a)) in [(20_000, 30), (30, 20_000), (500, 500)]
                .into_iter()
                .enumerate()
            {
                let row = json!({"messages": [
                    {"role": "user", "content": text(i as u64, u)},
                    {"role": "assistant", "content": text(i as u64 + 7, a)},
                    {"role": "user", "content": text(i as u64 + 8, 50)},
                    {"role": "assistant", "content": text(i as u64 + 9, 4_000)},
                ]});
                let conv = Conversation::from_json(&row.to_string()).unwrap();
                let r = render_spans(&template, &conv, train_on, &tok.special_tokens()).unwrap();
                let whole = tokenize(tok, &template, &r, train_on, usize::MAX).unwrap();
                for max in [64usize, 700] {
                    let mut opts = DataOptions::new(max);
                    opts.format = Some(Format::Chat);
                    opts.train_on = train_on;
                    let what = format!("{name} {train_on:?} max {max} user {u} assistant {a}");
                    long += check_row(&row, whole.clone(), tok, &opts, &what);
                }
            }
        }
    }
    assert!(long > 50, "the long rows were long: {long}");
    // The public one-call path agrees too.
    let tok = &dirs[0].1;
    let row = json!({"prompt": text(1, 50_000), "completion": "x"}).to_string();
    let d = parse_jsonl_with(
        &format!("{row}\n{{\"prompt\": \"a\", \"completion\": \"b\"}}\n"),
        Path::new("d.jsonl"),
        Some(tok),
        &DataOptions::new(32),
        1 << 20,
    )
    .unwrap();
    assert_eq!((d.rows, d.truncated, d.skipped), (2, 1, 1));
}
