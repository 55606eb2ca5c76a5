//! rtune's data-parallel world (issue 16): which rank this process is, how many there are, and the
//! few collectives data parallelism needs — a sum all-reduce of gradients (f32) and loss sums
//! (f64), an all-gather of small byte strings (the start-up agreement check, run.json's list of
//! ranks) and a broadcast.
//!
//! [`World::single`] is one process, where every collective is the identity and costs nothing: a
//! run without a launcher runs exactly as before. A distributed [`World`] wraps a [`Collective`],
//! the transport, implemented over MPI by the rtune binary when built with the `mpi` feature (this
//! crate has no MPI dependency, so the libraries above it build and test without one).
//!
//! Faults: MPI's default error handler aborts the whole job on a transport error, and `mpirun`
//! kills every rank when one dies. A rank whose peer *hangs* would wait in a collective forever,
//! so every collective runs under a [`Watchdog`]: past its timeout (`RTUNE_DIST_TIMEOUT`, seconds,
//! default 600) the waiting rank prints what it waited for and exits with status 1, which makes the
//! launcher end the job.

mod agree;
mod watchdog;

pub use agree::{check_agreement, Disagreement};
pub use watchdog::Watchdog;

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// The transport under a distributed [`World`]. Errors are fatal (MPI's default handler aborts the
/// job), so the calls return nothing to handle.
pub trait Collective {
    /// `buf[i] = Σ_ranks buf[i]`, on every rank.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]);
    /// `buf[i] = Σ_ranks buf[i]`, on every rank.
    fn all_reduce_sum_f64(&self, buf: &mut [f64]);
    /// Every rank's `mine`, in rank order, on every rank.
    fn all_gather_bytes(&self, mine: &[u8]) -> Vec<Vec<u8>>;
    /// `buf` becomes `root`'s `buf` on every rank.
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>);
    /// Ends every rank of the job with `code` (MPI_Abort).
    fn abort(&self, code: i32) -> !;
    /// What carries the collectives, for reports (`MPI (Open MPI v4.1.4)`).
    fn describe(&self) -> String;
}

/// This process's place in the run: `rank` of `size`, `local_rank` among the ranks on its host.
#[derive(Clone)]
pub struct World {
    pub rank: usize,
    pub size: usize,
    /// Rank among the processes on this host (the GPU a CUDA rank takes).
    pub local_rank: usize,
    /// This host's name.
    pub host: String,
    // Rc: the transport stays on the thread that made it (MPI is initialised FUNNELED).
    comm: Option<Rc<dyn Collective>>,
    watchdog: Option<Arc<Watchdog>>,
}

impl World {
    /// One process: rank 0 of 1; every collective is the identity.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_rank: 0,
            host: hostname(),
            comm: None,
            watchdog: None,
        }
    }

    /// A distributed world over `comm`; collectives time out after `timeout` (see [`Watchdog`]).
    pub fn new(
        rank: usize,
        size: usize,
        local_rank: usize,
        comm: Rc<dyn Collective>,
        timeout: Duration,
    ) -> Self {
        Self {
            rank,
            size,
            local_rank,
            host: hostname(),
            comm: Some(comm),
            watchdog: Some(Arc::new(Watchdog::start(rank, timeout))),
        }
    }

    /// Rank 0: the one that writes the run directory and prints.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// More than one rank.
    pub fn is_distributed(&self) -> bool {
        self.size > 1
    }

    /// What carries the collectives (`single process` without one).
    pub fn describe(&self) -> String {
        match &self.comm {
            Some(c) => c.describe(),
            None => "single process".into(),
        }
    }

    /// Runs one collective `what` under the watchdog.
    fn guarded<T>(&self, what: &str, f: impl FnOnce(&dyn Collective) -> T) -> Option<T> {
        let comm = self.comm.as_deref()?;
        let _guard = self.watchdog.as_ref().map(|w| w.enter(what));
        Some(f(comm))
    }

    /// Sums `buf` over the ranks, in place (`what` names it if the watchdog fires).
    pub fn all_reduce_sum_f32(&self, what: &str, buf: &mut [f32]) {
        self.guarded(what, |c| c.all_reduce_sum_f32(buf));
    }

    /// Sums `buf` over the ranks, in place.
    pub fn all_reduce_sum_f64(&self, what: &str, buf: &mut [f64]) {
        self.guarded(what, |c| c.all_reduce_sum_f64(buf));
    }

    /// True on every rank when `flag` is true on any rank (a stop request seen by one rank).
    pub fn any(&self, what: &str, flag: bool) -> bool {
        let mut v = [if flag { 1.0 } else { 0.0 }];
        self.all_reduce_sum_f64(what, &mut v);
        v[0] > 0.0
    }

    /// Every rank's `mine`, in rank order (`[mine]` in a single process).
    pub fn all_gather(&self, what: &str, mine: &[u8]) -> Vec<Vec<u8>> {
        self.guarded(what, |c| c.all_gather_bytes(mine))
            .unwrap_or_else(|| vec![mine.to_vec()])
    }

    /// `buf` becomes rank `root`'s `buf` on every rank.
    pub fn broadcast(&self, what: &str, root: usize, buf: &mut Vec<u8>) {
        self.guarded(what, |c| c.broadcast_bytes(root, buf));
    }

    /// Ends the whole job with `code` after an error on this rank (other ranks may be waiting in
    /// a collective for this one); a single process just exits.
    pub fn abort(&self, code: i32) -> ! {
        match &self.comm {
            Some(c) => c.abort(code),
            None => std::process::exit(code),
        }
    }
}

/// Ranks a launcher started, from its environment: Open MPI's `OMPI_COMM_WORLD_SIZE`, or the PMI
/// (MPICH, Intel MPI, Slurm's `srun --mpi=pmi2`) and PMIx (`srun --mpi=pmix`) sizes. `None`
/// without a launcher.
pub fn launched_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
        .or_else(|| std::env::var_os("PMIX_RANK").map(|_| 0))
}

/// The watchdog's timeout: `RTUNE_DIST_TIMEOUT` seconds, default 600 (a step, an evaluation on
/// rank 0 or a checkpoint write must fit in it).
pub fn timeout_from_env() -> Duration {
    let s = std::env::var("RTUNE_DIST_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(600.0);
    Duration::from_secs_f64(s)
}

/// This host's name (`gethostname`), or `localhost` if it has none.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what is passed; gethostname writes
    // at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match (rc, std::str::from_utf8(&buf[..end])) {
        (0, Ok(s)) if !s.is_empty() => s.to_string(),
        _ => "localhost".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A single process: collectives are the identity, `any` is the flag, gather is `[mine]`.
    #[test]
    fn single_world_collectives_are_the_identity() {
        let w = World::single();
        assert!(w.is_root() && !w.is_distributed());
        let mut g = [1.5f32, -2.0];
        w.all_reduce_sum_f32("g", &mut g);
        assert_eq!(g, [1.5, -2.0]);
        assert!(w.any("stop", true) && !w.any("stop", false));
        assert_eq!(w.all_gather("x", b"abc"), vec![b"abc".to_vec()]);
        let mut b = b"xyz".to_vec();
        w.broadcast("b", 0, &mut b);
        assert_eq!(b, b"xyz");
        assert_eq!(w.describe(), "single process");
    }
}
