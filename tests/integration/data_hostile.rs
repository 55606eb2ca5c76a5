//! Issue 46's data loader cases: a data file that is a FIFO or `/dev/zero` is refused at once by
//! every command that reads data; the preference loader streams its file (a huge file or one
//! huge row costs megabytes) and applies `[data]`'s row settings; absurd weights are refused
//! before rows are copied; a pre-tokenized row far over `max_seq_len` costs its text, not a parse
//! tree 19 times its size.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{fixture, rtune, stderr};

/// Runs `rtune args` (in the repository root, a private cache) and kills it after `limit`:
/// `None` when it had to be killed (a hang, or a read without end).
fn rtune_within(args: &[&str], cache: &Path, limit: Duration) -> Option<Output> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rtune"))
        .args(args)
        .env("RTUNE_CACHE", cache)
        .current_dir(crate::common::root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            child.kill().unwrap();
            child.wait().unwrap();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(child.wait_with_output().unwrap())
}

/// A config on the tiny Llama 3 whose `[data]` is `data` (TOML lines) and `[train]` is `train`.
fn config(dir: &Path, data: &str, train: &str) -> PathBuf {
    let text = format!(
        "[model]\npath = \"{}\"\ndtype = \"f32\"\n[data]\n{data}\n[train]\nsteps = 2\n\
         micro_batch_size = 2\ndevice = \"cpu\"\n{train}\n[output]\ndir = \"{}\"\n",
        fixture("fixtures/tiny-llama3").display(),
        dir.join("out").display()
    );
    // A new file each call: a test holds several configs at once.
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let p = dir.join(format!("run-{n}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// `train = "<path>"` for a `[data]` section.
fn train_line(p: &Path) -> String {
    format!("train = \"{}\"", p.display())
}

/// A data file that is a FIFO (no writer: `open` blocked) or a symlink to `/dev/zero` (read
/// forever: 28.7 GB in 8 s) is refused at once, naming the file and what it is, by `train` (SFT
/// and DPO), `data inspect`, `data scan`, `data prepare`, `estimate --data` and `check`.
#[test]
fn data_that_is_a_fifo_or_a_device_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let fifo = t.join("fifo.jsonl");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let zero = t.join("zero.jsonl");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    for (file, what) in [(&fifo, "a FIFO"), (&zero, "a character device")] {
        for objective in ["sft", "dpo"] {
            let cfg = config(
                t,
                &train_line(file),
                &format!("objective = \"{objective}\""),
            );
            let cfg = cfg.to_str().unwrap();
            for cmd in [
                &["train", "--config", cfg][..],
                &["data", "inspect", "--config", cfg],
                &["data", "scan", "--config", cfg],
                &["data", "prepare", "--config", cfg],
                &["estimate", "--data", "--config", cfg],
                &["check", "--config", cfg],
            ] {
                let o = rtune_within(cmd, &t.join("cache"), Duration::from_secs(60))
                    .unwrap_or_else(|| panic!("{cmd:?} on {what}: still running after 60 s"));
                let all = String::from_utf8_lossy(&o.stdout).into_owned() + &stderr(&o);
                // `check` reports its failed checks and exits 1; the others exit 2 with one line.
                let want = if cmd[0] == "check" { 1 } else { 2 };
                assert_eq!(o.status.code(), Some(want), "{cmd:?} on {what}: {all}");
                assert!(
                    all.contains(&format!("{}: cannot read data: is {what}", file.display())),
                    "{cmd:?} on {what}: {all}"
                );
                assert!(!all.contains("panicked"), "{cmd:?}: {all}");
            }
        }
    }
}

/// A config for `objective` on `data` (a file) with `extra` `[data]` lines, its path as a string.
fn pref_config(t: &Path, data: &Path, extra: &str, objective: &str) -> String {
    let cfg = config(
        t,
        &format!("{}\nmax_seq_len = 8\n{extra}", train_line(data)),
        &format!("objective = \"{objective}\""),
    );
    cfg.to_str().unwrap().to_string()
}

/// The preference loader read its whole file into memory (a 7 GiB file aborted with "memory
/// allocation failed"; one 2 GiB line took 2.1 GB): it streams the file a line at a time, a row
/// over `max_row_bytes` dropped unread. A 256 MiB sparse file (one line of NULs) as the training
/// data, as `valid` and through `estimate --data` costs tens of MB (measured below 30 MB; before:
/// over 256 MB), and the run says why no pair is left.
#[test]
fn preference_data_is_streamed_under_max_row_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let big = t.join("big.jsonl");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let good = t.join("good.jsonl");
    std::fs::write(
        &good,
        "{\"prompt_ids\":[1,2],\"chosen_ids\":[3,4],\"rejected_ids\":[5]}\n",
    )
    .unwrap();
    let as_train = pref_config(t, &big, "", "dpo");
    let as_valid = pref_config(t, &good, &format!("valid = \"{}\"", big.display()), "dpo");
    for (cfg, cmd) in [
        (&as_train, &["data", "inspect", "--config"][..]),
        (&as_train, &["estimate", "--data", "--config"]),
        (&as_valid, &["data", "inspect", "--config"]),
    ] {
        let mut args = cmd.to_vec();
        args.push(cfg);
        let (code, peak) = crate::hardening::peak_rss(&args, &t.join("cache"));
        eprintln!("{cmd:?}: exit {code}, peak {peak} KiB");
        assert!(peak < 128 * 1024, "{cmd:?}: peak {peak} KiB");
        if cfg == &as_train {
            assert_eq!(code, 2, "{cmd:?}");
        }
    }
    let o = rtune(&["data", "inspect", "--config", &as_train]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("no preference pair left for training of 1 rows read: 0 dropped at max_seq_len, 0 without a token to train on, 1 over max_row_bytes"),
        "{}",
        stderr(&o)
    );
    let o = rtune(&["data", "inspect", "--config", &as_valid]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("1 of 1 rows were longer than [data] max_row_bytes and dropped unread"),
        "{said}"
    );
}

/// `[data]`'s row settings were ignored for preference runs: `truncation = "drop"`, `on_bad_row
/// = "skip"` and `max_row_bytes` are now applied to pairs (counted and warned about), `format`
/// and `train_on` refused naming the key; a UTF-8 BOM (refused as "not valid JSON") is accepted
/// as SFT accepts it; a pair with no token to train on (a one-token completion after an empty
/// prompt: ORPO's NLL term divided by zero) is dropped and counted; `data prepare` checks pairs
/// instead of failing with "missing `completion`".
#[test]
fn preference_rows_follow_the_data_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = t.join("pairs.jsonl");
    let rows = [
        "\u{feff}{\"prompt_ids\":[1,2],\"chosen_ids\":[3,4],\"rejected_ids\":[5]}",
        // 2 + 7 tokens: over max_seq_len 8.
        "{\"prompt_ids\":[1,2],\"chosen_ids\":[3,4,5,6,7,8,9],\"rejected_ids\":[5]}",
        "{\"prompt_ids\":[1,2],\"chosen_ids\":[3,4],",
        "{\"prompt_ids\":[],\"chosen_ids\":[3],\"rejected_ids\":[5,6]}",
        &format!(
            "{{\"prompt_ids\":[1],\"chosen_ids\":[3],\"rejected_ids\":[5],\"pad\":\"{}\"}}",
            "x".repeat(600)
        ),
        "{\"prompt_ids\":[1,2,3],\"chosen_ids\":[4],\"rejected_ids\":[5,6]}",
    ];
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let settings = "truncation = \"drop\"\non_bad_row = \"skip\"\nmax_row_bytes = 512";
    let cfg = pref_config(t, &data, settings, "orpo");
    let o = rtune(&["data", "inspect", "--config", &cfg]);
    let said = String::from_utf8_lossy(&o.stdout).into_owned() + &stderr(&o);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("sequences of 2 training pairs"), "{said}");
    for counted in [
        "1 of 6 pairs had completions cut (0) or were dropped (1",
        "1 of 6 pairs dropped with no token to train on",
        "1 of 6 rows were longer than [data] max_row_bytes",
        "1 malformed row(s) skipped (on_bad_row = \"skip\")",
        "pairs.jsonl:3: not valid JSON",
    ] {
        assert!(said.contains(counted), "{counted}: {said}");
    }
    // Each setting on its own: the defaults cut the long pair and stop at the bad row.
    let cfg = pref_config(t, &data, "", "orpo");
    let o = rtune(&["data", "inspect", "--config", &cfg]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("pairs.jsonl:3: not valid JSON"),
        "{}",
        stderr(&o)
    );
    // `data prepare` reads the pairs as a run does.
    let cfg = pref_config(t, &data, settings, "dpo");
    let o = rtune(&["data", "prepare", "--config", &cfg]);
    let said = String::from_utf8_lossy(&o.stdout).into_owned() + &stderr(&o);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("6 rows, 2 pairs"), "{said}");
    assert!(said.contains("checked, not cached"), "{said}");
    // SFT's row settings are refused naming the key.
    for (extra, key) in [
        ("format = \"tokens\"", "data.format"),
        ("train_on = \"all\"", "data.train_on"),
    ] {
        let cfg = pref_config(t, &data, extra, "dpo");
        let o = rtune(&["data", "inspect", "--config", &cfg]);
        assert_eq!(o.status.code(), Some(2), "{extra}: {}", stderr(&o));
        assert!(stderr(&o).contains(key), "{extra}: {}", stderr(&o));
    }
}

/// `[data] train` weight 1e7 copied rows until the allocator aborted (SFT, DPO and `estimate
/// --data`): refused at once, exit 2, one line naming the file, the key and the figures.
#[test]
fn absurd_weights_are_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let sft = fixture("fixtures/smoke.jsonl");
    let pairs = t.join("pairs.jsonl");
    std::fs::write(
        &pairs,
        "{\"prompt_ids\":[1,2],\"chosen_ids\":[3,4],\"rejected_ids\":[5]}\n".repeat(4),
    )
    .unwrap();
    for (data, objective) in [(&sft, "sft"), (&pairs, "dpo")] {
        let line = format!(
            "train = [{{ path = \"{}\", weight = 1e7 }}]\nmax_seq_len = 64",
            data.display()
        );
        let cfg = config(t, &line, &format!("objective = \"{objective}\""));
        let cfg = cfg.to_str().unwrap();
        for cmd in [
            &["train", "--config", cfg][..],
            &["estimate", "--data", "--config", cfg],
        ] {
            let o = rtune_within(cmd, &t.join("cache"), Duration::from_secs(60))
                .unwrap_or_else(|| panic!("{objective} {cmd:?}: still running after 60 s"));
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{objective} {cmd:?}: {e}");
            let lines: Vec<&str> = e.lines().filter(|l| l.starts_with("error:")).collect();
            assert_eq!(lines.len(), 1, "{e}");
            assert!(
                lines[0].contains(&format!(
                    "{}: [data] train weight 10000000 repeats its",
                    data.display()
                )),
                "{e}"
            );
        }
    }
}

/// A pre-tokenized row of ~40 MB (`[1,1,...]`, 20 M ids) under a raised `max_row_bytes` was
/// parsed into a `serde_json::Value` per id (a 100 MB row took 1.9 GB): its ids now stream past
/// with only `max_seq_len` + 1 kept, so `data inspect` and `train` stay within 150 MB of their
/// peak without the row (the row's text is held a few times: the line, its chunk).
#[test]
fn a_long_pretokenized_row_costs_its_text_not_a_parse_tree() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let row = |n: usize| format!("{{\"input_ids\":[{}]}}", vec!["1"; n].join(","));
    let small = t.join("small.jsonl");
    let large = t.join("large.jsonl");
    let rows: Vec<String> = (0..4).map(|_| row(20)).collect();
    std::fs::write(&small, rows.join("\n") + "\n").unwrap();
    let mut with = rows.clone();
    with.insert(2, row(20_000_000));
    std::fs::write(&large, with.join("\n") + "\n").unwrap();
    let mut fresh = 0;
    for cmd in [
        &["data", "inspect", "-n", "1", "--config"][..],
        &["train", "--config"],
    ] {
        let mut peak = |data: &Path| {
            fresh += 1;
            let d = t.join(format!("run-{fresh}"));
            std::fs::create_dir_all(&d).unwrap();
            let cfg = config(
                &d,
                &format!(
                    "{}\nmax_seq_len = 32\nmax_row_bytes = 100000000",
                    train_line(data)
                ),
                "",
            );
            let mut args = cmd.to_vec();
            args.push(cfg.to_str().unwrap());
            crate::hardening::peak_rss(&args, &d.join("cache"))
        };
        let (c0, without) = peak(&small);
        let (c1, with) = peak(&large);
        eprintln!("{cmd:?}: {without} KiB without the 40 MB row, {with} KiB with");
        assert_eq!((c0, c1), (0, 0), "{cmd:?}");
        assert!(
            with < without + 150 * 1024,
            "{cmd:?}: {with} KiB with the row vs {without} KiB without"
        );
    }
}
