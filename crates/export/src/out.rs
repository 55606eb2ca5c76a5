//! The destination of an export: checked before anything is read, built beside itself in
//! `.NAME.tmp-PID/` and renamed into place, so a crash leaves no directory that looks complete (and
//! a SIGINT or SIGTERM removes the staging directory). Nothing is ever written inside (or onto)
//! the run directory, the adapter or the base model directory, whatever the format and with or
//! without `--force` (paths resolved through symlinks and `..`). `--force` replaces only an earlier
//! export: a directory holding exactly what its [`EXPORT_MARKER`] lists, or for a file output a
//! plain GGUF file (not a directory, not a symlink) — never a directory of other files, `/`, the
//! home directory or a symlinked directory (issue 46).

use std::path::{Path, PathBuf};

use rtune_fsio::{fsync_dir, IoError, Privacy};

use crate::{ExportError, Format, Result};

/// The marker every directory export carries: the format and each file it wrote with its size.
/// `--force` replaces a directory only when it holds exactly what its marker lists (issue 46: a
/// directory whose names merely looked like an export's was deleted, a user's model among them).
pub const EXPORT_MARKER: &str = ".rtune-export";

/// The most of a marker read (it lists a few dozen file names).
const MARKER_CAP: u64 = 1 << 20;

/// The marker's content for the `files` an export wrote into `dir`.
fn marker(dir: &Path, format: Format, files: &[String]) -> Result<Vec<u8>> {
    let mut sizes = serde_json::Map::new();
    for f in files {
        let p = dir.join(f);
        let len = std::fs::symlink_metadata(&p).map_err(io(&p, "stat"))?.len();
        sizes.insert(f.clone(), len.into());
    }
    let v = serde_json::json!({ "format": format.as_str(), "files": sizes });
    Ok(serde_json::to_vec_pretty(&v).expect("JSON serialises"))
}

/// Why `--force` may not replace the directory `dir`, or `None` when it holds exactly what an
/// earlier export wrote: its marker, and each file the marker lists, plain and of the listed size.
/// An empty directory may be replaced too (nothing is lost).
fn not_own_export(dir: &Path) -> Option<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Some("cannot be listed".into());
    };
    let mut found = Vec::new();
    for e in entries {
        let Ok(e) = e else {
            return Some("cannot be listed".into());
        };
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.file_type().is_ok_and(|t| t.is_file()) {
            return Some(format!(
                "holds {name}, which is not a plain file an export writes"
            ));
        }
        found.push((name, e.metadata().map(|m| m.len()).unwrap_or(u64::MAX)));
    }
    if found.is_empty() {
        return None;
    }
    let kind = rtune_fsio::FileKind::Sized {
        cap: MARKER_CAP,
        name: "export marker",
    };
    let listed = rtune_fsio::read_bounded(&dir.join(EXPORT_MARKER), kind)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("files").and_then(|f| f.as_object()).cloned());
    let Some(listed) = listed else {
        return Some(format!(
            "has no {EXPORT_MARKER} marker of an rtune export (or an unreadable one)"
        ));
    };
    for (name, len) in &found {
        if name == EXPORT_MARKER {
            continue;
        }
        match listed.get(name).and_then(|v| v.as_u64()) {
            None => {
                return Some(format!(
                    "holds {name}, which the earlier export did not write"
                ))
            }
            Some(l) if l != *len => {
                return Some(format!(
                    "holds {name}, changed since the earlier export wrote it"
                ))
            }
            Some(_) => {}
        }
    }
    None
}

/// Why `--force` may not replace the file `path` (not a GGUF), or `None` when it starts with the
/// GGUF magic, as every GGUF an export writes does.
fn not_a_gguf(path: &Path) -> Option<String> {
    use std::io::Read;
    let kind = rtune_fsio::FileKind::Sized {
        cap: u64::MAX,
        name: "GGUF",
    };
    let mut magic = [0u8; 4];
    let read = rtune_fsio::open_regular(path, kind).map(|mut f| f.read_exact(&mut magic));
    match read {
        Ok(Ok(())) if &magic == b"GGUF" => None,
        _ => Some(
            "is not a GGUF file (no GGUF magic); --force replaces only a .gguf an earlier export \
             wrote"
                .into(),
        ),
    }
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

/// Refuses a destination that exists (without `force`), that is not what an earlier export of
/// rtune wrote, that is `/`, the home directory or a directory symlink, or that is (or holds) one
/// of `protected` — all before anything is read or written.
pub(crate) fn check_destination(
    out: &Path,
    force: bool,
    format: Format,
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
    if format.writes_a_file() {
        if !meta.file_type().is_file() {
            return Err(ExportError::input(
                out,
                "exists and is not a file of its own (a directory or a symlink); --force \
                 replaces only a file an earlier export wrote; --out names the .gguf file",
            ));
        }
        if let Some(why) = not_a_gguf(out) {
            return Err(ExportError::input(out, why));
        }
    } else if let Some(why) = rtune_fsio::refuse_output(out) {
        return Err(ExportError::input(out, format!("{why} (--out)")));
    } else if !meta.is_dir() {
        return Err(ExportError::input(out, "exists and is not a directory"));
    } else if let Some(why) = not_own_export(out) {
        return Err(ExportError::input(
            out,
            format!("{why}; --force replaces only what an earlier export wrote: not replacing it"),
        ));
    }
    Ok(())
}

/// `RTUNE_FAULT_STALL_EXPORT_MS=N`: waits N ms once the staging directory is full, so a test can
/// stop the export with a signal there.
fn stall_for_tests() {
    if let Some(ms) = std::env::var("RTUNE_FAULT_STALL_EXPORT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
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
///
/// The staging directory is registered ([`rtune_fsio::Staging`]) so that a signal stopping the
/// process removes it; the directory exported gets the [`EXPORT_MARKER`] that `--force` checks.
pub(crate) fn stage_dir(
    out: &Path,
    privacy: Privacy,
    format: Format,
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
    let staging = rtune_fsio::Staging::register(parent.join(format!(".{name}.tmp-{pid}")));
    let tmp = staging.path();
    if std::fs::symlink_metadata(tmp).is_ok() {
        std::fs::remove_dir_all(tmp).map_err(io(tmp, "remove"))?;
    }
    privacy.create_dir_all(tmp)?;
    let built = build(tmp).and_then(|f| {
        let m = marker(tmp, format, &f)?;
        rtune_fsio::write_atomic(&tmp.join(EXPORT_MARKER), &m, privacy)?;
        fsync_dir(tmp)?;
        Ok(f)
    });
    stall_for_tests();
    let files = match built {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_dir_all(tmp);
            return Err(e);
        }
    };
    if std::fs::symlink_metadata(out).is_ok() {
        let old = rtune_fsio::Staging::register(parent.join(format!(".{name}.old-{pid}")));
        std::fs::rename(out, old.path()).map_err(io(out, "rename"))?;
        std::fs::rename(tmp, out).map_err(io(out, "rename"))?;
        std::fs::remove_dir_all(old.path()).map_err(io(old.path(), "remove"))?;
    } else {
        std::fs::rename(tmp, out).map_err(io(out, "rename"))?;
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
        stage_dir(&prev, Privacy::PRIVATE, Format::Merged, |tmp| {
            std::fs::write(tmp.join("config.json"), "{}").unwrap();
            std::fs::write(tmp.join("model-00001-of-00002.safetensors"), "").unwrap();
            Ok(vec![
                "config.json".into(),
                "model-00001-of-00002.safetensors".into(),
            ])
        })
        .unwrap();
        let run = t.join("run");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(run.join("metrics.jsonl"), "").unwrap();
        let protected = vec![run.canonicalize().unwrap()];
        let dest = |out: &Path, force, format| {
            check_destination(out, force, format, &protected).map_err(|e| e.to_string())
        };

        assert!(dest(&t.join("new"), false, Format::Peft).is_ok());
        let e = check_destination(&prev, false, Format::Merged, &protected).unwrap_err();
        assert!(matches!(e, ExportError::Exists { .. }));
        assert!(dest(&prev, true, Format::Merged).is_ok());
        // A directory of other files is never replaced; the run and its parents neither.
        let e = dest(&t, true, Format::Merged).unwrap_err();
        assert!(e.contains("holds one of them"), "{e}");
        let e = dest(&run, true, Format::Merged).unwrap_err();
        assert!(e.contains("choose another --out"), "{e}");
        // A file of the export's, changed since: not replaced.
        std::fs::write(prev.join("config.json"), "{\"mine\": 1}").unwrap();
        let e = dest(&prev, true, Format::Merged).unwrap_err();
        assert!(e.contains("config.json, changed since"), "{e}");
        std::fs::write(prev.join("config.json"), "{}").unwrap();
        std::fs::write(prev.join("notes.txt"), "mine").unwrap();
        let e = dest(&prev, true, Format::Merged).unwrap_err();
        assert!(
            e.contains("notes.txt, which the earlier export did not write"),
            "{e}"
        );
        std::fs::remove_file(prev.join("notes.txt")).unwrap();
        // A file destination must be a file.
        let e = dest(&prev, true, Format::GgufLora).unwrap_err();
        assert!(e.contains("not a file"), "{e}");

        // A failed build leaves neither the output nor its staging directory.
        let out = t.join("failed");
        let r = stage_dir(&out, Privacy::PRIVATE, Format::Merged, |tmp| {
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
        stage_dir(&prev, Privacy::PRIVATE, Format::Merged, |tmp| {
            std::fs::write(tmp.join("config.json"), "{\"new\":1}").unwrap();
            Ok(vec!["config.json".into()])
        })
        .unwrap();
        assert!(!prev.join("model-00001-of-00002.safetensors").exists());
        assert_eq!(
            std::fs::read_to_string(prev.join("config.json")).unwrap(),
            "{\"new\":1}"
        );
        std::fs::remove_dir_all(&t).unwrap();
    }

    /// Issue 46: `--force` deleted any directory whose names looked like export output (a user's
    /// model: config.json, model.safetensors, tokenizer.json), for every format, and replaced any
    /// regular file for gguf-lora; a symlink to an empty directory was converted into, then failed.
    #[test]
    fn force_replaces_only_what_an_export_wrote() {
        let t = std::env::temp_dir().join(format!("rtune-export-force-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&t);
        let model = t.join("my-model");
        std::fs::create_dir_all(&model).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            std::fs::write(model.join(f), "{}").unwrap();
        }
        for format in [Format::Peft, Format::Merged] {
            let e = check_destination(&model, true, format, &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("no .rtune-export marker"), "{e}");
        }
        let notes = t.join("notes.gguf");
        std::fs::write(&notes, "my notes").unwrap();
        let e = check_destination(&notes, true, Format::GgufLora, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no GGUF magic"), "{e}");
        std::fs::write(t.join("lora.gguf"), b"GGUF\x03\0\0\0").unwrap();
        assert!(check_destination(&t.join("lora.gguf"), true, Format::GgufLora, &[]).is_ok());
        let empty = t.join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert!(check_destination(&empty, true, Format::Peft, &[]).is_ok());
        std::os::unix::fs::symlink(&empty, t.join("link")).unwrap();
        let e = check_destination(&t.join("link"), true, Format::Peft, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
        if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            let e = check_destination(Path::new(&h), true, Format::Peft, &[])
                .unwrap_err()
                .to_string();
            assert!(e.contains("home directory"), "{e}");
        }
        assert_eq!(std::fs::read_to_string(&notes).unwrap(), "my notes");
        std::fs::remove_dir_all(&t).unwrap();
    }
}
