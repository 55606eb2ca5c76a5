//! SIGINT and SIGTERM held back while a temporary is being written, so that the writer can remove
//! it before the process ends (issue 46: an interrupted GGUF conversion left `.NAME.tmp-PID`
//! directories of hundreds of MB that nothing removed).
//!
//! While a [`Deferred`] is alive, the first SIGINT or SIGTERM is only recorded: the writer polls
//! [`Deferred::pending`] between steps, removes what it wrote and returns. When the last
//! `Deferred` is dropped the signals' previous dispositions come back and a recorded signal is
//! raised again, so the process ends as the signal would have ended it (a shell sees 130 or 143),
//! only after the clean-up. A second signal while one is pending ends the process at once (the
//! default action), for a user who does not want to wait; what it leaves behind is a temporary of
//! a dead process, which the writer's next run sweeps.
//!
//! A signal that was ignored (`SIG_IGN`, e.g. under `nohup`) stays ignored. Handlers are installed
//! with `sigaction` and the previous ones saved and restored exactly (signal-hook's registry cannot
//! give the default action back once a handler is unregistered).

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

const SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// The signal recorded while deferred (0: none).
static PENDING: AtomicI32 = AtomicI32::new(0);

/// How many `Deferred` are alive, and the dispositions to restore when the last one goes.
struct Installed {
    depth: usize,
    saved: Vec<(libc::c_int, libc::sigaction)>,
}

static STATE: Mutex<Installed> = Mutex::new(Installed {
    depth: 0,
    saved: Vec::new(),
});

extern "C" fn on_signal(sig: libc::c_int) {
    // Async-signal-safe only: an atomic swap, sigaction and raise.
    if PENDING.swap(sig, Ordering::SeqCst) != 0 {
        // SAFETY: a zeroed sigaction with SIG_DFL is a valid disposition; sigaction and raise
        // are async-signal-safe.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &dfl, std::ptr::null_mut());
            libc::raise(sig);
        }
    }
}

/// SIGINT and SIGTERM deferred while this is alive: see the module docs.
#[must_use = "signals are deferred only while the guard is alive"]
pub struct Deferred {
    _private: (),
}

impl Deferred {
    pub fn new() -> Deferred {
        let mut st = STATE.lock().unwrap_or_else(|p| p.into_inner());
        if st.depth == 0 {
            PENDING.store(0, Ordering::SeqCst);
            for sig in SIGNALS {
                // SAFETY: sigaction with a null new action only reads the current one into `old`;
                // the handler installed is async-signal-safe (above) and `act` is fully set.
                unsafe {
                    let mut old: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(sig, std::ptr::null(), &mut old) != 0
                        || old.sa_sigaction == libc::SIG_IGN
                    {
                        continue;
                    }
                    let mut act: libc::sigaction = std::mem::zeroed();
                    act.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                    act.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut act.sa_mask);
                    if libc::sigaction(sig, &act, std::ptr::null_mut()) == 0 {
                        st.saved.push((sig, old));
                    }
                }
            }
        }
        st.depth += 1;
        Deferred { _private: () }
    }

    /// The signal received since the guard was made, if any: the writer should stop, remove its
    /// temporary and return.
    pub fn pending(&self) -> Option<i32> {
        match PENDING.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

impl Default for Deferred {
    fn default() -> Self {
        Deferred::new()
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        let mut st = STATE.lock().unwrap_or_else(|p| p.into_inner());
        st.depth -= 1;
        if st.depth > 0 {
            return;
        }
        for (sig, old) in st.saved.drain(..) {
            // SAFETY: `old` is the disposition sigaction returned for `sig`.
            unsafe { libc::sigaction(sig, &old, std::ptr::null_mut()) };
        }
        let sig = PENDING.swap(0, Ordering::SeqCst);
        drop(st);
        if sig != 0 {
            // SAFETY: raising a signal in this process; its previous disposition is back.
            unsafe { libc::raise(sig) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SIGTERM sent while deferred is recorded, not acted on, and raised again at the end: in
    /// this test the previous disposition is a handler that records it, so the test survives.
    #[test]
    fn a_signal_is_held_until_the_guard_goes_and_then_raised() {
        static SEEN: AtomicI32 = AtomicI32::new(0);
        extern "C" fn record(sig: libc::c_int) {
            SEEN.store(sig, Ordering::SeqCst);
        }
        // SAFETY: installs an async-signal-safe handler (one atomic store) for SIGTERM.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = record as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut act.sa_mask);
            assert_eq!(
                libc::sigaction(libc::SIGTERM, &act, std::ptr::null_mut()),
                0
            );
        }
        {
            let outer = Deferred::new();
            let inner = Deferred::new();
            assert_eq!(outer.pending(), None);
            // SAFETY: sends SIGTERM to this process, whose handler is now `on_signal`.
            unsafe { libc::raise(libc::SIGTERM) };
            assert_eq!(inner.pending(), Some(libc::SIGTERM));
            drop(inner);
            // Still deferred: the outer guard is alive.
            assert_eq!(SEEN.load(Ordering::SeqCst), 0);
            assert_eq!(outer.pending(), Some(libc::SIGTERM));
        }
        // The last guard restored the recording handler and raised the signal again.
        assert_eq!(SEEN.load(Ordering::SeqCst), libc::SIGTERM);
        // SAFETY: puts SIGTERM's default disposition back for the rest of the test binary.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGTERM, &dfl, std::ptr::null_mut());
        }
    }
}
