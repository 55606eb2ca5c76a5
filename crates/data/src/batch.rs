//! Micro-batches: examples taken in (shuffled) order, right-padded to the longest in the batch.

use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::{Example, IGNORE};

/// One right-padded micro-batch, row-major `(B, T)`.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    pub b: usize,
    pub t: usize,
    pub input_ids: Vec<u32>,
    pub positions: Vec<u32>,
    /// The next-token target of each position (labels shifted by one), `None` = no loss.
    pub targets: Vec<Option<u32>>,
    /// Non-padding tokens.
    pub tokens: usize,
}

impl MicroBatch {
    pub fn target_tokens(&self) -> usize {
        self.targets.iter().filter(|t| t.is_some()).count()
    }

    pub fn from_examples(examples: &[&Example], pad_id: u32) -> Self {
        let b = examples.len();
        let t = examples
            .iter()
            .map(|e| e.input_ids.len())
            .max()
            .unwrap_or(1);
        let mut input_ids = vec![pad_id; b * t];
        let mut targets = vec![None; b * t];
        let mut tokens = 0;
        for (r, e) in examples.iter().enumerate() {
            let row = r * t;
            input_ids[row..row + e.input_ids.len()].copy_from_slice(&e.input_ids);
            tokens += e.input_ids.len();
            for i in 0..e.labels.len().saturating_sub(1) {
                let l = e.labels[i + 1];
                if l != IGNORE {
                    targets[row + i] = Some(l as u32);
                }
            }
        }
        let positions = (0..b).flat_map(|_| 0..t as u32).collect();
        Self {
            b,
            t,
            input_ids,
            positions,
            targets,
            tokens,
        }
    }
}

/// An endless stream of micro-batches over `examples`, epoch after epoch.
pub struct Batcher {
    examples: Vec<Example>,
    order: Vec<usize>,
    cursor: usize,
    pub epoch: usize,
    shuffle: bool,
    seed: u64,
    pad_id: u32,
}

impl Batcher {
    pub fn new(examples: Vec<Example>, shuffle: bool, seed: u64, pad_id: u32) -> Self {
        let mut me = Self {
            order: Vec::new(),
            examples,
            cursor: 0,
            epoch: 0,
            shuffle,
            seed,
            pad_id,
        };
        me.order = me.epoch_order(0);
        me
    }

    fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.examples.len()).collect();
        if self.shuffle {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
                self.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            order.shuffle(&mut rng);
        }
        order
    }

    /// `(epoch, position in that epoch's order)` of the next example: with the seed, all a resumed
    /// run needs to continue the same stream.
    pub fn position(&self) -> (usize, usize) {
        (self.epoch, self.cursor)
    }

    /// Continues from a [`position`](Self::position) (the epoch's order is recomputed from the seed).
    pub fn seek(&mut self, epoch: usize, cursor: usize) {
        self.epoch = epoch;
        self.order = self.epoch_order(epoch);
        self.cursor = cursor.min(self.order.len());
    }

    pub fn len(&self) -> usize {
        self.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// The next `size` examples (crossing into the next epoch if needed), padded.
    pub fn next_batch(&mut self, size: usize) -> MicroBatch {
        let mut picked = Vec::with_capacity(size);
        while picked.len() < size {
            if self.cursor == self.order.len() {
                self.epoch += 1;
                self.order = self.epoch_order(self.epoch);
                self.cursor = 0;
            }
            picked.push(self.order[self.cursor]);
            self.cursor += 1;
        }
        let refs: Vec<&Example> = picked.iter().map(|&i| &self.examples[i]).collect();
        MicroBatch::from_examples(&refs, self.pad_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_never_carries_a_target() {
        let a = Example {
            input_ids: vec![1, 5, 6, 7],
            labels: vec![-100, -100, 6, 7],
        };
        let b = Example {
            input_ids: vec![1, 8],
            labels: vec![1, 8],
        };
        let mb = MicroBatch::from_examples(&[&a, &b], 0);
        assert_eq!((mb.b, mb.t, mb.tokens), (2, 4, 6));
        assert_eq!(mb.input_ids, vec![1, 5, 6, 7, 1, 8, 0, 0]);
        assert_eq!(
            mb.targets,
            vec![None, Some(6), Some(7), None, Some(8), None, None, None]
        );
        assert_eq!(mb.target_tokens(), 3);
    }

    #[test]
    fn order_is_kept_without_shuffle_and_seeded_with_it() {
        let ex: Vec<Example> = (0..5)
            .map(|i| Example {
                input_ids: vec![1, i + 2],
                labels: vec![1, i as i64 + 2],
            })
            .collect();
        let mut plain = Batcher::new(ex.clone(), false, 0, 0);
        let firsts: Vec<u32> = (0..7).map(|_| plain.next_batch(1).input_ids[1]).collect();
        assert_eq!(firsts, vec![2, 3, 4, 5, 6, 2, 3]);
        assert_eq!(plain.epoch, 1);
        let run = |seed| {
            let mut b = Batcher::new(ex.clone(), true, seed, 0);
            (0..5)
                .map(|_| b.next_batch(1).input_ids[1])
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        // A batcher moved to another's position continues its stream.
        let mut a = Batcher::new(ex.clone(), true, 9, 0);
        (0..7).for_each(|_| drop(a.next_batch(1)));
        let mut b = Batcher::new(ex.clone(), true, 9, 0);
        let (e, c) = a.position();
        b.seek(e, c);
        for _ in 0..9 {
            assert_eq!(a.next_batch(2).input_ids, b.next_batch(2).input_ids);
        }
        let mut sorted = run(3);
        sorted.sort();
        assert_eq!(sorted, vec![2, 3, 4, 5, 6]);
    }
}
