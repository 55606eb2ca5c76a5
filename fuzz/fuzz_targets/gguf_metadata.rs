//! A GGUF file from an untrusted source: arbitrary bytes through the bounded walk over its header,
//! metadata and tensor infos (`rtune_gguf::scan`, here under small caps so that the fuzzer reaches
//! them). Whatever the walk accepts must parse in candle's reader within the memory it counted (no
//! panic: `general.alignment = 0` divided by zero there), and then convert or be refused as
//! `rtune convert gguf` does (config.json, the tokenizer, the tensors checked against the
//! metadata) — never a panic, an abort or runaway memory.
#![no_main]
use candle_core::quantized::gguf_file::Content;
use libfuzzer_sys::fuzz_target;
use rtune_gguf::scan::{scan, Limits};
use std::path::{Path, PathBuf};

const LIMITS: Limits = Limits {
    max_string: 1 << 16,
    max_name: 256,
    max_array: 1 << 12,
    max_entries: 256,
    max_memory: 8 << 20,
};

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    let Ok(scanned) = scan(data, data.len() as u64, path, &LIMITS) else {
        return;
    };
    assert!(scanned.memory <= LIMITS.max_memory);
    let Ok(c) = Content::read(&mut std::io::Cursor::new(data)) else {
        return;
    };
    assert_eq!(c.metadata.len() as u64, scanned.entries);
    assert_eq!(c.tensor_infos.len() as u64, scanned.tensors);
    // The whole conversion, in a scratch directory of this process (`convert` scans again with
    // its own, larger caps: the input is small).
    let dir: PathBuf = std::env::temp_dir().join(format!("rtune-fuzz-gguf-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let file = dir.join("m.gguf");
    let out = dir.join("hf");
    let _ = std::fs::remove_dir_all(&out);
    if std::fs::write(&file, data).is_ok() {
        if let Err(e) = rtune_gguf::convert(&file, &out) {
            assert!(!e.to_string().contains('\n'), "{e}");
        }
    }
});
