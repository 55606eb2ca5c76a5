//! The preference objectives (`[train] objective` = `dpo`, `simpo`, `orpo`, `kto`), TRL's
//! `DPOTrainer`, `CPOTrainer`, `ORPOTrainer` and `KTOTrainer`: a micro-batch is a batch of pairs,
//! each its two sequences (prompt + chosen, prompt + rejected; KTO: a row and its KL row), and the
//! loss a function of each sequence's summed log-probability.
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the recipe: the pairs' stream, the head, the step's totals and metrics, evaluation |
//! | `kind.rs` | which loss (`Loss`, from `[train] objective`) and what it needs |
//! | [`loss`] | the losses and their gradients by hand, TRL's metrics |
//! | [`pairs`] | the pairs of the run's files, the reference log-probabilities (cached) |

mod kind;
pub mod loss;
pub mod pairs;

use std::collections::BTreeMap;

use rtune_config::RunConfig;
use rtune_data::cache::RowCounts;
use rtune_data::{Batcher, Layout, MicroBatch, Pair, PairBatch, PairSet, Tokenizer};
use rtune_model::AuxShare;

pub use loss::{Loss, PairLoss, PairSums, StepTotals};

use super::{About, HeadLoss, Live, Micro, Recipe, ReferencePass, Sums};
use crate::dataset::{OwnRows, RunData};
use crate::evaluate::{no_dropout, EvalMetrics};
use crate::TrainError;

/// A preference run's recipe: its loss, its pairs (held from [`Recipe::load`] to
/// [`Recipe::start`]), the stream of them, and the validation pairs.
pub struct Preference {
    loss: Loss,
    train: Vec<Pair>,
    valid: Vec<Pair>,
    stream: Option<Batcher<Pair>>,
}

impl Preference {
    pub fn new(loss: Loss) -> Self {
        Preference {
            loss,
            train: Vec::new(),
            valid: Vec::new(),
            stream: None,
        }
    }

    fn stream(&self) -> &Batcher<Pair> {
        self.stream
            .as_ref()
            .expect("the pairs' stream is made at start")
    }
}

impl Micro for PairBatch {
    fn batch(&self) -> &MicroBatch {
        &self.batch
    }
    fn batch_mut(&mut self) -> &mut MicroBatch {
        &mut self.batch
    }
}

impl Sums for PairSums {
    fn to_vec(&self) -> Vec<f64> {
        self.to_array().to_vec()
    }
    fn from_slice(v: &[f64]) -> Self {
        PairSums::from_array(
            v.try_into()
                .expect("the ranks' pair sums keep their length"),
        )
    }
}

impl Recipe for Preference {
    type Micro = PairBatch;
    type Totals = StepTotals;
    type Sums = PairSums;

    fn about(&self) -> About {
        let kto = self.loss.is_unpaired();
        About {
            name: self.loss.name(),
            unit: if kto { "unpaired rows" } else { "pairs" },
            sides: if kto {
                &["row", "KL row"]
            } else {
                &["chosen", "rejected"]
            },
            reference: self.loss.needs_reference(),
            uncached: Some(format!(
                "objective \"{}\": preference pairs are checked, not cached (they are tokenized \
                 at the start of each run)",
                self.loss.name()
            )),
            single_rank: None,
        }
    }

    /// The pairs of the run's files; `RunData::train` holds each pair's two sequences (the
    /// estimate's rows).
    fn load(
        &mut self,
        cfg: &RunConfig,
        tok: Option<&Tokenizer>,
        vocab: usize,
    ) -> Result<RunData, TrainError> {
        // The template conversational pairs render with: `[data] chat_template` or the model's,
        // with `chat_template_kwargs`, as chat rows take it.
        let template = crate::dataset::chat_template(&cfg.data, tok)?;
        let p = pairs::load(cfg, &self.loss, tok, template.as_ref(), vocab)?;
        let sequences = pairs::PairData::as_examples(&p.train);
        let report = PairFiles {
            pairs: p.train.len(),
            unpaired: self.loss.is_unpaired(),
            files: p.files,
        };
        (self.train, self.valid) = (p.train, p.valid);
        Ok(RunData {
            train: sequences,
            valid: Vec::new(),
            files: Vec::new(),
            own: Some(Box::new(report)),
        })
    }

    /// A preference loss has no fixed scale (DPO starts at log 2 and may end anywhere above 0):
    /// the pairs must end ranked right (KTO, which has no accuracy: a positive reward margin),
    /// and the loss lower.
    fn overfit(&self, l0: f64, l1: f64, last: &BTreeMap<String, f64>) -> Option<(bool, String)> {
        let (name, value, ok) = match last.get("rewards/accuracies") {
            Some(&a) => ("reward accuracy", a, a >= 1.0),
            None => {
                let m = last.get("rewards/margins").copied().unwrap_or(f64::NAN);
                ("reward margin", m, m > 0.0)
            }
        };
        Some((
            ok && l1 < l0,
            format!("loss {l0:.4} -> {l1:.4}, {name} {value:.3} at the end"),
        ))
    }

    /// The pairs in the order the config asks for (grouped by length, or as they come; each
    /// epoch shuffled by seed when `[data] shuffle`). Packing is refused when the config is
    /// checked. The sequences in `data.train` were for the estimate alone.
    fn start(&mut self, cfg: &RunConfig, data: &mut RunData, pad_id: u32) -> (usize, usize) {
        data.train = Vec::new();
        let layout = match cfg.data.group_by_length {
            true => Layout::GroupByLength {
                micro_batch: cfg.train.micro_batch_size,
            },
            false => Layout::Plain,
        };
        let pairs = std::mem::take(&mut self.train);
        let rows = pairs.len();
        self.stream = Some(Batcher::with_layout(
            pairs,
            cfg.data.shuffle,
            cfg.train.seed,
            pad_id,
            layout,
        ));
        (rows, self.valid.len())
    }

    /// DPO's and KTO's reference log-probabilities of every pair (train and validation): the
    /// model as training starts.
    fn reference(&mut self, cfg: &RunConfig, pass: ReferencePass) -> Result<usize, TrainError> {
        if !self.loss.needs_reference() {
            return Ok(0);
        }
        let stream = self
            .stream
            .as_mut()
            .expect("the pairs' stream is made at start");
        let train_order = stream.epoch_order(0);
        let rows = pairs::Rows {
            train: stream.rows_mut(),
            train_order: &train_order,
            valid: &mut self.valid,
        };
        pairs::reference(
            cfg,
            pass.model,
            pass.adapter,
            rows,
            pass.pad_id,
            pass.writer,
            pass.every,
            pass.interrupted,
        )
    }

    /// The next `size` pairs; ORPO's chosen prompts carry targets too; the model's LongRoPE
    /// length picks each pair's reference ([`PairBatch::with_rope`]).
    fn draw(&mut self, live: &Live, size: usize) -> Result<PairBatch, TrainError> {
        let (prompt_nll, long_past) = (self.loss.nll_on_prompt(), live.model.long_rope_past());
        let stream = self
            .stream
            .as_mut()
            .expect("the pairs' stream is made at start");
        Ok(PairBatch::with_rope(
            &stream.next_rows(size),
            live.pad_id,
            prompt_nll,
            long_past,
        ))
    }

    /// The step's pairs and chosen target tokens.
    fn totals(&self, micro: &[PairBatch]) -> StepTotals {
        let mut t = StepTotals {
            pairs: 0,
            nll_tokens: 0,
        };
        for p in micro {
            t.pairs += p.pairs();
            t.nll_tokens += p.chosen_targets();
        }
        t
    }

    /// The head hands every position's NLL to [`loss::weigh`], which forms the micro-batch's
    /// share of the loss and `dloss/dnll` (scaled by `loss_scale`). A mixture-of-experts
    /// model's load-balancing loss joins it as TRL 1.16 adds it: `router_aux_loss_coef · aux` of
    /// the policy's forward over the micro-batch (chosen then rejected rows: `DPOTrainer`,
    /// `CPOTrainer`, `ORPOTrainer`; KTO: the completion rows, not the KL rows), weighed by the
    /// micro-batch's share of the step's pairs (TRL: `1 / gradient_accumulation_steps`).
    fn pass(
        &self,
        pb: &PairBatch,
        t: StepTotals,
        loss_scale: f64,
        sums: &mut PairSums,
        backward: &mut dyn FnMut(HeadLoss) -> Result<f64, TrainError>,
    ) -> Result<f64, TrainError> {
        let mut weigh = |nll: &[f32]| {
            let (l, w, s) = loss::weigh(&self.loss, pb, nll, t);
            sums.add(&s);
            let scaled = w.iter().map(|x| x * loss_scale as f32).collect();
            Ok((l, scaled))
        };
        let share = pb.pairs() as f64 / t.pairs.max(1) as f64;
        let aux = AuxShare {
            share,
            grad_scale: share * loss_scale,
            // KTO's batch is its completion rows, then their KL rows ([`PairBatch`]): the
            // completion rows' real tokens.
            tokens: self.loss.is_unpaired().then(|| {
                let (b, lens) = (pb.pairs(), &pb.batch.lens);
                (0..lens.len())
                    .map(|r| if r < b { lens[r] } else { 0 })
                    .collect()
            }),
        };
        backward(HeadLoss::PerToken {
            weigh: &mut weigh,
            aux,
        })
    }

    /// Each micro-batch's share is already normalised by the step's pairs.
    fn loss(&self, loss_sum: f64, _: StepTotals) -> f64 {
        loss_sum
    }

    fn metrics(&self, sums: &PairSums, t: StepTotals) -> BTreeMap<String, f64> {
        loss::metrics(sums, t.pairs, self.loss, "")
    }

    /// The loss over the validation pairs (their reference log-probs filled in), `micro_batch`
    /// pairs at a time: the mean loss and TRL's `eval_` metrics.
    fn evaluate(&self, live: &Live, micro_batch: usize) -> Result<Option<EvalMetrics>, TrainError> {
        let (model, pairs) = (live.model, &self.valid);
        if pairs.is_empty() {
            return Ok(None);
        }
        let lc = no_dropout(live.adapter);
        let mut batches: Vec<PairBatch> = pairs
            .chunks(micro_batch.max(1))
            .map(|chunk| {
                let refs: Vec<&Pair> = chunk.iter().collect();
                let (prompt_nll, long_past) = (self.loss.nll_on_prompt(), model.long_rope_past());
                PairBatch::with_rope(&refs, live.pad_id, prompt_nll, long_past)
            })
            .collect();
        let totals = StepTotals {
            pairs: pairs.len(),
            nll_tokens: batches.iter().map(|b| b.chosen_targets()).sum(),
        };
        let (mut loss, mut sums, mut tokens) = (0.0, PairSums::default(), 0);
        for pb in &mut batches {
            let nll = pairs::pair_nll(model, Some(&lc), pb)?;
            let (l, _, s) = loss::weigh(&self.loss, pb, &nll, totals);
            loss += l;
            sums.add(&s);
            tokens += pb.batch.target_tokens();
        }
        Ok(Some(EvalMetrics {
            step: live.step,
            valid_loss: loss,
            valid_ppl: None,
            valid_tokens: tokens,
            recipe: loss::metrics(&sums, pairs.len(), self.loss, "eval_"),
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

/// What loading the pairs read, cut or left out, per file: the reports' view of them.
struct PairFiles {
    /// Training pairs (KTO: unpaired rows).
    pairs: usize,
    unpaired: bool,
    /// Per file: its path and counts (`pairs` emptied: they are the recipe's).
    files: Vec<(std::path::PathBuf, PairSet)>,
}

impl OwnRows for PairFiles {
    fn counts(&self) -> RowCounts {
        let mut c = RowCounts::default();
        // Rows read, pairs whose completions were cut or left out.
        for (_, set) in &self.files {
            c.add(&RowCounts {
                rows: set.rows,
                truncated: set.truncated,
                dropped: set.dropped + set.no_target,
                skipped: set.bad_rows,
                oversized: set.oversized,
            });
        }
        c
    }

    fn warnings(&self) -> Vec<String> {
        pairs::warnings(&self.files)
    }

    fn file_lines(&self) -> Vec<String> {
        (self.files.iter())
            .map(|(path, set)| {
                format!(
                    "{}: {} rows, {} truncated, {} dropped, {} with identical completions",
                    path.display(),
                    set.rows,
                    set.truncated,
                    set.dropped,
                    set.identical
                )
            })
            .collect()
    }

    fn prepare_lines(&self) -> Vec<String> {
        (self.files.iter())
            .map(|(path, s)| {
                format!(
                    "{}: {} rows, {} pairs; {} truncated, {} dropped, {} without a token to \
                     train on, {} over max_row_bytes, {} malformed (skipped)",
                    path.display(),
                    s.rows,
                    s.rows - s.dropped - s.no_target - s.oversized - s.bad_rows,
                    s.truncated,
                    s.dropped,
                    s.no_target,
                    s.oversized,
                    s.bad_rows
                )
            })
            .collect()
    }

    fn sequences(&self) -> String {
        match self.unpaired {
            false => format!("sequences of {} training pairs", self.pairs),
            true => format!(
                "sequences of {} unpaired rows and their KL rows",
                self.pairs
            ),
        }
    }

    fn rows(&self) -> String {
        match self.unpaired {
            true => format!("{} unpaired rows with their KL rows", self.pairs),
            false => format!(
                "{} pairs as their chosen and rejected sequences",
                self.pairs
            ),
        }
    }
}
