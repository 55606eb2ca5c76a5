//! One process per run directory: an exclusive advisory lock (`flock`, through std's
//! [`File::try_lock`]) on `<dir>/.rtune.lock`, held for as long as the [`RunLock`] lives.
//!
//! `rtune export` takes the same lock shared ([`RunLock::acquire_shared`]): readers of a run
//! directory exclude a training process, not each other.
//!
//! The kernel drops the lock with the process, so `kill -9` leaves nothing to clean up: the lock
//! file may stay, but a stale file is never "held". The file records the holder's pid and host so a
//! refused process can name them.
//!
//! The lock file is opened with `O_NOFOLLOW`: a symlink planted at `.rtune.lock` is refused, never
//! truncated or written through (issue 46).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::{no_follow_error, Privacy};

/// The lock file's name inside a run directory. Files rtune deletes or replaces in a run
/// directory (an `overwrite` or an export) must leave it alone.
pub const LOCK_FILE: &str = ".rtune.lock";

/// Why a run directory could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another live process holds it (an input error: the user started two runs on one dir).
    #[error(
        "{dir}: in use by another rtune process (pid {pid} on {host}); wait for it to finish, or \
         use another [output] dir"
    )]
    Held {
        dir: PathBuf,
        pid: String,
        host: String,
    },
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
}

/// Exclusive use of a run directory until dropped (or the process ends).
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    path: PathBuf,
}

impl RunLock {
    /// Locks `dir` (which must exist) without waiting: [`LockError::Held`] names the holder.
    pub fn acquire(dir: &Path, privacy: Privacy) -> Result<RunLock, LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |op: &'static str| {
            let path = path.clone();
            move |source| LockError::Io { path, op, source }
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(privacy.file_mode())
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io("open")(no_follow_error(e)))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(held(dir, &mut file)),
            Err(TryLockError::Error(e)) => return Err(io("flock")(e)),
        }
        // A holder that never used the directory removes the file ([`RunLock::remove`]); a lock
        // taken on the file it unlinked is no lock on the directory: take the new one.
        if !still_named(&file, &path) {
            drop(file);
            return Self::acquire(dir, privacy);
        }
        // Ours now: record who holds it for the next one to name.
        let me = format!("{} {}\n", std::process::id(), hostname());
        file.set_len(0).map_err(io("truncate"))?;
        file.seek(SeekFrom::Start(0)).map_err(io("seek"))?;
        file.write_all(me.as_bytes()).map_err(io("write"))?;
        file.flush().map_err(io("write"))?;
        Ok(RunLock { _file: file, path })
    }

    /// Shares `dir` with other readers (`rtune export`) without waiting: refused with
    /// [`LockError::Held`] while a training process holds it exclusively, and a training started
    /// meanwhile is refused in turn. Readers do not exclude each other. `Ok(None)`: the directory
    /// is not writable and holds no lock file, so no training can hold it either.
    pub fn acquire_shared(dir: &Path, privacy: Privacy) -> Result<Option<RunLock>, LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |op: &'static str| {
            let path = path.clone();
            move |source| LockError::Io { path, op, source }
        };
        let opened = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(privacy.file_mode())
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path);
        let (mut file, writable) = match opened {
            Ok(f) => (f, true),
            Err(e) if read_only(&e) => match OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
            {
                Ok(f) => (f, false),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(io("open")(no_follow_error(e))),
            },
            Err(e) => return Err(io("open")(no_follow_error(e))),
        };
        match file.try_lock_shared() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Err(held(dir, &mut file)),
            Err(TryLockError::Error(e)) => return Err(io("flock")(e)),
        }
        if !still_named(&file, &path) {
            drop(file);
            return Self::acquire_shared(dir, privacy);
        }
        // Named to a training refused meanwhile (with several readers, the last one to start).
        if writable {
            let me = format!("{} {}\n", std::process::id(), hostname());
            file.set_len(0).map_err(io("truncate"))?;
            file.write_all_at(me.as_bytes(), 0).map_err(io("write"))?;
        }
        Ok(Some(RunLock { _file: file, path }))
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Releases the lock and deletes its file, for a holder that created the file and leaves the
    /// directory unused (a run refused before its first step). The file is unlinked while still
    /// locked, so a process that opened it meanwhile finds, once it gets the lock, that the name
    /// no longer leads to it and locks the directory afresh.
    pub fn remove(self) -> std::io::Result<()> {
        let r = std::fs::remove_file(&self.path);
        drop(self);
        r
    }
}

/// Whether `path` still names the open `file` (not unlinked or replaced since it was opened).
fn still_named(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        (_, Err(e)) => e.kind() != std::io::ErrorKind::NotFound,
        // Cannot tell: taken as named (acquiring again could loop).
        (Err(_), Ok(_)) => true,
    }
}

/// [`LockError::Held`], naming the holder recorded in the lock file.
fn held(dir: &Path, file: &mut File) -> LockError {
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    let mut it = text.split_whitespace();
    LockError::Held {
        dir: dir.to_path_buf(),
        pid: it.next().unwrap_or("unknown").to_string(),
        host: it.next().unwrap_or("unknown host").to_string(),
    }
}

/// An open for writing refused because the directory or filesystem is read-only.
fn read_only(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{PermissionDenied, ReadOnlyFilesystem};
    matches!(e.kind(), PermissionDenied | ReadOnlyFilesystem)
}

/// This machine's host name (`/proc/sys/kernel/hostname`), or "unknown host".
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_is_refused_naming_the_holder_and_released_on_drop() {
        let d = std::env::temp_dir().join(format!("rtune-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let first = RunLock::acquire(&d, Privacy::PRIVATE).unwrap();
        // flock locks belong to the open file description: a second open in the same process is
        // refused just as another process would be.
        match RunLock::acquire(&d, Privacy::PRIVATE) {
            Err(LockError::Held { pid, host, .. }) => {
                assert_eq!(pid, std::process::id().to_string());
                assert_eq!(host, hostname());
            }
            other => panic!("expected Held, got {other:?}"),
        }
        drop(first);
        let again = RunLock::acquire(&d, Privacy::PRIVATE).unwrap();
        assert!(again.path().ends_with(LOCK_FILE));
        drop(again);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_removed_lock_file_is_not_held_by_whoever_opened_it_meanwhile() {
        let d = std::env::temp_dir().join(format!("rtune-lock-remove-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let first = RunLock::acquire(&d, Privacy::PRIVATE).unwrap();
        // Opened before the removal, locked after it: the unlinked file's lock is worthless.
        let stale = File::open(d.join(LOCK_FILE)).unwrap();
        first.remove().unwrap();
        assert!(!d.join(LOCK_FILE).exists());
        stale.try_lock().unwrap();
        assert!(!still_named(&stale, &d.join(LOCK_FILE)));
        let second = RunLock::acquire(&d, Privacy::PRIVATE).unwrap();
        assert!(still_named(&second._file, second.path()));
        assert!(RunLock::acquire(&d, Privacy::PRIVATE).is_err());
        drop((stale, second));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_planted_lock_link_is_refused_by_writers_and_readers() {
        let d = std::env::temp_dir().join(format!("rtune-lock-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let victim = d.join("victim.txt");
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, d.join(LOCK_FILE)).unwrap();
        let e = RunLock::acquire(&d, Privacy::PRIVATE).unwrap_err();
        assert!(e.to_string().contains(crate::LINK_REFUSED), "{e}");
        assert!(e.to_string().contains(LOCK_FILE), "{e}");
        let e = RunLock::acquire_shared(&d, Privacy::PRIVATE).unwrap_err();
        assert!(e.to_string().contains(crate::LINK_REFUSED), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn readers_share_and_exclude_a_writer() {
        let d = std::env::temp_dir().join(format!("rtune-lock-shared-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let writer = RunLock::acquire(&d, Privacy::PRIVATE).unwrap();
        assert!(matches!(
            RunLock::acquire_shared(&d, Privacy::PRIVATE),
            Err(LockError::Held { .. })
        ));
        drop(writer);
        let r1 = RunLock::acquire_shared(&d, Privacy::PRIVATE)
            .unwrap()
            .unwrap();
        let r2 = RunLock::acquire_shared(&d, Privacy::PRIVATE)
            .unwrap()
            .unwrap();
        match RunLock::acquire(&d, Privacy::PRIVATE) {
            Err(LockError::Held { pid, .. }) => assert_eq!(pid, std::process::id().to_string()),
            other => panic!("expected Held, got {other:?}"),
        }
        drop(r1);
        assert!(
            RunLock::acquire(&d, Privacy::PRIVATE).is_err(),
            "r2 still reads"
        );
        drop(r2);
        drop(RunLock::acquire(&d, Privacy::PRIVATE).unwrap());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
