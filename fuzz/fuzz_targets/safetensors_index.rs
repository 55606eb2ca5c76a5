//! A model directory from an untrusted source: arbitrary `model.safetensors.index.json` text (the
//! first half of the input) and arbitrary bytes as the shard it may name (the second half),
//! opened by the weight loader. Shard names that leave the directory must be refused, malformed
//! headers reported — never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;

fuzz_target!(|data: &[u8]| {
    let (index, shard) = data.split_at(data.len() / 2);
    // Pure check of the index's shard list.
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(index) {
        if let Ok(names) = rtune_model::weights::index_shards(&v) {
            for n in names {
                assert!(!n.contains('/') && n != ".." && n != ".", "{n}");
            }
        }
    }
    // Through the loader, in a scratch directory of this process.
    let dir: PathBuf = std::env::temp_dir().join(format!("rtune-fuzz-index-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("model.safetensors.index.json"), index);
    let _ = std::fs::write(dir.join("model-00001-of-00001.safetensors"), shard);
    let _ = rtune_model::weights::Weights::open(&dir, candle_core::DType::F32, &candle_core::Device::Cpu);
});
