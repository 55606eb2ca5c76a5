//! Objectives as recipes: what a training step minimises, each in its own folder, and the one
//! trait the training loop is generic over ([`Recipe`]).
//!
//! | folder | `[train] objective` | rows | head |
//! |---|---|---|---|
//! | [`sft`] | `sft` | examples (packed or padded) | next-token cross-entropy |
//! | [`preference`] | `dpo`, `simpo`, `orpo`, `kto` | pairs (KTO: unpaired rows), 2 sequences each | a function of each sequence's log-probability |
//! | [`grpo`] | `grpo` | prompts; completions sampled in the step | TRL's clipped policy loss on per-token log-probabilities |
//!
//! The loop (`crate::trainer`) keeps what is hard to get right twice — resume, accumulation, the
//! ranks, checkpoints — and asks the recipe, step after step, to [`draw`](Recipe::draw) its
//! micro-batches (with the live model at hand: an objective that samples completions inside the
//! step, as GRPO does, draws them there), their [`totals`](Recipe::totals), each micro-batch's
//! [`pass`](Recipe::pass) (the head's per-token loss, handed to the model's backward), the
//! step's [`loss`](Recipe::loss) and [`metrics`](Recipe::metrics) under the objective's own
//! names, its [`evaluate`](Recipe::evaluate), and once before the first step its
//! [`reference`](Recipe::reference) pass. What the recipe must carry across a resume beyond the
//! data cursor (a sampler's RNG) goes in the checkpoint through [`state`](Recipe::state) and
//! [`restore`](Recipe::restore).
//!
//! Before any training, `rtune estimate`, `rtune check` and `rtune data inspect`/`prepare` ask
//! the config's recipe through [`about`], [`load`] and [`overfit`]: this file is the one place
//! `[train] objective` picks a recipe ([`with_recipe`]), as torchtune's config names the recipe
//! it runs (`lora_dpo_single_device` beside an untouched `lora_finetune_single_device`).

pub mod grpo;
pub mod preference;
pub mod sft;

use std::collections::BTreeMap;

use rtune_config::RunConfig;
use rtune_data::{MicroBatch, Tokenizer};
use rtune_lora::Adapter;
/// The model's training head: next-token cross-entropy, or a loss of every position's NLL.
pub use rtune_model::HeadLoss;
use rtune_model::Model;

use crate::dataset::RunData;
use crate::evaluate::EvalMetrics;
use crate::TrainError;

/// What a step's micro-batch holds for the model: the rows as it takes them (the recipe's own
/// fields beside them stay for its head).
pub trait Micro {
    fn batch(&self) -> &MicroBatch;
    fn batch_mut(&mut self) -> &mut MicroBatch;
}

impl Micro for MicroBatch {
    fn batch(&self) -> &MicroBatch {
        self
    }
    fn batch_mut(&mut self) -> &mut MicroBatch {
        self
    }
}

/// What a step's micro-batches add to its metrics, summed over the ranks as numbers (an empty
/// vector: nothing to sum, no all-reduce).
pub trait Sums: Default {
    /// The last entries of [`to_vec`](Self::to_vec) reduced over the ranks by their max rather
    /// than summed (a min travels negated).
    const MAX_TAIL: usize = 0;
    fn to_vec(&self) -> Vec<f64>;
    fn from_slice(v: &[f64]) -> Self;
}

impl Sums for () {
    fn to_vec(&self) -> Vec<f64> {
        Vec::new()
    }
    fn from_slice(_: &[f64]) -> Self {}
}

/// The live model a recipe may use while it draws a step or evaluates: the model with its
/// adapter as trained so far (sampling completions, computing old log-probs).
pub struct Live<'a> {
    pub model: &'a Model,
    pub adapter: &'a Adapter,
    /// Optimizer steps done (the step being drawn is `step + 1`).
    pub step: usize,
    /// The ranks of a data-parallel run (one process: [`rtune_dist::World::single`]). A recipe
    /// may run collectives in [`Recipe::draw`], which every rank calls alike; never in
    /// [`Recipe::evaluate`], which rank 0 alone may run.
    pub world: &'a rtune_dist::World,
    pub pad_id: u32,
}

/// What a reference pass (once, before the first step) is given: the model as training starts,
/// whether this rank writes the cache, and how the ranks agree and a stop request is asked.
pub struct ReferencePass<'a> {
    pub model: &'a Model,
    pub adapter: &'a Adapter,
    pub pad_id: u32,
    /// This rank writes the cache (rank 0 of a data-parallel run).
    pub writer: bool,
    /// Whether every rank that must run the same forwards found the cache.
    pub every: &'a dyn Fn(bool) -> bool,
    /// Asked between forward passes: a stop request ends the pass.
    pub interrupted: &'a dyn Fn() -> bool,
}

/// What the commands that do not train need of an objective.
#[derive(Debug, Clone)]
pub struct About {
    /// The config's name (`[train] objective`).
    pub name: &'static str,
    /// A training row, for people: "examples", "pairs", "unpaired rows".
    pub unit: &'static str,
    /// The sequences each training row puts in a micro-batch, in turn (a pair's `["chosen",
    /// "rejected"]`); empty for one sequence a row.
    pub sides: &'static [&'static str],
    /// A forward pass over every row before training (the reference log-probabilities).
    pub reference: bool,
    /// `rtune data prepare`: why the token cache does not hold these rows (they are tokenized
    /// at the start of each run); `None`: the cache holds them.
    pub uncached: Option<String>,
    /// Why the objective cannot run on several ranks (refused at start); `None`: it can.
    pub single_rank: Option<&'static str>,
}

/// An objective as the training loop runs it (module docs). One value per run, made by
/// [`with_recipe`] from the config; it holds its rows and where the stream of them stands.
pub trait Recipe {
    /// One micro-batch as drawn.
    type Micro: Micro;
    /// What normalises each micro-batch's share of the step (computed over the whole step, every
    /// rank's micro-batches, so accumulation and data parallelism equal one big batch).
    type Totals: Copy;
    /// What the step's micro-batches add to its metrics.
    type Sums: Sums;

    /// The commands' view of it ([`About`]).
    fn about(&self) -> About;

    /// Loads the run's data as training takes it: `RunData::train` holds the sequences the model
    /// sees (what the memory estimate, `rtune check` and `rtune data inspect` look at), the
    /// recipe keeps whatever else its rows are.
    fn load(
        &mut self,
        cfg: &RunConfig,
        tok: Option<&Tokenizer>,
        vocab: usize,
    ) -> Result<RunData, TrainError>;

    /// The verdict of `rtune check`'s overfit run from its first loss and last step's metrics;
    /// `None`: the loss must fall (SFT's rule).
    fn overfit(&self, _l0: f64, _l1: f64, _last: &BTreeMap<String, f64>) -> Option<(bool, String)> {
        None
    }

    /// Takes the training rows of `data` into the seeded stream the steps draw from, and keeps
    /// the validation rows for [`evaluate`](Self::evaluate). Returns (training rows,
    /// validation rows).
    fn start(&mut self, cfg: &RunConfig, data: &mut RunData, pad_id: u32) -> (usize, usize);

    /// Once before the first step, after the run directory is taken: the forward passes an
    /// objective needs of the model as training starts. Returns the passes run.
    fn reference(&mut self, _cfg: &RunConfig, _pass: ReferencePass) -> Result<usize, TrainError> {
        Ok(0)
    }

    /// The next micro-batch of `size` rows.
    fn draw(&mut self, live: &Live, size: usize) -> Result<Self::Micro, TrainError>;

    /// The step's normalisers over all its micro-batches.
    fn totals(&self, micro: &[Self::Micro]) -> Self::Totals;

    /// One micro-batch's forward and backward: hands the head's loss (of `loss_scale ·` the
    /// micro-batch's share of the step's loss) to `backward`, which runs the model, and adds to
    /// `sums`. Returns the loss `backward` returned.
    fn pass(
        &self,
        micro: &Self::Micro,
        totals: Self::Totals,
        loss_scale: f64,
        sums: &mut Self::Sums,
        backward: &mut dyn FnMut(HeadLoss) -> Result<f64, TrainError>,
    ) -> Result<f64, TrainError>;

    /// The step's loss from the sum of its micro-batches' losses.
    fn loss(&self, loss_sum: f64, totals: Self::Totals) -> f64;

    /// The step's own metrics under the objective's names (metrics.jsonl, TensorBoard); empty
    /// for none.
    fn metrics(&self, sums: &Self::Sums, totals: Self::Totals) -> BTreeMap<String, f64>;

    /// The validation loss (and metrics) over the kept validation rows, `micro_batch` rows at a
    /// time, no dropout, no gradient; `None` without validation rows.
    fn evaluate(&self, live: &Live, micro_batch: usize) -> Result<Option<EvalMetrics>, TrainError>;

    /// `(epoch, cursor)` of the stream, saved by a checkpoint.
    fn position(&self) -> (usize, usize);

    /// Continues the stream at a checkpoint's `(epoch, cursor)`.
    fn seek(&mut self, epoch: usize, cursor: usize);

    /// What else a checkpoint must keep for a resume to be exact (a sampler's RNG state);
    /// `None`: nothing (absent from trainer_state.json).
    fn state(&self) -> Option<serde_json::Value> {
        None
    }

    /// Restores [`state`](Self::state) from a checkpoint.
    fn restore(&mut self, _state: Option<&serde_json::Value>) -> Result<(), TrainError> {
        Ok(())
    }
}

/// What is done with the config's recipe, whatever its type.
pub trait WithRecipe {
    type Out;
    fn run<R: Recipe>(self, recipe: R) -> Self::Out;
}

/// Runs `f` with the recipe `[train] objective` names: the one place the config's objective
/// picks a recipe.
pub fn with_recipe<F: WithRecipe>(cfg: &RunConfig, f: F) -> F::Out {
    if let rtune_config::Objective::Grpo(g) = cfg.train.objective {
        return f.run(grpo::recipe::Grpo::new(g, cfg));
    }
    match preference::Loss::of(cfg.train.objective) {
        None => f.run(sft::Sft::default()),
        Some(loss) => f.run(preference::Preference::new(loss)),
    }
}

/// The config's objective as the commands see it.
pub fn about(cfg: &RunConfig) -> About {
    struct F;
    impl WithRecipe for F {
        type Out = About;
        fn run<R: Recipe>(self, r: R) -> About {
            r.about()
        }
    }
    with_recipe(cfg, F)
}

/// The run's data as its recipe loads it for training (`RunData::train`: the sequences the model
/// sees).
pub fn load(cfg: &RunConfig, tok: Option<&Tokenizer>, vocab: usize) -> Result<RunData, TrainError> {
    struct F<'a>(&'a RunConfig, Option<&'a Tokenizer>, usize);
    impl WithRecipe for F<'_> {
        type Out = Result<RunData, TrainError>;
        fn run<R: Recipe>(self, mut r: R) -> Self::Out {
            r.load(self.0, self.1, self.2)
        }
    }
    with_recipe(cfg, F(cfg, tok, vocab))
}

/// The config's data loaded as training loads it (through the cache) with the model's tokenizer:
/// what `rtune data inspect`, `rtune check` and `rtune estimate --data` look at.
pub fn load_for(cfg: &RunConfig) -> Result<(RunData, Option<Tokenizer>), TrainError> {
    let (tok, vocab) = crate::dataset::model_tokenizer(cfg)?;
    let data = load(cfg, tok.as_ref(), vocab)?;
    Ok((data, tok))
}

/// `rtune check`'s overfit verdict ([`Recipe::overfit`]).
pub fn overfit(
    cfg: &RunConfig,
    l0: f64,
    l1: f64,
    last: &BTreeMap<String, f64>,
) -> Option<(bool, String)> {
    struct F<'a>(f64, f64, &'a BTreeMap<String, f64>);
    impl WithRecipe for F<'_> {
        type Out = Option<(bool, String)>;
        fn run<R: Recipe>(self, r: R) -> Self::Out {
            r.overfit(self.0, self.1, self.2)
        }
    }
    with_recipe(cfg, F(l0, l1, last))
}
