//! The PEFT adapter as PEFT saves it: `adapter_model.safetensors` copied byte for byte and
//! `adapter_config.json` with every key kept but `base_model_name_or_path`, which is set to a base
//! that resolves where the export is used (the run recorded the path as written in its config,
//! often relative to the directory training ran in).

use std::path::Path;

use rtune_fsio::{write_atomic, Privacy};
use rtune_lora::{ADAPTER_CONFIG, ADAPTER_WEIGHTS};

use crate::{ExportError, Result};

/// Writes the PEFT adapter of `adapter_dir` into `dest` (an existing directory) with
/// `base_model_name_or_path = base_name`; returns the file names written.
pub fn export_peft(
    adapter_dir: &Path,
    dest: &Path,
    base_name: &str,
    privacy: Privacy,
) -> Result<Vec<String>> {
    // Refuses what rtune cannot vouch for (other PEFT types, ...) before copying anything.
    rtune_lora::read_adapter_config(adapter_dir)?;
    let wpath = adapter_dir.join(ADAPTER_WEIGHTS);
    let adapter = rtune_fsio::FileKind::Sized {
        cap: 64 << 30,
        name: "LoRA adapter",
    };
    let weights = rtune_fsio::read_bounded(&wpath, adapter)
        .map_err(|e| ExportError::input(&wpath, format!("cannot read: {e}")))?;
    safetensors::SafeTensors::read_metadata(&weights)
        .map_err(|e| ExportError::input(&wpath, format!("not a safetensors file: {e}")))?;
    let cpath = adapter_dir.join(ADAPTER_CONFIG);
    let text = rtune_fsio::read_bounded(&cpath, rtune_fsio::FileKind::ModelConfig)
        .map_err(|e| ExportError::input(&cpath, format!("cannot read: {e}")))?;
    let mut cfg: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| ExportError::input(&cpath, format!("not JSON: {e}")))?;
    let obj = cfg
        .as_object_mut()
        .ok_or_else(|| ExportError::input(&cpath, "not a JSON object"))?;
    obj.insert(
        "base_model_name_or_path".into(),
        serde_json::Value::String(base_name.to_string()),
    );
    write_atomic(&dest.join(ADAPTER_WEIGHTS), &weights, privacy)?;
    let text = serde_json::to_string_pretty(&cfg).expect("JSON value serialises");
    write_atomic(&dest.join(ADAPTER_CONFIG), text.as_bytes(), privacy)?;
    Ok(vec![ADAPTER_WEIGHTS.into(), ADAPTER_CONFIG.into()])
}
