//! [`Watchdog`]: a thread that ends this rank when a collective has waited longer than a timeout.
//!
//! A collective returns only when every rank has joined it; a rank that hangs (a deadlocked
//! device, a stuck filesystem) would keep the others waiting forever. MPI notices a rank that
//! *dies*, not one that hangs. Each collective marks when it started ([`Watchdog::enter`]); the
//! thread checks every 250 ms and, past the timeout, prints one line naming this rank, what it
//! waited for and for how long, and `_exit(1)`s: `mpirun` (or `srun`) then ends every other rank.
//! Exiting from the watchdog thread calls nothing in MPI, which may be blocked in the main thread.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the main thread is waiting for, and since when.
type Waiting = Option<(String, Instant)>;

/// The watchdog of one rank.
pub struct Watchdog {
    waiting: Arc<Mutex<Waiting>>,
    timeout: Duration,
}

/// Marks the end of a collective when dropped.
pub struct Entered<'a>(&'a Watchdog);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        *self.0.waiting.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

impl Watchdog {
    /// Starts the thread for rank `rank`.
    pub fn start(rank: usize, timeout: Duration) -> Self {
        let waiting: Arc<Mutex<Waiting>> = Arc::new(Mutex::new(None));
        let seen = Arc::clone(&waiting);
        let spawned = std::thread::Builder::new()
            .name("rtune-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(250));
                let late = seen
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .filter(|(_, since)| since.elapsed() > timeout)
                    .map(|(what, since)| (what.clone(), since.elapsed()));
                if let Some((what, waited)) = late {
                    eprintln!(
                        "error: rank {rank}: waited {:.0} s for the other ranks in {what} (RTUNE_DIST_TIMEOUT = {} s): \
                         a rank died or hangs; ending this one",
                        waited.as_secs_f64(),
                        timeout.as_secs_f64()
                    );
                    // SAFETY: `_exit` ends the process at once; it is async-signal-safe and needs
                    // nothing from the (possibly blocked) main thread.
                    unsafe { libc::_exit(1) };
                }
            });
        if let Err(e) = spawned {
            eprintln!(
                "warning: rank {rank}: no watchdog thread ({e}); a hung rank is not detected"
            );
        }
        Self { waiting, timeout }
    }

    /// The timeout a collective may wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Marks the start of collective `what`; it ends when the returned guard drops.
    pub fn enter(&self, what: &str) -> Entered<'_> {
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((what.to_string(), Instant::now()));
        Entered(self)
    }
}
