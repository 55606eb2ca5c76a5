//! Qwen3's real chat template (`tests/fixtures/qwen3-chat/`, Qwen/Qwen3-0.6B's, Apache-2.0) on
//! multi-turn conversations with reasoning: the template drops the `<think>` block of every
//! assistant turn a user query follows, so the renders of the first turns are not prefixes of the
//! whole. The golden (`tests/parity/make_qwen3_chat_golden.py`, transformers 5.24.0) gives per
//! conversation and `enable_thinking` (unset, true, false): the text, the ids, and the assistant
//! spans found in the final render; rtune must equal them position by position.

mod common;
use common::ints;
use rtune_data::chat::{render_spans, tokenize};
use rtune_data::{
    parse_jsonl_with, ChatTemplate, Conversation, DataOptions, Tokenizer, TrainOn, IGNORE,
};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-chat")
}

fn golden() -> Value {
    let text = std::fs::read_to_string(dir().join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn with_thinking(t: &ChatTemplate, case: &Value) -> ChatTemplate {
    match &case["enable_thinking"] {
        Value::Null => t.clone(),
        v => t.clone().with_var("enable_thinking", v),
    }
}

#[test]
fn the_fixture_template_is_qwen3s() {
    let tok = Tokenizer::load(&dir(), None).unwrap();
    let t = ChatTemplate::from_tokenizer(&tok).unwrap().unwrap();
    let file = std::fs::read_to_string(dir().join("qwen3-0.6b.jinja")).unwrap();
    assert_eq!(t.source(), file);
    assert!(file.contains("last_query_index") && file.contains("enable_thinking"));
}

#[test]
fn qwen3_masks_equal_transformers_position_by_position() {
    let g = golden();
    let tok = Tokenizer::load(&dir(), None).unwrap();
    let base = ChatTemplate::from_tokenizer(&tok).unwrap().unwrap();
    let specials = tok.special_tokens();
    let cases = g["cases"].as_array().unwrap();
    assert!(cases.len() >= 18, "{}", cases.len());
    let mut rewritten = 0;
    for case in cases {
        let name = format!("{}/{}", case["name"], case["enable_thinking"]);
        let t = with_thinking(&base, case);
        let conv = Conversation::from_json(case["row"].as_str().unwrap()).unwrap();
        conv.check_trainable().unwrap();
        let r = render_spans(&t, &conv, TrainOn::Assistant, &specials)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(r.text, case["text"].as_str().unwrap(), "{name}: text");
        let spans: Vec<Vec<usize>> = r.trained.iter().map(|s| vec![s.start, s.end]).collect();
        let want: Vec<Vec<usize>> = case["spans"]
            .as_array()
            .unwrap()
            .iter()
            .map(ints::<usize>)
            .collect();
        assert_eq!(spans, want, "{name}: spans");
        let ex = tokenize(&tok, &t, &r, TrainOn::Assistant, usize::MAX).unwrap();
        assert_eq!(ex.input_ids, ints::<u32>(&case["input_ids"]), "{name}: ids");
        assert_eq!(ex.labels, ints::<i64>(&case["labels"]), "{name}: labels");
        // The conversations are ones where the prefix renders are not prefixes of the whole.
        let first = conv
            .roles()
            .iter()
            .position(|r| *r == rtune_data::chat::Role::Assistant);
        let upto = conv.render(&t, first.unwrap() + 1, false).unwrap();
        if !r.text.starts_with(&upto) {
            rewritten += 1;
        }
    }
    assert!(rewritten >= 12, "{rewritten}");
}

/// Through the row parser, as training and `rtune data inspect` load rows: `enable_thinking`
/// from `chat_template_kwargs` changes what is trained in the last turn.
#[test]
fn chat_template_kwargs_reach_the_template() {
    let g = golden();
    let tok = Tokenizer::load(&dir(), None).unwrap();
    for case in g["cases"].as_array().unwrap() {
        let mut o = DataOptions::new(4096);
        if let Value::Bool(b) = case["enable_thinking"] {
            o.chat_template_kwargs = vec![("enable_thinking".into(), Value::Bool(b))];
        }
        let row = case["row"].as_str().unwrap();
        let d =
            parse_jsonl_with(row, Path::new("d.jsonl"), Some(&tok), &o, tok.vocab_size()).unwrap();
        let name = format!("{}/{}", case["name"], case["enable_thinking"]);
        assert_eq!(d.examples.len(), 1, "{name}");
        let labels = &d.examples[0].labels;
        assert_eq!(*labels, ints::<i64>(&case["labels"]), "{name}");
        assert!(labels.iter().any(|&l| l != IGNORE));
    }
}
