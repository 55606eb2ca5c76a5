//! [`Watchdog`]: a thread that ends this rank when a collective has waited longer than allowed.
//!
//! A collective returns only when every rank has joined it; a rank that hangs (a deadlocked
//! device, a stuck filesystem, a stopped process) would keep the others waiting forever. MPI
//! notices a rank that *dies*, not one that hangs. Each collective marks when it started and how
//! long it may wait ([`Watchdog::enter`]); the thread checks every 250 ms and, past that, runs the
//! abort hooks (NCCL's `ncclCommAbort`, so a GPU stream spinning in a collective is released),
//! prints one line naming this rank, the rank(s) it waited for, what it waited in and for how
//! long, and `_exit(1)`s: `mpirun` (or `srun`) then ends every other rank. Exiting from the
//! watchdog thread calls nothing in MPI, which may be blocked in the main thread.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the main thread is waiting in, since when, and for how long it may.
struct Waiting {
    what: String,
    since: Instant,
    allowed: Duration,
    /// Why `allowed` is what it is (`RTUNE_DIST_TIMEOUT = 30 s`), for the message.
    why: String,
}

/// Run by the watchdog thread just before it ends the process (must not block).
pub type AbortHook = Box<dyn Fn() + Send>;

/// The watchdog of one rank.
pub struct Watchdog {
    waiting: Arc<Mutex<Option<Waiting>>>,
    hooks: Arc<Mutex<Vec<AbortHook>>>,
}

/// Marks the end of a collective when dropped.
pub struct Entered<'a>(&'a Watchdog);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        *lock(&self.0.waiting) = None;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Watchdog {
    /// Starts the thread for rank `rank` of `size`.
    pub fn start(rank: usize, size: usize) -> Self {
        let waiting: Arc<Mutex<Option<Waiting>>> = Arc::new(Mutex::new(None));
        let hooks: Arc<Mutex<Vec<AbortHook>>> = Arc::new(Mutex::new(Vec::new()));
        let (seen, abort) = (Arc::clone(&waiting), Arc::clone(&hooks));
        // With two ranks the one waited for is known; with more, any of the others may be it.
        let others = match size {
            2 => format!("rank {}", 1 - rank),
            _ => format!("one of the other {} ranks", size.saturating_sub(1)),
        };
        let spawned = std::thread::Builder::new()
            .name("rtune-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(250));
                let late = lock(&seen)
                    .as_ref()
                    .filter(|w| w.since.elapsed() > w.allowed)
                    .map(|w| (w.what.clone(), w.since.elapsed(), w.why.clone()));
                let Some((what, waited, why)) = late else {
                    continue;
                };
                // try_lock: a hook being registered right now is not worth a deadlock.
                if let Ok(hooks) = abort.try_lock() {
                    for h in hooks.iter() {
                        h();
                    }
                }
                eprintln!(
                    "error: rank {rank}: waited {:.0} s for {others} in {what} ({why}): {others} \
                     died or hangs; ending this one",
                    waited.as_secs_f64(),
                );
                // SAFETY: `_exit` ends the process at once; it is async-signal-safe and needs
                // nothing from the (possibly blocked) main thread.
                unsafe { libc::_exit(1) };
            });
        if let Err(e) = spawned {
            eprintln!(
                "warning: rank {rank}: no watchdog thread ({e}); a hung rank is not detected"
            );
        }
        Self { waiting, hooks }
    }

    /// Marks the start of collective `what`, which may wait `allowed` (`why` says why that long);
    /// it ends when the returned guard drops.
    pub fn enter(&self, what: &str, allowed: Duration, why: String) -> Entered<'_> {
        *lock(&self.waiting) = Some(Waiting {
            what: what.to_string(),
            since: Instant::now(),
            allowed,
            why,
        });
        Entered(self)
    }

    /// Adds `hook`, run (from the watchdog thread) before the process ends on a timeout.
    pub fn on_timeout(&self, hook: AbortHook) {
        lock(&self.hooks).push(hook);
    }
}
