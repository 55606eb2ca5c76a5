//! What an adversarial user tried (issue 19): two runs on one directory, a filesystem too small for
//! the run, a model index that points outside the model directory, a rank above a layer's size,
//! a Windows-saved data file. Each is refused at start with exit 2 and the reason, or accepted.
//! Issue 35's write rules: `/`, the home directory and a directory that is not an rtune run are
//! refused before anything is written; only what rtune wrote is replaced.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::{fixture, rtune_env, stderr};
use crate::resume::{config, spawn_until_step, train};

/// The second `rtune train` on a directory a live run holds is refused at once (exit 2, the
/// holder's pid named) and the first finishes untouched; after `kill -9` of a holder, `--resume`
/// takes the directory at once (the kernel released the lock with the process).
#[test]
fn one_process_per_run_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let cfg = config(tmp.path(), &out, "");
    let mut first = spawn_until_step(&cfg, &out, 2);
    let t0 = Instant::now();
    let second = train(&cfg, &["--set", "output.overwrite=true"]);
    assert_eq!(second.status.code(), Some(2), "{}", stderr(&second));
    let e = stderr(&second);
    assert!(
        e.contains(&format!(
            "in use by another rtune process (pid {}",
            first.id()
        )),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(20), "refused at once");
    let status = first.wait().unwrap();
    assert!(status.success());
    assert!(out.join("summary.json").exists(), "the first run finished");
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(
        lines.lines().count(),
        30,
        "the first run's metrics are whole"
    );

    // kill -9 mid-run, then an immediate --resume takes the lock.
    let out2 = tmp.path().join("killed");
    let cfg2 = config(tmp.path(), &out2, "");
    let mut victim = spawn_until_step(&cfg2, &out2, 9);
    victim.kill().unwrap();
    victim.wait().unwrap();
    let o = train(&cfg2, &["--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out2.join("summary.json").exists());
}

/// A filesystem that cannot hold the run's checkpoints, adapter and logs: refused before the
/// output directory exists, with the figures; `[output] check_disk = false` lets it start.
#[test]
fn too_little_disk_is_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let cfg = config(tmp.path(), &out, "");
    let free = [("RTUNE_FAULT_FREE_BYTES", "250000")];
    let args = ["train", "--config", cfg.to_str().unwrap()];
    let o = rtune_env(&args, &free);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("not enough free disk"), "{e}");
    assert!(
        e.contains("checkpoint(s) ×") && e.contains("0.2 MB free"),
        "{e}"
    );
    assert!(!out.exists(), "nothing written");
    let mut args = args.to_vec();
    args.extend(["--set", "output.check_disk=false", "--set", "train.steps=3"]);
    let o = rtune_env(&args, &free);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Copies the tiny Llama model into `dir` as two shards named by an index whose `weight_map` is
/// rewritten by `entry` (the name given to the second shard).
fn sharded_model(dir: &Path, entry: &str) {
    let src = fixture("fixtures/tiny-llama3");
    std::fs::create_dir_all(dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let second = v["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|f| f.as_str())
        .max()
        .unwrap()
        .to_string();
    std::fs::write(&index, text.replace(&second, entry)).unwrap();
}

/// A model index is untrusted: shard names that leave the model directory are refused (exit 2,
/// the entry named), even when the file they point at exists and is a valid shard.
#[test]
fn index_traversal_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("fixtures/tiny-llama3");
    assert!(src.join("model.safetensors.index.json").exists());
    for (name, entry) in [
        ("rel", "../outside.safetensors".to_string()),
        (
            "abs",
            tmp.path().join("abs.safetensors").display().to_string(),
        ),
    ] {
        let model = tmp.path().join(name).join("model");
        sharded_model(&model, &entry);
        // The file the entry names exists and is a real shard.
        let shard = std::fs::read_dir(&src)
            .unwrap()
            .map(|f| f.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .max()
            .unwrap();
        let target = if entry.starts_with('/') {
            entry.clone().into()
        } else {
            model.join(&entry)
        };
        std::fs::copy(&shard, target).unwrap();
        let out = tmp.path().join(name).join("run");
        let cfg = config(tmp.path(), &out, "");
        let text = std::fs::read_to_string(&cfg)
            .unwrap()
            .replace(&src.display().to_string(), &model.display().to_string());
        std::fs::write(&cfg, text).unwrap();
        let o = train(&cfg, &[]);
        assert_eq!(o.status.code(), Some(2), "{entry}: {}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("weight_map entry") && e.contains(&entry), "{e}");
        assert!(!out.exists(), "nothing written");
    }
}

/// `r` above a targeted layer's min(in, out) trains (PEFT allows it) with one warning naming the
/// numbers; a data file saved by a Windows editor (BOM, CRLF) trains as its LF twin does.
#[test]
fn oversized_rank_warns_and_windows_data_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let data = std::fs::read_to_string(fixture("fixtures/smoke.jsonl")).unwrap();
    let windows = tmp.path().join("windows.jsonl");
    std::fs::write(&windows, format!("\u{feff}{}", data.replace('\n', "\r\n"))).unwrap();
    let out = tmp.path().join("run");
    let cfg = config(tmp.path(), &out, "");
    let o = train(
        &cfg,
        &[
            "--set",
            "lora.r=200",
            "--set",
            "train.steps=3",
            "--set",
            &format!("data.train={}", windows.display()),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert_eq!(e.matches("is larger than min(in, out)").count(), 1, "{e}");
    assert!(e.contains("r = 200 is larger than min(in, out) = "), "{e}");
}

/// Runs `rtune args` and returns its exit code and peak resident memory in KiB: the largest
/// `VmHWM` of `/proc/<pid>/status`, read every millisecond until the child exits. (Not wait4's
/// `ru_maxrss`: the child is spawned with `CLONE_VM` and exec keeps the parent's high-water mark as
/// the child's, so it reported this test process's own peak, the same for every command.) The
/// peaks measured here come mid-run; only a peak within the last millisecond before exit could be
/// missed.
pub(crate) fn peak_rss(args: &[&str], cache: &Path) -> (i32, u64) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_rtune"))
        .args(args)
        .env("RTUNE_CACHE", cache)
        .current_dir(crate::common::root())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak = 0u64;
    loop {
        let hwm = std::fs::read_to_string(&status_file).ok().and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        });
        peak = peak.max(hwm.unwrap_or(0));
        if let Some(status) = child.try_wait().unwrap() {
            return (status.code().unwrap_or(-1), peak);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// One 50 MB row (scraped data with a stray blob) costs a few MB, not gigabytes: it is dropped
/// unread by `train`, `data inspect`, `data prepare` and `data scan`, and counted as dropped.
/// Bound: within 16 MB of the same command's peak on the same data without the row (measured:
/// train +2.8 MB, inspect and prepare +7 MB; before, 9.3 GB).
/// Two smoke configs for `rtune`, one whose data holds `big` as its 4th row and one without it;
/// returns their paths.
fn configs_with_row(tmp: &Path, big: &str) -> (String, String) {
    let rows: Vec<String> = std::fs::read_to_string(fixture("fixtures/smoke.jsonl"))
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let with = tmp.join("with.jsonl");
    let without = tmp.join("without.jsonl");
    let mut lines = rows.clone();
    lines.insert(3, big.to_string());
    std::fs::write(&with, lines.join("\n") + "\n").unwrap();
    std::fs::write(&without, rows.join("\n") + "\n").unwrap();
    let base = std::fs::read_to_string(crate::common::root().join("configs/smoke.toml")).unwrap();
    let base = base
        .replace("tests/fixtures", &fixture("fixtures").display().to_string())
        .replace("steps = 150", "steps = 3")
        .replace("warmup_steps = 10", "warmup_steps = 1");
    for (name, data) in [("with", &with), ("without", &without)] {
        let text = base
            .replace(
                &fixture("fixtures/smoke.jsonl").display().to_string(),
                &data.display().to_string(),
            )
            .replace("runs/smoke", &tmp.join(name).display().to_string());
        std::fs::write(tmp.join(format!("{name}.toml")), text).unwrap();
    }
    let c = |name: &str| tmp.join(format!("{name}.toml")).display().to_string();
    (c("with"), c("without"))
}

#[test]
fn a_huge_row_costs_megabytes_not_gigabytes() {
    let tmp = tempfile::tempdir().unwrap();
    let big = format!(
        "{{\"prompt\": \"Q: {}\", \"completion\": \" x\"}}",
        "a".repeat(50_000_000)
    );
    let (with, without) = configs_with_row(tmp.path(), &big);
    let c = |name: &str| {
        if name == "with" {
            with.clone()
        } else {
            without.clone()
        }
    };
    // A fresh tokenized-data cache for every command, so none reuses another's work.
    let mut fresh = 0;
    for cmd in [
        vec!["train", "--config"],
        vec!["data", "inspect", "-n", "1", "--config"],
        vec!["data", "prepare", "--config"],
        vec!["data", "scan", "--config"],
    ] {
        let mut run = |name: &str| {
            let cfgp = c(name);
            let mut args = cmd.clone();
            args.push(&cfgp);
            fresh += 1;
            peak_rss(&args, &tmp.path().join(format!("cache-{fresh}")))
        };
        let (code0, small) = run("without");
        let (code1, large) = run("with");
        assert_eq!((code0, code1), (0, 0), "{cmd:?}");
        assert!(
            large < small + 16 * 1024,
            "{cmd:?}: {large} KiB with the 50 MB row vs {small} KiB without"
        );
    }
    // Counted apart from the rows dropped at max_seq_len, and warned about.
    let o = rtune_env(&["data", "inspect", "-n", "1", "--config", &c("with")], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &stderr(&o);
    assert!(
        text.contains("0 dropped, 0 skipped, 1 over max_row_bytes"),
        "{text}"
    );
    assert!(
        text.contains("1 of 7 rows were longer than [data] max_row_bytes and dropped unread"),
        "{text}"
    );
    assert!(!text.contains("at max_seq_len"), "{text}");
}

/// A 5 MB row under `max_row_bytes` is cut to a byte budget before tokenizing (only max_seq_len
/// tokens of it are kept): `train` and `data inspect` stay within 40 MB of their peak without the
/// row (the row itself is held a few times: the line, its chunk, the parsed JSON, the prompt;
/// measured +12 MB for train, +18 MB for inspect; tokenized whole, main at 10905b2 took 1.04 GB
/// and 42 s for either), and the row is counted as truncated.
#[test]
fn a_long_row_under_the_cap_is_cut_before_tokenizing() {
    let tmp = tempfile::tempdir().unwrap();
    let prose = "The quick brown fox jumps over the lazy dog; 12345 don't stop. ";
    let big = format!(
        "{{\"prompt\": \"Q: {}\", \"completion\": \" x\"}}",
        prose.repeat(5_000_000 / prose.len())
    );
    let (with, without) = configs_with_row(tmp.path(), &big);
    let mut fresh = 0;
    for cmd in [
        vec!["train", "--config"],
        vec!["data", "inspect", "-n", "1", "--config"],
    ] {
        let mut run = |cfg: &str| {
            let mut args = cmd.clone();
            args.push(cfg);
            fresh += 1;
            let t0 = Instant::now();
            let r = peak_rss(&args, &tmp.path().join(format!("cache-{fresh}")));
            (r, t0.elapsed())
        };
        let ((code0, small), t_small) = run(&without);
        let ((code1, large), t_large) = run(&with);
        assert_eq!((code0, code1), (0, 0), "{cmd:?}");
        eprintln!(
            "{cmd:?}: {small} KiB / {t_small:?} without the 5 MB row, {large} KiB / {t_large:?} with"
        );
        assert!(
            large < small + 40 * 1024,
            "{cmd:?}: {large} KiB with the 5 MB row vs {small} KiB without"
        );
    }
    let o = rtune_env(&["data", "inspect", "-n", "1", "--config", &with], &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &stderr(&o);
    assert!(text.contains("1 truncated"), "{text}");
}

/// `rtune export` reads a run directory under a shared lock: while a training process holds the
/// directory, export is refused at once (exit 2, the trainer's pid named, nothing written); once
/// the run has finished, the same export succeeds.
#[test]
fn export_is_refused_while_the_run_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let cfg = config(tmp.path(), &out, "");
    let mut first = spawn_until_step(&cfg, &out, 2);
    let peft = tmp.path().join("peft");
    let args = [
        "export",
        "--run",
        out.to_str().unwrap(),
        "--format",
        "peft",
        "--out",
        peft.to_str().unwrap(),
    ];
    let t0 = Instant::now();
    let o = rtune_env(&args, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&format!("in use by a training process (pid {}", first.id())),
        "{e}"
    );
    assert_eq!(e.trim().lines().count(), 1, "one line: {e}");
    assert!(t0.elapsed() < Duration::from_secs(20), "refused at once");
    assert!(!peft.exists(), "nothing written");
    assert!(first.wait().unwrap().success());
    let o = rtune_env(&args, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(peft.join("adapter_model.safetensors").exists());
}

/// A refusal found after the run directory was locked (exit 2, before step 0) leaves the
/// directory as it was found: an existing directory keeps exactly its files (no `.rtune.lock`
/// of this process's making), and a directory this run created is removed again.
#[test]
fn a_refused_start_leaves_no_lock_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let listing = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // A directory holding a finished run's summary (copied without its lock file): refused
    // unless [output] overwrite, with and without --resume.
    let out = tmp.path().join("finished");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join(".rtune-run"), "").unwrap();
    std::fs::write(out.join("summary.json"), "{}").unwrap();
    // A directory holding an unfinished run's checkpoint: a fresh start is refused.
    let ckpt = tmp.path().join("unfinished");
    std::fs::create_dir_all(ckpt.join("checkpoint-3")).unwrap();
    std::fs::write(ckpt.join(".rtune-run"), "").unwrap();
    std::fs::write(
        ckpt.join("checkpoint-3/trainer_state.json"),
        r#"{"format": "rtune-checkpoint/2"}"#,
    )
    .unwrap();
    for (dir, extra, refusal) in [
        (&out, None, "already holds a finished run"),
        (&out, Some("--resume"), "this run already finished"),
        (&ckpt, None, "holds checkpoints of an unfinished run"),
    ] {
        let before = listing(dir);
        let cfg = config(tmp.path(), dir, "");
        let o = train(&cfg, extra.as_slice());
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains(refusal), "{}", stderr(&o));
        assert_eq!(listing(dir), before, "{} left as found", dir.display());
    }
}

fn listing_modes(d: &Path) -> Vec<(String, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut v: Vec<(String, u32)> = std::fs::read_dir(d)
        .unwrap()
        .flatten()
        .map(|e| {
            let mode = e.metadata().unwrap().permissions().mode() & 0o777;
            (e.file_name().to_string_lossy().into_owned(), mode)
        })
        .collect();
    v.sort();
    v
}

fn dir_mode(d: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(d).unwrap().permissions().mode() & 0o777
}

/// Issue 35: `[output] dir = "/"` was accepted (chmod 0700, files written there); any existing
/// directory was chmodded 0700, and `overwrite = true` deleted a user's own `checkpoint-99/` in
/// it. Now `/`, `$HOME` and a non-empty directory that is not an rtune run are refused at start
/// with one line and exit 2, nothing written, no mode changed, with or without `overwrite`.
#[test]
fn output_dir_root_home_and_foreign_directories_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir_all(home.join("checkpoint-99")).unwrap();
    std::fs::write(home.join("checkpoint-99/weights.bin"), "mine").unwrap();
    std::fs::write(home.join("notes.txt"), "mine").unwrap();
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755)).unwrap();
    let user = tmp.path().join("user");
    std::fs::create_dir_all(user.join("checkpoint-99")).unwrap();
    std::fs::write(user.join("checkpoint-99/weights.bin"), "mine").unwrap();
    std::fs::set_permissions(&user, std::fs::Permissions::from_mode(0o755)).unwrap();
    let home_env = [("HOME", home.to_str().unwrap())];
    let root_mode = dir_mode(Path::new("/"));
    for (dir, refusal) in [
        (Path::new("/"), "is the root directory"),
        (home.as_path(), "is your home directory"),
        (
            user.as_path(),
            "is a non-empty directory that is not an rtune run",
        ),
    ] {
        for overwrite in ["false", "true"] {
            let before = (dir != Path::new("/")).then(|| (listing_modes(dir), dir_mode(dir)));
            let extra = format!("overwrite = {overwrite}");
            let cfg = if dir == Path::new("/") {
                let cfg = config(tmp.path(), &tmp.path().join("root"), &extra);
                let text = std::fs::read_to_string(&cfg).unwrap();
                let line = format!("dir = \"{}\"", tmp.path().join("root").display());
                std::fs::write(&cfg, text.replace(&line, "dir = \"/\"")).unwrap();
                cfg
            } else {
                config(tmp.path(), dir, &extra)
            };
            let o = rtune_env(&["train", "--config", cfg.to_str().unwrap()], &home_env);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{}: {e}", dir.display());
            let errors: Vec<&str> = e.lines().filter(|l| l.starts_with("error")).collect();
            assert_eq!(errors.len(), 1, "one line: {e}");
            assert!(errors[0].contains(refusal), "{}: {e}", dir.display());
            if let Some(before) = before {
                assert_eq!(
                    (listing_modes(dir), dir_mode(dir)),
                    before,
                    "{} untouched",
                    dir.display()
                );
            }
        }
    }
    assert_eq!(dir_mode(Path::new("/")), root_mode, "/ not chmodded");
    assert!(!Path::new("/.rtune.lock").exists() && !Path::new("/.rtune-run").exists());
    assert_eq!(
        std::fs::read(user.join("checkpoint-99/weights.bin")).unwrap(),
        b"mine"
    );
}

/// Issue 35: an empty directory that rtune did not create is taken as is (its mode unchanged) and
/// marked as a run; inside a run, `overwrite` replaces only what rtune wrote: a `checkpoint-N/`
/// of the user's is never deleted (the start is refused naming it); a run from before the marker
/// (run.json only) is still recognised.
#[test]
fn overwrite_replaces_only_what_rtune_wrote() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("empty");
    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o750)).unwrap();
    let steps = ["--set", "train.steps=4"];
    let cfg = config(tmp.path(), &out, "");
    let o = train(&cfg, &steps);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        dir_mode(&out),
        0o750,
        "an existing directory keeps its mode"
    );
    assert!(
        out.join(".rtune-run").is_file(),
        "the run marks its directory"
    );
    assert!(out.join("checkpoint-4/manifest.json").is_file());

    // A folder of the user's named like a checkpoint, inside the run: never deleted.
    let mine = out.join("checkpoint-99");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("weights.bin"), "mine").unwrap();
    let cfg = config(tmp.path(), &out, "overwrite = true");
    let o = train(&cfg, &steps);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("checkpoint-99/, which rtune did not write"),
        "{e}"
    );
    assert_eq!(std::fs::read(mine.join("weights.bin")).unwrap(), b"mine");
    assert!(
        out.join("summary.json").exists(),
        "the run is left as it was"
    );
    std::fs::remove_dir_all(&mine).unwrap();

    // A run from before the marker: recognised by its run.json, replaced with overwrite.
    std::fs::remove_file(out.join(".rtune-run")).unwrap();
    let o = train(&cfg, &steps);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(out.join(".rtune-run").is_file());
    assert_eq!(dir_mode(&out), 0o750);
}

/// A DPO config over `pairs` pre-tokenized pairs (tiny Llama, one pair a forward pass: the
/// reference pass runs `pairs` forwards before the first step), writing to `out`.
fn dpo_config(tmp: &Path, out: &Path, pairs: usize) -> std::path::PathBuf {
    let rows: String = (0..pairs)
        .map(|i| {
            let t = |k: usize| 3 + (i * 7 + k) % 500;
            let row = serde_json::json!({
                "prompt_ids": [1, t(0), t(1), t(2), t(3), t(4)],
                "chosen_ids": [t(5), t(6), 2],
                "rejected_ids": [t(7), t(8), t(9), 2],
            });
            format!("{row}\n")
        })
        .collect();
    let data = tmp.join(format!("pairs-{pairs}.jsonl"));
    std::fs::write(&data, rows).unwrap();
    let cfg = format!(
        "[model]\npath = \"{}\"\n[data]\ntrain = \"{}\"\n[train]\nobjective = \"dpo\"\nsteps = 2\n\
         micro_batch_size = 1\n[output]\ndir = \"{}\"\n",
        fixture("fixtures/tiny-llama").display(),
        data.display(),
        out.display()
    );
    let name = out
        .file_name()
        .map_or("root".into(), |n| n.to_string_lossy());
    let path = tmp.join(format!("dpo-{name}.toml"));
    std::fs::write(&path, cfg).unwrap();
    path
}

/// Issue 46: an output directory of `/`, or one another process holds, was refused only after
/// the whole reference pass (the README promises "at once"). Both are refused before it starts:
/// the pass's log line never appears.
#[test]
fn a_refused_output_dir_is_refused_before_the_reference_pass() {
    let tmp = tempfile::tempdir().unwrap();
    let held = tmp.path().join("held");
    std::fs::create_dir_all(&held).unwrap();
    // Another process holds the directory's lock (flock, as rtune's own lock).
    let mut holder = std::process::Command::new("flock")
        .arg(held.join(".rtune.lock"))
        .args(["sleep", "60"])
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !held.join(".rtune.lock").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "flock did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let root = dpo_config(tmp.path(), Path::new("/"), 50);
    let locked = dpo_config(tmp.path(), &held, 50);
    for (cfg, refusal) in [
        (root, "is the root directory"),
        (locked, "in use by another"),
    ] {
        let o = rtune_env(
            &["train", "--config", cfg.to_str().unwrap()],
            &[("RTUNE_LOG", "info")],
        );
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{e}");
        let errors: Vec<&str> = e.lines().filter(|l| l.starts_with("error")).collect();
        assert!(errors.len() == 1 && errors[0].contains(refusal), "{e}");
        assert!(
            !e.contains("reference log-probabilities of"),
            "after the pass: {e}"
        );
    }
    holder.kill().unwrap();
    holder.wait().unwrap();
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// Issue 46: the first SIGINT was ignored during the reference pass (the run went on to its
/// first step ~59 s later). It ends the pass between two forward passes: exit 130 at once, the
/// run directory left as it was found (here: not there).
#[test]
fn sigint_ends_the_reference_pass_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("interrupted");
    // 20000 forward passes: seconds to minutes, far longer than the signal takes.
    let cfg = dpo_config(tmp.path(), &out, 20_000);
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_rtune"));
    c.args(["train", "--config", cfg.to_str().unwrap()])
        .current_dir(crate::common::root())
        .env("RTUNE_CACHE", tmp.path().join("cache"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let child = c.spawn().unwrap();
    // The directory is locked just before the pass begins.
    let t0 = Instant::now();
    while !out.join(".rtune.lock").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the run never took its directory"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: a plain kill(2) of our own child.
    assert_eq!(unsafe { libc_kill(child.id() as i32, 2) }, 0);
    let sent = Instant::now();
    let o = child.wait_with_output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "exited {:?} after the signal",
        sent.elapsed()
    );
    assert_eq!(o.status.code(), Some(130), "{e}");
    let errors: Vec<&str> = e.lines().filter(|l| l.starts_with("error")).collect();
    assert!(
        errors.len() == 1 && errors[0].contains("interrupted during the reference"),
        "{e}"
    );
    assert!(!out.exists(), "left as found: {e}");
}
