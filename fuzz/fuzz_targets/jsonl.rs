//! The JSONL reader on arbitrary bytes (pre-tokenized rows need no tokenizer).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = rtune_data::parse_jsonl(&text, std::path::Path::new("fuzz.jsonl"), None, 16, 512);
});
