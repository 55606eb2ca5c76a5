//! Micro-batches: examples taken in (shuffled) order, either one a row, right-padded to the longest
//! in the batch (optionally length-grouped so rows of a batch have similar lengths), or packed
//! several to a row up to `max_seq_len` with positions restarting at 0 for each sample and a
//! segment id per position that the model turns into a block-diagonal causal mask.
//!
//! Either way a token's target is the next token *of the same sample*, padding never carries a
//! target, and the loss is normalised by target tokens per optimizer step, so packing changes the
//! arithmetic layout only, not the per-token weighting.

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
    /// Each row's non-padding tokens (`b` values): a row's padding is after them.
    pub lens: Vec<usize>,
    /// Packed rows: the sample of each position within its row ([`PAD_SEGMENT`] for padding).
    pub segments: Option<Vec<u32>>,
}

/// Segment id of padding in packed rows.
pub const PAD_SEGMENT: u32 = u32::MAX;

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
        let lens = examples.iter().map(|e| e.input_ids.len()).collect();
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
            lens,
            segments: None,
        }
    }

    /// Rows of several samples each (`rows[r]` = the samples of row `r`, in order), right-padded
    /// to the longest row.
    pub fn packed(rows: &[Vec<&Example>], pad_id: u32) -> Self {
        let b = rows.len();
        let row_len = |r: &Vec<&Example>| r.iter().map(|e| e.input_ids.len()).sum::<usize>();
        let t = rows.iter().map(row_len).max().unwrap_or(1).max(1);
        let mut input_ids = vec![pad_id; b * t];
        let mut targets = vec![None; b * t];
        let mut positions = vec![0u32; b * t];
        let mut segments = vec![PAD_SEGMENT; b * t];
        let mut tokens = 0;
        let lens = rows.iter().map(row_len).collect();
        for (r, samples) in rows.iter().enumerate() {
            let mut at = r * t;
            for (s, e) in samples.iter().enumerate() {
                let n = e.input_ids.len();
                input_ids[at..at + n].copy_from_slice(&e.input_ids);
                for i in 0..n {
                    positions[at + i] = i as u32;
                    segments[at + i] = s as u32;
                }
                // The last token of a sample predicts nothing: its successor is another sample.
                for i in 0..n.saturating_sub(1) {
                    let l = e.labels[i + 1];
                    if l != IGNORE {
                        targets[at + i] = Some(l as u32);
                    }
                }
                at += n;
                tokens += n;
            }
            // Padding continues the positions so rope stays in range; it is masked off anyway.
            let used = at - r * t;
            for (k, p) in positions[at..(r + 1) * t].iter_mut().enumerate() {
                *p = (used + k) as u32;
            }
        }
        Self {
            b,
            t,
            input_ids,
            positions,
            targets,
            tokens,
            lens,
            segments: Some(segments),
        }
    }
}

/// How examples are laid into micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// One example a row, in the (shuffled) order.
    Plain,
    /// One example a row; within windows of 64 micro-batches, examples of similar length share a
    /// micro-batch (less padding); the batches' order is shuffled again.
    GroupByLength { micro_batch: usize },
    /// Several examples a row, up to `max_seq_len` tokens.
    Packed { max_seq_len: usize },
}

/// What a [`Batcher`] orders: its length in tokens sets length grouping and packing.
pub trait Row {
    fn tokens(&self) -> usize;
}

impl Row for Example {
    fn tokens(&self) -> usize {
        self.input_ids.len()
    }
}

/// An endless stream of micro-batches over `examples` (SFT examples, or preference pairs),
/// epoch after epoch.
pub struct Batcher<T: Row = Example> {
    examples: Vec<T>,
    order: Vec<usize>,
    cursor: usize,
    pub epoch: usize,
    shuffle: bool,
    seed: u64,
    pad_id: u32,
    layout: Layout,
}

impl<T: Row> Batcher<T> {
    pub fn new(examples: Vec<T>, shuffle: bool, seed: u64, pad_id: u32) -> Self {
        Self::with_layout(examples, shuffle, seed, pad_id, Layout::Plain)
    }

    pub fn with_layout(
        examples: Vec<T>,
        shuffle: bool,
        seed: u64,
        pad_id: u32,
        layout: Layout,
    ) -> Self {
        let mut me = Self {
            order: Vec::new(),
            examples,
            cursor: 0,
            epoch: 0,
            shuffle,
            seed,
            pad_id,
            layout,
        };
        me.order = me.epoch_order(0);
        me
    }

    /// The rows' indices (into [`rows_mut`](Self::rows_mut)) in the order epoch `epoch` draws
    /// them: shuffled by the seed, grouped by length, as [`next_rows`](Self::next_rows) takes them.
    pub fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.examples.len()).collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(
            self.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        if self.shuffle {
            order.shuffle(&mut rng);
        }
        if let Layout::GroupByLength { micro_batch } = self.layout {
            let mb = micro_batch.max(1);
            let mut groups = Vec::new();
            for window in order.chunks(mb * 64) {
                let mut w = window.to_vec();
                // Stable, longest first: ties keep the shuffled order.
                w.sort_by_key(|&i| std::cmp::Reverse(self.examples[i].tokens()));
                groups.extend(w.chunks(mb).map(<[usize]>::to_vec));
            }
            if self.shuffle {
                groups.shuffle(&mut rng);
            }
            order = groups.concat();
        }
        order
    }

    /// The example at the cursor, moving into the next epoch when this one is done.
    fn take(&mut self) -> usize {
        if self.cursor == self.order.len() {
            self.epoch += 1;
            self.order = self.epoch_order(self.epoch);
            self.cursor = 0;
        }
        self.cursor += 1;
        self.order[self.cursor - 1]
    }

    fn peek_len(&mut self) -> usize {
        if self.cursor == self.order.len() {
            self.epoch += 1;
            self.order = self.epoch_order(self.epoch);
            self.cursor = 0;
        }
        self.examples[self.order[self.cursor]].tokens()
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

    /// The rows in their loaded order (e.g. to fill in each pair's reference log-probabilities).
    pub fn rows_mut(&mut self) -> &mut [T] {
        &mut self.examples
    }

    /// The next `size` rows of the stream, one a micro-batch row (no packing).
    pub fn next_rows(&mut self, size: usize) -> Vec<&T> {
        let picked: Vec<usize> = (0..size).map(|_| self.take()).collect();
        picked.iter().map(|&i| &self.examples[i]).collect()
    }
}

impl Batcher<Example> {
    /// The next micro-batch of `size` rows (crossing into the next epoch if needed), padded.
    pub fn next_batch(&mut self, size: usize) -> MicroBatch {
        if let Layout::Packed { max_seq_len } = self.layout {
            let mut rows: Vec<Vec<usize>> = Vec::with_capacity(size);
            for _ in 0..size {
                let mut row = vec![self.take()];
                let mut used = self.examples[row[0]].input_ids.len();
                while used + self.peek_len() <= max_seq_len {
                    let i = self.take();
                    used += self.examples[i].input_ids.len();
                    row.push(i);
                }
                rows.push(row);
            }
            let refs: Vec<Vec<&Example>> = rows
                .iter()
                .map(|r| r.iter().map(|&i| &self.examples[i]).collect())
                .collect();
            return MicroBatch::packed(&refs, self.pad_id);
        }
        let picked: Vec<usize> = (0..size).map(|_| self.take()).collect();
        let refs: Vec<&Example> = picked.iter().map(|&i| &self.examples[i]).collect();
        MicroBatch::from_examples(&refs, self.pad_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(ids: &[u32]) -> Example {
        Example {
            input_ids: ids.to_vec(),
            labels: ids.iter().map(|&i| i as i64).collect(),
        }
    }

    #[test]
    fn packed_rows_restart_positions_and_never_target_across_samples() {
        let (a, b, c) = (ex(&[1, 5, 6]), ex(&[1, 7]), ex(&[1, 8, 9, 10]));
        let mb = MicroBatch::packed(&[vec![&a, &b], vec![&c]], 0);
        assert_eq!((mb.b, mb.t, mb.tokens), (2, 5, 9));
        assert_eq!(mb.input_ids, vec![1, 5, 6, 1, 7, 1, 8, 9, 10, 0]);
        assert_eq!(mb.positions, vec![0, 1, 2, 0, 1, 0, 1, 2, 3, 4]);
        let p = PAD_SEGMENT;
        assert_eq!(mb.segments.unwrap(), vec![0, 0, 0, 1, 1, 0, 0, 0, 0, p]);
        // Sample a's last token (6) does not predict b's first (1).
        let t = |x| Some(x);
        assert_eq!(
            mb.targets,
            vec![t(5), t(6), None, t(7), None, t(8), t(9), t(10), None, None]
        );
    }

    #[test]
    fn packing_fills_rows_up_to_the_limit_in_stream_order() {
        let exs: Vec<Example> = [3usize, 4, 2, 5, 1]
            .iter()
            .map(|&n| ex(&vec![1; n]))
            .collect();
        let mut b = Batcher::with_layout(exs, false, 0, 0, Layout::Packed { max_seq_len: 8 });
        let mb = b.next_batch(2);
        // Row 0: 3+4 (adding 2 would make 9); row 1: 2+5+1.
        assert_eq!(mb.tokens, 15);
        let seg = mb.segments.unwrap();
        assert_eq!(&seg[..8], &[0, 0, 0, 1, 1, 1, 1, PAD_SEGMENT]);
        assert_eq!(&seg[8..], &[0, 0, 1, 1, 1, 1, 1, 2]);
        // Looking ahead for a sample that might still fit moved the stream into epoch 1.
        assert_eq!(b.position(), (1, 0));
    }

    #[test]
    fn length_grouping_batches_similar_lengths_and_keeps_every_example() {
        let exs: Vec<Example> = (1..=40u32).map(|n| ex(&vec![1; n as usize])).collect();
        let layout = Layout::GroupByLength { micro_batch: 4 };
        let mut b = Batcher::with_layout(exs, true, 7, 0, layout);
        let mut seen = Vec::new();
        let mut padding = 0;
        for _ in 0..10 {
            let mb = b.next_batch(4);
            padding += mb.b * mb.t - mb.tokens;
            seen.push(mb.tokens);
        }
        // Sorted windows: each batch holds 4 consecutive lengths, so 0+1+2+3 = 6 pad tokens.
        assert_eq!(padding, 60);
        assert_eq!(seen.iter().sum::<usize>(), (1..=40).sum::<usize>());
        assert_eq!(b.epoch, 0);
    }

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
