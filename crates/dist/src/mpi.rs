//! The MPI transport of data-parallel runs (feature `mpi`): [`init`] starts MPI when a launcher
//! (`mpirun`, `srun --mpi=pmix`) started this process and returns the [`World`] over
//! `MPI_COMM_WORLD`; [`Mpi`] implements rtune-dist's [`Collective`] with rsmpi (`MPI_Allreduce`
//! with `MPI_SUM`, `MPI_Allgatherv`, `MPI_Bcast`, `MPI_Abort`).
//!
//! MPI is initialised with `MPI_THREAD_SERIALIZED`: the main thread calls MPI, and so does a
//! sharded base's prefetching thread ([`Collective::background`]: the next layer's
//! `MPI_Allgatherv` while the main thread computes), never both at once — the main thread makes no
//! collective until it has waited for that thread (`rtune_model::gathered::Feed`). rayon's and
//! BLAS's threads never call MPI; the watchdog thread only `_exit`s. An MPI that provides less
//! (FUNNELED) gets no prefetch. The node-local rank is the rank in
//! `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`. Dropping the last [`World`] clone finalises MPI.
//!
//! Where it is built: this file lives with the rest of data parallelism in crates/dist, but it is
//! not a module of rtune-dist: the rtune binary compiles it (`#[path]` in crates/cli/main.rs), and
//! the rsmpi dependency is the binary's, behind its `mpi` feature. rtune-dist's features, hence its
//! build and those of rtune-train and rtune-diag above it, are the same with and without `mpi`, so
//! `cargo test --features mpi --test dist` rebuilds only the binary and its tests. (rtune-dist with
//! an `mpi` feature of its own would change rtune-dist's hash and rebuild every crate above it.)

use std::rc::Rc;
use std::sync::Arc;

use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Count;
use rtune_dist::{AllGather, Collective, World};

/// MPI_COMM_WORLD, and the universe whose drop calls `MPI_Finalize`.
pub struct Mpi {
    world: SimpleCommunicator,
    /// MPI provided `MPI_THREAD_SERIALIZED` (or more): another thread may gather.
    serialized: bool,
    // Dropped after `world` (fields drop in order): the communicator handle first, then finalise.
    _universe: Universe,
}

/// The world this process belongs to: over MPI when a launcher started it, else a single process.
pub fn init() -> anyhow::Result<World> {
    if rtune_dist::launched_size().is_none() {
        return Ok(World::single());
    }
    let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
        .ok_or_else(|| anyhow::anyhow!("MPI was already initialised"))?;
    let serialized = matches!(
        threading,
        mpi::Threading::Serialized | mpi::Threading::Multiple
    );
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let local_rank = world.split_shared(world.rank()).rank() as usize;
    if size == 1 {
        return Ok(World::single());
    }
    let comm = Mpi {
        world,
        serialized,
        _universe: universe,
    };
    Ok(World::new(rank, size, local_rank, Rc::new(comm)))
}

impl Collective for Mpi {
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) {
        let send = buf.to_vec();
        self.world
            .all_reduce_into(&send[..], buf, mpi::collective::SystemOperation::sum());
    }

    fn all_reduce_sum_f64(&self, buf: &mut [f64]) {
        let send = buf.to_vec();
        self.world
            .all_reduce_into(&send[..], buf, mpi::collective::SystemOperation::sum());
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Vec<Vec<u8>> {
        let size = self.world.size() as usize;
        let mut counts: Vec<Count> = vec![0; size];
        self.world
            .all_gather_into(&(mine.len() as Count), &mut counts[..]);
        let displs: Vec<Count> = counts
            .iter()
            .scan(0, |acc, &n| {
                let at = *acc;
                *acc += n;
                Some(at)
            })
            .collect();
        let total: usize = counts.iter().map(|&n| n as usize).sum();
        let mut all = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            self.world.all_gather_varcount_into(mine, &mut part);
        }
        counts
            .iter()
            .zip(&displs)
            .map(|(&n, &at)| all[at as usize..(at + n) as usize].to_vec())
            .collect()
    }

    fn all_gather_into(&self, mine: &[u8], counts: &[usize], out: &mut [u8]) {
        all_gather_into(&self.world, mine, counts, out, false)
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut Vec<u8>) {
        let root = self.world.process_at_rank(root as i32);
        let mut len = buf.len() as u64;
        root.broadcast_into(&mut len);
        buf.resize(len as usize, 0);
        root.broadcast_into(&mut buf[..]);
    }

    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    fn describe(&self) -> String {
        let v = mpi::environment::library_version().unwrap_or_default();
        // "Open MPI v4.1.4, package: Debian OpenMPI, ident: ...": the name and version.
        let first = v.split([',', '\n']).next().unwrap_or("").trim();
        format!("MPI ({first})")
    }

    fn background(&self) -> Option<Arc<dyn AllGather>> {
        self.serialized
            .then(|| Arc::new(WorldGather) as Arc<dyn AllGather>)
    }
}

/// `MPI_COMM_WORLD`'s all-gather from another thread (MPI is SERIALIZED there).
struct WorldGather;

impl AllGather for WorldGather {
    fn all_gather_into(&self, mine: &[u8], counts: &[usize], out: &mut [u8]) {
        // A handle to the predefined communicator: nothing to free when it drops.
        all_gather_into(&SimpleCommunicator::world(), mine, counts, out, true)
    }
}

/// How often the background thread tests its gather.
const POLL: std::time::Duration = std::time::Duration::from_micros(200);

/// `MPI_Allgatherv`; with `poll`, started nonblocking (`MPI_Iallgatherv`) and tested every
/// [`POLL`], sleeping between tests. A thread gathering beside the one that computes must not
/// spin: MPI's blocking wait busy-polls, and a rank's background thread waiting for a peer that
/// is still computing took a core from its own computation (measured on 2 ranks of a 2-core
/// machine: 30% slower than gathering in turn).
fn allgatherv<C, D>(
    world: &SimpleCommunicator,
    send: &[u8],
    recv: &mut PartitionMut<'_, [u8], C, D>,
    poll: bool,
) where
    C: std::borrow::Borrow<[Count]>,
    D: std::borrow::Borrow<[Count]>,
{
    if !poll {
        world.all_gather_varcount_into(send, recv);
        return;
    }
    mpi::request::scope(|scope| {
        let mut req = world.immediate_all_gather_varcount_into(scope, send, recv);
        loop {
            match req.test() {
                Ok(_) => break,
                Err(r) => req = r,
            }
            std::thread::sleep(POLL);
        }
    });
}

/// Every rank's `mine` (rank r's `counts[r]` bytes) concatenated in rank order into `out`
/// (`poll`: see [`allgatherv`]).
fn all_gather_into(
    world: &SimpleCommunicator,
    mine: &[u8],
    counts: &[usize],
    out: &mut [u8],
    poll: bool,
) {
    // MPI's counts and displacements are `int`: rounds of at most 1 GiB in all, each rank
    // sending the next `chunk` bytes of its part (the rounds are the same on every rank,
    // which all know every count).
    let size = counts.len();
    let chunk = ((1usize << 30) / size.max(1)).max(1);
    let rounds = counts.iter().max().map_or(0, |m| m.div_ceil(chunk));
    let starts: Vec<usize> = counts
        .iter()
        .scan(0, |acc, &n| {
            let at = *acc;
            *acc += n;
            Some(at)
        })
        .collect();
    if rounds == 1 {
        // The usual case: straight into `out`.
        let c: Vec<Count> = counts.iter().map(|&n| n as Count).collect();
        let d: Vec<Count> = starts.iter().map(|&n| n as Count).collect();
        let mut recv = PartitionMut::new(out, &c[..], &d[..]);
        allgatherv(world, mine, &mut recv, poll);
        return;
    }
    let mut tmp = Vec::new();
    for k in 0..rounds {
        let part = |n: usize| n.saturating_sub(k * chunk).min(chunk);
        let these: Vec<Count> = counts.iter().map(|&n| part(n) as Count).collect();
        let displs: Vec<Count> = these
            .iter()
            .scan(0, |acc, &n| {
                let at = *acc;
                *acc += n;
                Some(at)
            })
            .collect();
        let from = (k * chunk).min(mine.len());
        let send = &mine[from..from + part(mine.len())];
        tmp.resize(these.iter().map(|&n| n as usize).sum(), 0);
        {
            let mut recv = PartitionMut::new(&mut tmp[..], &these[..], &displs[..]);
            allgatherv(world, send, &mut recv, poll);
        }
        for r in 0..size {
            let (n, at) = (these[r] as usize, displs[r] as usize);
            let to = starts[r] + k * chunk;
            out[to..to + n].copy_from_slice(&tmp[at..at + n]);
        }
    }
}
