//! The preference loader on arbitrary bytes (pre-tokenized pairs and KTO rows need no tokenizer):
//! the first byte picks the `[data]` settings (truncation, on_bad_row, a small max_row_bytes),
//! the rest is the file.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rtune_data::preference::{parse_pairs, PairOptions};
use rtune_data::{OnBadRow, Truncation};

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, rest)) = data.split_first() else {
        return;
    };
    let opts = PairOptions {
        truncation: match knobs & 1 {
            0 => Truncation::Truncate,
            _ => Truncation::Drop,
        },
        on_bad_row: match knobs & 2 {
            0 => OnBadRow::Error,
            _ => OnBadRow::Skip,
        },
        max_row_bytes: match knobs & 4 {
            0 => usize::MAX,
            _ => 64,
        },
        ..PairOptions::new(16, 512)
    };
    let text = String::from_utf8_lossy(rest);
    let path = std::path::Path::new("fuzz.jsonl");
    if let Ok(mut set) = parse_pairs(&text, path, None, None, &opts) {
        // What training does next with unpaired rows.
        rtune_data::preference::assign_kl_completions(&mut set.pairs, 2, 16);
    }
});
