//! Which of two reused buffers a group's dequantized weights go to, and which group to dequantize
//! next ahead of time (issue 48, item 4, QLoRA's grouped NF4 dequantization): the plain logic of
//! the double-buffered prefetch, with no device in it (`rtune-model`'s `group/nf4.rs` carries it
//! out: on CUDA the prefetch is a launch on a side stream).
//!
//! Two slots, each holding one group's weights (`K`: the group's identity). A request for a group:
//! - finds it in a slot (a hit: no dequantization; on CUDA the compute stream waits for that
//!   slot's last write, which cudarc's per-buffer events make it do), or
//! - takes the least recently used slot that no lease holds and has it filled now (a demand fill);
//!   with both slots leased, none ([`Ring::request`] answers `None`: the caller dequantizes into a
//!   fresh buffer, as without grouping);
//! - then predicts the next request and, when that group is in neither slot and the other slot is
//!   free, names it for a prefetch into that slot. The other slot is never the one just handed out,
//!   so layer L+1's dequantization never overwrites layer L's weights while they are in use.
//!
//! The prediction: a training step requests the same sequence of groups every time (forward
//! layer by layer; the backward in reverse; with checkpointing each layer's forward recomputed
//! just before its backward), so after the same three requests the same one follows. Three,
//! because two are ambiguous under checkpointing: `(qkv L, gate/up L)` is followed by `qkv L+1` in
//! the forward and by `gate/up L` (its backward) in the recomputation. The map is learnt during
//! the first step; a wrong guess costs a dequantization, never a wrong weight (a slot's content is
//! named by its key, and a leased slot is never written).

use std::collections::HashMap;
use std::hash::Hash;

/// Requests of context in a prediction.
const CONTEXT: usize = 3;
/// Contexts learnt before the map is cleared (a model's step has ~4 a layer).
const MAX_LEARNT: usize = 1 << 14;

/// What to do for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step<K> {
    /// The slot holding (or to hold) the requested group; leased until [`Ring::release`].
    pub slot: usize,
    /// The slot does not hold the group yet: dequantize it there now.
    pub fill: bool,
    /// Dequantize this group into this slot ahead of its request (on CUDA: on the side stream).
    pub prefetch: Option<(usize, K)>,
}

/// Counts of what the requests did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Found in a slot (prefetched, or still there from an earlier request).
    pub hits: usize,
    /// Dequantized on request.
    pub demand: usize,
    /// Dequantized ahead of the request.
    pub prefetched: usize,
    /// Both slots leased: no slot given.
    pub refused: usize,
}

#[derive(Debug, Clone)]
struct Slot<K> {
    key: Option<K>,
    leases: usize,
    /// Request count when last handed out (least recently used first).
    used: usize,
}

/// Two slots and the learnt successor map.
#[derive(Debug, Clone)]
pub struct Ring<K> {
    slots: [Slot<K>; 2],
    recent: Vec<K>,
    next: HashMap<Vec<K>, K>,
    clock: usize,
    pub stats: Stats,
}

impl<K: Clone + Eq + Hash> Default for Ring<K> {
    fn default() -> Self {
        let slot = || Slot {
            key: None,
            leases: 0,
            used: 0,
        };
        Ring {
            slots: [slot(), slot()],
            recent: Vec::new(),
            next: HashMap::new(),
            clock: 0,
            stats: Stats::default(),
        }
    }
}

impl<K: Clone + Eq + Hash> Ring<K> {
    /// A request for `key`: which slot, whether to fill it, what to prefetch (only when
    /// `prefetch`); `None` when both slots are leased.
    pub fn request(&mut self, key: K, prefetch: bool) -> Option<Step<K>> {
        if self.next.len() > MAX_LEARNT {
            // Keys that never recur (a sharded base's weights, gathered afresh at each use).
            self.next.clear();
        }
        if self.recent.len() == CONTEXT {
            self.next.insert(self.recent.clone(), key.clone());
            self.recent.remove(0);
        }
        self.recent.push(key.clone());
        self.clock += 1;
        let (slot, fill) = match self.find(&key) {
            Some(s) => {
                self.stats.hits += 1;
                (s, false)
            }
            None => {
                let free = (0..2)
                    .filter(|&s| self.slots[s].leases == 0)
                    .min_by_key(|&s| self.slots[s].used);
                let Some(s) = free else {
                    self.stats.refused += 1;
                    return None;
                };
                self.stats.demand += 1;
                self.slots[s].key = Some(key.clone());
                (s, true)
            }
        };
        self.slots[slot].leases += 1;
        self.slots[slot].used = self.clock;
        let other = 1 - slot;
        let prefetch = match self.predict().filter(|_| prefetch) {
            Some(p) if self.find(&p).is_none() && self.slots[other].leases == 0 => {
                self.stats.prefetched += 1;
                self.slots[other].key = Some(p.clone());
                Some((other, p))
            }
            _ => None,
        };
        Some(Step {
            slot,
            fill,
            prefetch,
        })
    }

    /// The lease of `slot` from a [`Ring::request`] ended (its weights are no longer read by
    /// work still to be issued).
    pub fn release(&mut self, slot: usize) {
        self.slots[slot].leases = self.slots[slot].leases.saturating_sub(1);
    }

    /// A slot's content is unknown (its fill failed): it holds nothing.
    pub fn forget(&mut self, slot: usize) {
        self.slots[slot].key = None;
    }

    /// The next request, as learnt from what followed the last three requests before.
    pub fn predict(&self) -> Option<K> {
        (self.recent.len() == CONTEXT)
            .then(|| self.next.get(&self.recent).cloned())
            .flatten()
    }

    fn find(&self, key: &K) -> Option<usize> {
        (0..2).find(|&s| self.slots[s].key.as_ref() == Some(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's group requests for `layers` layers: (layer, 0 = q/k/v, 1 = gate/up); with
    /// checkpointing each layer's forward is recomputed before its backward.
    fn step(layers: u32, checkpointing: bool) -> Vec<(u32, u8)> {
        let mut s: Vec<(u32, u8)> = (0..layers).flat_map(|l| [(l, 0), (l, 1)]).collect();
        for l in (0..layers).rev() {
            if checkpointing {
                s.extend([(l, 0), (l, 1)]);
            }
            s.extend([(l, 1), (l, 0)]);
        }
        s
    }

    /// Plays `steps` steps, each lease released before the next request (as the layer does);
    /// returns the stats of the last step alone and checks every hit is the slot's true content.
    fn play(seq: &[(u32, u8)], steps: usize) -> Stats {
        let mut ring = Ring::default();
        // What each slot really holds, as the device would (fills and prefetches applied).
        let mut held: [Option<(u32, u8)>; 2] = [None, None];
        let mut before = Stats::default();
        for n in 0..steps {
            before = ring.stats;
            for &k in seq {
                let st = ring.request(k, true).expect("a slot is free");
                if st.fill {
                    held[st.slot] = Some(k);
                }
                assert_eq!(
                    held[st.slot],
                    Some(k),
                    "step {n}: slot {} holds the wrong group",
                    st.slot
                );
                if let Some((s, p)) = st.prefetch {
                    assert_ne!(s, st.slot, "a prefetch overwrote the leased slot");
                    held[s] = Some(p);
                }
                ring.release(st.slot);
            }
        }
        let s = ring.stats;
        Stats {
            hits: s.hits - before.hits,
            demand: s.demand - before.demand,
            prefetched: s.prefetched - before.prefetched,
            refused: s.refused - before.refused,
        }
    }

    /// Once learnt, every request of a step is a hit: each group dequantized ahead of its use,
    /// never on demand.
    #[test]
    fn after_one_step_every_group_is_prefetched() {
        for ckpt in [false, true] {
            let seq = step(4, ckpt);
            let s = play(&seq, 3);
            assert_eq!(s.demand, 0, "checkpointing {ckpt}: {s:?}");
            assert_eq!(s.hits, seq.len(), "checkpointing {ckpt}: {s:?}");
            // Each group once ahead of its forward, and once ahead of its backward (without
            // checkpointing) or of its recomputation (with it; the recomputed weights then serve
            // the backward as hits): 8 - 2 + 8 - 2 either way. Not layer 0's in the forward (the
            // last step's backward left them in the slots), nor layer 3's after the forward
            // (still there).
            assert_eq!(s.prefetched, 12, "checkpointing {ckpt}: {s:?}");
        }
    }

    /// The first step learns; its requests are filled on demand.
    #[test]
    fn the_first_step_fills_on_demand() {
        let s = play(&step(3, true), 1);
        assert!(s.demand > 0 && s.prefetched == 0, "{s:?}");
    }

    /// A held lease is never written: with both slots leased a request gets no slot, and a
    /// prefetch never targets a leased slot.
    #[test]
    fn leased_slots_are_never_overwritten() {
        let mut ring = Ring::default();
        let a = ring.request(1, true).unwrap();
        let b = ring.request(2, true).unwrap();
        assert_ne!(a.slot, b.slot);
        assert_eq!(ring.request(3, true), None);
        assert_eq!(ring.stats.refused, 1);
        // A hit on a leased slot is fine (a second reader).
        assert_eq!(
            ring.request(1, true).map(|s| (s.slot, s.fill)),
            Some((a.slot, false))
        );
        ring.release(a.slot);
        ring.release(a.slot);
        let c = ring.request(3, true).unwrap();
        assert_eq!((c.slot, c.fill), (a.slot, true));
        // Learn 1 → 2 → 3 → 4 → 1, then replay it.
        let mut ring = Ring::default();
        for k in [1, 2, 3, 4, 1, 2, 3] {
            let s = ring.request(k, true).unwrap();
            ring.release(s.slot);
        }
        assert_eq!(ring.predict(), Some(4));
        let mut ring2 = ring.clone();
        assert_eq!(ring.clone().request(4, false).unwrap().prefetch, None);
        // 4 was prefetched when 3 was requested; requesting it predicts 1, into 3's slot.
        let s = ring.request(4, true).unwrap();
        let three = ring2.find(&3).unwrap();
        assert_eq!((s.fill, s.prefetch), (false, Some((three, 1))));
        // The same with 3's slot still leased: no prefetch.
        ring2.slots[three].leases = 1;
        let s = ring2.request(4, true).unwrap();
        assert_eq!((s.fill, s.prefetch), (false, None));
    }
}
