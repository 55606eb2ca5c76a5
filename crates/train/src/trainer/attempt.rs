//! How an attempt starts and ends: [`Trainer::setup`] loads and checks everything before the run
//! directory is touched; the ranks of a data-parallel run agree (`join_ranks`); when resuming, the
//! checkpoint to continue from is the newest that verifies if its settings equal this run's (the
//! refusals name what is wrong: a finished run, no checkpoint that verifies, each changed setting;
//! a new world size needs the same global batch); `begin` writes run.json and config.toml and
//! reports the start; `end` records in run.json how the attempt ended; `summary` gives
//! summary.json's numbers.

use std::time::Instant;

use rtune_config::RunConfig;
use rtune_dist::{DataParallel, World};

use super::state::Loaded;
use super::{metrics, Event, Outcome, RunOptions, RunState, Summary, Trainer};
use crate::compute::device;
use crate::objective::{Recipe, ReferencePass};
use crate::optim::LoraOptimizer;
use crate::setup::{self, base_model_name, prepare, settings_diff, Prepared};
use crate::{memory, TrainError};
use rtune_run::checkpoint;
use rtune_run::files::RunFiles;
use rtune_run::record::RunRecord;

impl<'a, R: Recipe> Trainer<'a, R> {
    /// Loads and checks everything (model, data, adapter) before the run directory is touched.
    pub fn setup(
        cfg: &'a RunConfig,
        recipe: R,
        on_event: &'a mut dyn FnMut(Event),
    ) -> Result<Self, TrainError> {
        Self::setup_in(cfg, recipe, World::single(), on_event)
    }

    /// [`setup`](Self::setup) as one rank of `world` (a data-parallel run): the world size is a
    /// setting a resume checks, and only rank 0's files are written.
    pub fn setup_in(
        cfg: &'a RunConfig,
        mut recipe: R,
        world: World,
        on_event: &'a mut dyn FnMut(Event),
    ) -> Result<Self, TrainError> {
        let started = Instant::now();
        let dist = DataParallel::new(world);
        let dev = device(match cfg.train.device {
            rtune_config::Device::Cuda(n) => rtune_config::Device::Cuda(dist.gpu(n)),
            d => d,
        })?;
        // The ranks agree on what they run before anything loads, so a rank that differs is
        // refused at once, not after the load. With `[distributed] shard_base` (this rank keeps
        // its shard of the base, gathering through the world; a single process runs the same
        // code with a world of one) loading is collective, and the loader, DoRA's init and a
        // preference run's reference pass gather layers before the start-up's barrier
        // (`join_ranks`): ranks that differ would wait on each other's different gathers
        // instead. So also `shard_base` and the kept layers, or the gathers would pair up
        // wrongly (the settings leave `[distributed]` out: it may change on resume). The
        // settings (which hash the data) are made once; a file they cannot read is left to the
        // loader below, whose error names it (this rank's error then ends the job).
        if let (true, Some(why)) = (
            dist.world.is_distributed(),
            crate::objective::about(cfg).single_rank,
        ) {
            return Err(TrainError::NotDataParallel {
                objective: crate::objective::about(cfg).name,
                why,
            });
        }
        let early = dist.world.is_distributed().then(|| setup::settings(cfg));
        if let Some(Ok(settings)) = &early {
            let d = &cfg.distributed;
            let mut mine = agreement(cfg, settings);
            mine.insert("distributed.shard_base".into(), d.shard_base.to_string());
            mine.insert(
                "distributed.keep_gathered_layers".into(),
                d.keep_gathered_layers.to_string(),
            );
            rtune_dist::check_agreement(&dist.world, &mine)
                .map_err(|d| rtune_dist::DistError::Ranks(Box::new(d)))?;
        }
        // The next collective follows the model's load, each rank at its disk's pace.
        dist.world.expect_long("the start-up (loading the model)");
        if cfg.distributed.shard_base && !dist.world.is_distributed() {
            on_event(Event::Warning(
                "[distributed] shard_base in a single process: the one rank holds the whole base \
                 (launch with mpirun or srun to shard it)"
                    .into(),
            ));
        }
        let shard = cfg
            .distributed
            .shard_base
            .then(|| std::rc::Rc::new(dist.world.clone()) as std::rc::Rc<dyn rtune_model::Gather>);
        let Prepared {
            mut model,
            adapter,
            mut data,
            tok,
            pad_id,
            initial,
        } = prepare(cfg, &mut recipe, &dev, shard.as_ref())?;
        let mut settings = match early {
            Some(Ok(s)) => s,
            _ => setup::settings(cfg)?,
        };
        dist.add_settings(&mut settings);
        model.offload_checkpoints = cfg.train.offload_checkpoints;
        model.set_keep_gathered(cfg.distributed.keep_gathered_layers);
        let prefetching = model.set_prefetch(cfg.distributed.prefetch);
        if cfg.distributed.prefetch && !prefetching && dist.world.is_distributed() {
            on_event(Event::Warning(
                "[distributed] prefetch: the MPI library does not let a second thread gather \
                 (it provides less than MPI_THREAD_SERIALIZED); every gather runs in turn"
                    .into(),
            ));
        }
        // data.train holds the sequences the model sees (the estimate's rows).
        let world = dist.world.size;
        let checkpointing = setup::checkpointing(cfg, &model.cfg, &data.train, &dev, world)?;
        let estimated_peak_bytes =
            rtune_estimate::for_run(cfg, &model.cfg, &data.train, &dev, checkpointing.on, world);
        setup::check_memory(estimated_peak_bytes, setup::memory_budget(&dev))?;
        let (betas, eps, wd) = (cfg.train.betas, cfg.train.eps, cfg.train.weight_decay);
        let opt =
            LoraOptimizer::with_loraplus(&adapter, betas, eps, wd, cfg.train.loraplus_lr_ratio)?;
        // The recipe takes its rows into its stream. A reference pass runs once the run
        // directory is taken (`reference_pass`): a directory that cannot be used is refused at
        // once.
        let (examples, valid_examples) = recipe.start(cfg, &mut data, pad_id);
        let state = RunState::fresh(setup::loss_scaler(cfg));
        Ok(Self {
            cfg,
            on_event,
            started,
            dev,
            model,
            adapter,
            opt,
            recipe,
            data,
            reference_passes: 0,
            examples,
            valid_examples,
            tok,
            pad_id,
            settings,
            base: base_model_name(&cfg.model.path),
            estimated_peak_bytes,
            checkpointing,
            files: RunFiles::new(cfg, dist.world.is_root()),
            state,
            fault_nan_steps: setup::fault_nan_steps(),
            dist,
            initial,
        })
    }

    /// The recipe's reference pass (a preference run's reference log-probabilities of every
    /// pair), once, before the first step: after the run directory is checked and locked (issue 46: `/` or a locked directory
    /// was refused only after the whole pass), before a resume replaces the adapter (the
    /// reference is the start). A raised `stop` (SIGINT/SIGTERM) ends the pass between two
    /// forward passes (it was ignored until the pass ended); in a data-parallel run `mpirun`
    /// ends the job instead, and the ranks' passes stay in step.
    pub(super) fn reference_pass(
        &mut self,
        stop: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<(), TrainError> {
        let (cfg, pad_id) = (self.cfg, self.pad_id);
        if !self.recipe.about().reference {
            return Ok(());
        }
        let world = &self.dist.world;
        world.expect_long("the reference log-probabilities pass");
        let root = world.is_root();
        // A sharded base's reference forwards gather on every rank: a cache one rank finds and
        // another does not is computed by all.
        let sharded = self.model.shard_world().is_some();
        let every = |hit: bool| match sharded {
            true => !world.any("the reference cache's agreement", !hit),
            false => hit,
        };
        let alone = !world.is_distributed();
        let interrupted =
            || alone && stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst));
        let pass = ReferencePass {
            model: &self.model,
            adapter: &self.adapter,
            pad_id,
            writer: root,
            every: &every,
            interrupted: &interrupted,
        };
        self.reference_passes = self.recipe.reference(cfg, pass)?;
        Ok(())
    }

    /// A data-parallel run's start-up (collective: every rank calls it; a no-op in one process):
    /// every rank's settings and model files equal rank 0's, or the same refusal on every rank;
    /// each rank's host and device are gathered for run.json; a CUDA rank joins NCCL.
    pub(super) fn join_ranks(&mut self) -> Result<(), TrainError> {
        if !self.dist.world.is_distributed() {
            return Ok(());
        }
        let mine = agreement(self.cfg, &self.settings);
        self.dist.join(&mine, &self.dev)?;
        // A CUDA rank's sharded base: its shards move to the GPU and gather through the
        // communicator `join` made (the gradient buckets' own), the next layer launched ahead
        // with `prefetch`. Every rank of a CUDA run does the same (the gathers pair up).
        if let Some(transport) = self.dist.device_gather() {
            let what = "moving the sharded base's shards to the device";
            if self
                .model
                .set_device_gather(transport)
                .map_err(|e| rtune_model::ModelError::candle(what, e))?
            {
                self.model.set_prefetch(self.cfg.distributed.prefetch);
            }
        }
        Ok(())
    }

    /// Checks made before the run directory is created or touched: room on the
    /// filesystem for what the run will write (refused with the figures, a warning under 2×), and
    /// a LoRA rank above a targeted layer's smaller dimension (legal in PEFT, never meant).
    pub(super) fn preflight(&mut self) -> Result<(), TrainError> {
        let cfg = self.cfg;
        let modules = self.model.lora_modules(&self.adapter.spec);
        if let Some(m) = modules
            .iter()
            .find(|m| cfg.lora.r > m.in_features.min(m.out_features))
        {
            let n = modules
                .iter()
                .filter(|x| cfg.lora.r > x.in_features.min(x.out_features))
                .count();
            self.warn(format!(
                "[lora] r = {} is larger than min(in, out) = {} of {} ({} × {}; {n} module(s) like \
                 it): those adapters have more parameters than the layer's rank can use",
                cfg.lora.r,
                m.in_features.min(m.out_features),
                m.name,
                m.out_features,
                m.in_features
            ));
        }
        if !cfg.output.check_disk || !self.dist.world.is_root() {
            return Ok(());
        }
        let dir = &cfg.output.dir;
        let need = rtune_run::disk::need(cfg, self.adapter.num_params());
        let free = rtune_run::disk::free_bytes(dir)?;
        // A resumed run's checkpoints already hold part of what it needs.
        let held = checkpoint::list(dir).len() as u64 * need.checkpoint;
        let more = need.total.saturating_sub(held);
        if free < more {
            return Err(TrainError::OutputDir {
                path: dir.clone(),
                message: format!(
                    "not enough free disk: {}; free space, lower [output] keep_last, or set \
                     [output] check_disk = false",
                    need.describe(free, dir)
                ),
            });
        }
        if free < 2 * more {
            self.warn(format!("little free disk: {}", need.describe(free, dir)));
        }
        Ok(())
    }

    /// The checkpoint to resume from, when asked to resume (`--resume` or `[output] resume =
    /// "auto"`) and the directory exists: the newest that verifies, if its settings equal this
    /// run's (or `--force`). `None` (after a warning) when there is none to use and none is lost.
    pub(super) fn checkpoint_to_resume(
        &mut self,
        opts: &RunOptions,
        existed: bool,
    ) -> Result<Option<Loaded>, TrainError> {
        let cfg = self.cfg;
        let dir = &cfg.output.dir;
        if opts.resume && !existed {
            self.warn(format!(
                "{} does not exist yet; starting from step 0",
                dir.display()
            ));
        }
        if !((opts.resume || cfg.output.resume) && existed) {
            return Ok(None);
        }
        if dir.join("summary.json").exists() {
            let message = "this run already finished (summary.json); nothing to resume".into();
            return Err(TrainError::OutputDir {
                path: dir.clone(),
                message,
            });
        }
        let partial = self.files.remove_partial_checkpoints();
        if partial > 0 {
            self.warn(format!(
                "removed {partial} incomplete checkpoint(s) left by an interrupted write"
            ));
        }
        let (spec, modules) = (
            &self.adapter.spec,
            self.model.lora_modules(&self.adapter.spec),
        );
        let on_event = &mut self.on_event;
        let found: Option<Loaded> = checkpoint::latest(dir, spec, &modules, &self.dev, &mut |w| {
            on_event(Event::Warning(w))
        });
        let Some(l) = found else {
            let n = checkpoint::list(dir).len();
            if n > 0 && !cfg.output.overwrite {
                return Err(TrainError::NoVerifiedCheckpoint {
                    dir: dir.clone(),
                    found: n,
                });
            }
            self.warn(format!(
                "no usable checkpoint in {}; starting from step 0",
                dir.display()
            ));
            return Ok(None);
        };
        let diff = settings_diff(&l.state.settings, &self.settings);
        let diff = DataParallel::resume_diff(&l.state.settings, &self.settings, diff);
        if !diff.is_empty() && !opts.force {
            return Err(TrainError::ResumeChanged {
                checkpoint: l.dir.clone(),
                changed: diff,
            });
        }
        // Even with --force: a run cannot end before the step its adapter is already at (it
        // reported "30 steps" for step 62's adapter, issue 35).
        if l.state.run.step > cfg.train.steps {
            return Err(TrainError::ResumePastSteps {
                checkpoint: l.dir.clone(),
                step: l.state.run.step,
                steps: cfg.train.steps,
            });
        }
        Ok(Some(l))
    }

    /// Writes run.json and config.toml, opens the metrics, and reports the start.
    pub(super) fn begin(&mut self) -> Result<RunRecord, TrainError> {
        let resumed_from = (self.state.step > 0).then_some(self.state.step);
        let mut record = if self.dist.world.is_root() {
            RunRecord::begin(self.cfg, &self.files.dir, resumed_from)?
        } else {
            // Other ranks write nothing: no need to hash the model.
            RunRecord::placeholder(self.cfg)
        };
        record.set_world(self.dist.world.size, self.dist.ranks());
        if let Some(a) = record.attempts.last_mut() {
            a.gradient_checkpointing = Some(self.checkpointing.clone());
        }
        if let Some(w) = self.files.open(self.cfg, &record)? {
            self.warn(w);
        }
        (self.on_event)(Event::Start {
            examples: self.examples,
            valid_examples: self.valid_examples,
            counts: self.data.counts(),
            files: &self.data.files,
            warnings: self.data.warnings(),
            lora_params: self.adapter.num_params(),
            model_params: self.model.num_params(),
            model_bytes: self.model.resident_bytes(),
            start_step: self.state.step,
            checkpointing: &self.checkpointing,
        });
        Ok(record)
    }

    /// Records how the attempt ended in run.json and returns `result`. The record is best effort
    /// on failure: the error that stopped the run is what matters.
    pub(super) fn end(
        &self,
        mut record: RunRecord,
        result: Result<Outcome, TrainError>,
    ) -> Result<Outcome, TrainError> {
        let status = match &result {
            Ok(Outcome::Completed(_)) => "completed".to_string(),
            Ok(Outcome::Stopped { .. }) => "stopped".to_string(),
            Err(e) => format!("failed: {e}"),
        };
        record.end(&status, self.state.step);
        // The final adapter's hashes, for `rtune export` to check it against. Best effort as the
        // record is: without them export refuses the final adapter and says why.
        let mut hashed = Ok(());
        if matches!(result, Ok(Outcome::Completed(_))) && self.dist.world.is_root() {
            hashed = record.record_adapter(&self.files.dir);
        }
        let written = self.files.record(&record);
        let outcome = result?;
        hashed?;
        written?;
        Ok(outcome)
    }

    /// summary.json's numbers, at the end of the run (a collective in a distributed run: every
    /// rank's peak memory and frozen bytes are gathered).
    pub(super) fn summary(&self) -> Summary {
        let peak = memory::peak_bytes(&self.dev);
        let held = self.model.resident_bytes() as u64;
        let (mut rank_peak, mut rank_held) = (Vec::new(), Vec::new());
        if self.dist.world.is_distributed() {
            let mine = [peak.to_le_bytes(), held.to_le_bytes()].concat();
            for b in self.dist.world.all_gather("the ranks' peak memory", &mine) {
                let word = |i: usize| {
                    b.get(8 * i..8 * i + 8)
                        .map_or(0, |w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                };
                rank_peak.push(word(0));
                rank_held.push(word(1));
            }
        }
        Summary {
            rank_peak_memory_bytes: rank_peak,
            rank_model_bytes: rank_held,
            steps: self.cfg.train.steps,
            final_loss: self.state.last_loss,
            tokens_per_s: metrics::median(&self.state.speeds),
            peak_memory_bytes: peak,
            estimated_peak_bytes: self.estimated_peak_bytes,
            wall_s: self.wall_s(),
            total_tokens: self.state.total_tokens,
            lora_params: self.adapter.num_params(),
            model_bytes: self.model.resident_bytes(),
            examples: self.examples,
            epochs_started: self.recipe.position().0 + 1,
            skipped_steps: self.state.skipped_steps,
            reference_passes: self.reference_passes,
            output_dir: self.files.dir.clone(),
        }
    }
}

/// What the ranks of a data-parallel run must share: `settings` and the model files' sizes.
fn agreement(
    cfg: &RunConfig,
    settings: &std::collections::BTreeMap<String, String>,
) -> std::collections::BTreeMap<String, String> {
    let mut mine = settings.clone();
    for p in rtune_run::record::model_files(&cfg.model.path) {
        let bytes = std::fs::metadata(&p).map_or(0, |m| m.len());
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
        mine.insert(
            format!("model file {}", name.unwrap_or_default()),
            format!("{bytes} bytes"),
        );
    }
    mine
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use rtune_dist::{DataParallel, WORLD_SIZE};

    fn m(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Same world: the diff as it was. Another world, same global batch: accepted. Another global
    /// batch: one entry naming both products.
    #[test]
    fn a_new_world_size_needs_the_same_global_batch() {
        let resume_diff = DataParallel::resume_diff;
        let two = m(&[
            ("train.micro_batch_size", "2"),
            ("train.grad_accum", "1"),
            (WORLD_SIZE, "2"),
        ]);
        let one = m(&[("train.micro_batch_size", "2"), ("train.grad_accum", "2")]);
        let diff = crate::setup::settings_diff(&two, &one);
        assert_eq!(diff.len(), 2);
        assert!(resume_diff(&two, &one, diff).is_empty());
        let small = m(&[("train.micro_batch_size", "2"), ("train.grad_accum", "1")]);
        let diff = crate::setup::settings_diff(&two, &small);
        assert_eq!(
            resume_diff(&two, &small, diff),
            vec!["global batch (micro_batch_size × grad_accum × world size) was 2 × 1 × 2 = 4, is now \
                  2 × 1 × 1 = 2 (a different world size needs the same global batch)"]
        );
        let same = crate::setup::settings_diff(&one, &small);
        assert_eq!(resume_diff(&one, &small, same.clone()), same);
    }
}
