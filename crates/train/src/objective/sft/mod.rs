//! Supervised fine-tuning (`[train] objective = "sft"`, TRL's `SFTTrainer`): next-token
//! cross-entropy summed over the completion tokens of the step's examples, divided by the step's
//! target tokens (so accumulation equals one big batch). The examples come through the tokenized
//! cache (`crate::dataset`), packed or padded (`batcher` below); validation is the mean loss
//! and perplexity over the held-out examples.

use std::collections::BTreeMap;

use rtune_config::RunConfig;
use rtune_data::{Batcher, Example, Layout, MicroBatch, Tokenizer};

use super::{About, HeadLoss, Live, Recipe};
use crate::dataset::RunData;
use crate::evaluate::{no_dropout, EvalMetrics};
use crate::TrainError;

/// The SFT recipe: its examples in their seeded order, and the validation examples.
#[derive(Default)]
pub struct Sft {
    stream: Option<Batcher>,
    valid: Vec<Example>,
}

impl Sft {
    fn stream(&self) -> &Batcher {
        self.stream
            .as_ref()
            .expect("the SFT stream is made at start")
    }
}

impl Recipe for Sft {
    type Micro = MicroBatch;
    /// The step's target tokens.
    type Totals = usize;
    type Sums = ();

    fn about(&self) -> About {
        About {
            name: "sft",
            unit: "examples",
            sides: &[],
            reference: false,
            uncached: None,
            single_rank: None,
        }
    }

    fn load(
        &mut self,
        cfg: &RunConfig,
        tok: Option<&Tokenizer>,
        vocab: usize,
    ) -> Result<RunData, TrainError> {
        crate::dataset::load(&cfg.data, &cfg.model.path, tok, vocab, cfg.train.seed)
    }

    fn start(&mut self, cfg: &RunConfig, data: &mut RunData, pad_id: u32) -> (usize, usize) {
        let train = std::mem::take(&mut data.train);
        let rows = train.len();
        self.stream = Some(batcher(cfg, train, pad_id));
        self.valid = std::mem::take(&mut data.valid);
        (rows, self.valid.len())
    }

    fn draw(&mut self, _live: &Live, size: usize) -> Result<MicroBatch, TrainError> {
        let stream = self
            .stream
            .as_mut()
            .expect("the SFT stream is made at start");
        Ok(stream.next_batch(size))
    }

    fn totals(&self, micro: &[MicroBatch]) -> usize {
        micro.iter().map(|m| m.target_tokens()).sum()
    }

    fn pass(
        &self,
        _micro: &MicroBatch,
        target_tokens: usize,
        loss_scale: f64,
        _sums: &mut (),
        backward: &mut dyn FnMut(HeadLoss) -> Result<f64, TrainError>,
    ) -> Result<f64, TrainError> {
        backward(HeadLoss::Tokens {
            grad_scale: loss_scale / target_tokens as f64,
        })
    }

    /// The head sums token losses: their mean over the step's target tokens.
    fn loss(&self, loss_sum: f64, target_tokens: usize) -> f64 {
        loss_sum / target_tokens as f64
    }

    fn metrics(&self, _: &(), _: usize) -> BTreeMap<String, f64> {
        BTreeMap::new()
    }

    /// Validation loss over the held-out examples, `micro_batch` rows at a time, in order.
    fn evaluate(&self, live: &Live, micro_batch: usize) -> Result<Option<EvalMetrics>, TrainError> {
        let lc = no_dropout(live.adapter);
        let (mut sum, mut n) = (0.0, 0usize);
        for chunk in self.valid.chunks(micro_batch.max(1)) {
            let refs: Vec<&Example> = chunk.iter().collect();
            let mut mb = MicroBatch::from_examples(&refs, live.pad_id);
            n += mb.target_tokens();
            let inputs = crate::compute::take_inputs(&mut mb);
            sum += live.model.eval_loss(&inputs, &mb.targets, Some(&lc))?;
        }
        if n == 0 {
            return Ok(None);
        }
        let valid_loss = sum / n as f64;
        Ok(Some(EvalMetrics {
            step: live.step,
            valid_loss,
            valid_ppl: Some(valid_loss.exp()),
            valid_tokens: n,
            recipe: Default::default(),
        }))
    }

    fn position(&self) -> (usize, usize) {
        self.stream().position()
    }

    fn seek(&mut self, epoch: usize, cursor: usize) {
        if let Some(s) = self.stream.as_mut() {
            s.seek(epoch, cursor);
        }
    }
}

/// The training rows in the order the config asks for: packed, grouped by length, or as they come
/// (each epoch shuffled by seed when `[data] shuffle`).
fn batcher(cfg: &RunConfig, train: Vec<Example>, pad_id: u32) -> Batcher {
    let layout = if cfg.data.packing {
        Layout::Packed {
            max_seq_len: cfg.data.max_seq_len,
        }
    } else if cfg.data.group_by_length {
        Layout::GroupByLength {
            micro_batch: cfg.train.micro_batch_size,
        }
    } else {
        Layout::Plain
    };
    Batcher::with_layout(train, cfg.data.shuffle, cfg.train.seed, pad_id, layout)
}
