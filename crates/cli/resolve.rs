//! Model resolution, shared by every command that loads a model: a local Hugging Face directory, a
//! llama `.gguf` file (converted once into the cache) or a hub id (downloaded once), see
//! `rtune_hub`. Says where the model came from when that is not the path itself.

use anyhow::Result;
use std::path::{Path, PathBuf};

use rtune_config::RunConfig;

/// Resolves the config's `[model] path` to a local model directory and sets `cfg.model.path` to it.
pub fn resolve_model(cfg: &mut RunConfig) -> Result<rtune_hub::Resolved> {
    let r = rtune_train::resolve_model(cfg)?;
    report(&r);
    Ok(r)
}

/// `--model` of `rtune generate`: the same resolution at `revision`.
pub fn resolve_model_path(path: &Path, revision: &str) -> Result<PathBuf> {
    let r = rtune_hub::resolve(&path.to_string_lossy(), revision)?;
    report(&r);
    Ok(r.dir)
}

fn report(r: &rtune_hub::Resolved) {
    if r.source != rtune_hub::Source::Local {
        eprintln!("rtune: model {r}");
    }
}
