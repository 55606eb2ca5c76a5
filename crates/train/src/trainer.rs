//! The training loop, from a fresh start or a checkpoint, to a finished run directory:
//!
//! | file | when |
//! |---|---|
//! | `run.json` | at start and end of every attempt (the run record) |
//! | `config.toml` | at start: the config as resolved |
//! | `metrics.jsonl` | one line per optimizer step, as it goes |
//! | `checkpoint-<step>/` | every `save_every` steps, on SIGINT/SIGTERM, and at the end |
//! | `adapter_model.safetensors`, `adapter_config.json` | at the end: the PEFT adapter |
//! | `summary.json` | last: its presence marks a finished run |
//!
//! [`train`] reads like torchtune's `recipes/lora_finetune_single_device.py`: set up a [`Trainer`],
//! [`resume_or_fresh`](Trainer::resume_or_fresh), then each [`step`](Trainer::step), an
//! [`evaluate`](Trainer::evaluate) and a [`checkpoint`](Trainer::checkpoint) when due, and
//! [`finish`](Trainer::finish). The counters live in one [`RunState`], which a checkpoint saves as is.
//!
//! A run resumed from `checkpoint-k` is bitwise identical on CPU to one never interrupted: the
//! adapter, AdamW's state and the data cursor are restored exactly, the dropout masks and shuffle
//! order are functions of (seed, step, epoch), and metrics.jsonl is cut back to its length at step k.
//!
//! Beside it: [`state`] (the counters), `attempt` (setup, the ranks' start-up, the checkpoint to
//! resume, run.json, the summary), `remote` (the remote store and MLflow at the run's ends),
//! `metrics` and `events` (what is reported, and to whom); every write goes through
//! `rtune_run::files::RunFiles`.
//!
//! Data parallelism (issue 16) lives in `rtune-dist`; the trainer holds one [`DataParallel`]
//! (`dist`): with W ranks a step draws W × `grad_accum` micro-batches on every rank and each rank
//! computes its share; `Trainer::gradients` ends with the all-reduce of the gradients and loss
//! sum, before clipping; [`RunFiles`] is the only writer of the run directory (rank 0 alone
//! writes, decided in `RunFiles::new`); evaluation runs on rank 0; the ranks agree on a stop
//! request after every step.

mod attempt;
mod events;
mod metrics;
mod remote;
pub mod state;

use candle_core::Device;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rtune_config::RunConfig;
use rtune_data::Tokenizer;
use rtune_dist::{DataParallel, World};
use rtune_lora::Adapter;
use rtune_model::{Grads, Inputs, LoraCtx, Model};

use crate::dataset::RunData;
use crate::objective::{HeadLoss, Live, Micro, Recipe, Sums, WithRecipe};
use crate::optim::{lr_factor, LoraOptimizer};
use crate::{evaluate, memory, TrainError};
use rtune_run::checkpoint;
use rtune_run::files::RunFiles;
use state::TrainerState;

pub use crate::compute::{device, dtype};
pub use events::{Event, Outcome, RunOptions};
pub use metrics::{StepMetrics, Summary};
pub use state::RunState;

/// Runs (or resumes) a whole training job as configured.
pub fn train(
    cfg: &RunConfig,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<Outcome, TrainError> {
    crate::objective::with_recipe(
        cfg,
        Run {
            cfg,
            opts,
            on_event,
        },
    )
}

/// [`train`] with the recipe `[train] objective` names.
struct Run<'c, 'o, 'p, 'e> {
    cfg: &'c RunConfig,
    opts: &'o RunOptions<'p>,
    on_event: &'e mut dyn FnMut(Event),
}

impl WithRecipe for Run<'_, '_, '_, '_> {
    type Out = Result<Outcome, TrainError>;
    fn run<R: Recipe>(self, recipe: R) -> Self::Out {
        train_with(self.cfg, recipe, self.opts, self.on_event)
    }
}

/// [`train`] with `recipe`.
fn train_with<R: Recipe>(
    cfg: &RunConfig,
    recipe: R,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<Outcome, TrainError> {
    let world = opts.world.cloned().unwrap_or_else(World::single);
    let mut t = Trainer::setup_in(cfg, recipe, world, on_event)?;
    // Refused before step 0: the run directory is left as it was found (no lock file of ours).
    let begun = t.resume_or_fresh(opts).and_then(|()| t.begin());
    let record = begun.inspect_err(|_| t.files.abandon())?;
    let result = t.run(opts.stop);
    let outcome = t.end(record, result);
    t.finish_remote(outcome)
}

/// One training job: the model and adapter, the optimizer, the objective's recipe (its rows and
/// their stream), the run's files and counters.
pub struct Trainer<'a, R: Recipe> {
    cfg: &'a RunConfig,
    on_event: &'a mut dyn FnMut(Event),
    /// When this attempt started (elapsed times add the earlier attempts' `state.wall_s`).
    started: Instant,
    dev: Device,
    model: Model,
    adapter: Adapter,
    opt: LoraOptimizer,
    /// The objective: its training rows in the seeded order of each epoch, with the cursor,
    /// and its validation rows.
    recipe: R,
    /// The per-file reports (the rows are the recipe's).
    data: RunData,
    /// Forward passes of the recipe's reference pass (0 without one).
    reference_passes: usize,
    /// Training and validation rows.
    examples: usize,
    valid_examples: usize,
    tok: Option<Tokenizer>,
    pad_id: u32,
    /// Settings a resumed run must share with the original (see `setup::settings`).
    settings: BTreeMap<String, String>,
    /// The base model as PEFT records it.
    base: String,
    estimated_peak_bytes: Option<u64>,
    /// `[train] gradient_checkpointing` as decided for this attempt (`auto` resolved).
    checkpointing: rtune_estimate::CheckpointingChoice,
    files: RunFiles,
    state: RunState,
    /// Tests poison the loss of these steps (`RTUNE_FAULT_NAN_STEPS`, 1-based) to exercise the NaN path.
    fault_nan_steps: Vec<usize>,
    /// The ranks of a data-parallel run (a single process otherwise): the world, each rank's
    /// host and device once they agreed (run.json), the gradient all-reduce.
    dist: DataParallel,
    /// PiSSA / OLoRA: the initial factors; the final adapter is saved against the original base.
    initial: Option<crate::variants::InitialAdapter>,
}

impl<R: Recipe> Trainer<'_, R> {
    fn warn(&mut self, message: String) {
        (self.on_event)(Event::Warning(message));
    }

    /// Continues from the newest checkpoint that verifies, when asked to resume and one exists
    /// (adapter, AdamW's moments, data cursor, [`RunState`], metrics.jsonl cut back); otherwise
    /// makes the directory ready for a fresh run.
    pub fn resume_or_fresh(&mut self, opts: &RunOptions) -> Result<(), TrainError> {
        // Seen by every rank before rank 0 creates the directory; `join_ranks` is also a barrier.
        let existed = self.cfg.output.dir.is_dir();
        self.join_ranks()?;
        self.preflight()?;
        // Rank 0 alone talks to the remote store (RunFiles writes only there).
        self.files.connect_remote(self.cfg)?;
        self.files.lock()?;
        // The remote prefix is claimed like the directory (after it: a refusal leaves both as found).
        let resume = opts.resume || self.cfg.output.resume;
        self.files.claim_remote(self.cfg, resume)?;
        self.reference_pass(opts.stop)?;
        let existed = self.fetch_remote_checkpoint(opts, existed)?;
        // A barrier: the other ranks read the checkpoint rank 0 may just have fetched.
        self.dist
            .world
            .expect_root_phase("rank 0's remote checkpoint fetch");
        self.dist.world.any("the remote checkpoint fetch", false);
        let Some(l) = self.checkpoint_to_resume(opts, existed)? else {
            return Ok(self.files.clear_for_fresh_run(self.cfg)?);
        };
        self.adapter = l.adapter;
        self.model.attach(&self.adapter);
        self.opt
            .restore(&self.adapter, l.state.adamw_step, l.m, l.v)?;
        self.recipe.seek(l.state.epoch, l.state.cursor);
        self.recipe.restore(l.state.recipe.as_ref())?;
        self.state.resume(l.state.run);
        Ok(self.files.cut_metrics(self.state.metrics_bytes)?)
    }

    /// The loop: steps until `[train] steps`, evaluating and checkpointing when due; a raised
    /// `stop` flag ends it after the current step with a checkpoint.
    fn run(&mut self, stop: Option<&AtomicBool>) -> Result<Outcome, TrainError> {
        let cfg = self.cfg;
        // How long the ranks wait on each other (rtune_dist's pace): announced long phases, and
        // the step times, the first one (warm-up) apart.
        let mut first = true;
        self.dist.world.expect_long("the first step (warm-up)");
        while self.state.step < cfg.train.steps {
            let t0 = Instant::now();
            self.step()?;
            self.dist.world.step_took(t0.elapsed(), first);
            first = false;
            let step = self.state.step;
            let due =
                |every: usize| (every > 0 && step.is_multiple_of(every)) || step == cfg.train.steps;
            if due(cfg.train.eval_every) {
                let phase = format!("step {step}'s evaluation on rank 0");
                self.dist.world.expect_root_phase(&phase);
                self.dist.fault_slow_root_phase();
                self.evaluate()?;
            }
            let stop = stop.is_some_and(|s| s.load(Ordering::SeqCst));
            // A signal may reach one rank only, or the ranks at different steps: all stop together.
            let stop = self.dist.world.any("the stop agreement", stop);
            if due(cfg.output.save_every) || stop {
                self.dist.fault_slow_root_phase();
                self.checkpoint(stop)?;
                // Only the wait for rank 0's write is long: the next step's all-reduce is not.
                let phase = format!("the checkpoint of step {step} on rank 0");
                self.dist.world.expect_root_phase(&phase);
                self.dist.world.any("the checkpoint barrier", false);
                if stop && step < cfg.train.steps {
                    self.check_device()?;
                    let checkpoint = self.files.dir.join(format!("checkpoint-{step}"));
                    return Ok(Outcome::Stopped { step, checkpoint });
                }
            }
        }
        // The end of the run: what the last step, evaluation and checkpoint freed is checked
        // before the adapter and summary.json mark the run finished.
        self.check_device()?;
        self.state.check_trained()?;
        self.finish().map(Outcome::Completed)
    }

    /// Fails with the driver error cudarc recorded, since the last check, where it could not
    /// return it (in a `Drop`: a free, a stream or event destroyed; `rtune_backend::cuda::
    /// deferred_error`). Read at every step boundary and at the end of the run. A no-op off CUDA.
    fn check_device(&self) -> Result<(), TrainError> {
        #[cfg(feature = "cuda")]
        if let candle_core::DeviceLocation::Cuda { gpu_id } = self.dev.location() {
            rtune_backend::cuda::deferred_error(&self.dev).map_err(|source| {
                TrainError::DeviceDeferred {
                    ordinal: gpu_id,
                    step: self.state.step,
                    source,
                }
            })?;
        }
        Ok(())
    }

    /// One optimizer step: `grad_accum` micro-batches forward and backward (× the world size, each
    /// rank computing its share), then clipping and AdamW (or a skipped update), then the step's
    /// metrics line.
    // Never inlined: a frame of its own, from which tests/integration/readme.rs measures the
    // files one step executes (a call per step costs nothing measurable).
    #[inline(never)]
    pub fn step(&mut self) -> Result<(), TrainError> {
        let (t0, cfg, step) = (Instant::now(), self.cfg, self.state.step);
        let (w, rank) = (self.dist.world.size, self.dist.world.rank);
        let live = Live {
            model: &self.model,
            adapter: &self.adapter,
            step,
            pad_id: self.pad_id,
            world: &self.dist.world,
        };
        let mbs = cfg.train.micro_batch_size;
        let micro = (0..cfg.train.grad_accum * w)
            .map(|_| self.recipe.draw(&live, mbs))
            .collect::<Result<Vec<_>, _>>()?;
        let n_target: usize = micro.iter().map(|m| m.batch().target_tokens()).sum();
        let tokens: usize = micro.iter().map(|m| m.batch().tokens).sum();
        let totals = self.recipe.totals(&micro);
        let loss_scale = self.state.loss_scale();
        // This rank's micro-batches k ≡ rank (mod w), with their index in the global step.
        let mine = micro
            .into_iter()
            .enumerate()
            .skip(rank)
            .step_by(w)
            .collect();
        let (grads, loss_sum, sums) = self.gradients(mine, totals, loss_scale)?;
        let mut loss = self.recipe.loss(loss_sum, totals);
        if self.fault_nan_steps.contains(&(step + 1)) {
            loss = f64::NAN;
        }
        let lr = cfg.train.lr
            * lr_factor(
                cfg.train.schedule,
                step,
                cfg.train.steps,
                cfg.train.warmup_steps,
            );
        let (clip, unscale) = (cfg.train.max_grad_norm, 1.0 / loss_scale);
        let done = self
            .opt
            .step(&mut self.adapter, &grads, lr, clip, loss, unscale)?;
        // The step boundary: everything the step freed has been enqueued (not `state.step + 1`
        // yet: an error names the last step that completed cleanly).
        self.check_device()?;
        let (on_event, max_bad) = (&mut self.on_event, cfg.train.max_bad_steps);
        let warn = &mut |w| on_event(Event::Warning(w));
        self.state
            .count_update(done, loss, loss_scale, max_bad, warn)?;
        let secs = t0.elapsed().as_secs_f64();
        let mut recipe = self.recipe.metrics(&sums, totals);
        // A mixture-of-experts model's load-balancing loss (before its coefficient; `loss`
        // includes coefficient × it), logged apart as transformers returns it: the step's last
        // micro-batch's. Under data parallelism that is the world's last, which the last rank
        // ran (micro-batch k is rank k mod w's): its value, summed with the others' zeros (every
        // rank's model has the aux loss or none does).
        if let Some(aux) = self.model.last_aux_loss() {
            let mut v = [if rank + 1 == w { aux } else { 0.0 }];
            if self.dist.world.is_distributed() {
                let what = format!("step {}'s aux loss", step + 1);
                self.dist.world.all_reduce_sum_f64(&what, &mut v);
            }
            recipe.insert("aux_loss".into(), v[0]);
        }
        let m = StepMetrics {
            step: step + 1,
            loss,
            lr,
            grad_norm: done.grad_norm,
            tokens,
            target_tokens: n_target,
            tokens_per_s: tokens as f64 / secs.max(1e-9),
            skipped: !done.applied,
            loss_scale: self.state.scaler.is_some().then_some(loss_scale),
            recipe,
            peak_memory_bytes: memory::peak_bytes(&self.dev),
            estimated_peak_bytes: self.estimated_peak_bytes,
            elapsed_s: self.wall_s(),
        };
        self.state.count_step(&m, cfg.train.steps);
        self.state.metrics_bytes += self.files.metrics_line(&m)?;
        (self.on_event)(Event::Step(&m));
        if let Some(w) = self.files.step_scalars(m.step, &m.scalars()) {
            self.warn(w);
        }
        self.report_remote();
        Ok(())
    }

    /// Forward and backward over this rank's micro-batches of the step (`(index in the step,
    /// batch)`) into one set of gradients (of `loss_scale · loss`), the sum of their losses, and
    /// the recipe's metric sums, all summed over the ranks. Each micro-batch is normalised by
    /// the whole step's `totals` (the recipe's), so accumulation (and data parallelism) equals
    /// one big batch. The all-reduce ends this function: clipping and the NaN/Inf skip decide on
    /// the step's whole gradients.
    fn gradients(
        &self,
        micro: Vec<(usize, R::Micro)>,
        totals: R::Totals,
        loss_scale: f64,
    ) -> Result<(Grads, f64, R::Sums), TrainError> {
        let cfg = self.cfg;
        let mut grads = Grads::new(self.adapter.pairs.len());
        let (mut loss_sum, mut sums) = (0.0, R::Sums::default());
        let last = micro.len().saturating_sub(1);
        for (j, (k, mut mb)) in micro.into_iter().enumerate() {
            let lc = LoraCtx {
                adapter: &self.adapter,
                scaling: self.adapter.spec.scaling(),
                dropout: cfg.lora.dropout,
                seed: self.state.dropout_seed(cfg.train.seed, k),
            };
            let inputs = crate::compute::take_inputs(mb.batch_mut());
            let b = mb.batch();
            let ckpt = self.checkpointing.on;
            let mut backward = |head: HeadLoss| {
                self.backward(&inputs, &b.targets, &lc, head, ckpt, &mut grads, j == last)
            };
            loss_sum += self
                .recipe
                .pass(&mb, totals, loss_scale, &mut sums, &mut backward)?;
        }
        let step = self.state.step + 1;
        let mut s = sums.to_vec();
        if self.dist.world.is_distributed() && !s.is_empty() {
            let world = &self.dist.world;
            let tail = s.len() - R::Sums::MAX_TAIL.min(s.len());
            let what = format!("step {step}'s objective metrics all-reduce");
            world.all_reduce_sum_f64(&what, &mut s[..tail]);
            if tail < s.len() {
                // The max over the ranks: each rank's values gathered (a few f64s a rank).
                let mine: Vec<u8> = s[tail..].iter().flat_map(|v| v.to_le_bytes()).collect();
                let what = format!("step {step}'s objective metrics gather (max)");
                for theirs in world.all_gather(&what, &mine) {
                    for (i, b) in theirs.chunks_exact(8).enumerate() {
                        let v = f64::from_le_bytes(b.try_into().expect("8 bytes"));
                        s[tail + i] = s[tail + i].max(v);
                    }
                }
            }
            sums = R::Sums::from_slice(&s);
        }
        let (grads, loss) = self.dist.all_reduce(step, &self.adapter, grads, loss_sum)?;
        Ok((grads, loss, sums))
    }

    /// One micro-batch's forward and backward into `grads` under `head` (see
    /// `Model::train_pass`). On a CUDA rank with NCCL, the step's `last` micro-batch launches
    /// each layer's gradient all-reduce as soon as its backward ends.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        inputs: &Inputs,
        targets: &[Option<u32>],
        lc: &LoraCtx,
        head: HeadLoss,
        ckpt: bool,
        grads: &mut Grads,
        last: bool,
    ) -> Result<f64, TrainError> {
        let (model, adapter, dist) = (&self.model, &self.adapter, &self.dist);
        if last && dist.overlaps_backward() {
            let mut launch =
                |i: usize, g: &Grads| dist.launch_layer(adapter, g, &model.layer_slots(i));
            return Ok(model.train_pass(inputs, targets, lc, head, ckpt, grads, &mut launch)?);
        }
        let mut none = |_: usize, _: &Grads| Ok(());
        Ok(model.train_pass(inputs, targets, lc, head, ckpt, grads, &mut none)?)
    }

    /// Validation loss over the held-out rows (a metrics.jsonl line), and greedy completions of
    /// the `eval_prompts` (samples.jsonl).
    pub fn evaluate(&mut self) -> Result<(), TrainError> {
        let (cfg, step) = (self.cfg, self.state.step);
        // Rank 0 alone evaluates (the others wait at the next step's all-reduce): same numbers.
        // A sharded base needs every rank for each layer's gather: they all evaluate, in step,
        // and rank 0 alone reports.
        let root = self.dist.world.is_root();
        if !root && self.model.shard_world().is_none() {
            return Ok(());
        }
        let (model, adapter) = (&self.model, &self.adapter);
        let live = Live {
            model,
            adapter,
            step,
            pad_id: self.pad_id,
            world: &self.dist.world,
        };
        let ev = self.recipe.evaluate(&live, cfg.train.micro_batch_size)?;
        if let (Some(ev), true) = (ev, root) {
            self.state.metrics_bytes += self.files.metrics_line(&ev)?;
            (self.on_event)(Event::Eval(&ev));
            if let Some(w) = self
                .files
                .eval_scalars(ev.step, &metrics::eval_scalars(&ev))
            {
                (self.on_event)(Event::Warning(w));
            }
        }
        if let (Some(tok), false) = (&self.tok, cfg.train.eval_prompts.is_empty()) {
            let (prompts, max_new) = (&cfg.train.eval_prompts, cfg.train.eval_max_new_tokens);
            let samples = evaluate::samples(step, model, adapter, tok, prompts, max_new)?;
            if root {
                self.files.samples(&samples)?;
            }
        }
        Ok(())
    }

    /// Writes `checkpoint-<step>/`. A failed write stops the run unless `[output] on_save_error =
    /// "continue"` and more steps follow (never when `stopping`).
    // Never inlined: where the README's step trace ends (see `step`).
    #[inline(never)]
    pub fn checkpoint(&mut self, stopping: bool) -> Result<(), TrainError> {
        let (cfg, step) = (self.cfg, self.state.step);
        if let Some(w) = self.files.sync()? {
            self.warn(w);
        }
        let (epoch, cursor) = self.recipe.position();
        let state = TrainerState {
            format: checkpoint::FORMAT.into(),
            run: RunState {
                wall_s: self.wall_s(),
                ..self.state.clone()
            },
            adamw_step: self.opt.adamw_step(),
            epoch,
            cursor,
            seed: cfg.train.seed,
            next_lr: cfg.train.lr
                * lr_factor(
                    cfg.train.schedule,
                    step,
                    cfg.train.steps,
                    cfg.train.warmup_steps,
                ),
            settings: self.settings.clone(),
            recipe: self.recipe.state(),
        };
        let (adapter, keep) = (&self.adapter, cfg.output.keep_last);
        let (m, v) = self.opt.moments()?;
        let moments = rtune_run::checkpoint::Moments { m: &m, v: &v };
        match self
            .files
            .checkpoint(&state, adapter, moments, &self.base, keep)
        {
            Ok(Some(path)) => (self.on_event)(Event::Checkpoint { step, path: &path }),
            Ok(None) => {}
            Err(e) if cfg.output.continue_on_save_error && !stopping && step < cfg.train.steps => {
                self.warn(format!(
                    "checkpoint at step {step} not written: {e}; continuing"
                ))
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// The PEFT adapter, the loss plot and summary.json (written last: a finished run).
    pub fn finish(&mut self) -> Result<Summary, TrainError> {
        let saved = crate::variants::for_saving(&self.adapter, self.initial.as_ref())?;
        self.files.adapter(&saved, &self.base)?;
        if let Some(w) = self.files.flush_tb() {
            self.warn(w);
        }
        if let Some(w) = self.files.plot() {
            self.warn(w);
        }
        let summary = self.summary();
        self.files.summary(&summary)?;
        Ok(summary)
    }

    /// Wall-clock seconds of every attempt so far.
    fn wall_s(&self) -> f64 {
        self.state.wall_s + self.started.elapsed().as_secs_f64()
    }
}
