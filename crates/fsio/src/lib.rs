//! Files that survive crashes and stay private: every file rtune writes goes through here.
//!
//! - [`write_atomic`]: temporary file, fsync, rename, fsync of the directory — a reader (or a resumed
//!   run after `kill -9`) sees the old file or the new one, never half of one.
//! - No write, truncate or create follows a symlink (issue 46): [`Privacy::create`] and
//!   [`Privacy::append`] open with `O_NOFOLLOW`, [`write_atomic`]'s temporary is created with
//!   `O_EXCL` (which never follows a link), and a link planted where rtune writes is refused with
//!   [`LINK_REFUSED`] naming it. A link is never deleted either: it may be the user's.
//! - [`Privacy`]: with `private = true` (the default) directories are created 0700 and files 0600;
//!   training data and adapters are often personal.
//! - [`sha256_file`]: checksums for checkpoint manifests and the run record.
//! - [`RunLock`]: one process per run directory (`flock`, released when the process ends).
//! - [`read_bounded`]: the one door for every file read whole: a cap per [`FileKind`], checked on
//!   the open handle; devices and FIFOs refused.
//! - Interrupted writers leave nothing behind: [`Deferred`] holds SIGINT/SIGTERM back while a
//!   writer that can stop between steps (a GGUF conversion) writes its temporary, and removes it
//!   itself; [`Staging`] registers what other writers build beside its final place (an export, the
//!   scratch runs of `check`), for the binary's signal thread to remove. [`refuse_output`]: `/`,
//!   the home directory and symlinks are never an output.
//! - [`plain_file_name`]: the rule for file names read from untrusted files (model indexes, hub
//!   listings, GGUF metadata): one plain component inside the directory.
//!
//! Tests can make writes fail as a full disk would: `RTUNE_FAULT_ENOSPC_AFTER=N` makes every
//! [`write_atomic`] after the first N fail with "No space left on device".

mod lock;
mod names;
mod read;
mod signals;
mod staging;

pub use lock::{hostname, LockError, RunLock, LOCK_FILE};
pub use names::plain_file_name;
pub use read::{
    check_regular, open_regular, read_bounded, read_string_bounded, FileKind, ReadError,
};
pub use signals::Deferred;
pub use staging::{end_by_signal, refuse_output, remove_staged, Staging};

use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug, thiserror::Error)]
#[error("{path}: {op}: {source}")]
pub struct IoError {
    pub path: PathBuf,
    pub op: &'static str,
    pub source: std::io::Error,
}

pub type Result<T> = std::result::Result<T, IoError>;

/// What an error says of a symlink found where rtune writes (after the path and the op).
pub const LINK_REFUSED: &str =
    "is a symbolic link; rtune never writes, truncates or creates through one: remove the link";

/// `O_NOFOLLOW`'s refusal (`ELOOP` on the last component) as [`LINK_REFUSED`]; other errors as
/// they are.
pub fn no_follow_error(e: std::io::Error) -> std::io::Error {
    if e.raw_os_error() == Some(libc::ELOOP) {
        std::io::Error::other(LINK_REFUSED)
    } else {
        e
    }
}

/// Whether `path` itself (not what it points to) is a symbolic link.
pub fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

fn ctx<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> IoError + 'a {
    move |source| IoError {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// Permissions for what rtune creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Privacy {
    pub private: bool,
}

impl Privacy {
    pub const PRIVATE: Privacy = Privacy { private: true };
    pub const SHARED: Privacy = Privacy { private: false };

    pub(crate) fn file_mode(self) -> u32 {
        if self.private {
            0o600
        } else {
            0o644
        }
    }
    fn dir_mode(self) -> u32 {
        if self.private {
            0o700
        } else {
            0o755
        }
    }

    /// Creates `dir` and missing parents; the directories it creates get this privacy's mode.
    pub fn create_dir_all(self, dir: &Path) -> Result<()> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(self.dir_mode())
            .create(dir)
            .map_err(ctx(dir, "create directory"))
    }

    /// Sets `path`'s mode (a directory that already existed).
    pub fn apply_to_dir(self, dir: &Path) -> Result<()> {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(self.dir_mode()))
            .map_err(ctx(dir, "chmod"))
    }

    /// A new file for writing (truncated), with this privacy's mode. A symlink at `path` is
    /// refused ([`LINK_REFUSED`]), never followed.
    pub fn create(self, path: &Path) -> Result<File> {
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(self.file_mode())
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| ctx(path, "create")(no_follow_error(e)))
    }

    /// A file that must not exist yet (`O_EXCL`: not even as a dangling symlink).
    pub fn create_new(self, path: &Path) -> Result<File> {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(self.file_mode())
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| ctx(path, "create")(no_follow_error(e)))
    }

    /// An existing or new file for appending (or cutting back with `set_len`). A symlink at `path`
    /// is refused ([`LINK_REFUSED`]), never followed.
    pub fn append(self, path: &Path) -> Result<File> {
        OpenOptions::new()
            .append(true)
            .create(true)
            .mode(self.file_mode())
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| ctx(path, "open")(no_follow_error(e)))
    }
}

static WRITES: AtomicUsize = AtomicUsize::new(0);

fn injected_enospc(path: &Path) -> Result<()> {
    if let Some(limit) = std::env::var("RTUNE_FAULT_ENOSPC_AFTER")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        if WRITES.fetch_add(1, Ordering::SeqCst) >= limit {
            return Err(IoError {
                path: path.to_path_buf(),
                op: "write",
                source: std::io::Error::from_raw_os_error(28), // ENOSPC
            });
        }
    }
    Ok(())
}

/// Writes `bytes` to `path` through `path.tmp`: write, fsync, rename, fsync the directory.
///
/// The temporary is created with `O_EXCL`: a regular `path.tmp` left by a killed writer is removed
/// first, a symlink there is refused ([`LINK_REFUSED`]) and left alone. The rename replaces a
/// symlink at `path` itself, never what it points to.
pub fn write_atomic(path: &Path, bytes: &[u8], privacy: Privacy) -> Result<()> {
    let tmp = with_suffix(path, ".tmp");
    match std::fs::symlink_metadata(&tmp) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(IoError {
                path: tmp,
                op: "create",
                source: std::io::Error::other(LINK_REFUSED),
            })
        }
        Ok(m) if m.is_file() => std::fs::remove_file(&tmp).map_err(ctx(&tmp, "remove"))?,
        _ => {}
    }
    let res = (|| {
        injected_enospc(path)?;
        let mut f = privacy.create_new(&tmp)?;
        f.write_all(bytes).map_err(ctx(&tmp, "write"))?;
        f.sync_all().map_err(ctx(&tmp, "fsync"))?;
        std::fs::rename(&tmp, path).map_err(ctx(path, "rename"))?;
        fsync_dir(path.parent().unwrap_or(Path::new(".")))
    })();
    // Only a temporary this call created is removed (a planted link never is: see above).
    if res.is_err() && !is_symlink(&tmp) {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// fsync a directory, so a rename or a new entry in it is durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(ctx(dir, "fsync directory"))
}

/// `path` with `suffix` appended to its file name.
pub fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    s.into()
}

/// Bytes available to an unprivileged user on the filesystem holding `path` (statvfs).
pub fn free_bytes(path: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| IoError {
        path: path.to_path_buf(),
        op: "statvfs",
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable statvfs the call fills.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(IoError {
            path: path.to_path_buf(),
            op: "statvfs",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    let st = unsafe { st.assume_init() };
    // Both fields are u64 on 64-bit Linux but narrower elsewhere.
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// The current user's home directory as `$HOME` names it and as the password database does (they
/// can differ), each resolved through symlinks: directories rtune never takes as a run directory.
pub fn home_dirs() -> Vec<PathBuf> {
    let mut homes: Vec<PathBuf> = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .collect();
    homes.extend(passwd_home());
    let mut out: Vec<PathBuf> = Vec::new();
    for h in homes {
        let h = std::fs::canonicalize(&h).unwrap_or(h);
        if !out.contains(&h) {
            out.push(h);
        }
    }
    out
}

/// Whether a process `pid` exists on this machine (`kill(pid, 0)`: a process of another user
/// counts).
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The current user's home from the password database (`getpwuid_r`).
fn passwd_home() -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    let mut pw = std::mem::MaybeUninit::<libc::passwd>::zeroed();
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: `pw` and `buf` are writable and live for the call; `found` receives a pointer to
    // `pw` or null.
    let rc = unsafe {
        libc::getpwuid_r(
            libc::getuid(),
            pw.as_mut_ptr(),
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        )
    };
    if rc != 0 || found.is_null() {
        return None;
    }
    // SAFETY: getpwuid_r succeeded and `found` points at `pw`, whose `pw_dir` is null or a
    // NUL-terminated string inside `buf`, still alive.
    let dir = unsafe { (*found).pw_dir };
    if dir.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated (above).
    let bytes = unsafe { std::ffi::CStr::from_ptr(dir) }.to_bytes();
    (!bytes.is_empty()).then(|| PathBuf::from(std::ffi::OsStr::from_bytes(bytes)))
}

/// Lower-case hex SHA-256 of a file's contents, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    // A device behind the name would be hashed forever: regular files only (issue 35).
    let kind = FileKind::Sized {
        cap: u64::MAX,
        name: "file",
    };
    let mut f = open_regular(path, kind).map_err(|e| ctx(path, "open")(e.into_io()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(ctx(path, "read"))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

pub fn sha256_bytes(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rtune-fsio-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn free_bytes_is_positive_and_missing_paths_fail() {
        let free = free_bytes(&std::env::temp_dir()).unwrap();
        assert!(free > 0);
        let e = free_bytes(Path::new("/no/such/dir/rtune")).unwrap_err();
        assert_eq!(e.op, "statvfs");
    }

    #[test]
    fn atomic_private_write_and_modes() {
        let d = tmpdir("a");
        Privacy::PRIVATE.create_dir_all(&d.join("x")).unwrap();
        assert_eq!(
            std::fs::metadata(d.join("x")).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let p = d.join("x/f.json");
        write_atomic(&p, b"one", Privacy::PRIVATE).unwrap();
        write_atomic(&p, b"two", Privacy::PRIVATE).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(!with_suffix(&p, ".tmp").exists());
        write_atomic(&d.join("x/g"), b"g", Privacy::SHARED).unwrap();
        assert_eq!(
            std::fs::metadata(d.join("x/g"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o644
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A user's file behind a link planted where rtune writes: never written, truncated or
    /// created through (issue 46).
    #[test]
    fn planted_links_are_refused_and_their_targets_untouched() {
        let d = tmpdir("links");
        std::fs::create_dir_all(&d).unwrap();
        let victim = d.join("victim.txt");
        std::fs::write(&victim, b"precious").unwrap();
        let untouched = || assert_eq!(std::fs::read(&victim).unwrap(), b"precious");

        // write_atomic: `run.json.tmp` -> victim.
        let p = d.join("run.json");
        std::os::unix::fs::symlink(&victim, with_suffix(&p, ".tmp")).unwrap();
        let e = write_atomic(&p, b"new", Privacy::PRIVATE).unwrap_err();
        assert!(e.to_string().contains("run.json.tmp"), "{e}");
        assert!(e.to_string().contains(LINK_REFUSED), "{e}");
        untouched();
        assert!(
            is_symlink(&with_suffix(&p, ".tmp")),
            "the link is not ours to delete"
        );
        assert!(!p.exists());

        // A dangling link: O_EXCL still refuses to create its target.
        let q = d.join("q.json");
        let absent = d.join("absent");
        std::os::unix::fs::symlink(&absent, with_suffix(&q, ".tmp")).unwrap();
        assert!(write_atomic(&q, b"new", Privacy::PRIVATE).is_err());
        assert!(!absent.exists());

        // create (truncating) and append (metrics.jsonl, cut back on resume).
        for (name, open) in [
            (
                "events",
                Privacy::create as fn(Privacy, &Path) -> Result<File>,
            ),
            ("metrics.jsonl", Privacy::append),
        ] {
            let link = d.join(name);
            std::os::unix::fs::symlink(&victim, &link).unwrap();
            let e = open(Privacy::PRIVATE, &link).unwrap_err();
            assert!(e.to_string().contains(LINK_REFUSED), "{name}: {e}");
            untouched();
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_stale_temporary_is_replaced() {
        let d = tmpdir("stale");
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("f.json");
        std::fs::write(with_suffix(&p, ".tmp"), b"half of an old write").unwrap();
        write_atomic(&p, b"whole", Privacy::PRIVATE).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"whole");
        assert!(!with_suffix(&p, ".tmp").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn home_dirs_name_the_users_home() {
        let homes = home_dirs();
        if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            let h = std::fs::canonicalize(&h).unwrap_or(PathBuf::from(h));
            assert!(homes.contains(&h), "{homes:?}");
        }
        assert!(!homes.is_empty());
    }

    #[test]
    fn this_process_is_alive() {
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(0));
        assert!(!process_alive(u32::MAX));
    }

    #[test]
    fn sha256_known_value() {
        // sha256("abc"), FIPS 180-2 appendix B.1
        assert_eq!(
            sha256_bytes(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let d = tmpdir("h");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("f"), b"abc").unwrap();
        assert_eq!(sha256_file(&d.join("f")).unwrap(), sha256_bytes(b"abc"));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
