//! The bookkeeping of a pool of reusable host buffers: the page-locked buffers checkpoint offload
//! (`offload.rs`, `Offloader`, feature `cuda`) copies layer inputs into are taken from it and given
//! back when the input has been restored, so a run allocates pinned memory during its first steps
//! only instead of once per layer per micro-batch (`cuMemHostAlloc` and `cuMemFreeHost` each
//! synchronise the device and cost milliseconds).
//!
//! Device-agnostic (generic over the buffer, tested with plain `Vec<u8>`); the CUDA side supplies
//! the allocation. Policy, per request of `n` bytes:
//! - **best fit**: the smallest free buffer of at least `n` bytes is reused (a shorter micro-batch
//!   reuses a longer one's buffer; only the first `n` bytes are copied in and out);
//! - **outgrown buffers go**: when no free buffer is large enough, the free buffers smaller than
//!   `n` are released before a new one of exactly `n` bytes is allocated. Within one forward pass
//!   every layer input has the same size, so the pool holds at most one pass's inputs (L − 1
//!   buffers) of the longest micro-batch seen, plus nothing that can no longer be used.

/// A host buffer the pool can hold: only its capacity matters here.
pub(crate) trait PoolBuffer {
    /// Capacity in bytes.
    fn capacity_bytes(&self) -> usize;
}

impl PoolBuffer for Vec<u8> {
    fn capacity_bytes(&self) -> usize {
        self.len()
    }
}

/// What the pool has done so far (for tests and the run's diagnostics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers allocated.
    pub allocations: usize,
    /// Requests served by a free buffer.
    pub reuses: usize,
    /// Outgrown free buffers released.
    pub released: usize,
    /// Buffers in the pool now (free).
    pub free: usize,
    /// Bytes held by the free buffers.
    pub free_bytes: usize,
}

/// Free buffers, and counts of what happened.
pub(crate) struct HostPool<B> {
    free: Vec<B>,
    stats: PoolStats,
}

impl<B: PoolBuffer> HostPool<B> {
    pub fn new() -> Self {
        Self {
            free: Vec::new(),
            stats: PoolStats::default(),
        }
    }

    /// A buffer of at least `bytes` bytes: the best-fitting free one, else (after releasing the
    /// outgrown free buffers) a new one from `alloc(bytes)`.
    pub fn take<E>(
        &mut self,
        bytes: usize,
        alloc: impl FnOnce(usize) -> Result<B, E>,
    ) -> Result<B, E> {
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity_bytes() >= bytes)
            .min_by_key(|(_, b)| b.capacity_bytes())
            .map(|(i, _)| i);
        if let Some(i) = best {
            self.stats.reuses += 1;
            return Ok(self.free.swap_remove(i));
        }
        let before = self.free.len();
        // Every free buffer is smaller than `bytes` here: all are outgrown.
        self.free.clear();
        self.stats.released += before;
        let b = alloc(bytes)?;
        self.stats.allocations += 1;
        Ok(b)
    }

    /// Returns a buffer taken from the pool (or any buffer of the same kind) for reuse.
    pub fn give(&mut self, b: B) {
        self.free.push(b);
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            free: self.free.len(),
            free_bytes: self.free.iter().map(PoolBuffer::capacity_bytes).sum(),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{HostPool, PoolStats};

    fn alloc(n: usize) -> Result<Vec<u8>, ()> {
        Ok(vec![0; n])
    }

    /// One "forward pass" of `layers` inputs of `bytes` each, all taken before any is given back
    /// (as checkpointing keeps them), then given back in reverse (as the backward restores them).
    fn pass(pool: &mut HostPool<Vec<u8>>, layers: usize, bytes: usize) {
        let taken: Vec<Vec<u8>> = (0..layers)
            .map(|_| pool.take(bytes, alloc).unwrap())
            .collect();
        assert!(taken.iter().all(|b| b.len() >= bytes));
        for b in taken.into_iter().rev() {
            pool.give(b);
        }
    }

    #[test]
    fn steady_state_allocates_only_in_the_first_pass() {
        let mut pool = HostPool::new();
        pass(&mut pool, 31, 1000);
        assert_eq!(pool.stats().allocations, 31);
        for _ in 0..10 {
            pass(&mut pool, 31, 1000);
        }
        let s = pool.stats();
        assert_eq!((s.allocations, s.reuses, s.released), (31, 310, 0));
        assert_eq!((s.free, s.free_bytes), (31, 31_000));
    }

    #[test]
    fn shorter_batches_reuse_longer_buffers_and_longer_ones_replace_outgrown() {
        let mut pool = HostPool::new();
        pass(&mut pool, 4, 1000);
        // Shorter: served by the 1000-byte buffers, nothing new.
        pass(&mut pool, 4, 600);
        assert_eq!(pool.stats().allocations, 4);
        // Longer: the first request finds nothing large enough and releases all four outgrown
        // buffers; the next three find none free either and allocate.
        pass(&mut pool, 4, 1500);
        let s = pool.stats();
        assert_eq!(
            s,
            PoolStats {
                allocations: 8,
                reuses: 4,
                released: 4,
                free: 4,
                free_bytes: 6000
            }
        );
        // And every later pass of either length reuses those.
        pass(&mut pool, 4, 1500);
        pass(&mut pool, 4, 10);
        assert_eq!(pool.stats().allocations, 8);
    }

    #[test]
    fn best_fit_keeps_the_large_buffer_for_the_large_request() {
        let mut pool = HostPool::new();
        pool.give(vec![0; 100]);
        pool.give(vec![0; 5000]);
        pool.give(vec![0; 800]);
        assert_eq!(pool.take(700, alloc).unwrap().len(), 800);
        assert_eq!(pool.take(90, alloc).unwrap().len(), 100);
        assert_eq!(pool.take(4000, alloc).unwrap().len(), 5000);
        assert_eq!(pool.stats().allocations, 0);
    }

    #[test]
    fn a_failed_allocation_is_returned_and_counted_as_nothing() {
        let mut pool: HostPool<Vec<u8>> = HostPool::new();
        let r = pool.take(64, |_| Err::<Vec<u8>, _>("out of pinned memory"));
        assert_eq!(r.unwrap_err(), "out of pinned memory");
        assert_eq!(pool.stats(), PoolStats::default());
    }
}
