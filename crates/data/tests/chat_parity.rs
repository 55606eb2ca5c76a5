//! Chat templates against transformers: for six real templates (Llama-3.2, Qwen2.5, Mistral v0.2,
//! Gemma-2, Mistral-Nemo, DeepSeek-Coder; `tests/chat/templates/`, sources in
//! `tests/chat/README.md`), the
//! goldens that `tests/chat/make_goldens.py` made with `apply_chat_template` give, per
//! conversation:
//! - the rendered text, compared byte for byte (or the template's `raise_exception` message);
//! - the token ids of `apply_chat_template(tokenize=True)`, compared exactly (so BOS is single);
//! - the labels, written by the generator from the text each template is known to print for an
//!   assistant turn (not from rtune's algorithm), compared exactly, and decoded back to those texts.

mod common;
use common::ints;
use rtune_data::chat::{render_spans, tokenize, ChatError};
use rtune_data::{
    parse_jsonl_with, ChatTemplate, Conversation, DataError, DataOptions, OnBadRow, TemplateError,
    Tokenizer, TrainOn, IGNORE,
};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chat")
}

fn goldens() -> Value {
    let text = std::fs::read_to_string(chat_dir().join("goldens.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

struct Model {
    name: String,
    tok: Tokenizer,
    template: ChatTemplate,
    cases: Vec<Value>,
}

fn models() -> Vec<Model> {
    let g = goldens();
    g["models"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, m)| {
            let dir = chat_dir().join(m["dir"].as_str().unwrap());
            let tok = Tokenizer::load(&dir, None).unwrap();
            let template = ChatTemplate::from_tokenizer(&tok).unwrap().unwrap();
            Model {
                name: name.clone(),
                tok,
                template,
                cases: m["cases"].as_array().unwrap().clone(),
            }
        })
        .collect()
}

fn with_vars(t: &ChatTemplate, case: &Value) -> ChatTemplate {
    let mut t = t.clone();
    for (k, v) in case["vars"].as_object().unwrap() {
        t = t.with_var(k, v);
    }
    t
}

#[test]
fn goldens_cover_every_template_and_case_kind() {
    let ms = models();
    let names: Vec<&str> = ms.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "deepseek-coder",
            "gemma-2",
            "llama-3.2",
            "mistral-nemo",
            "mistral-v0.2",
            "qwen2.5"
        ]
    );
    let all: Vec<&Value> = ms.iter().flat_map(|m| &m.cases).collect();
    let count = |f: &dyn Fn(&Value) -> bool| all.iter().filter(|c| f(c)).count();
    assert!(count(&|c| c.get("labels").is_some()) >= 20);
    assert!(count(&|c| c.get("error").is_some()) >= 5);
    assert!(count(&|c| c["add_generation_prompt"] == true) >= 8);
}

/// The template read from tokenizer_config.json is the stored .jinja file, byte for byte, and a
/// `.jinja` override loads the same.
#[test]
fn templates_load_from_config_and_from_a_file() {
    let g = goldens();
    for m in models() {
        let path = chat_dir().join(g["models"][&m.name]["template"].as_str().unwrap());
        let file = ChatTemplate::from_file(&path, &m.tok).unwrap();
        assert_eq!(m.template.source(), file.source(), "{}", m.name);
        assert_eq!(m.template.bos_token(), file.bos_token(), "{}", m.name);
    }
}

#[test]
fn renders_are_byte_identical_to_transformers() {
    let mut checked = 0;
    for m in models() {
        for case in &m.cases {
            let name = format!("{}/{}", m.name, case["name"].as_str().unwrap());
            let t = with_vars(&m.template, case);
            let conv = Conversation::from_json(case["row"].as_str().unwrap()).unwrap();
            let agp = case["add_generation_prompt"].as_bool().unwrap();
            let got = conv.render(&t, conv.len(), agp);
            match (case.get("text"), case.get("error")) {
                (Some(want), _) => {
                    let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
                    let want = want.as_str().unwrap();
                    // strftime_now prints today's date; the golden holds a placeholder there.
                    let got = match want.find("{TODAY}") {
                        Some(at) => format!("{}{{TODAY}}{}", &got[..at], &got[at + 11..]),
                        None => got,
                    };
                    assert_eq!(got, want, "{name}");
                }
                (None, Some(err)) => match got {
                    Err(TemplateError::Raised { message }) => {
                        assert_eq!(message, err.as_str().unwrap(), "{name}")
                    }
                    other => panic!("{name}: expected the template to raise, got {other:?}"),
                },
                _ => panic!("{name}: golden has neither text nor error"),
            }
            checked += 1;
        }
    }
    assert!(checked >= 40, "{checked}");
}

/// The trained tokens are exactly each assistant turn's text through its end-of-turn token; ids
/// are transformers' (one BOS); labels equal the generator's, which it derived independently.
#[test]
fn masks_train_exactly_the_assistant_turns() {
    let mut checked = 0;
    for m in models() {
        let specials = m.tok.special_tokens();
        for case in m.cases.iter().filter(|c| c.get("labels").is_some()) {
            let name = format!("{}/{}", m.name, case["name"].as_str().unwrap());
            let t = with_vars(&m.template, case);
            let conv = Conversation::from_json(case["row"].as_str().unwrap()).unwrap();
            let r = render_spans(&t, &conv, TrainOn::Assistant, &specials).unwrap();
            let ex = tokenize(&m.tok, &t, &r, TrainOn::Assistant, usize::MAX).unwrap();
            assert_eq!(ex.input_ids, ints::<u32>(&case["input_ids"]), "{name}: ids");
            assert_eq!(ex.labels, ints::<i64>(&case["labels"]), "{name}: labels");
            // Each trained run of tokens decodes to one assistant turn, end token included.
            let turns: Vec<String> = case["trained_turns"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_string())
                .collect();
            let mut runs: Vec<Vec<u32>> = Vec::new();
            let mut prev_trained = false;
            for &l in &ex.labels {
                if l != IGNORE {
                    if !prev_trained {
                        runs.push(Vec::new());
                    }
                    runs.last_mut().unwrap().push(l as u32);
                }
                prev_trained = l != IGNORE;
            }
            let decoded: Vec<String> = runs
                .iter()
                .map(|r| m.tok.decode(r, false).unwrap())
                .collect();
            assert_eq!(decoded, turns, "{name}: trained text");
            // The end-of-turn token (EOS for Mistral and Llama-3.2) is trained.
            let eot = turns.last().unwrap();
            let last_special = specials.iter().find(|s| eot.ends_with(s.as_str())).unwrap();
            let eot_id = m.tok.encode(last_special, false).unwrap();
            assert!(
                ex.labels.contains(&(eot_id[0] as i64)),
                "{name}: no end token"
            );
            // BOS appears once (the template prints it; the tokenizer must not add another).
            if let Some(bos) = m.tok.bos_id {
                let n = ex.input_ids.iter().filter(|&&i| i == bos).count();
                assert_eq!(n, 1, "{name}: BOS count");
                assert_eq!(ex.input_ids[0], bos, "{name}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked}");
}

/// Mistral-Nemo moves the system prompt into the last user turn, so the render of the first turn
/// is not a prefix of the whole conversation: rtune refuses to guess a mask.
#[test]
fn a_template_that_is_not_prefix_stable_is_refused() {
    let m = models()
        .into_iter()
        .find(|m| m.name == "mistral-nemo")
        .unwrap();
    let case = m
        .cases
        .iter()
        .find(|c| c.get("mask_error").is_some())
        .unwrap();
    let conv = Conversation::from_json(case["row"].as_str().unwrap()).unwrap();
    let e = render_spans(
        &m.template,
        &conv,
        TrainOn::Assistant,
        &m.tok.special_tokens(),
    )
    .unwrap_err();
    assert!(
        matches!(e, ChatError::NotPrefixStable { turn: 2, .. }),
        "{e}"
    );
    // Through the row parser it stops the load even with on_bad_row = "skip".
    let mut o = DataOptions::new(4096);
    o.on_bad_row = OnBadRow::Skip;
    let row = format!("{}\n", case["row"].as_str().unwrap());
    let e = parse_jsonl_with(&row, Path::new("d.jsonl"), Some(&m.tok), &o, 1 << 20).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("d.jsonl:1: the chat template is not prefix-stable at messages[2]"),
        "{e}"
    );
}

/// Whole files: every trainable golden conversation as a JSONL row gives the golden example; a
/// conversation the template refuses is a `file:line:` error carrying the template's message, or a
/// counted skip.
#[test]
fn jsonl_rows_match_the_goldens_and_refusals_are_bad_rows() {
    for m in models() {
        let trainable: Vec<&Value> = m
            .cases
            .iter()
            .filter(|c| c.get("labels").is_some())
            .collect();
        let mut opts = DataOptions::new(4096);
        opts.chat_template = Some(with_vars(&m.template, trainable[0]));
        let body: String = trainable
            .iter()
            .map(|c| format!("{}\n", c["row"].as_str().unwrap()))
            .collect();
        let d =
            parse_jsonl_with(&body, Path::new("d.jsonl"), Some(&m.tok), &opts, 1 << 20).unwrap();
        assert_eq!(d.examples.len(), trainable.len(), "{}", m.name);
        for (ex, c) in d.examples.iter().zip(&trainable) {
            assert_eq!(ex.input_ids, ints::<u32>(&c["input_ids"]), "{}", m.name);
            assert_eq!(ex.labels, ints::<i64>(&c["labels"]), "{}", m.name);
        }
        let Some(refused) = m
            .cases
            .iter()
            .find(|c| c.get("error").is_some() && c["add_generation_prompt"] == false)
        else {
            continue;
        };
        let body = format!("{body}{}\n", refused["row"].as_str().unwrap());
        let line = trainable.len() + 1;
        let e = parse_jsonl_with(&body, Path::new("d.jsonl"), Some(&m.tok), &opts, 1 << 20)
            .unwrap_err();
        let want = format!(
            "d.jsonl:{line}: the chat template refused this conversation: {}",
            refused["error"].as_str().unwrap()
        );
        assert_eq!(e.to_string(), want, "{}", m.name);
        assert!(
            matches!(
                e,
                DataError::RowTemplate {
                    source: TemplateError::Raised { .. },
                    ..
                }
            ),
            "{}",
            m.name
        );
        opts.on_bad_row = OnBadRow::Skip;
        let d =
            parse_jsonl_with(&body, Path::new("d.jsonl"), Some(&m.tok), &opts, 1 << 20).unwrap();
        assert_eq!(
            (d.examples.len(), d.bad_rows),
            (trainable.len(), 1),
            "{}",
            m.name
        );
        assert_eq!(d.bad_row_samples, [want], "{}", m.name);
    }
}
