//! GGUF files as model directories: converted once (rtune-gguf) into
//! `<models cache>/<sha256 of the file>`, then loaded like any Hugging Face directory. Keyed by
//! content, so a renamed or copied file reuses the conversion and a changed one does not.

use std::path::Path;

use crate::{Resolved, Result, Source};

/// The converted directory of the GGUF at `file`, converting it into `models_cache` first when
/// no complete conversion is there (a conversion is renamed into place whole, so a directory that
/// exists is complete).
pub fn resolve(file: &Path, models_cache: &Path) -> Result<Resolved> {
    // The bounded walk over its header and metadata first: a file that is not a GGUF (or not a
    // regular file) is refused from its first bytes, not after hashing all of it.
    rtune_gguf::scan::open(file)?;
    let size = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
    if size > 1 << 30 {
        tracing::info!(
            "hashing {} ({:.1} GB) to find its conversion",
            file.display(),
            size as f64 / 1e9
        );
    }
    let sha256 = rtune_fsio::sha256_file(file)?;
    let dir = models_cache.join(&sha256);
    let complete =
        |d: &Path| d.join("config.json").exists() && d.join("model.safetensors").exists();
    if complete(&dir) {
        return Ok(Resolved {
            dir,
            source: Source::Gguf {
                file: file.to_path_buf(),
                sha256,
                converted: false,
            },
        });
    }
    // What conversions killed before their clean-up left here (the names are sha256s).
    rtune_gguf::convert::sweep_stale(models_cache, |stem| {
        stem.len() == 64 && stem.bytes().all(|b| b.is_ascii_hexdigit())
    });
    tracing::info!("converting {} into {}", file.display(), dir.display());
    match rtune_gguf::convert(file, &dir) {
        Ok(_) => {}
        // Another process converted the same file meanwhile.
        Err(_) if complete(&dir) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Resolved {
        dir,
        source: Source::Gguf {
            file: file.to_path_buf(),
            sha256,
            converted: true,
        },
    })
}
