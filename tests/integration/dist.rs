//! Data-parallel training under `mpirun -np 2` (issue 16), on the CPU with the tiny Llama 3:
//! - two ranks with `grad_accum = 1` train the adapter of one process with `grad_accum = 2`, bit
//!   for bit, with the same metrics lines, and only rank 0 writes (the run directory holds what a
//!   single process's holds; run.json lists both ranks); DPO likewise (reward metrics summed
//!   over the ranks);
//! - a rank whose data file differs is refused at start, naming the rank and the setting;
//! - `kill -9` of one rank ends `mpirun` non-zero within 60 s, and `--resume` on two ranks ends
//!   with the uninterrupted run's adapter;
//! - SIGUSR1 to `mpirun` (which forwards it; it kills the job on SIGTERM) finishes the step,
//!   checkpoints and exits 0; one process resumes it only with the same global batch, and then
//!   ends with the uninterrupted run's adapter;
//! - SIGTERM to `mpirun`, given `odls_base_sigkill_timeout` seconds of grace, reaches the ranks as
//!   a stop request: rank 0 checkpoints and two ranks resume from it (`mpirun` itself exits 1);
//! - SIGTERM to one rank only stops every rank after the same step, with a checkpoint;
//! - `rtune estimate --world 2` adds the all-reduce buffers to the per-rank peak;
//! - a rank that hangs (SIGSTOP) makes the other exit through the watchdog within 60 s, naming
//!   it; rank 0's evaluation and checkpoints, announced as long phases, are not taken for a hang;
//! - a sharded base (`[distributed] shard_base`, `dist/shard.rs`);
//! - GRPO (issue 44): two ranks sample their shares of each generation batch, gathered for the
//!   advantages, and equal one process with twice the accumulation bit for bit (rollouts,
//!   adapter, metrics), resume included; with a sharded base it is refused at start.
//!
//! A separate test target (`required-features = ["mpi"]`): scripts/test.sh runs it with
//! `cargo test --features mpi --test dist`. Needs `mpirun` (Open MPI; scripts/deps/openmpi.sh).

#[allow(dead_code)]
#[path = "common.rs"]
mod common;
/// `[distributed] shard_base` (issue 37).
#[path = "dist/shard.rs"]
mod shard;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{fixture, root, stderr};

/// 4 steps (8 for the interrupted runs) over the smoke data, shuffled, with dropout: the rows of a
/// step and the dropout masks of each micro-batch must follow the global batch exactly.
fn config(dir: &Path, name: &str, grad_accum: usize, steps: usize, data: &Path) -> PathBuf {
    let out = dir.join(name);
    let text = format!(
        r#"[model]
path = "{model}"
[lora]
r = 4
alpha = 8
dropout = 0.1
[data]
train = "{data}"
max_seq_len = 64
shuffle = true
[train]
seed = 11
steps = {steps}
micro_batch_size = 2
grad_accum = {grad_accum}
lr = 5e-3
warmup_steps = 1
max_grad_norm = 0.5
[output]
dir = "{out}"
save_every = 1
keep_last = 2
"#,
        model = fixture("fixtures/tiny-llama3").display(),
        data = data.display(),
        out = out.display(),
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn smoke() -> PathBuf {
    fixture("fixtures/smoke.jsonl")
}

/// `mpirun` with what a root CI machine and 2 cores need (each rank keeps both cores, as the
/// single-process reference does); ranks inherit the environment.
fn mpirun_base() -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
    ])
    .current_dir(root())
    .env(
        "RTUNE_CACHE",
        std::env::temp_dir().join(format!("rtune-dist-cache-{}", std::process::id())),
    );
    c
}

fn mpirun(np: usize) -> Command {
    let mut c = mpirun_base();
    c.args(["-np", &np.to_string()]);
    c
}

fn train_args(cfg: &Path) -> Vec<String> {
    let bin = env!("CARGO_BIN_EXE_rtune").to_string();
    vec![
        bin,
        "train".into(),
        "--config".into(),
        cfg.display().to_string(),
    ]
}

/// `c` run to its end (at most [`LIMIT`]), its output captured.
fn run(mut c: Command) -> Output {
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run mpirun");
    wait_timed(child).0
}

fn single(cfg: &Path, extra: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rtune"));
    c.args(["train", "--config", cfg.to_str().unwrap()])
        .args(extra)
        .current_dir(root());
    run(c)
}

fn two_ranks(cfg: &Path, extra: &[&str]) -> Output {
    let mut c = mpirun(2);
    c.args(train_args(cfg)).args(extra);
    run(c)
}

/// metrics.jsonl without the wall-clock and memory fields, which no two runs share.
fn metrics(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            for k in [
                "tokens_per_s",
                "elapsed_s",
                "peak_memory_bytes",
                "estimated_peak_bytes",
            ] {
                o.remove(k);
            }
            v
        })
        .collect()
}

fn adapter(out: &Path) -> Vec<u8> {
    std::fs::read(out.join("adapter_model.safetensors")).unwrap()
}

/// Every path under `dir`, relative, TensorBoard event files by their directory only (their names
/// hold a time and a pid).
fn files(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                todo.push(p);
            } else if rel.contains("events.out.tfevents") {
                out.insert(format!(
                    "{}/<events>",
                    Path::new(&rel).parent().unwrap().display()
                ));
            } else {
                out.insert(rel);
            }
        }
    }
    out
}

/// One process with grad_accum 2 — the run every two-rank run here must equal.
fn reference(dir: &Path, steps: usize) -> PathBuf {
    let cfg = config(dir, "reference", 2, steps, &smoke());
    let o = single(&cfg, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    dir.join("reference")
}

#[test]
fn two_ranks_train_the_adapter_of_one_process_with_twice_the_accumulation() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path(), 4);
    let cfg = config(tmp.path(), "dist", 1, 4, &smoke());
    let o = two_ranks(&cfg, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        said.matches("done:").count(),
        1,
        "rank 0 alone reports: {said}"
    );
    let out = tmp.path().join("dist");
    // Bitwise: each rank holds one micro-batch's gradient, and their f32 sum is the single
    // process's g0 + g1 (addition commutes); the loss sum likewise in f64.
    assert!(adapter(&out) == adapter(&reference), "adapters differ");
    assert_eq!(metrics(&out), metrics(&reference));
    assert_eq!(metrics(&out).len(), 4);
    // Only rank 0 wrote: the directory holds exactly what a single process's holds.
    assert_eq!(files(&out), files(&reference));
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(record["world"]["size"], 2, "{record}");
    let ranks = record["world"]["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    assert_eq!(
        (ranks[1]["rank"].as_u64(), ranks[1]["device"].as_str()),
        (Some(1), Some("cpu"))
    );
    assert!(record.get("world").is_some() && reference.join("run.json").exists());
    let single_record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(reference.join("run.json")).unwrap()).unwrap();
    assert!(
        single_record.get("world").is_none(),
        "a single process records no world"
    );
}

/// `n` pre-tokenized preference pairs written to `dir/name`.
fn pairs(dir: &Path, name: &str, n: u32) -> PathBuf {
    let p = dir.join(name);
    let rows: String = (0..n)
        .map(|i| {
            format!(
                "{{\"prompt_ids\":[1,{},{}],\"chosen_ids\":[{},{},2],\"rejected_ids\":[{},2]}}\n",
                10 + i,
                20 + 3 * i,
                40 + i,
                50 + 2 * i,
                70 + i
            )
        })
        .collect();
    std::fs::write(&p, rows).unwrap();
    p
}

/// DPO on two ranks equals one process with twice the accumulation, bit for bit: each rank
/// computes the reference log-probs of every pair (the same numbers), its micro-batch's share of
/// the loss normalised by the whole step's pairs, and the reward metrics are summed over the
/// ranks before they are reported.
#[test]
fn two_ranks_train_dpo_as_one_process_with_twice_the_accumulation() {
    let tmp = tempfile::tempdir().unwrap();
    let data = pairs(tmp.path(), "pairs.jsonl", 8);
    let dpo = |name: &str, grad_accum: usize| {
        let cfg = config(tmp.path(), name, grad_accum, 4, &data);
        let text = std::fs::read_to_string(&cfg).unwrap();
        let text = text.replace("[train]\n", "[train]\nobjective = \"dpo\"\nbeta = 0.5\n");
        std::fs::write(&cfg, text).unwrap();
        cfg
    };
    let o = single(&dpo("reference", 2), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = two_ranks(&dpo("dist", 1), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (reference, out) = (tmp.path().join("reference"), tmp.path().join("dist"));
    assert!(adapter(&out) == adapter(&reference), "adapters differ");
    let m = metrics(&out);
    assert_eq!(m, metrics(&reference));
    assert_eq!(m.len(), 4);
    assert!(m[3]["rewards/accuracies"].is_f64(), "{}", m[3]);
}

/// `rtune estimate --world 2`: the per-rank peak is one process's plus the all-reduce's two f32
/// copies of the LoRA gradients (8 bytes per LoRA parameter) and MPI's runtime, and the global
/// batch is named.
#[test]
fn estimate_per_rank_adds_the_all_reduce_buffers() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), "estimate", 1, 4, &smoke());
    let json = |world: &str| -> serde_json::Value {
        let o = common::rtune(&[
            "estimate",
            "--config",
            cfg.to_str().unwrap(),
            "--json",
            "--world",
            world,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let (one, two) = (json("1"), json("2"));
    // 27,264 LoRA parameters: the tiny Llama 3 at r = 4 on every linear (the adapter file's count).
    let buffers = &two["breakdown"]["all-reduce buffers (data parallel)"];
    assert_eq!(buffers.as_u64(), Some(8 * 27_264), "{two}");
    assert!(one["breakdown"]
        .get("all-reduce buffers (data parallel)")
        .is_none());
    // And MPI's own memory, in the rank's runtime.
    let runtime = |v: &serde_json::Value| v["breakdown"]["runtime base"].as_u64().unwrap();
    assert_eq!(runtime(&two), runtime(&one) + (12 << 20), "{two}");
    assert_eq!(
        two["peak_bytes"].as_u64().unwrap(),
        one["peak_bytes"].as_u64().unwrap() + 8 * 27_264 + (12 << 20)
    );
    assert_eq!(
        (one["global_batch"].as_u64(), two["global_batch"].as_u64()),
        (Some(2), Some(4))
    );
}

/// Rank 0 runs config `a`, rank 1 config `b` (MPMD: `mpirun -np 1 A : -np 1 B`); the run must be
/// refused: its stderr.
fn refused_mpmd(a: &Path, b: &Path) -> String {
    let mut c = mpirun_base();
    c.args(["-np", "1"]).args(train_args(a)).arg(":");
    c.args(["-np", "1"]).args(train_args(b));
    let o = run(c);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    err
}

#[test]
fn a_rank_whose_data_differs_is_refused_at_start_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("other.jsonl");
    let mut text = std::fs::read_to_string(smoke()).unwrap();
    text.push_str("{\"prompt\": \"Q: Extra?\\nA:\", \"completion\": \" Yes.\"}\n");
    std::fs::write(&other, text).unwrap();
    let a = config(tmp.path(), "same", 1, 4, &smoke());
    let b = config(tmp.path(), "same-b", 1, 4, &other);
    // Rank 1's config: the same run but its own data file (same output dir).
    std::fs::write(
        &b,
        std::fs::read_to_string(&b)
            .unwrap()
            .replace("same-b", "same"),
    )
    .unwrap();
    let err = refused_mpmd(&a, &b);
    assert!(
        err.contains("rank 1 (of 2) does not run what rank 0 runs: data.train[0]"),
        "{err}"
    );
    assert!(!tmp.path().join("same").exists(), "nothing is written");
}

/// A rank that cannot read its data ends the job at once with the loader's error naming the
/// file (the ranks' agreement, which hashes the data before loading, leaves the file to it), not
/// after the other rank's start-up allowance.
#[test]
fn a_rank_missing_its_data_ends_the_job_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let a = config(tmp.path(), "same", 1, 4, &smoke());
    let b = config(tmp.path(), "same-b", 1, 4, &tmp.path().join("nope.jsonl"));
    let text = std::fs::read_to_string(&b).unwrap();
    std::fs::write(&b, text.replace("same-b", "same")).unwrap();
    let t0 = Instant::now();
    let err = refused_mpmd(&a, &b);
    assert!(
        err.contains("nope.jsonl") && err.contains("cannot read"),
        "{err}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "{:?}: {err}",
        t0.elapsed()
    );
    assert!(!err.contains("waited"), "{err}");
}

/// The pid of rank `rank` among the processes `mpirun` (pid `launcher`) started.
fn rank_pid(launcher: u32, rank: usize) -> Option<i32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().nth(1));
        if ppid != Some(&launcher.to_string()) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let want = format!("OMPI_COMM_WORLD_RANK={rank}");
        if env.split(|&b| b == 0).any(|v| v == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Starts the two-rank run of `cfg` and returns once `steps` lines are in metrics.jsonl.
fn spawn_until_step(cfg: &Path, out: &Path, steps: usize, env: &[(&str, &str)]) -> Child {
    let mut c = mpirun(2);
    c.args(train_args(cfg))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let child = c.spawn().unwrap();
    wait_for_steps(out, steps);
    child
}

/// Returns once `steps` lines are in `out`'s metrics.jsonl (at most 120 s).
fn wait_for_steps(out: &Path, steps: usize) {
    let t0 = Instant::now();
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |m| m.lines().count())
        < steps
    {
        assert!(t0.elapsed() < Duration::from_secs(120), "run did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a live process this test started (directly or through mpirun).
    assert_eq!(unsafe { libc_kill(pid, sig) }, 0);
}

/// The longest a run of these tests may take: past it the job is ended (SIGTERM to mpirun,
/// which ends its ranks; SIGKILL 10 s later) and the test fails, instead of CI waiting on a hang
/// until its own limit.
const LIMIT: Duration = Duration::from_secs(600);

/// `child` waited for (at most [`LIMIT`]), and how long that took.
fn wait_timed(child: Child) -> (Output, Duration) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let t0 = Instant::now();
    let pid = child.id() as i32;
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let ended = done.clone();
    let killer = std::thread::spawn(move || {
        let waited = |d: Duration| {
            let from = Instant::now();
            while from.elapsed() < d {
                if ended.load(Ordering::SeqCst) {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            false
        };
        for (after, sig) in [(LIMIT, 15), (Duration::from_secs(10), 9)] {
            if waited(after) {
                return;
            }
            // SAFETY: kill(2) of the child this test started, not yet waited for (`ended`).
            unsafe { libc_kill(pid, sig) };
        }
    });
    let o = child.wait_with_output().unwrap();
    done.store(true, Ordering::SeqCst);
    let _ = killer.join();
    let took = t0.elapsed();
    assert!(
        took < LIMIT,
        "ran past {LIMIT:?} and was ended: {}",
        stderr(&o)
    );
    (o, took)
}

#[test]
fn kill_9_of_a_rank_ends_the_job_and_resume_on_two_ranks_is_the_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path(), 8);
    let cfg = config(tmp.path(), "killed", 1, 8, &smoke());
    let out = tmp.path().join("killed");
    let child = spawn_until_step(&cfg, &out, 3, &[]);
    let pid = rank_pid(child.id(), 1).expect("rank 1's process");
    signal(pid, 9);
    let (o, took) = wait_timed(child);
    assert!(!o.status.success(), "mpirun exits non-zero");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert!(
        stderr(&o).contains("rank 1"),
        "the dead rank is named: {}",
        stderr(&o)
    );
    assert!(!out.join("summary.json").exists());
    let o = two_ranks(&cfg, &["--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(adapter(&out) == adapter(&reference), "adapters differ");
    assert_eq!(metrics(&out), metrics(&reference));
}

#[test]
fn sigusr1_to_mpirun_checkpoints_exits_0_and_resumes_to_the_same_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path(), 8);
    let cfg = config(tmp.path(), "stopped", 1, 8, &smoke());
    let out = tmp.path().join("stopped");
    let child = spawn_until_step(&cfg, &out, 2, &[]);
    signal(child.id() as i32, libc_sigusr1());
    let (o, _) = wait_timed(child);
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(said.matches("stopped after step").count(), 1, "{said}");
    assert!(!out.join("summary.json").exists());
    // One process may continue a two-rank run only with the same global batch (2 × 1 × 2 rows):
    // grad_accum 1 is refused naming both products, grad_accum 2 continues it.
    let o = single(&cfg, &["--resume"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("global batch (micro_batch_size × grad_accum × world size) was 2 × 1 × 2 = 4, is now 2 × 1 × 1 = 2"),
        "{}",
        stderr(&o)
    );
    let o = single(&cfg, &["--resume", "--set", "train.grad_accum=2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming at step"), "{}", stderr(&o));
    assert!(adapter(&out) == adapter(&reference), "adapters differ");
    assert_eq!(metrics(&out), metrics(&reference));
}

/// A stop request that reaches one rank only (SIGTERM to rank 1, as `srun` would forward it to
/// every task) stops every rank after the same step: they agree on it through an all-reduce.
#[test]
fn sigterm_to_one_rank_stops_every_rank_after_the_same_step() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), "one-signal", 1, 200, &smoke());
    let out = tmp.path().join("one-signal");
    let child = spawn_until_step(&cfg, &out, 2, &[]);
    let pid = rank_pid(child.id(), 1).expect("rank 1's process");
    signal(pid, 15);
    let (o, took) = wait_timed(child);
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(took < Duration::from_secs(60), "took {took:?}");
    let step: usize = said
        .split("stopped after step ")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(out.join(format!("checkpoint-{step}")).is_dir(), "{said}");
    assert_eq!(metrics(&out).len(), step);
}

/// SIGTERM to `mpirun` (what a scheduler or `kill` sends the launcher): Open MPI 4.1 answers it
/// itself — SIGTERM to the ranks after `odls_base_sigkill_timeout` seconds, SIGKILL as long
/// after — and exits 1 whatever the ranks do. Given a grace period long enough for a step and a
/// checkpoint, the ranks take that SIGTERM as a stop request: rank 0 checkpoints the step they
/// agree on, and two ranks resume from it.
#[test]
fn sigterm_to_mpirun_with_a_grace_period_checkpoints_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    // Enough steps that the run cannot end in the grace period before the ranks' SIGTERM.
    let cfg = config(tmp.path(), "terminated", 1, 100_000, &smoke());
    let out = tmp.path().join("terminated");
    let grace = [("OMPI_MCA_odls_base_sigkill_timeout", "10")];
    let child = spawn_until_step(&cfg, &out, 2, &grace);
    signal(child.id() as i32, 15);
    let (o, took) = wait_timed(child);
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(
        o.status.code(),
        Some(1),
        "Open MPI 4.1's own status: {}",
        stderr(&o)
    );
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert_eq!(said.matches("stopped after step").count(), 1, "{said}");
    let before = metrics(&out);
    let step = before.len();
    assert!(out.join(format!("checkpoint-{step}")).is_dir(), "{said}");
    // The checkpoint is whole: two ranks resume from it (its steps kept as they were), and stop
    // again on SIGUSR1 a step later.
    let mut c = mpirun(2);
    c.args(train_args(&cfg))
        .arg("--resume")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    wait_for_steps(&out, step + 1);
    signal(child.id() as i32, libc_sigusr1());
    let (o, _) = wait_timed(child);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("resuming at step {step}")),
        "{}",
        stderr(&o)
    );
    assert_eq!(metrics(&out)[..step], before[..]);
}

fn libc_sigusr1() -> i32 {
    10 // Linux x86-64 and aarch64.
}

/// A rank that hangs (SIGSTOP: alive, but never reaches the next collective) ends the job within
/// 60 s under the default pace (RTUNE_DIST_TIMEOUT 30 s), the waiting rank naming it, although a
/// checkpoint is written after every step (rank 0's checkpoint is a long phase, but only for the
/// other ranks' barrier after it: rank 0's own wait keeps the ordinary deadline).
#[test]
fn a_hung_rank_ends_the_job_within_60_s_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), "hung", 1, 200, &smoke());
    let out = tmp.path().join("hung");
    let child = spawn_until_step(&cfg, &out, 2, &[]);
    let pid = rank_pid(child.id(), 1).expect("rank 1's process");
    signal(pid, 19); // SIGSTOP
    let (o, took) = wait_timed(child);
    // A stopped process outlives mpirun's SIGTERM; end it (it is already orphaned).
    // SAFETY: kill(2) of a pid this test stopped; it may already be gone (ESRCH, ignored).
    unsafe { libc_kill(pid, 9) };
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(took < Duration::from_secs(60), "took {took:?}: {err}");
    assert!(
        err.contains("rank 0: waited") && err.contains("rank 1 died or hangs"),
        "{err}"
    );
    assert!(err.contains("RTUNE_DIST_TIMEOUT = 30 s"), "{err}");
}

/// Rank 0's long phases (evaluation, a checkpoint every step) do not trip the watchdog although
/// they outlast RTUNE_DIST_TIMEOUT: every rank announces them, and the other rank waits for them
/// under RTUNE_DIST_PHASE_TIMEOUT. The test hook RTUNE_FAULT_SLOW_ROOT_PHASE_S makes rank 0 take
/// 3 s in each (a real one takes minutes) against a 2 s timeout; the ordinary waits (a step's
/// all-reduce on these tiny steps) stay far below 2 s.
#[test]
fn rank_0s_evaluation_and_checkpoints_are_not_taken_for_a_hang() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path(), "phases", 1, 4, &smoke());
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("[train]", "[train]\neval_every = 2");
    std::fs::write(&cfg, text).unwrap();
    let mut c = mpirun(2);
    c.args(train_args(&cfg))
        .env("RTUNE_DIST_TIMEOUT", "2")
        .env("RTUNE_FAULT_SLOW_ROOT_PHASE_S", "3");
    let o = run(c);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&tmp.path().join("phases")).len(), 4);
}

/// A GRPO run's config (issue 44): the tiny Llama 3, 8 prompts, groups of 2, 4 steps (each
/// generation batch trained twice, `num_iterations = 2`: old log-probs kept), β > 0 (the
/// reference pass), `scale_rewards = "batch"` (the std over the whole generation batch) and
/// `dapo`'s global token count; `extra` lines go in `[train]`.
fn grpo_config(dir: &Path, name: &str, grad_accum: usize, extra: &str) -> PathBuf {
    let data = dir.join("prompts.jsonl");
    let prompts = [
        "the cat sat on",
        "one two",
        "hello world",
        "a story about",
        "once upon a time",
        "red green blue",
        "the end of",
        "seven eight nine",
    ];
    let rows: String = (prompts.iter())
        .map(|p| serde_json::json!({ "prompt": p }).to_string() + "\n")
        .collect();
    std::fs::write(&data, rows).unwrap();
    let out = dir.join(name);
    let text = format!(
        r#"[model]
path = "{model}"
[lora]
r = 4
alpha = 8
[data]
train = "{data}"
max_seq_len = 32
shuffle = true
[train]
seed = 11
steps = 4
micro_batch_size = 4
grad_accum = {grad_accum}
lr = 2e-2
objective = "grpo"
num_generations = 2
max_completion_length = 8
temperature = 0.9
beta = 0.04
num_iterations = 2
scale_rewards = "batch"
{extra}
[output]
dir = "{out}"
save_every = 1

[[reward]]
name = "format"
kind = "regex"
pattern = "e"

[[reward]]
name = "short"
kind = "length"
target = 4
"#,
        model = fixture("fixtures/tiny-llama3").display(),
        data = data.display(),
        out = out.display(),
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn rollouts(out: &Path) -> String {
    std::fs::read_to_string(out.join("rollouts.jsonl")).unwrap()
}

/// GRPO on two ranks equals one process with twice the accumulation (the same global batch):
/// each rank samples, scores and computes the old and reference log-probs of its share of the
/// generation batch (2 of its 4 prompts, whole groups), the shares are gathered so that the
/// advantages (here over the whole batch's std) and dapo's token count are global, and each
/// rank trains its own share. Completion i of a batch draws from its own RNG stream, so the
/// completions are the same as the single process's: rollouts.jsonl (written by rank 0 alone)
/// is identical byte for byte; the micro-batches, their normalisation and the two-term
/// gradient sum are the single process's, so the adapter and metrics.jsonl (the loss's
/// metrics summed, `clip_ratio/low_min` and `high_max` taken as min and max over the ranks)
/// are equal bit for bit. Then a two-rank run killed (-9 of rank 1) after step 2 and resumed
/// on two ranks ends with the same adapter, metrics and rollouts.
#[test]
fn grpo_on_two_ranks_is_one_process_with_twice_the_accumulation() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let o = single(&grpo_config(t, "reference", 2, ""), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = two_ranks(&grpo_config(t, "dist", 1, ""), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (reference, out) = (t.join("reference"), t.join("dist"));
    let lines = rollouts(&reference);
    assert_eq!(lines.lines().count(), 2 * 8, "2 generation batches of 8");
    assert_eq!(rollouts(&out), lines, "rollouts differ");
    assert!(adapter(&out) == adapter(&reference), "adapters differ");
    let m = metrics(&out);
    assert_eq!(m, metrics(&reference));
    assert_eq!(m.len(), 4);
    for k in ["kl", "entropy", "clip_ratio/low_min", "reward_std"] {
        assert!(m[3][k].is_f64(), "{k}: {}", m[3]);
    }
    // Rank 0 alone writes: the run directory holds what the single process's holds.
    assert_eq!(files(&out), files(&reference));

    let cfg = grpo_config(t, "killed", 1, "");
    let killed = t.join("killed");
    let child = spawn_until_step(&cfg, &killed, 2, &[]);
    let pid = rank_pid(child.id(), 1).expect("rank 1's process");
    signal(pid, 9);
    let (o, _) = wait_timed(child);
    assert!(!o.status.success(), "mpirun exits non-zero");
    let o = two_ranks(&cfg, &["--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("resuming at step"), "{}", stderr(&o));
    assert!(
        adapter(&killed) == adapter(&reference),
        "resumed adapter differs"
    );
    assert_eq!(metrics(&killed), metrics(&reference));
    assert_eq!(rollouts(&killed), lines, "resumed rollouts differ");
}

/// GRPO with a sharded base (`[distributed] shard_base`) on two ranks is refused at start,
/// naming why (each rank decodes its own completions for as many steps as they take, so the
/// base's per-layer gathers would not pair up), with exit 2 and nothing written.
#[test]
fn grpo_with_a_sharded_base_on_two_ranks_is_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = grpo_config(tmp.path(), "grpo", 1, "");
    let text = std::fs::read_to_string(&cfg).unwrap() + "\n[distributed]\nshard_base = true\n";
    std::fs::write(&cfg, text).unwrap();
    let o = two_ranks(&cfg, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("objective = \"grpo\" does not run data-parallel yet")
            && err.contains("shard_base"),
        "{err}"
    );
    assert!(!tmp.path().join("grpo").exists(), "nothing is written");
}
