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
//! A run resumed from `checkpoint-k` is bitwise identical on CPU to one never interrupted: the
//! adapter, AdamW's state and the data cursor are restored exactly, the dropout masks and shuffle
//! order are functions of (seed, step, epoch), and metrics.jsonl is cut back to its length at step k.

use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use rtune_config::RunConfig;
use rtune_data::{Batcher, Layout, MicroBatch};
use rtune_fsio::{write_atomic, Privacy};
use rtune_model::{Grads, Inputs, LoraCtx};

use crate::checkpoint::{self, TrainerState};
use crate::evaluate;
use crate::optim::{lr_factor, LoraOptimizer, LossScaler};
use crate::record::RunRecord;
use crate::setup::{base_model_name, fresh_output, prepare, settings_diff, Prepared};
use crate::{memory, TrainError};

pub use crate::setup::{device, dtype};

/// One line of metrics.jsonl.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub step: usize,
    /// Mean loss over all target tokens of this step's micro-batches, before the update.
    pub loss: f64,
    pub lr: f64,
    /// Global L2 norm of the LoRA gradients before clipping.
    pub grad_norm: f64,
    /// Non-padding input tokens in the step.
    pub tokens: usize,
    /// Tokens that carried a loss.
    pub target_tokens: usize,
    pub tokens_per_s: f64,
    /// The update was skipped: the loss or a gradient was NaN/Inf.
    pub skipped: bool,
    /// f16 only: the loss scale this step's gradients were computed with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Peak memory so far: resident set of the process on the CPU, device memory on CUDA.
    pub peak_memory_bytes: u64,
    /// What `rtune estimate` predicted for this run's peak (CPU runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_peak_bytes: Option<u64>,
    pub elapsed_s: f64,
}

/// summary.json.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: usize,
    pub final_loss: f64,
    /// Median over steps after the first (the first includes warm-up costs).
    pub tokens_per_s: f64,
    pub peak_memory_bytes: u64,
    /// `rtune estimate`'s prediction of `peak_memory_bytes` (CPU runs).
    pub estimated_peak_bytes: Option<u64>,
    pub wall_s: f64,
    pub total_tokens: usize,
    pub lora_params: usize,
    /// Bytes of the frozen weights as held (4-bit layers at their packed size).
    pub model_bytes: usize,
    pub examples: usize,
    pub epochs_started: usize,
    /// Steps whose update was skipped for a non-finite loss or gradient.
    pub skipped_steps: usize,
    pub output_dir: PathBuf,
}

/// How a call to [`train`] ended.
pub enum Outcome {
    Completed(Summary),
    /// Stopped by the caller's flag (SIGINT/SIGTERM) after a step; the checkpoint to resume from.
    Stopped {
        step: usize,
        checkpoint: PathBuf,
    },
}

/// What [`train`] reports while it runs.
pub enum Event<'a> {
    /// Everything checked; training starts (at `start_step` when resumed).
    Start {
        examples: usize,
        valid_examples: usize,
        /// Rows read, truncated, dropped and skipped, over all files.
        counts: rtune_data::cache::RowCounts,
        /// Per-file: path, examples, tokens, cache reused, tokenisation tokens/s.
        files: &'a [crate::dataset::FileReport],
        warnings: Vec<String>,
        lora_params: usize,
        model_params: usize,
        /// Bytes of the frozen weights as held (4-bit layers at their packed size).
        model_bytes: usize,
        start_step: usize,
    },
    Step(&'a StepMetrics),
    /// Validation loss and perplexity (every `eval_every` steps and at the end).
    Eval(&'a crate::evaluate::EvalMetrics),
    Checkpoint {
        step: usize,
        path: &'a std::path::Path,
    },
    Warning(String),
}

/// Caller's choices that are not in the config file.
#[derive(Default)]
pub struct RunOptions<'a> {
    /// Continue from the newest complete checkpoint (also `[output] resume = "auto"`).
    pub resume: bool,
    /// Resume even when settings changed since the checkpoint.
    pub force: bool,
    /// Set (e.g. by a signal handler) to stop after the current step with a checkpoint.
    pub stop: Option<&'a AtomicBool>,
}

/// Seed of one micro-batch's dropout masks.
fn micro_seed(seed: u64, step: usize, micro: usize) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((step as u64) << 20) ^ micro as u64
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Appends one JSON line to metrics.jsonl; returns its length (the resume offset grows by it).
fn metrics_line(
    f: &mut std::fs::File,
    path: &std::path::Path,
    v: &impl Serialize,
) -> Result<u64, TrainError> {
    let line = serde_json::to_string(v).expect("metrics serialise") + "\n";
    f.write_all(line.as_bytes())
        .map_err(|e| TrainError::Output {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    Ok(line.len() as u64)
}

/// Runs (or resumes) a whole training job as configured.
pub fn train(
    cfg: &RunConfig,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<Outcome, TrainError> {
    let started = Instant::now();
    let dev = device(cfg.device)?;
    let privacy = if cfg.private {
        Privacy::PRIVATE
    } else {
        Privacy::SHARED
    };
    let Prepared {
        mut model,
        spec,
        modules,
        mut adapter,
        mut data,
        tok,
        pad_id,
        settings,
    } = prepare(cfg, &dev)?;
    model.offload_checkpoints = cfg.offload_checkpoints;
    let dir = cfg.output_dir.clone();
    let estimated_peak_bytes = rtune_estimate::for_run(cfg, &model.cfg, &data.train, &dev);

    let resuming = (opts.resume || cfg.resume) && dir.is_dir();
    if opts.resume && !dir.is_dir() {
        on_event(Event::Warning(format!(
            "{} does not exist yet; starting from step 0",
            dir.display()
        )));
    }
    let mut resumed = None;
    if resuming {
        if dir.join("summary.json").exists() {
            return Err(TrainError::OutputDir {
                path: dir,
                message: "this run already finished (summary.json); nothing to resume".into(),
            });
        }
        let partial = checkpoint::remove_partial(&dir);
        if partial > 0 {
            on_event(Event::Warning(format!(
                "removed {partial} incomplete checkpoint(s) left by an interrupted write"
            )));
        }
        resumed = checkpoint::latest(&dir, &spec, &modules, &dev, &mut |w| {
            on_event(Event::Warning(w))
        });
        match &resumed {
            Some(l) => {
                let diff = settings_diff(&l.state.settings, &settings);
                if !diff.is_empty() && !opts.force {
                    return Err(TrainError::Resume(format!(
                        "cannot resume from {}: {}; the resumed run would not reproduce the original (--force resumes anyway)",
                        l.dir.display(),
                        diff.join("; ")
                    )));
                }
            }
            None => {
                let n = checkpoint::list(&dir).len();
                if n > 0 && !cfg.overwrite {
                    return Err(TrainError::Resume(format!(
                        "{}: none of its {n} checkpoint(s) verifies (see above); set [output] overwrite = true \
                         to start over",
                        dir.display()
                    )));
                }
                on_event(Event::Warning(format!(
                    "no usable checkpoint in {}; starting from step 0",
                    dir.display()
                )))
            }
        }
    }
    if resumed.is_none() {
        fresh_output(cfg, privacy)?;
    }

    let mut opt = LoraOptimizer::new(&adapter, cfg.betas, cfg.eps, cfg.weight_decay)?;
    let examples = data.train.len();
    let layout = if cfg.data.packing {
        Layout::Packed {
            max_seq_len: cfg.data.max_seq_len,
        }
    } else if cfg.data.group_by_length {
        Layout::GroupByLength {
            micro_batch: cfg.micro_batch_size,
        }
    } else {
        Layout::Plain
    };
    let train_examples = std::mem::take(&mut data.train);
    let mut batcher =
        Batcher::with_layout(train_examples, cfg.data.shuffle, cfg.seed, pad_id, layout);
    let (mut speeds, mut total_tokens, mut last_loss, mut wall_before, mut start_step) =
        (Vec::new(), 0, f64::NAN, 0.0, 0);
    let metrics_path = dir.join("metrics.jsonl");
    let mut metrics_bytes = 0u64;
    let (mut bad_in_a_row, mut skipped_steps) = (0usize, 0usize);
    let mut scaler = (cfg.dtype == rtune_config::DType::F16)
        .then(|| LossScaler::new(cfg.loss_scale_init, cfg.loss_scale_growth_interval));
    // Tests poison the loss of these steps (comma-separated, 1-based) to exercise the NaN path.
    let fault_nan_steps: Vec<usize> = std::env::var("RTUNE_FAULT_NAN_STEPS")
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_default();
    if let Some(l) = resumed.take() {
        adapter = l.adapter;
        model.attach(&adapter);
        opt.restore(&adapter, l.state.adamw_step, l.m, l.v)?;
        batcher.seek(l.state.epoch, l.state.cursor);
        (speeds, total_tokens, last_loss, wall_before, start_step) = (
            l.state.speeds,
            l.state.total_tokens,
            l.state.last_loss,
            l.state.wall_s,
            l.state.step,
        );
        metrics_bytes = l.state.metrics_bytes;
        (bad_in_a_row, skipped_steps) = (l.state.bad_in_a_row, l.state.skipped_steps);
        if let (Some(s), Some(scale)) = (scaler.as_mut(), l.state.loss_scale) {
            (s.scale, s.clean_steps) = (scale, l.state.loss_scale_clean_steps);
        }
        // Lines written after the checkpoint are written again, identically.
        let f = privacy.append(&metrics_path).map_err(TrainError::from)?;
        f.set_len(metrics_bytes).map_err(|e| TrainError::Output {
            path: metrics_path.clone(),
            message: e.to_string(),
        })?;
    }
    let resumed_from = (start_step > 0).then_some(start_step);
    let mut record = RunRecord::begin(cfg, &dir, resumed_from)?;
    record.write(&dir, privacy)?;
    let resolved = toml::to_string(&cfg.file).expect("config serialises");
    write_atomic(&dir.join("config.toml"), resolved.as_bytes(), privacy)
        .map_err(TrainError::from)?;
    let mut metrics = privacy.append(&metrics_path).map_err(TrainError::from)?;
    // TensorBoard scalars (a resumed run opens a new event file; TensorBoard shows the redone
    // steps from both). Best effort: a failure to write them is a warning, not a stopped run.
    let mut tb = match rtune_watch::TbWriter::create(&dir.join(rtune_watch::TB_DIR), privacy) {
        Ok(w) => Some(w),
        Err(e) => {
            on_event(Event::Warning(format!("no TensorBoard events: {e}")));
            None
        }
    };

    on_event(Event::Start {
        examples,
        valid_examples: data.valid.len(),
        counts: data.counts(),
        files: &data.files,
        warnings: data.warnings(),
        lora_params: adapter.num_params(),
        model_params: model.num_params(),
        model_bytes: model.resident_bytes(),
        start_step,
    });
    let base = base_model_name(&cfg.model_path);
    let scaling = adapter.spec.scaling();
    let mut step = start_step;
    let result = (|| -> Result<Outcome, TrainError> {
        while step < cfg.steps {
            let t0 = Instant::now();
            let micro: Vec<MicroBatch> = (0..cfg.grad_accum)
                .map(|_| batcher.next_batch(cfg.micro_batch_size))
                .collect();
            let n_target: usize = micro.iter().map(MicroBatch::target_tokens).sum();
            let tokens: usize = micro.iter().map(|m| m.tokens).sum();
            let mut grads = Grads::new(adapter.pairs.len());
            let mut loss_sum = 0.0;
            let loss_scale = scaler.as_ref().map_or(1.0, |s| s.scale);
            for (k, mb) in micro.into_iter().enumerate() {
                let lc = LoraCtx {
                    adapter: &adapter,
                    scaling,
                    dropout: cfg.dropout,
                    seed: micro_seed(cfg.seed, step, k),
                };
                let inputs = Inputs {
                    ids: mb.input_ids,
                    positions: mb.positions,
                    b: mb.b,
                    t: mb.t,
                    segments: mb.segments,
                };
                // Normalised by the whole step's target tokens: accumulation equals one big batch.
                loss_sum += model.forward_backward(
                    &inputs,
                    &mb.targets,
                    &lc,
                    loss_scale / n_target as f64,
                    cfg.gradient_checkpointing,
                    &mut grads,
                )?;
            }
            let loss = loss_sum / n_target as f64;
            let lr = cfg.lr * lr_factor(cfg.schedule, step, cfg.steps, cfg.warmup_steps);
            let loss = if fault_nan_steps.contains(&(step + 1)) {
                f64::NAN
            } else {
                loss
            };
            let done = opt.step(
                &mut adapter,
                &grads,
                lr,
                cfg.max_grad_norm,
                loss,
                1.0 / loss_scale,
            )?;
            let grad_norm = done.grad_norm;
            let overflow = !done.applied && loss.is_finite() && scaler.is_some();
            if let Some(s) = scaler.as_mut() {
                s.update(overflow);
            }
            if done.applied {
                bad_in_a_row = 0;
            } else if overflow {
                // f16 gradients overflowed at this scale: skip and retry smaller, as GradScaler.
                skipped_steps += 1;
                on_event(Event::Warning(format!(
                    "step {}: gradients overflow f16 at loss scale {loss_scale}; update skipped, scale now {}",
                    step + 1,
                    loss_scale / 2.0
                )));
                if loss_scale < 1e-6 {
                    return Err(TrainError::NonFinite {
                        step: step + 1,
                        loss,
                        grad_norm,
                        in_a_row: bad_in_a_row + 1,
                    });
                }
            } else {
                bad_in_a_row += 1;
                skipped_steps += 1;
                if bad_in_a_row > cfg.max_bad_steps {
                    return Err(TrainError::NonFinite {
                        step: step + 1,
                        loss,
                        grad_norm,
                        in_a_row: bad_in_a_row,
                    });
                }
                on_event(Event::Warning(format!(
                    "step {}: loss {loss} / gradient norm {grad_norm} not finite; update skipped ({bad_in_a_row} in a row, \
                     the run stops after {})",
                    step + 1,
                    cfg.max_bad_steps
                )));
            }
            step += 1;
            let secs = t0.elapsed().as_secs_f64();
            let m = StepMetrics {
                step,
                loss,
                lr,
                grad_norm,
                tokens,
                target_tokens: n_target,
                tokens_per_s: tokens as f64 / secs.max(1e-9),
                skipped: !done.applied,
                loss_scale: scaler.is_some().then_some(loss_scale),
                peak_memory_bytes: memory::peak_bytes(&dev),
                estimated_peak_bytes,
                elapsed_s: wall_before + started.elapsed().as_secs_f64(),
            };
            if step > 1 || cfg.steps == 1 {
                speeds.push(m.tokens_per_s);
            }
            total_tokens += tokens;
            last_loss = loss;
            metrics_bytes += metrics_line(&mut metrics, &metrics_path, &m)?;
            on_event(Event::Step(&m));
            if let Some(w) = tb.as_mut() {
                let scalars = [
                    ("train/loss", m.loss),
                    ("train/lr", m.lr),
                    ("train/grad_norm", m.grad_norm),
                    ("train/tokens_per_s", m.tokens_per_s),
                    ("train/peak_memory_mb", m.peak_memory_bytes as f64 / 1e6),
                ];
                if let Err(e) = w.scalars(step as u64, &scalars) {
                    on_event(Event::Warning(format!(
                        "TensorBoard events: {e}; no more written"
                    )));
                    tb = None;
                }
            }

            let eval_now = (cfg.eval_every > 0 && step % cfg.eval_every == 0) || step == cfg.steps;
            if eval_now {
                let lc = LoraCtx {
                    adapter: &adapter,
                    scaling,
                    dropout: 0.0,
                    seed: 0,
                };
                let ev = evaluate::validation(
                    step,
                    &model,
                    &lc,
                    &data.valid,
                    cfg.micro_batch_size,
                    pad_id,
                )?;
                if let Some(ev) = ev {
                    metrics_bytes += metrics_line(&mut metrics, &metrics_path, &ev)?;
                    on_event(Event::Eval(&ev));
                    if let Some(w) = tb.as_mut() {
                        let vals = [("valid/loss", ev.valid_loss), ("valid/ppl", ev.valid_ppl)];
                        if let Err(e) = w.scalars(step as u64, &vals) {
                            on_event(Event::Warning(format!("TensorBoard events: {e}")));
                        }
                    }
                }
                if let (Some(tok), false) = (&tok, cfg.eval_prompts.is_empty()) {
                    let samples = evaluate::samples(
                        step,
                        &model,
                        &lc,
                        tok,
                        &cfg.eval_prompts,
                        cfg.eval_max_new_tokens,
                    )?;
                    let mut f = privacy
                        .append(&dir.join("samples.jsonl"))
                        .map_err(TrainError::from)?;
                    for s in samples {
                        let line = serde_json::to_string(&s).expect("sample serialises") + "\n";
                        f.write_all(line.as_bytes())
                            .map_err(|e| TrainError::Output {
                                path: dir.join("samples.jsonl"),
                                message: e.to_string(),
                            })?;
                    }
                }
            }

            let stop = opts.stop.is_some_and(|s| s.load(Ordering::SeqCst));
            let periodic = cfg.save_every > 0 && step % cfg.save_every == 0;
            if periodic || stop || step == cfg.steps {
                metrics.sync_all().map_err(|e| TrainError::Output {
                    path: metrics_path.clone(),
                    message: e.to_string(),
                })?;
                if let Some(w) = tb.as_mut() {
                    if let Err(e) = w.flush() {
                        on_event(Event::Warning(format!("TensorBoard events: {e}")));
                    }
                }
                let (epoch, cursor) = batcher.position();
                let state = TrainerState {
                    format: checkpoint::FORMAT.into(),
                    step,
                    adamw_step: opt.state().0,
                    epoch,
                    cursor,
                    seed: cfg.seed,
                    next_lr: cfg.lr * lr_factor(cfg.schedule, step, cfg.steps, cfg.warmup_steps),
                    loss_scale: scaler.as_ref().map(|s| s.scale),
                    loss_scale_clean_steps: scaler.as_ref().map_or(0, |s| s.clean_steps),
                    metrics_bytes,
                    speeds: speeds.clone(),
                    total_tokens,
                    wall_s: wall_before + started.elapsed().as_secs_f64(),
                    last_loss,
                    bad_in_a_row,
                    skipped_steps,
                    settings: settings.clone(),
                };
                match checkpoint::save(&dir, &state, &adapter, &opt, &base, privacy, cfg.keep_last)
                {
                    Ok(path) => on_event(Event::Checkpoint { step, path: &path }),
                    Err(e) if cfg.continue_on_save_error && !stop && step < cfg.steps => {
                        on_event(Event::Warning(format!(
                            "checkpoint at step {step} not written: {e}; continuing"
                        )))
                    }
                    Err(e) => return Err(e),
                }
                if stop && step < cfg.steps {
                    let checkpoint = dir.join(format!("checkpoint-{step}"));
                    return Ok(Outcome::Stopped { step, checkpoint });
                }
            }
        }
        adapter.save_peft(&dir, &base, privacy)?;
        if let Some(w) = tb.as_mut() {
            if let Err(e) = w.flush() {
                on_event(Event::Warning(format!("TensorBoard events: {e}")));
            }
        }
        if let Err(e) = rtune_watch::plot_run(&dir, privacy) {
            on_event(Event::Warning(format!("no loss plot: {e}")));
        }
        let summary = Summary {
            steps: cfg.steps,
            final_loss: last_loss,
            tokens_per_s: median(&speeds),
            peak_memory_bytes: memory::peak_bytes(&dev),
            estimated_peak_bytes,
            wall_s: wall_before + started.elapsed().as_secs_f64(),
            total_tokens,
            lora_params: adapter.num_params(),
            model_bytes: model.resident_bytes(),
            examples,
            epochs_started: batcher.position().0 + 1,
            skipped_steps,
            output_dir: dir.clone(),
        };
        let text = serde_json::to_string_pretty(&summary).expect("summary serialises");
        write_atomic(&dir.join("summary.json"), text.as_bytes(), privacy)
            .map_err(TrainError::from)?;
        Ok(Outcome::Completed(summary))
    })();
    let status = match &result {
        Ok(Outcome::Completed(_)) => "completed".to_string(),
        Ok(Outcome::Stopped { .. }) => "stopped".to_string(),
        Err(e) => format!("failed: {e}"),
    };
    record.end(&status, step);
    // The record is best effort on failure: the error that stopped the run is what matters.
    let written = record.write(&dir, privacy);
    let outcome = result?;
    written?;
    Ok(outcome)
}
