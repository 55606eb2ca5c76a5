//! How a sharded base's all-gather runs as NCCL calls (issue 48 item 5): the plan is plain Rust,
//! so the CPU proves it; `nccl.rs` (feature `cuda`) issues it on a CUDA rank.
//!
//! Every rank holds `counts[r]` bytes of a weight (rank r's shard, `rtune_model::shard::span`) and
//! wants their concatenation in rank order in one buffer `out` of `Σ counts` bytes: rank r's slot
//! is `out[offsets[r] .. offsets[r] + counts[r]]`, `offsets` the prefix sums. [`plan`] picks the
//! calls:
//! - every count equal (a world that divides the weight, and a world of one): one
//!   `ncclAllGather` of `counts[0]` bytes per rank, whose receive layout (rank r at
//!   `r · count`) is exactly the slots;
//! - counts that differ (the first `units mod world` ranks hold one unit more; a rank past the last
//!   unit holds nothing): `ncclGroupStart`, one `ncclBroadcast` per non-empty shard (root r sends
//!   its `counts[r]` bytes, every rank receives them into slot r), `ncclGroupEnd`. The group makes
//!   NCCL launch the broadcasts together, one kernel, instead of one after the other; an
//!   all-gather of padded slots would need a scratch buffer and a compaction copy instead. Empty
//!   shards make no call (every rank knows every count, so every rank skips the same ones, as
//!   NCCL requires of a collective).
//!
//! The calls move bytes (`ncclUint8`): all-gather and broadcast compute nothing, and NCCL moves
//! bytes whatever the type. Nothing is padded: the slots must be contiguous, for the gathered
//! buffer is the weight. [`Plan::aligned`] says whether every slot starts on a 16-byte boundary
//! (NCCL's fast path for loads and stores), which an odd count breaks; it is reported, not
//! required.
//!
//! [`execute`] issues a plan through a [`Primitives`] (NCCL's on a CUDA rank; in this file's tests a
//! host fake with the collectives' semantics over in-process buffers, every rank of a world run
//! from the same plan, which checks that the calls are the same on every rank, stay in their
//! buffers, and gather the concatenation).

/// One rank's share of a gather: which calls, and where each rank's bytes land.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Bytes each rank sends, in rank order.
    pub counts: Vec<usize>,
    /// Where rank r's bytes start in the gathered buffer (prefix sums of `counts`).
    pub offsets: Vec<usize>,
    /// The calls, in order (empty when there is nothing to move).
    pub calls: Vec<Call>,
}

/// A collective call of a plan (every rank issues the same ones, with the same arguments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `ncclAllGather(mine, out, count)`: rank r's `count` bytes into `out[r·count ..]`.
    AllGather { count: usize },
    /// `ncclGroupStart`, the broadcasts, `ncclGroupEnd`.
    Broadcasts(Vec<Bcast>),
}

/// `ncclBroadcast(mine, out + at, count, root)`: `root`'s `count` bytes into every rank's
/// `out[at .. at + count]` (the send buffer is read on `root` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bcast {
    pub root: usize,
    pub at: usize,
    pub count: usize,
}

impl Plan {
    /// Bytes gathered (the length `out` must have).
    pub fn total(&self) -> usize {
        self.counts.iter().sum()
    }

    /// Every slot starts on a 16-byte boundary of `out` (given an aligned `out`).
    pub fn aligned(&self) -> bool {
        self.offsets.iter().all(|o| o % 16 == 0)
    }
}

/// The plan of a gather in which rank r sends `counts[r]` bytes: one all-gather when the counts
/// are equal, else grouped broadcasts into the slots (the module says why).
pub fn plan(counts: &[usize]) -> Plan {
    let equal = counts.windows(2).all(|w| w[0] == w[1]);
    if equal {
        let mut p = slots(counts);
        let count = counts.first().copied().unwrap_or(0);
        if count > 0 {
            p.calls.push(Call::AllGather { count });
        }
        return p;
    }
    broadcasts(counts)
}

/// The grouped-broadcast plan whatever the counts (what [`plan`] makes of unequal ones; also
/// for a selftest that runs this path in a world of one).
pub fn broadcasts(counts: &[usize]) -> Plan {
    let mut p = slots(counts);
    let group: Vec<Bcast> = (0..counts.len())
        .filter(|&r| counts[r] > 0)
        .map(|r| Bcast {
            root: r,
            at: p.offsets[r],
            count: counts[r],
        })
        .collect();
    if !group.is_empty() {
        p.calls.push(Call::Broadcasts(group));
    }
    p
}

fn slots(counts: &[usize]) -> Plan {
    let offsets = counts
        .iter()
        .scan(0, |acc, &n| {
            let at = *acc;
            *acc += n;
            Some(at)
        })
        .collect();
    Plan {
        counts: counts.to_vec(),
        offsets,
        calls: Vec::new(),
    }
}

/// The collective primitives a plan is issued through, on one rank, over that rank's send buffer
/// (`mine`) and receive buffer (`out`) which the implementation holds.
pub trait Primitives {
    type Error;
    /// `ncclAllGather`: `count` bytes of `mine` from every rank into `out[r·count ..]`.
    fn all_gather(&mut self, count: usize) -> Result<(), Self::Error>;
    /// `ncclGroupStart`.
    fn group_start(&mut self) -> Result<(), Self::Error>;
    /// `ncclBroadcast`: `root`'s `count` bytes of `mine` into `out[at .. at + count]`.
    fn broadcast(&mut self, root: usize, at: usize, count: usize) -> Result<(), Self::Error>;
    /// `ncclGroupEnd`.
    fn group_end(&mut self) -> Result<(), Self::Error>;
}

/// Issues `plan`'s calls through `p`. A group is always closed, even when a broadcast in it
/// failed (NCCL's group state is per thread: an open group would swallow the next calls).
pub fn execute<P: Primitives>(plan: &Plan, p: &mut P) -> Result<(), P::Error> {
    for call in &plan.calls {
        match call {
            Call::AllGather { count } => p.all_gather(*count)?,
            Call::Broadcasts(group) => {
                p.group_start()?;
                let issued = group
                    .iter()
                    .try_for_each(|b| p.broadcast(b.root, b.at, b.count));
                let ended = p.group_end();
                issued?;
                ended?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
