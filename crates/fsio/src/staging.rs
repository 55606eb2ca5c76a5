//! What rtune builds beside its final place (an export's `.NAME.tmp-PID/`, `check`'s scratch
//! directory) is registered here while it is built, so that a SIGINT or SIGTERM that stops
//! the process removes it instead of leaving hundreds of MB behind (issue 46). The binary's signal
//! thread calls [`remove_staged`]; a [`Staging`] dropped (renamed into place, or removed on an
//! error) unregisters itself.
//!
//! The output checks ([`refuse_output`]) live here too: the places no command ever replaces.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static STAGED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A staging path, removed by [`remove_staged`] until this is dropped.
#[derive(Debug)]
pub struct Staging {
    path: PathBuf,
}

impl Staging {
    /// Registers `path` (which the caller creates and, on success, renames away).
    pub fn register(path: PathBuf) -> Staging {
        STAGED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(path.clone());
        Staging { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let mut staged = STAGED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = staged.iter().rposition(|p| p == &self.path) {
            staged.remove(i);
        }
    }
}

/// Removes every registered staging path (a directory with what it holds, or a file; a symlink
/// is removed itself, never followed); returns how many were there. For the signal thread: the
/// process exits right after, while its other threads may still be writing, so a directory is
/// tried a few times.
pub fn remove_staged() -> usize {
    let staged = STAGED.lock().unwrap_or_else(|e| e.into_inner());
    let mut removed = 0;
    for p in staged.iter() {
        for _ in 0..5 {
            let r = match std::fs::symlink_metadata(p) {
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
                Ok(_) => std::fs::remove_file(p),
                Err(_) => break,
            };
            if r.is_ok() {
                removed += 1;
                break;
            }
        }
    }
    removed
}

/// Ends the process as `sig`'s default action would, after removing what is staged: for the
/// binary's signal thread, and for the main thread when a writer that held the signal back
/// ([`crate::Deferred`]) returns its interruption. Both may run at once (the deferred signal,
/// raised again, also wakes the signal thread): whichever gets here first ends the process by the
/// signal, so the exit status never depends on which thread wins (a shell sees 130 or 143).
pub fn end_by_signal(sig: i32) -> ! {
    remove_staged();
    // SAFETY: a zeroed sigaction with SIG_DFL is a valid disposition; raising a signal in this
    // process whose disposition is now the default ends it.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
        libc::raise(sig);
    }
    // Only if the signal is blocked in this thread: the shell's convention for it.
    std::process::exit(128 + sig)
}

/// Why `path` may never be an output that a command creates or replaces, even with `--force`:
/// `/`, the user's home, or a symbolic link (whose target would be replaced or written into).
/// `None` when it may.
pub fn refuse_output(path: &Path) -> Option<&'static str> {
    if crate::is_symlink(path) {
        return Some(crate::LINK_REFUSED);
    }
    let real = std::fs::canonicalize(path).ok()?;
    if real.parent().is_none() {
        Some("is the root directory; choose a new output path")
    } else if crate::home_dirs().contains(&real) {
        Some("is your home directory; choose a new output path inside it")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_paths_are_removed_until_dropped() {
        let d = std::env::temp_dir().join(format!("rtune-staging-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let tmp = d.join(".out.tmp-1");
        std::fs::create_dir_all(tmp.join("sub")).unwrap();
        std::fs::write(tmp.join("sub/f"), "x").unwrap();
        let file = d.join("a.gguf.tmp");
        std::fs::write(&file, "x").unwrap();
        let kept = d.join("kept.tmp");
        std::fs::write(&kept, "x").unwrap();
        let (_a, _b) = (
            Staging::register(tmp.clone()),
            Staging::register(file.clone()),
        );
        drop(Staging::register(kept.clone()));
        assert_eq!(remove_staged(), 2);
        assert!(!tmp.exists() && !file.exists());
        assert!(kept.exists(), "a dropped staging path is no longer removed");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn root_home_and_links_are_never_outputs() {
        assert!(refuse_output(Path::new("/")).is_some());
        assert!(refuse_output(Path::new("/tmp/..")).is_some());
        if let Some(h) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
            assert!(refuse_output(Path::new(&h)).unwrap().contains("home"));
        }
        let d = std::env::temp_dir().join(format!("rtune-refuse-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("empty")).unwrap();
        assert_eq!(refuse_output(&d.join("empty")), None);
        assert_eq!(refuse_output(&d.join("new")), None);
        std::os::unix::fs::symlink(d.join("empty"), d.join("link")).unwrap();
        assert_eq!(refuse_output(&d.join("link")), Some(crate::LINK_REFUSED));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
