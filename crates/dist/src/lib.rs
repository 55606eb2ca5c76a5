//! rtune's data parallelism (issue 16), all of it: which rank this process is, how many there are,
//! the few collectives data parallelism needs — a sum all-reduce of gradients (f32) and loss sums
//! (f64), an all-gather of small byte strings (the start-up agreement check, run.json's list of
//! ranks) and a broadcast — and what the trainer does with them.
//!
//! - `lib.rs`: [`World`] (rank, size, host; the collectives under the watchdog and their pace),
//!   the [`Collective`] transport trait, the launcher's environment, [`DistError`];
//! - `data_parallel.rs`: [`DataParallel`], the trainer's one door — the start-up agreement and the
//!   rank list ([`RankInfo`]), the GPU a rank takes, the step's gradient and loss all-reduce, the
//!   world size as a resume setting;
//! - `agree.rs`: the start-up agreement check ([`Disagreement`]);
//! - `watchdog.rs`: [`Watchdog`], which ends a rank whose collective waited too long, after its
//!   abort hooks ([`AbortHook`]: NCCL's `ncclCommAbort`);
//! - `nccl.rs` (feature `cuda`): `Nccl`, this rank's NCCL communicator on a second stream, and the
//!   in-place sum all-reduce of a candle tensor;
//! - `buckets.rs` (feature `cuda`): the per-layer gradient buckets a CUDA rank all-reduces during
//!   the backward;
//! - `mpi.rs` (the binary's feature `mpi`): the MPI transport and its `init` (and the all-gather a
//!   sharded base's prefetching thread runs, [`AllGather`]), compiled into the
//!   rtune binary, not into this crate, so that `--features mpi` rebuilds only the binary (the
//!   file says why).
//!
//! The trainer holds one [`DataParallel`] and calls it at start (`join`), in the step (after the
//! backward, `all_reduce`; on a CUDA rank `launch_layer` during the last micro-batch's backward)
//! and through its [`World`] (`world`) for the run loop's agreements and announced phases. This
//! crate sits above rtune-model and rtune-lora (what it reduces is their `Grads`, laid out by the
//! `Adapter`) and below rtune-train; `rtune check` (rtune-diag) and the binary use [`World`].
//!
//! [`World::single`] is one process, where every collective is the identity and costs nothing: a
//! run without a launcher runs exactly as before. A distributed [`World`] wraps a [`Collective`],
//! the transport, implemented over MPI by the rtune binary when built with the `mpi` feature (this
//! crate has no MPI dependency, so the libraries above it build and test without one).
//!
//! Faults: MPI's default error handler aborts the whole job on a transport error, and `mpirun`
//! kills every rank when one dies. A rank whose peer *hangs* would wait in a collective forever,
//! so every collective runs under a [`Watchdog`] that ends this rank when the wait is longer than
//! allowed, and the launcher then ends the job. What is allowed ([`World`]'s pace):
//! - a collective in the ordinary course (a step's all-reduce, where the ranks differ only by how
//!   long their own micro-batches took): `RTUNE_DIST_TIMEOUT` seconds (default 30), or twice the
//!   slowest step seen so far when that is longer (a slow model must not look hung), so a hung
//!   rank is caught within 60 s with the default;
//! - the one collective that follows a long phase every rank knows of — the start-up (ranks load
//!   the model at their disks' pace), the first step (warm-up) ([`World::expect_long`]), rank 0's
//!   evaluation or checkpoint ([`World::expect_root_phase`]: on the other ranks only; rank 0 finds
//!   them waiting), announced on every rank before the phase, which every rank knows from the same
//!   config and step — `RTUNE_DIST_PHASE_TIMEOUT` seconds (default 1800). A rank that hangs *in*
//!   such a phase is caught after that long, not 30 s.

mod agree;
#[cfg(feature = "cuda")]
mod buckets;
mod data_parallel;
pub mod gather_plan;
#[cfg(feature = "cuda")]
pub mod nccl;
mod watchdog;

pub use agree::{check_agreement, Disagreement};
pub use data_parallel::{DataParallel, RankInfo, WORLD_SIZE};
pub use watchdog::{AbortHook, Watchdog};

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// What can go wrong in data parallelism beyond the transport (whose errors end the job).
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The ranks of a data-parallel run do not run the same thing (config, model or data).
    #[error(transparent)]
    Ranks(Box<Disagreement>),
    /// An NCCL call (or the CUDA call around it) of a data-parallel CUDA run failed.
    #[error("NCCL {op} on cuda:{ordinal}: {message}")]
    Nccl {
        op: &'static str,
        ordinal: usize,
        message: String,
    },
    /// Moving gradients to or from the reduction's buffers failed.
    #[error("{op}: {source}")]
    Candle {
        op: &'static str,
        source: candle_core::Error,
    },
}

impl DistError {
    pub(crate) fn candle(op: &'static str) -> impl Fn(candle_core::Error) -> DistError {
        move |source| DistError::Candle { op, source }
    }
}

/// The transport under a distributed [`World`]. Errors are fatal (MPI's default handler aborts the
/// job), so the calls return nothing to handle.
pub trait Collective {
    /// `buf[i] = Σ_ranks buf[i]`, on every rank.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]);
    /// `buf[i] = Σ_ranks buf[i]`, on every rank.
    fn all_reduce_sum_f64(&self, buf: &mut [f64]);
    /// Every rank's `mine`, in rank order, on every rank.
    fn all_gather_bytes(&self, mine: &[u8]) -> Vec<Vec<u8>>;
    /// Every rank's `mine` (rank r's is `counts[r]` bytes, known to all) concatenated in rank
    /// order into `out` (their sum): a sharded base's weights, any size.
    fn all_gather_into(&self, mine: &[u8], counts: &[usize], out: &mut [u8]);
    /// `buf` becomes `root`'s `buf` on every rank.
    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>);
    /// Ends every rank of the job with `code` (MPI_Abort).
    fn abort(&self, code: i32) -> !;
    /// What carries the collectives, for reports (`MPI (Open MPI v4.1.4)`).
    fn describe(&self) -> String;
    /// [`all_gather_into`](Self::all_gather_into) for one other thread: a sharded base's next
    /// layer gathered while this thread computes. `None` (the default) where the transport may be
    /// used from this thread only. The caller never lets the two threads use it at once.
    fn background(&self) -> Option<Arc<dyn AllGather>> {
        None
    }
}

/// A transport's all-gather as another thread runs it ([`Collective::background`]).
pub trait AllGather: Send + Sync {
    /// As [`Collective::all_gather_into`].
    fn all_gather_into(&self, mine: &[u8], counts: &[usize], out: &mut [u8]);
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
    // Rc: the transport stays on the thread that made it; only its `background` all-gather
    // goes to another thread (MPI is initialised SERIALIZED, see mpi.rs).
    comm: Option<Rc<dyn Collective>>,
    watchdog: Option<Arc<Watchdog>>,
    /// How long the next collective may wait (shared by the clones of this world).
    pace: Rc<RefCell<Pace>>,
}

/// What decides how long a collective may wait (see the module's overview).
struct Pace {
    timeout: Duration,
    phase_timeout: Duration,
    /// The slowest step so far (the first, warm-up, step excluded).
    slowest_step: Duration,
    /// The long phase the next collective follows, announced by [`World::expect_long`].
    after: Option<String>,
}

impl Pace {
    fn new() -> Self {
        Self {
            timeout: timeout_from_env(),
            phase_timeout: env_secs("RTUNE_DIST_PHASE_TIMEOUT", 1800.0),
            slowest_step: Duration::ZERO,
            // Ranks reach the first collective after loading the model, each at its own pace.
            after: Some("the start-up".into()),
        }
    }

    /// How long the collective starting now may wait, and why; consumes an announced phase.
    fn next(&mut self) -> (Duration, String) {
        let s = |d: Duration| d.as_secs_f64();
        if let Some(phase) = self.after.take() {
            return (
                self.phase_timeout,
                format!(
                    "after {phase}: RTUNE_DIST_PHASE_TIMEOUT = {:.0} s",
                    s(self.phase_timeout)
                ),
            );
        }
        let twice = 2 * self.slowest_step;
        if twice > self.timeout {
            (
                twice,
                format!(
                    "twice the slowest step, {:.1} s; RTUNE_DIST_TIMEOUT = {:.0} s",
                    s(self.slowest_step),
                    s(self.timeout)
                ),
            )
        } else {
            (
                self.timeout,
                format!("RTUNE_DIST_TIMEOUT = {:.0} s", s(self.timeout)),
            )
        }
    }
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
            pace: Rc::new(RefCell::new(Pace::new())),
        }
    }

    /// A distributed world over `comm`; its collectives run under a [`Watchdog`], paced by
    /// `RTUNE_DIST_TIMEOUT` and `RTUNE_DIST_PHASE_TIMEOUT` (see the module's overview).
    pub fn new(rank: usize, size: usize, local_rank: usize, comm: Rc<dyn Collective>) -> Self {
        Self {
            rank,
            size,
            local_rank,
            host: hostname(),
            comm: Some(comm),
            watchdog: Some(Arc::new(Watchdog::start(rank, size))),
            pace: Rc::new(RefCell::new(Pace::new())),
        }
    }

    /// Announces, on every rank, that the next collective follows a long phase `what` on some
    /// rank (`step 5's evaluation on rank 0`): that collective alone may wait
    /// `RTUNE_DIST_PHASE_TIMEOUT`. Every rank must announce it alike (they decide it from the same
    /// config and step).
    pub fn expect_long(&self, what: &str) {
        self.pace.borrow_mut().after = Some(what.to_string());
    }

    /// [`expect_long`](Self::expect_long) for a phase rank 0 alone goes through (its evaluation,
    /// its checkpoint write): the other ranks' next collective may wait long; rank 0's own, which
    /// finds them waiting already, keeps the ordinary deadline, so a rank that hangs meanwhile is
    /// still caught in time.
    pub fn expect_root_phase(&self, what: &str) {
        if !self.is_root() {
            self.expect_long(what);
        }
    }

    /// Tells the pace how long a step took on this rank (the ordinary wait is at least twice the
    /// slowest). `first`: the attempt's first step, whose warm-up is not counted.
    pub fn step_took(&self, took: Duration, first: bool) {
        let mut p = self.pace.borrow_mut();
        if !first {
            p.slowest_step = p.slowest_step.max(took);
        }
    }

    /// Runs `f`, a wait on the other ranks outside this world's collectives (a GPU stream
    /// synchronised on an NCCL collective), under the watchdog as collective `what`.
    pub fn watch<T>(&self, what: &str, f: impl FnOnce() -> T) -> T {
        let _guard = self.enter(what);
        f()
    }

    /// Adds `hook`, run just before the watchdog ends this rank (NCCL's `ncclCommAbort`). A single
    /// process has no watchdog: the hook is dropped.
    pub fn on_timeout(&self, hook: AbortHook) {
        if let Some(w) = &self.watchdog {
            w.on_timeout(hook);
        }
    }

    fn enter(&self, what: &str) -> Option<watchdog::Entered<'_>> {
        let w = self.watchdog.as_ref()?;
        let (allowed, why) = self.pace.borrow_mut().next();
        Some(w.enter(what, allowed, why))
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
        let _guard = self.enter(what);
        Some(f(comm))
    }

    /// Sums `buf` over the ranks, in place (`what` names it if the watchdog fires), in rank
    /// order: `((b₀ + b₁) + b₂) + …`, what one process accumulating the ranks' micro-batches in
    /// turn adds, bit for bit. Two ranks' sum is the same in either order; from three on, MPI's
    /// reduction order is its algorithm's, so the ranks' buffers are gathered and summed here.
    pub fn all_reduce_sum_f32(&self, what: &str, buf: &mut [f32]) {
        if self.size > 2 {
            return self.ordered_sum(what, buf, f32::to_le_bytes, f32::from_le_bytes);
        }
        self.guarded(what, |c| c.all_reduce_sum_f32(buf));
    }

    /// Sums `buf` over the ranks, in place, in rank order (as [`all_reduce_sum_f32`](Self::all_reduce_sum_f32)).
    pub fn all_reduce_sum_f64(&self, what: &str, buf: &mut [f64]) {
        if self.size > 2 {
            return self.ordered_sum(what, buf, f64::to_le_bytes, f64::from_le_bytes);
        }
        self.guarded(what, |c| c.all_reduce_sum_f64(buf));
    }

    /// Every rank's `buf` gathered, then summed in rank order into `buf`.
    fn ordered_sum<T, const N: usize>(
        &self,
        what: &str,
        buf: &mut [T],
        to: fn(T) -> [u8; N],
        from: fn([u8; N]) -> T,
    ) where
        T: Copy + std::ops::AddAssign,
    {
        let mine: Vec<u8> = buf.iter().flat_map(|&x| to(x)).collect();
        let counts = vec![mine.len(); self.size];
        let mut all = vec![0u8; mine.len() * self.size];
        self.all_gather_into(what, &mine, &counts, &mut all);
        let value = |b: &[u8]| from(b.try_into().expect("N bytes"));
        let mut ranks = all.chunks_exact(mine.len().max(1));
        if let Some(first) = ranks.next() {
            for (x, b) in buf.iter_mut().zip(first.chunks_exact(N)) {
                *x = value(b);
            }
        }
        for r in ranks {
            for (x, b) in buf.iter_mut().zip(r.chunks_exact(N)) {
                *x += value(b);
            }
        }
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

    /// Every rank's `mine` (rank r's `counts[r]` bytes) in rank order into `out`; a copy in a
    /// single process.
    pub fn all_gather_into(&self, what: &str, mine: &[u8], counts: &[usize], out: &mut [u8]) {
        if self
            .guarded(what, |c| c.all_gather_into(mine, counts, out))
            .is_none()
        {
            out.copy_from_slice(mine);
        }
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

/// A sharded base (`rtune_model::shard`) gathers its weights through the world's collective.
impl rtune_model::Gather for World {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather_into(&self, what: &str, mine: &[u8], counts: &[usize], out: &mut [u8]) {
        World::all_gather_into(self, what, mine, counts, out)
    }

    fn background(&self) -> Option<Arc<dyn rtune_model::Gather + Send + Sync>> {
        let gather = self.comm.as_ref()?.background()?;
        Some(Arc::new(Background {
            rank: self.rank,
            size: self.size,
            gather,
        }))
    }

    /// The wait is watched as a collective is: a rank that never joins the gather ends this one.
    fn waiting(&self, what: &str, wait: &mut dyn FnMut()) {
        self.watch(what, wait)
    }
}

/// The world's all-gather on a sharded base's prefetching thread (unwatched there: the main
/// thread watches its wait for it, [`rtune_model::Gather::waiting`]).
struct Background {
    rank: usize,
    size: usize,
    gather: Arc<dyn AllGather>,
}

impl rtune_model::Gather for Background {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather_into(&self, _what: &str, mine: &[u8], counts: &[usize], out: &mut [u8]) {
        self.gather.all_gather_into(mine, counts, out)
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

/// The watchdog's ordinary timeout: `RTUNE_DIST_TIMEOUT` seconds, default 30 (see the module's
/// overview for when a collective may wait longer).
pub fn timeout_from_env() -> Duration {
    env_secs("RTUNE_DIST_TIMEOUT", 30.0)
}

/// `var` as a positive number of seconds, or `default`.
fn env_secs(var: &str, default: f64) -> Duration {
    let s = std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| *s > 0.0 && s.is_finite())
        .unwrap_or(default);
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

    /// The first collective follows the start-up; an announced phase lengthens the next wait
    /// only; the ordinary wait grows to twice the slowest step (the first step not counted).
    #[test]
    fn pace_lengthens_one_wait_after_a_long_phase_and_follows_slow_steps() {
        let secs = Duration::from_secs;
        let mut p = Pace {
            timeout: secs(30),
            phase_timeout: secs(1800),
            slowest_step: Duration::ZERO,
            after: Some("the start-up".into()),
        };
        let (d, why) = p.next();
        assert_eq!(d, secs(1800));
        assert!(why.starts_with("after the start-up"), "{why}");
        assert_eq!(p.next().0, secs(30));
        p.after = Some("step 4's evaluation on rank 0".into());
        assert_eq!(p.next().0, secs(1800));
        assert_eq!(p.next().0, secs(30));
        p.slowest_step = secs(40);
        let (d, why) = p.next();
        assert_eq!(d, secs(80));
        assert!(why.starts_with("twice the slowest step, 40.0 s"), "{why}");
        let w = World::single();
        w.step_took(secs(100), true);
        assert_eq!(w.pace.borrow().slowest_step, Duration::ZERO, "warm-up");
        w.step_took(secs(7), false);
        assert_eq!(w.pace.borrow().slowest_step, secs(7));
    }
}
