//! What an adversarial user tried (issue 19): two runs on one directory, a filesystem too small for
//! the run, a model index that points outside the model directory, a rank above a layer's size,
//! a Windows-saved data file. Each is refused at start with exit 2 and the reason, or accepted.

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
