//! `rtune check`: the pre-flight before a long run, on the real config, at a tiny scale. Each check
//! is one line with PASS/FAIL and the figure behind it:
//! 1. runtime and device (CPU SIMD features; CUDA availability);
//! 2. free disk in the output directory vs what checkpoints and logs will need;
//! 3. the first formatted samples with their loss masks;
//! 4. one optimizer step at the configured shape: peak memory;
//! 5. overfitting a 4-sample subset: the loss must fall;
//! 6. save a checkpoint, resume from it (identical adapter to an uninterrupted run), load the
//!    adapter and generate a reply;
//! 7. sustained throughput: the later steps are not slower than the first ones;
//! 8. under `mpirun` (every rank runs 1-7 on its own): [`all_reduce`], a sum all-reduce of a known
//!    buffer checked exactly, with its bandwidth and latency.
//!
//! Every run goes to a temporary directory; the configured output directory is never written.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rtune_config::RunConfig;
use rtune_data::inspect;
use rtune_infer::generate::GenerateOptions;
use rtune_train::{train, Event, Outcome, RunOptions, StepMetrics, TrainError};

use crate::{Check, DiagError};

/// Steps of the overfitting check, and the fraction the loss must fall by.
pub const OVERFIT_STEPS: usize = 30;
pub const OVERFIT_DROP: f64 = 0.3;
/// The later steps' median speed relative to the earlier ones': below it something degrades
/// (thermal throttling, memory growth, swapping). Loose, because shared machines are noisy.
pub const SUSTAINED_MIN: f64 = 0.5;

/// CPU features the GEMMs use (x86-64); `(present, names)`.
fn simd() -> (bool, Vec<&'static str>) {
    // The one CPU-feature detection (rtune_backend::cpu_features), as the kernels see it.
    let f = rtune_backend::cpu_features::get();
    if cfg!(target_arch = "x86_64") {
        (f.avx2 && f.fma, f.list())
    } else {
        (true, vec![std::env::consts::ARCH])
    }
}

fn runtime(cfg: &RunConfig) -> Check {
    let device = rtune_train::device(cfg.train.device);
    let (fast, names) = simd();
    let (pass, detail) = match device {
        Err(e) => (false, e.to_string()),
        Ok(candle_core::Device::Cpu) => (
            true,
            format!(
                "cpu, {} threads, SIMD: {}{}; BLAS: {}; bf16 GEMM: {}; dtype: {}",
                std::thread::available_parallelism().map_or(1, |n| n.get()),
                names.join(" "),
                if fast {
                    ""
                } else {
                    " (no AVX2/FMA: matrix products will be several times slower)"
                },
                rtune_backend::blas::loaded()
                    .unwrap_or("none (candle's gemm; install libopenblas0 for ~2x faster matmuls)"),
                rtune_backend::onednn::describe(),
                cfg.model.dtype_said()
            ),
        ),
        Ok(d) => {
            let (pass, line) = device_line(&d);
            (pass, format!("{line}; dtype: {}", cfg.model.dtype_said()))
        }
    };
    Check::new("runtime and device", pass, detail)
}

/// A device other than the CPU in words: on CUDA the card's name, compute capability and memory
/// (failing the check when the driver cannot say), else candle's name for it.
pub fn device_line(d: &candle_core::Device) -> (bool, String) {
    #[cfg(feature = "cuda")]
    if d.is_cuda() {
        return match rtune_backend::cuda::describe(d) {
            Ok(s) => (true, s),
            Err(e) => (false, e.to_string()),
        };
    }
    (true, format!("{:?}", d.location()))
}

fn disk(cfg: &RunConfig, lora_params: usize) -> Check {
    // The same figures `rtune train` refuses to start without (rtune_train::disk).
    let need = rtune_run::disk::need(cfg, lora_params);
    match rtune_run::disk::free_bytes(&cfg.output.dir) {
        Ok(free) => Check::new(
            "free disk",
            free >= need.total,
            need.describe(free, &rtune_run::disk::existing_ancestor(&cfg.output.dir)),
        ),
        Err(e) => Check::new("free disk", false, e.to_string()),
    }
}

/// The config, pointed at `out` with checkpoints, evaluation and the data cache turned off.
fn scratch(cfg: &RunConfig, out: &Path, steps: usize) -> RunConfig {
    let mut c = cfg.clone();
    c.output.dir = out.to_path_buf();
    c.train.steps = steps;
    c.train.warmup_steps = 0;
    c.output.save_every = 0;
    c.output.keep_last = 2;
    c.output.overwrite = true;
    c.output.resume = false;
    c.train.eval_every = 0;
    c.train.eval_prompts.clear();
    c.data.valid = None;
    c.data.valid_fraction = 0.0;
    c.data.cache_dir = None;
    // Scratch runs stay on this machine: no mirror, no tracking (the remote is probed apart).
    c.output.remote = None;
    c.output.mlflow = None;
    c
}

/// Runs `cfg`, collecting step metrics; `stop_at` stops after that step with a checkpoint.
fn run(
    cfg: &RunConfig,
    resume: bool,
    stop_at: Option<usize>,
) -> Result<(Outcome, Vec<StepMetrics>), TrainError> {
    let stop = AtomicBool::new(false);
    let opts = RunOptions {
        resume,
        force: false,
        stop: Some(&stop),
        world: None,
    };
    let mut steps = Vec::new();
    let outcome = train(cfg, &opts, &mut |ev| {
        if let Event::Step(m) = ev {
            if Some(m.step) == stop_at {
                stop.store(true, Ordering::SeqCst);
            }
            steps.push(m.clone());
        }
    })?;
    Ok((outcome, steps))
}

/// The first `n` non-empty lines of `src`, written to `dst`. Streamed from a regular file only
/// ([`rtune_data::open_data`]: a FIFO or `/dev/zero` was read whole, so `check` hung); lines
/// over `max_row_bytes` are passed over unread, as training drops them.
fn head(src: &Path, dst: &Path, n: usize, max_row_bytes: usize) -> Result<(), TrainError> {
    let mut reader = std::io::BufReader::new(rtune_data::open_data(src)?);
    let mut lines = Vec::new();
    for line in 1.. {
        if lines.len() == n {
            break;
        }
        let mut buf = Vec::new();
        let (read, over) =
            rtune_data::cache::read_line_capped(&mut reader, &mut buf, max_row_bytes).map_err(
                |e| rtune_data::DataError::File {
                    path: src.to_path_buf(),
                    message: format!("cannot read data: {e}"),
                },
            )?;
        if read == 0 {
            break;
        }
        let text = rtune_data::line_utf8(src, line, buf)?;
        if !over && !text.trim().is_empty() {
            lines.push(text.trim_end_matches(['\n', '\r']).to_string());
        }
    }
    std::fs::write(dst, lines.join("\n") + "\n").map_err(|e| TrainError::Output {
        path: dst.to_path_buf(),
        message: e.to_string(),
    })
}

fn adapter_bytes(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("adapter_model.safetensors")).unwrap_or_default()
}

/// A check that could not run: FAIL with the error as its detail (the other checks still run).
fn errored(name: &str, e: &dyn std::fmt::Display) -> Check {
    Check::new(name, false, format!("error: {e}"))
}

/// Runs every check, reporting each as soon as it is done. A check whose run errors (bad data, a
/// step that fails) is reported as FAIL with the error and the others still run (issue 35: the
/// first error used to end `rtune check`); only a failing runtime check stops the rest, which
/// would all fail on the same device.
pub fn run_checks(
    cfg: &RunConfig,
    tmp: &Path,
    report: &mut dyn FnMut(&Check),
) -> Result<Vec<Check>, DiagError> {
    let mut out = Vec::new();
    let mut push = |c: Check, out: &mut Vec<Check>| {
        report(&c);
        out.push(c);
    };
    push(runtime(cfg), &mut out);
    if !out[0].pass {
        return Ok(out);
    }

    // 3. Samples (printed by the caller from `inspect`); here: the counts and the first mask.
    const DATA: &str = "data and loss masks";
    let loaded = rtune_train::objective::load_for(cfg)
        .map_err(DiagError::from)
        .and_then(|(data, tok)| {
            let first = inspect::sample(&data.train[0], tok.as_ref())?;
            Ok((data, tok, first))
        });
    let data = match loaded {
        Ok((data, tok, first)) => {
            let c = data.counts();
            push(
                Check::new(
                    DATA,
                    first.trained_tokens > 0,
                    format!(
                        "{}{} examples ({} rows, {}); first sample: {} tokens, {} trained \
                         (see `rtune data inspect`)",
                        (data.own.as_ref()).map_or(String::new(), |o| format!("{}: ", o.rows())),
                        data.train.len(),
                        c.rows,
                        c.summary(),
                        first.input_ids.len(),
                        first.trained_tokens
                    ),
                ),
                &mut out,
            );
            Some((data, tok))
        }
        Err(e) => {
            push(errored(DATA, &e), &mut out);
            None
        }
    };

    // 4. One step at the configured shape.
    const STEP: &str = "forward + backward";
    let one_step = || -> Result<(Check, usize), DiagError> {
        let one = scratch(cfg, &tmp.join("one-step"), 1);
        let (done, steps) = run(&one, false, None)?;
        let peak = steps.last().map_or(0, |m| m.peak_memory_bytes);
        let cfg_path = cfg.model.path.join("config.json");
        let mc = rtune_model::HfConfig::from_file(&cfg_path)?.into_config(&cfg_path)?;
        let mut s = rtune_estimate::settings_for(cfg)?;
        if let Some((data, _)) = &data {
            rtune_estimate::fit_to_data(&mut s, &data.train, cfg.data.max_seq_len);
        }
        // The run's own estimate (checkpointing as it decided it); the CPU-side one on CUDA.
        let est = steps
            .last()
            .and_then(|m| m.estimated_peak_bytes)
            .unwrap_or_else(|| rtune_estimate::estimate(&mc, &s).peak_bytes);
        let lora_params = match &done {
            Outcome::Completed(s) => s.lora_params,
            Outcome::Stopped { .. } => 0,
        };
        let check = Check::new(
            STEP,
            steps.last().is_some_and(|m| m.loss.is_finite()),
            format!(
                "loss {:.4}, peak memory {:.1} MB (rtune estimate: {:.1} MB) at micro_batch_size {} × \
                 max_seq_len {}",
                steps.last().map_or(f64::NAN, |m| m.loss),
                peak as f64 / 1e6,
                est as f64 / 1e6,
                cfg.train.micro_batch_size,
                cfg.data.max_seq_len
            ),
        );
        Ok((check, lora_params))
    };
    let lora_params = match one_step() {
        Ok((c, n)) => {
            push(c, &mut out);
            n
        }
        Err(e) => {
            push(errored(STEP, &e), &mut out);
            0
        }
    };
    push(disk(cfg, lora_params), &mut out);

    // 5. Overfit four samples.
    const OVERFIT: &str = "overfit 4 samples";
    const SUSTAINED: &str = "sustained throughput";
    let subset = tmp.join("subset.jsonl");
    let mut o = scratch(cfg, &tmp.join("overfit"), OVERFIT_STEPS);
    o.data.train = vec![rtune_config::WeightedFile {
        path: subset.clone(),
        weight: 1.0,
    }];
    o.train.micro_batch_size = o.train.micro_batch_size.min(4);
    o.train.grad_accum = 1;
    o.train.schedule = rtune_config::Schedule::Constant;
    let overfit = head(&cfg.data.train[0].path, &subset, 4, cfg.data.max_row_bytes)
        .and_then(|()| run(&o, false, None))
        .map_err(DiagError::from);
    match overfit {
        Ok((_, steps)) => {
            let (l0, l1) = (
                steps.first().map_or(f64::NAN, |m| m.loss),
                steps.last().map_or(f64::NAN, |m| m.loss),
            );
            // The objective's own verdict (a preference loss has no fixed scale: the pairs must
            // end ranked right, and the loss lower), or the loss must fall.
            let last = steps.last().map(|m| m.recipe.clone()).unwrap_or_default();
            let check = match rtune_train::objective::overfit(cfg, l0, l1, &last) {
                None => Check::new(
                    OVERFIT,
                    l1 <= (1.0 - OVERFIT_DROP) * l0,
                    format!(
                        "loss {l0:.4} -> {l1:.4} in {OVERFIT_STEPS} steps at lr {} (must fall by {:.0}%)",
                        cfg.train.lr,
                        OVERFIT_DROP * 100.0
                    ),
                ),
                Some((ok, said)) => Check::new(
                    OVERFIT,
                    ok,
                    format!(
                        "{said}, in {OVERFIT_STEPS} steps at lr {} (every pair must end ranked \
                         right and the loss lower)",
                        cfg.train.lr
                    ),
                ),
            };
            push(check, &mut out);
            // 7. Sustained throughput over the overfit run: second half vs first half (after
            // step 1).
            push(sustained(&steps), &mut out);
        }
        Err(e) => {
            push(errored(OVERFIT, &e), &mut out);
            push(errored(SUSTAINED, &e), &mut out);
        }
    }

    // 6. Save, resume, reload, generate.
    const RESUME: &str = "checkpoint, resume, generate";
    let resume = || -> Result<Check, DiagError> {
        let Some((data, tok)) = &data else {
            return Ok(errored(
                RESUME,
                &"needs the data, which did not load (above)",
            ));
        };
        let mut whole = scratch(cfg, &tmp.join("whole"), 4);
        whole.data.train = o.data.train.clone();
        whole.train.micro_batch_size = o.train.micro_batch_size;
        let mut split = whole.clone();
        split.output.dir = tmp.join("split");
        run(&whole, false, None)?;
        let (stopped, _) = run(&split, false, Some(2))?;
        let stopped_ok = matches!(stopped, Outcome::Stopped { step: 2, .. });
        run(&split, true, None)?;
        let same = adapter_bytes(&whole.output.dir) == adapter_bytes(&split.output.dir)
            && !adapter_bytes(&split.output.dir).is_empty();
        let prompt = first_prompt(&data.train[0], tok.as_ref())?;
        let reply = rtune_infer::generate::generate(
            &cfg.model.path,
            Some(&split.output.dir),
            &prompt,
            &GenerateOptions {
                max_new_tokens: 16,
                temperature: 0.0,
                top_p: 1.0,
                seed: 0,
                dump_logits: None,
                quantize: cfg.model.quantize,
            },
        )?;
        Ok(Check::new(
            RESUME,
            stopped_ok && same,
            format!(
                "stopped at step 2 and resumed to 4: adapter {} the uninterrupted run's; reply to the first \
                 prompt: {:?}",
                if same { "identical to" } else { "DIFFERS from" },
                reply.chars().take(60).collect::<String>()
            ),
        ))
    };
    match resume() {
        Ok(c) => push(c, &mut out),
        Err(e) => push(errored(RESUME, &e), &mut out),
    }
    Ok(out)
}

/// The overfit run's later steps' median speed against its earlier steps' (after step 1).
fn sustained(steps: &[StepMetrics]) -> Check {
    let speeds: Vec<f64> = steps.iter().skip(1).map(|m| m.tokens_per_s).collect();
    let half = speeds.len() / 2;
    let med = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let (early, late) = (med(&speeds[..half]), med(&speeds[half..]));
    Check::new(
        "sustained throughput",
        late >= SUSTAINED_MIN * early,
        format!(
            "{early:.0} tokens/s in steps 2-{}, {late:.0} tokens/s in steps {}-{} (must stay ≥ {:.0}%)",
            half + 1,
            half + 2,
            speeds.len() + 1,
            SUSTAINED_MIN * 100.0
        ),
    )
}

/// The masked prefix of an example (its prompt), decoded.
fn first_prompt(
    e: &rtune_data::Example,
    tok: Option<&rtune_data::Tokenizer>,
) -> Result<String, DiagError> {
    let end = (1..e.labels.len())
        .find(|&i| e.labels[i] != rtune_data::IGNORE)
        .unwrap_or(e.labels.len());
    Ok(match tok {
        Some(t) => t.decode(&e.input_ids[..end], true)?,
        None => String::new(),
    })
}

/// A temporary directory for the check's runs.
/// Elements of the all-reduce check's buffer (16 MiB of f32, about a 7B model's rank-16 LoRA
/// gradients on q and v), and how many times each measurement repeats.
const ALL_REDUCE_LEN: usize = 4 << 20;
const ALL_REDUCE_REPS: usize = 5;
const LATENCY_REPS: usize = 200;

/// The data-parallel check: every rank fills `x[i] = (rank + 1) · (i mod 1000)` and the sum must
/// be `W(W+1)/2 · (i mod 1000)` exactly (integers below 2^24 are exact in f32, in any order of
/// addition). Reports the median time of a 16 MiB all-reduce as algorithm bandwidth (bytes / time)
/// and bus bandwidth (× 2(W−1)/W, what a ring moves per rank: NCCL-tests' convention), and the
/// latency of a one-element all-reduce. Collective: every rank calls it.
pub fn all_reduce(world: &rtune_dist::World) -> Check {
    let w = world.size;
    let fill = |x: &mut Vec<f32>| {
        x.clear();
        x.extend((0..ALL_REDUCE_LEN).map(|i| ((world.rank + 1) * (i % 1000)) as f32));
    };
    let mut x = Vec::with_capacity(ALL_REDUCE_LEN);
    let mut times = Vec::new();
    let mut exact = true;
    for _ in 0..ALL_REDUCE_REPS {
        fill(&mut x);
        let t = std::time::Instant::now();
        world.all_reduce_sum_f32("rtune check's all-reduce", &mut x);
        times.push(t.elapsed().as_secs_f64());
        let total = (w * (w + 1) / 2) as f32;
        exact &= x
            .iter()
            .enumerate()
            .all(|(i, v)| *v == total * (i % 1000) as f32);
    }
    let mut one = [1.0f64];
    let t = std::time::Instant::now();
    for _ in 0..LATENCY_REPS {
        world.all_reduce_sum_f64("rtune check's latency all-reduce", &mut one);
    }
    let latency = t.elapsed().as_secs_f64() / LATENCY_REPS as f64;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let bytes = (ALL_REDUCE_LEN * 4) as f64;
    let algbw = bytes / median / 1e9;
    let busbw = algbw * 2.0 * (w as f64 - 1.0) / w as f64;
    Check::new(
        "all-reduce across ranks",
        exact,
        format!(
            "{w} ranks over {}: {:.1} MiB sum {} in {:.2} ms (median of {ALL_REDUCE_REPS}): \
             {algbw:.2} GB/s algorithm, {busbw:.2} GB/s bus; latency {:.1} µs (8 bytes)",
            world.describe(),
            bytes / (1 << 20) as f64,
            if exact { "exact" } else { "WRONG" },
            median * 1e3,
            latency * 1e6
        ),
    )
}

/// Bytes rank r sends in the sharded-base check: unequal shares, as an odd world's shards are.
fn gather_share(rank: usize) -> usize {
    (4 << 20) + 4096 * rank + 17
}

/// The sharded-base check (`[distributed] shard_base`): every rank sends a share of its own size
/// and pattern (`byte i of rank r = (i·7 + r·31) mod 251`) and every rank must receive all of
/// them, in rank order, exactly — what each layer's gather does. Reports the median time of the
/// gather as bytes received per second. Collective: every rank calls it.
pub fn all_gather(world: &rtune_dist::World) -> Check {
    let w = world.size;
    let pattern = |r: usize, i: usize| ((i * 7 + r * 31) % 251) as u8;
    let counts: Vec<usize> = (0..w).map(gather_share).collect();
    let mine: Vec<u8> = (0..counts[world.rank])
        .map(|i| pattern(world.rank, i))
        .collect();
    let mut out = vec![0u8; counts.iter().sum()];
    let (mut times, mut exact) = (Vec::new(), true);
    for _ in 0..ALL_REDUCE_REPS {
        out.fill(0);
        let t = std::time::Instant::now();
        world.all_gather_into(
            "rtune check's sharded-base gather",
            &mine,
            &counts,
            &mut out,
        );
        times.push(t.elapsed().as_secs_f64());
        let mut at = 0;
        for (r, n) in counts.iter().enumerate() {
            exact &= out[at..at + n]
                .iter()
                .enumerate()
                .all(|(i, b)| *b == pattern(r, i));
            at += n;
        }
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let bytes = out.len() as f64;
    Check::new(
        "sharded-base gather",
        exact,
        format!(
            "{w} ranks over {}: {:.1} MiB gathered {} in {:.2} ms (median of {ALL_REDUCE_REPS}): \
             {:.2} GB/s",
            world.describe(),
            bytes / (1 << 20) as f64,
            if exact { "exact" } else { "WRONG" },
            median * 1e3,
            bytes / median / 1e9
        ),
    )
}

pub fn temp_dir() -> PathBuf {
    std::env::temp_dir().join(format!("rtune-check-{}", std::process::id()))
}
