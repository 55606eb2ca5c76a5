//! What a step draws: SFT micro-batches of examples, or a preference run's micro-batches of
//! pairs (2 rows a pair), from one seeded, resumable stream either way.

use rtune_data::{Batcher, MicroBatch, Pair, PairBatch};

use crate::preference::StepTotals;

/// The training rows in their seeded order, with the cursor.
pub(crate) enum Stream {
    Sft(Batcher),
    Pairs(Batcher<Pair>),
}

/// One micro-batch of either kind.
pub(crate) enum Micro {
    Sft(MicroBatch),
    Pairs(PairBatch),
}

/// What normalises a step's micro-batches: its target tokens (SFT), its pairs and chosen
/// completion tokens (preference).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Totals {
    Tokens(usize),
    Pairs(StepTotals),
}

impl Stream {
    /// The next micro-batch of `size` rows (SFT) or pairs.
    /// `prompt_nll`: the chosen rows' prompts carry targets too (ORPO); `long_past`: the model's
    /// LongRoPE length, which picks each pair's reference ([`PairBatch::with_rope`]).
    pub fn next(
        &mut self,
        size: usize,
        pad_id: u32,
        prompt_nll: bool,
        long_past: Option<usize>,
    ) -> Micro {
        match self {
            Stream::Sft(b) => Micro::Sft(b.next_batch(size)),
            Stream::Pairs(b) => Micro::Pairs(PairBatch::with_rope(
                &b.next_rows(size),
                pad_id,
                prompt_nll,
                long_past,
            )),
        }
    }

    /// `(epoch, cursor)`, as [`Batcher::position`].
    pub fn position(&self) -> (usize, usize) {
        match self {
            Stream::Sft(b) => b.position(),
            Stream::Pairs(b) => b.position(),
        }
    }

    pub fn seek(&mut self, epoch: usize, cursor: usize) {
        match self {
            Stream::Sft(b) => b.seek(epoch, cursor),
            Stream::Pairs(b) => b.seek(epoch, cursor),
        }
    }
}

impl Micro {
    /// The rows as the model takes them.
    pub fn batch(&self) -> &MicroBatch {
        match self {
            Micro::Sft(b) => b,
            Micro::Pairs(p) => &p.batch,
        }
    }

    pub fn batch_mut(&mut self) -> &mut MicroBatch {
        match self {
            Micro::Sft(b) => b,
            Micro::Pairs(p) => &mut p.batch,
        }
    }

    /// The step's normalisers over its micro-batches (all of one kind).
    pub fn totals(micro: &[Micro]) -> Totals {
        match micro.first() {
            Some(Micro::Pairs(_)) => {
                let mut t = StepTotals {
                    pairs: 0,
                    nll_tokens: 0,
                };
                for m in micro {
                    if let Micro::Pairs(p) = m {
                        t.pairs += p.pairs();
                        t.nll_tokens += p.chosen_targets();
                    }
                }
                Totals::Pairs(t)
            }
            _ => Totals::Tokens(micro.iter().map(|m| m.batch().target_tokens()).sum()),
        }
    }
}
