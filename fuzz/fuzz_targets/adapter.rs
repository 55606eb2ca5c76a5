//! The PEFT adapter loader on an arbitrary config and arbitrary safetensors bytes, for a model with
//! two q_proj modules (8 → 8, r 2). The first byte splits the input between the two files.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rtune_lora::{Adapter, LoraSpec, ModuleShape};

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let split = (data[0] as usize * data.len() / 256).max(1).min(data.len());
    let (config, weights) = data[1..].split_at(split - 1);
    let spec = LoraSpec::new(2, 4.0, 0.0, false, &["q_proj".to_string()]).unwrap();
    let modules: Vec<ModuleShape> = (0..2)
        .map(|i| ModuleShape {
            name: format!("model.layers.{i}.self_attn.q_proj"),
            in_features: 8,
            out_features: 8,
            experts: 1,
        })
        .collect();
    let dir = std::path::Path::new("fuzz-adapter");
    let _ = Adapter::from_peft_bytes(
        config,
        weights,
        dir,
        &spec,
        &modules,
        &candle_core::Device::Cpu,
    );
});
