//! The destination of an export: checked before anything is read, built beside itself in
//! `.NAME.tmp-PID/` and renamed into place, so a crash leaves no directory that looks complete.
//! Nothing is ever written inside (or onto) the run directory, the adapter or the base model
//! directory, whatever the format and with or without `--force` (paths resolved through symlinks
//! and `..`). `--force` replaces only an earlier export: a directory holding nothing but the files
//! exports write, or for a file output a plain file (not a directory, not a symlink) — never a
//! directory of other files.

use std::path::{Path, PathBuf};

use rtune_fsio::{fsync_dir, IoError, Privacy};

use crate::{ExportError, Result};

/// Whether `name` is a file some export writes.
fn export_file(name: &str) -> bool {
    const EXACT: [&str; 12] = [
        "adapter_model.safetensors",
        "adapter_config.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    ];
    EXACT.contains(&name)
        || name.starts_with("tokenizer")
        || (name.starts_with("model-") && name.ends_with(".safetensors"))
}

fn looks_like_export(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().all(|e| {
            e.file_type().is_ok_and(|t| t.is_file())
                && export_file(&e.file_name().to_string_lossy())
        })
    })
}

/// `p` made absolute with every symlink and `..` resolved: its longest existing ancestor
/// canonicalized, the components that do not exist yet appended (`..` among them taken
/// lexically: they will be plain directories once created).
fn absolute(p: &Path) -> PathBuf {
    if let Ok(c) = p.canonicalize() {
        return c;
    }
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        match std::env::current_dir() {
            Ok(d) => d.join(p),
            Err(_) => return p.to_path_buf(),
        }
    };
    let mut rest = Vec::new();
    let mut at = p.as_path();
    loop {
        if let Ok(mut c) = at.canonicalize() {
            for comp in rest.iter().rev() {
                match comp {
                    std::path::Component::ParentDir => {
                        c.pop();
                    }
                    std::path::Component::Normal(n) => c.push(n),
                    _ => {}
                }
            }
            return c;
        }
        match (at.parent(), at.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last);
                at = parent;
            }
            _ => return p.clone(),
        }
    }
}

/// Refuses a destination that exists (without `force`), that is not what the export writes, or
/// that is (or holds) one of `protected`.
pub(crate) fn check_destination(
    out: &Path,
    force: bool,
    file_output: bool,
    protected: &[PathBuf],
) -> Result<()> {
    if out.file_name().is_none() {
        return Err(ExportError::input(
            out,
            "--out needs a file or directory name",
        ));
    }
    let abs = absolute(out);
    if protected.iter().any(|p| p.starts_with(&abs)) {
        return Err(ExportError::input(
            out,
            "is the run, its adapter or the base model (or holds one of them); choose another --out",
        ));
    }
    if let Some(p) = protected.iter().find(|p| abs.starts_with(p)) {
        return Err(ExportError::input(
            out,
            format!(
                "is inside {} (the run, its adapter or the base model), which an export never \
                 writes into, even with --force; choose another --out",
                p.display()
            ),
        ));
    }
    let Ok(meta) = std::fs::symlink_metadata(out) else {
        return Ok(());
    };
    if !force {
        return Err(ExportError::Exists {
            path: out.to_path_buf(),
        });
    }
    if file_output {
        if !meta.file_type().is_file() {
            return Err(ExportError::input(
                out,
                "exists and is not a file of its own (a directory or a symlink); --force \
                 replaces only a file an earlier export wrote; --out names the .gguf file",
            ));
        }
    } else if !out.is_dir() {
        return Err(ExportError::input(out, "exists and is not a directory"));
    } else if !looks_like_export(out) {
        return Err(ExportError::input(
            out,
            "holds files an export does not write; not replacing it, even with --force",
        ));
    }
    Ok(())
}

pub(crate) fn io<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(std::io::Error) -> ExportError + 'a {
    move |source| {
        ExportError::Io(IoError {
            path: path.to_path_buf(),
            op,
            source,
        })
    }
}

/// Builds the directory `out` with `build` (which gets an empty staging directory and returns the
/// names of the files it wrote), then moves it into place, replacing an earlier export.
pub(crate) fn stage_dir(
    out: &Path,
    privacy: Privacy,
    build: impl FnOnce(&Path) -> Result<Vec<String>>,
) -> Result<Vec<String>> {
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = out
        .file_name()
        .expect("checked by check_destination")
        .to_string_lossy()
        .into_owned();
    privacy.create_dir_all(parent)?;
    let pid = std::process::id();
    let tmp = parent.join(format!(".{name}.tmp-{pid}"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp, "remove"))?;
    }
    privacy.create_dir_all(&tmp)?;
    let files = match build(&tmp).and_then(|f| fsync_dir(&tmp).map(|()| f).map_err(Into::into)) {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if out.exists() {
        let old = parent.join(format!(".{name}.old-{pid}"));
        std::fs::rename(out, &old).map_err(io(out, "rename"))?;
        std::fs::rename(&tmp, out).map_err(io(out, "rename"))?;
        std::fs::remove_dir_all(&old).map_err(io(&old, "remove"))?;
    } else {
        std::fs::rename(&tmp, out).map_err(io(out, "rename"))?;
    }
    fsync_dir(parent)?;
    Ok(files)
}

/// Creates `path` (mode by `privacy`) and writes it with `write`, then fsyncs it: for files too big
/// to hold in memory whole, inside a staging directory that is renamed only when complete.
pub(crate) fn write_streamed(
    path: &Path,
    privacy: Privacy,
    write: impl FnOnce(&mut dyn std::io::Write) -> Result<()>,
) -> Result<()> {
    let f = privacy.create(path)?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
    write(&mut w)?;
    let f = w.into_inner().map_err(|e| {
        ExportError::Io(IoError {
            path: path.to_path_buf(),
            op: "write",
            source: e.into_error(),
        })
    })?;
    f.sync_all().map_err(io(path, "fsync"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destination_rules() {
        let t = std::env::temp_dir().join(format!("rtune-export-out-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&t);
        let prev = t.join("prev");
        std::fs::create_dir_all(&prev).unwrap();
        std::fs::write(prev.join("config.json"), "{}").unwrap();
        std::fs::write(prev.join("model-00001-of-00002.safetensors"), "").unwrap();
        let run = t.join("run");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(run.join("metrics.jsonl"), "").unwrap();
        let protected = vec![run.canonicalize().unwrap()];

        assert!(check_destination(&t.join("new"), false, false, &protected).is_ok());
        let e = check_destination(&prev, false, false, &protected).unwrap_err();
        assert!(matches!(e, ExportError::Exists { .. }));
        assert!(check_destination(&prev, true, false, &protected).is_ok());
        // A directory of other files is never replaced; the run and its parents neither.
        let e = check_destination(&t, true, false, &protected)
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds one of them"), "{e}");
        let e = check_destination(&run, true, false, &protected)
            .unwrap_err()
            .to_string();
        assert!(e.contains("choose another --out"), "{e}");
        std::fs::write(prev.join("notes.txt"), "mine").unwrap();
        let e = check_destination(&prev, true, false, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not write"), "{e}");
        // A file destination must be a file.
        let e = check_destination(&prev, true, true, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a file"), "{e}");

        // A failed build leaves neither the output nor its staging directory.
        let out = t.join("failed");
        let r = stage_dir(&out, Privacy::PRIVATE, |tmp| {
            std::fs::write(tmp.join("config.json"), "{}").unwrap();
            Err(ExportError::input(tmp, "boom"))
        });
        assert!(r.is_err() && !out.exists());
        let left: Vec<_> = std::fs::read_dir(&t)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left.len(), 2, "{left:?}");
        // A good one replaces the earlier export whole.
        stage_dir(&prev, Privacy::PRIVATE, |tmp| {
            std::fs::write(tmp.join("config.json"), "{\"new\":1}").unwrap();
            Ok(vec!["config.json".into()])
        })
        .unwrap();
        assert!(!prev.join("notes.txt").exists());
        assert_eq!(
            std::fs::read_to_string(prev.join("config.json")).unwrap(),
            "{\"new\":1}"
        );
        std::fs::remove_dir_all(&t).unwrap();
    }
}
