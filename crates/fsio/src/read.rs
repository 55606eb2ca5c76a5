//! Bounded reads: every file rtune reads whole goes through [`read_bounded`] (issue 35).
//!
//! A file named by a user or a downloaded model can be anything: `/dev/zero` behind a symlink, a
//! FIFO, a 40 GB "tokenizer.json". Each read has a cap suited to the file's [`FileKind`], checked
//! on the opened handle (`fstat` of the open file, so a symlink or a path swapped after a check
//! cannot slip past), non-regular files are refused, and the read itself stops at `cap + 1` bytes
//! in case the file grows while it is read. The open is non-blocking so a FIFO without a writer
//! is refused instead of hanging.
//!
//! Files that are memory-mapped (safetensors weights) are checked with [`check_regular`].

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;

/// What a file is, which sets how large it may be. The caps are far above any real file of the
/// kind (the largest tokenizer.json on the hub is ~35 MB, a 405B model's shard index ~100 KB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A run's TOML (`--config`).
    RunConfig,
    /// config.json, generation_config.json, adapter_config.json.
    ModelConfig,
    /// model.safetensors.index.json.
    ShardIndex,
    /// tokenizer.json.
    Tokenizer,
    /// tokenizer_config.json (may embed chat templates and added tokens).
    TokenizerConfig,
    /// A Jinja chat template (chat_template.jinja or `[data] chat_template`).
    ChatTemplate,
    /// What rtune wrote itself: run.json, manifest.json, trainer_state.json, metrics.
    RunRecord,
    /// A file whose cap the caller computed (e.g. adapter weights from the model's shapes).
    Sized { cap: u64, name: &'static str },
}

impl FileKind {
    /// The largest size read, in bytes.
    pub fn cap(self) -> u64 {
        match self {
            FileKind::RunConfig => 4 * MIB,
            FileKind::ModelConfig => 16 * MIB,
            FileKind::ShardIndex => 64 * MIB,
            FileKind::Tokenizer => 512 * MIB,
            FileKind::TokenizerConfig => 64 * MIB,
            FileKind::ChatTemplate => 4 * MIB,
            FileKind::RunRecord => 256 * MIB,
            FileKind::Sized { cap, .. } => cap,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FileKind::RunConfig => "run config",
            FileKind::ModelConfig => "JSON config",
            FileKind::ShardIndex => "safetensors shard index",
            FileKind::Tokenizer => "tokenizer",
            FileKind::TokenizerConfig => "tokenizer config",
            FileKind::ChatTemplate => "chat template",
            FileKind::RunRecord => "run record",
            FileKind::Sized { name, .. } => name,
        }
    }
}

impl std::fmt::Display for FileKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a file was not read. The message does not repeat the path (the callers' errors lead with
/// it); the path is kept for callers that want it.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The OS refused (missing file, permissions): its error as is.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("is {what}, not a regular file (a {kind} must be a file)")]
    NotRegular {
        path: PathBuf,
        kind: FileKind,
        what: &'static str,
    },
    #[error(
        "is {} ({size} bytes), over the {} cap for a {kind}",
        human(*size),
        human(kind.cap())
    )]
    TooLarge {
        path: PathBuf,
        kind: FileKind,
        size: u64,
    },
}

impl ReadError {
    /// As an `std::io::Error` for callers whose error holds one (the OS error is returned as is).
    pub fn into_io(self) -> std::io::Error {
        match self {
            ReadError::Io(e) => e,
            other => std::io::Error::new(std::io::ErrorKind::InvalidData, other),
        }
    }
}

impl From<ReadError> for std::io::Error {
    fn from(e: ReadError) -> Self {
        e.into_io()
    }
}

fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else if bytes >= MIB {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{bytes} B")
    }
}

fn file_type_name(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Refuses an open `file` that is not a regular file or is over `kind`'s cap; returns its size.
pub fn check_regular(file: &File, path: &Path, kind: FileKind) -> Result<u64, ReadError> {
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(ReadError::NotRegular {
            path: path.to_path_buf(),
            kind,
            what: file_type_name(meta.file_type()),
        });
    }
    if meta.len() > kind.cap() {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            kind,
            size: meta.len(),
        });
    }
    Ok(meta.len())
}

/// Opens `path` for reading without blocking on a FIFO, and checks it as [`check_regular`] does.
pub fn open_regular(path: &Path, kind: FileKind) -> Result<File, ReadError> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    check_regular(&file, path, kind)?;
    Ok(file)
}

/// The whole of `path`, if it is a regular file within `kind`'s cap (checked on the open handle
/// and again while reading).
pub fn read_bounded(path: &Path, kind: FileKind) -> Result<Vec<u8>, ReadError> {
    let file = open_regular(path, kind)?;
    let size = file.metadata()?.len();
    let cap = kind.cap();
    let mut bytes = Vec::with_capacity(size.min(cap) as usize);
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            kind,
            size: bytes.len() as u64,
        });
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_string_bounded(path: &Path, kind: FileKind) -> Result<String, ReadError> {
    let bytes = read_bounded(path, kind)?;
    String::from_utf8(bytes).map_err(|e| {
        ReadError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8: {}", e.utf8_error()),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_fifos_are_refused_before_reading() {
        let e = read_bounded(Path::new("/dev/zero"), FileKind::Tokenizer).unwrap_err();
        assert!(matches!(e, ReadError::NotRegular { .. }), "{e}");
        assert!(e.to_string().contains("a character device"), "{e}");
        let d = std::env::temp_dir().join(format!("rtune-read-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        // A symlink to a device: the check is on the opened file, not the link.
        let link = d.join("tokenizer.json");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = read_bounded(&link, FileKind::Tokenizer).unwrap_err();
        assert!(matches!(e, ReadError::NotRegular { .. }), "{e}");
        // A FIFO with no writer: refused at once, not a hang.
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        let _ = std::fs::remove_file(&fifo);
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_bounded(&fifo, FileKind::RunConfig).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        let e = read_bounded(&d, FileKind::RunConfig).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn files_over_the_cap_are_refused_and_others_read() {
        let d = std::env::temp_dir().join(format!("rtune-read-cap-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("c.json");
        std::fs::write(&p, vec![b' '; 100]).unwrap();
        let small = FileKind::Sized {
            cap: 99,
            name: "test file",
        };
        let e = read_bounded(&p, small).unwrap_err();
        assert!(matches!(e, ReadError::TooLarge { size: 100, .. }), "{e}");
        assert!(e.to_string().contains("100 bytes"), "{e}");
        assert!(e.to_string().contains("test file"), "{e}");
        let ok = FileKind::Sized {
            cap: 100,
            name: "test file",
        };
        assert_eq!(read_bounded(&p, ok).unwrap().len(), 100);
        // Missing files keep the OS error as is.
        let e = read_bounded(&d.join("none"), ok).unwrap_err().into_io();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
