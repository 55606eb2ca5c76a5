use super::*;
use crate::{load_jsonl, load_jsonl_with, parse_jsonl_with};
use std::path::PathBuf;

fn write(name: &str, body: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("rtune-data-{}-{name}", std::process::id()));
    std::fs::write(&p, body).unwrap();
    p
}

/// tests/fixtures/tiny-llama: byte-level BPE, `<s>`=1 added on encode, `</s>`=2, and a chat
/// template that starts with `{{ bos_token }}`.
fn tiny() -> Tokenizer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    Tokenizer::load(&dir, None).unwrap()
}

fn parse(body: &str, opts: &DataOptions) -> Result<Dataset> {
    parse_jsonl_with(body, Path::new("d.jsonl"), Some(&tiny()), opts, 512)
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
            ":2: row is text but earlier rows are tokens",
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
    let body = "{\"input_ids\":[1,2,3,4,5]}\n{\"input_ids\":[1,2,3],\"labels\":[-100,-100,-100]}\n{\"input_ids\":[1,2]}\n";
    let p = write("long.jsonl", body);
    let d = load_jsonl(&p, None, 3, 10).unwrap();
    assert_eq!((d.examples.len(), d.truncated, d.skipped), (2, 1, 1));
    assert_eq!(d.examples[0].input_ids, vec![1, 2, 3]);
    // truncation = "drop": the long row is left out, not cut.
    let mut o = DataOptions::new(3);
    o.truncation = Truncation::Drop;
    let d = parse_jsonl_with(body, &p, None, &o, 10).unwrap();
    assert_eq!((d.examples.len(), d.dropped, d.truncated), (1, 1, 0));
    assert_eq!(d.examples[0].input_ids, vec![1, 2]);
    // Nothing left is an error that says where the rows went.
    let e = parse_jsonl_with("{\"input_ids\":[1,2,3,4,5]}\n", &p, None, &o, 10)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no example left of 1 rows: 1 longer than max_seq_len 3 (dropped)"),
        "{e}"
    );
}

#[test]
fn bad_rows_error_by_default_and_are_counted_when_skipped() {
    let body = concat!(
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"bot\", \"content\": \"yo\"}]}\n",
        "not json\n",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"\"}]}\n",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
        "{\"text\": \"other format\"}\n",
    );
    let e = parse(body, &DataOptions::new(64)).unwrap_err().to_string();
    assert_eq!(
        e,
        "d.jsonl:2: messages[1].role is \"bot\"; expected system, user, assistant or tool"
    );
    let mut o = DataOptions::new(64);
    o.on_bad_row = OnBadRow::Skip;
    let d = parse(body, &o).unwrap();
    assert_eq!((d.rows, d.examples.len(), d.bad_rows), (6, 1, 5));
    assert_eq!(
        d.bad_row_samples,
        [
            "d.jsonl:2: messages[1].role is \"bot\"; expected system, user, assistant or tool",
            "d.jsonl:3: not valid JSON: expected ident at line 1 column 2",
            "d.jsonl:4: messages[1] (assistant) is empty",
            "d.jsonl:5: no assistant turn to train on",
            "d.jsonl:6: row is text but earlier rows are chat",
        ]
    );
    // All rows bad: an error, not an empty run.
    let e = parse("{\"messages\": []}\n", &o).unwrap_err().to_string();
    assert!(
        e.contains("no example left of 1 rows: 1 malformed (skipped)"),
        "{e}"
    );
}

#[test]
fn setup_problems_are_never_skipped() {
    let mut o = DataOptions::new(64);
    o.on_bad_row = OnBadRow::Skip;
    let e = parse_jsonl_with("{\"text\": \"a\"}\n", Path::new("d.jsonl"), None, &o, 512)
        .unwrap_err()
        .to_string();
    assert_eq!(e, "d.jsonl:1: text rows need the model's tokenizer.json");
}

#[test]
fn explicit_format_is_required_of_every_row() {
    let mut o = DataOptions::new(64);
    o.format = Some(Format::PromptCompletion);
    let e = parse("{\"text\": \"a\"}\n", &o).unwrap_err().to_string();
    assert_eq!(e, "d.jsonl:1: missing `prompt`");
    assert_eq!(Format::parse_setting("auto"), Ok(None));
    assert_eq!(Format::parse_setting("chat"), Ok(Some(Format::Chat)));
    let e = Format::parse_setting("csv").unwrap_err();
    assert!(e.contains("\"alpaca\"") && e.contains("\"auto\""), "{e}");
    assert_eq!("skip".parse(), Ok(OnBadRow::Skip));
    assert_eq!("drop".parse(), Ok(Truncation::Drop));
    assert_eq!("all".parse(), Ok(TrainOn::All));
}

/// The Alpaca prompt is Stanford Alpaca's, with or without an input; the loss is on the output and
/// the EOS only.
#[test]
fn alpaca_rows_train_on_the_output_and_eos() {
    let tok = tiny();
    let body = concat!(
        "{\"instruction\": \"Add.\", \"input\": \"2 2\", \"output\": \"4\"}\n",
        "{\"instruction\": \"Greet.\", \"input\": \"\", \"output\": \"Hello\"}\n",
    );
    let d = parse(body, &DataOptions::new(512)).unwrap();
    assert_eq!(d.format, Format::Alpaca);
    let prompts = [
        "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\nAdd.\n\n### Input:\n2 2\n\n### Response:\n",
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\nGreet.\n\n### Response:\n",
    ];
    for ((ex, prompt), output) in d.examples.iter().zip(prompts).zip(["4", "Hello"]) {
        let p = tok.encode(prompt, true).unwrap();
        let o = tok.encode(output, false).unwrap();
        let mut ids = p.clone();
        ids.extend(&o);
        ids.push(2);
        assert_eq!(ex.input_ids, ids);
        let trained: Vec<u32> = ex
            .labels
            .iter()
            .filter(|&&l| l != IGNORE)
            .map(|&l| l as u32)
            .collect();
        assert_eq!(
            tok.decode(&trained, false).unwrap(),
            format!("{output}</s>")
        );
    }
    let e = parse(
        "{\"instruction\": \"x\", \"output\": \" \"}\n",
        &DataOptions::new(64),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(e, "d.jsonl:1: `output` is empty");
}

/// tiny-llama's template starts with `{{ bos_token }}` and its tokenizer adds `<s>` too: the
/// example must hold one BOS, and exactly the assistant contents plus their `</s>`.
#[test]
fn chat_rows_use_the_models_template_without_doubling_bos() {
    let tok = tiny();
    let body = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}, {\"role\": \"user\", \"content\": \"more\"}, {\"role\": \"assistant\", \"content\": \"ok\"}]}\n";
    let d = parse(body, &DataOptions::new(512)).unwrap();
    let ex = &d.examples[0];
    assert_eq!(&ex.input_ids[..2], &[1, tok.encode("<", false).unwrap()[0]]);
    assert_eq!(ex.input_ids.iter().filter(|&&i| i == 1).count(), 1);
    let text =
        "<s><|user|>\nhi</s>\n<|assistant|>\nyo</s>\n<|user|>\nmore</s>\n<|assistant|>\nok</s>\n";
    assert_eq!(ex.input_ids, tok.encode(text, false).unwrap());
    let trained: Vec<u32> = ex
        .labels
        .iter()
        .filter(|&&l| l != IGNORE)
        .map(|&l| l as u32)
        .collect();
    assert_eq!(tok.decode(&trained, false).unwrap(), "yo</s>ok</s>");
    // train_on = "all": every token.
    let mut o = DataOptions::new(512);
    o.train_on = TrainOn::All;
    let d = parse(body, &o).unwrap();
    let all: Vec<i64> = d.examples[0].input_ids.iter().map(|&i| i as i64).collect();
    assert_eq!(d.examples[0].labels, all);
}

/// The cache parses chunks of a file on all cores with one parser.
#[test]
fn row_parser_is_shared_across_threads() {
    fn sync<T: Sync>() {}
    sync::<RowParser<'static>>();
}

/// A UTF-8 byte-order mark (Windows editors) and CRLF endings are accepted and give exactly the
/// rows an LF file gives; invalid UTF-8 names its line; a stray CR is named when a row is bad.
#[test]
fn bom_crlf_and_invalid_utf8() {
    let lf = "{\"prompt\": \"Q: a\", \"completion\": \" b\"}\n{\"text\": \"x\"}\n";
    let lf = &lf[..lf.find("{\"text").unwrap()];
    let lf = format!("{lf}{{\"prompt\": \"Q: c\", \"completion\": \" d\"}}\n");
    let windows = format!("\u{feff}{}", lf.replace('\n', "\r\n"));
    let opts = DataOptions::new(64);
    let a = parse(&lf, &opts).unwrap();
    let b = parse(&windows, &opts).unwrap();
    assert_eq!(a.examples.len(), 2);
    assert_eq!(
        a.examples.iter().map(|e| &e.input_ids).collect::<Vec<_>>(),
        b.examples.iter().map(|e| &e.input_ids).collect::<Vec<_>>()
    );
    // Through the file reader too (the BOM is in the file's first bytes).
    let p = write("bom.jsonl", &windows);
    let c = load_jsonl_with(&p, Some(&tiny()), &opts, 512).unwrap();
    assert_eq!(c.examples.len(), 2);
    // Something else wrong on a CRLF line: the line is named as usual.
    let bad = format!("\u{feff}{}{{\"prompt\": 3}}\r\n", lf.replace('\n', "\r\n"));
    let e = parse(&bad, &opts).unwrap_err().to_string();
    assert!(e.starts_with("d.jsonl:3:"), "{e}");
    // Old Mac CR-only endings: one long line, and the CR is named as the likely cause.
    let e = parse(&lf.replace('\n', "\r"), &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("carriage return"), "{e}");
    // Invalid UTF-8: the line and the byte are named.
    let p = std::env::temp_dir().join(format!("rtune-data-{}-latin1.jsonl", std::process::id()));
    let mut bytes = lf.clone().into_bytes();
    bytes.extend_from_slice(b"{\"text\": \"caf\xe9\"}\n");
    std::fs::write(&p, &bytes).unwrap();
    let e = load_jsonl_with(&p, Some(&tiny()), &opts, 512)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(":3: not valid UTF-8 (byte 14 of the line)"),
        "{e}"
    );
}
