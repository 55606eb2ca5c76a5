//! Issue 46, the second hostile trial's data-loss cases: a symlink planted where rtune writes (the
//! run lock, metrics.jsonl cut back on resume, an atomic write's `.tmp`) is refused at start with
//! one line naming it and its target left as it was; `export --force` replaces only what an earlier
//! export wrote; `convert` and `export` never replace `$HOME` or write through a symlinked output;
//! a signal during an export removes its staging directory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::{fixture, rtune, rtune_env, stderr};

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// export.rs's 4-step run on tests/fixtures/tiny-llama (checkpoints at 2 and 4), `extra` after.
fn train(run: &Path, extra: &[&str]) -> std::process::Output {
    crate::export::train_tiny_with(run, "tests/fixtures/tiny-llama", extra)
}

/// `rtune export --run RUN --format FORMAT --out OUT --force`.
fn export_force(run: &str, format: &str, out: &Path) -> std::process::Output {
    rtune(&[
        "export",
        "--run",
        run,
        "--format",
        format,
        "--out",
        &s(out),
        "--force",
    ])
}

/// A user's file that a planted link points at.
fn victim(dir: &Path) -> PathBuf {
    let v = dir.join("victim.txt");
    std::fs::write(&v, "precious").unwrap();
    v
}

/// Exit 2 and one error line naming `name` as a link (the progress lines before it aside).
fn refused_naming(o: &std::process::Output, name: &str) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    let errors: Vec<&str> = e.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one line: {e}");
    assert!(
        errors[0].contains(name) && errors[0].contains("symbolic link"),
        "{e}"
    );
}

/// Before: the run lock truncated the link's target and wrote `pid host` into it (a directory
/// holding only the link counted as empty); `--resume` cut metrics.jsonl's target back; an atomic
/// write created `run.json.tmp`'s target; `export`, a reader, wrote the lock's target too.
#[test]
fn planted_links_in_a_run_directory_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = victim(tmp.path());
    let untouched = || assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");

    let only_link = tmp.path().join("only-link");
    std::fs::create_dir(&only_link).unwrap();
    std::os::unix::fs::symlink(&victim, only_link.join(".rtune.lock")).unwrap();
    refused_naming(&train(&only_link, &[]), ".rtune.lock");
    untouched();

    let run = tmp.path().join("run");
    let o = train(&run, &["--set", "train.steps=2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let metrics = run.join("metrics.jsonl");
    std::fs::remove_file(&metrics).unwrap();
    std::os::unix::fs::symlink(&victim, &metrics).unwrap();
    refused_naming(&train(&run, &["--resume"]), "metrics.jsonl");
    untouched();
    std::fs::remove_file(&metrics).unwrap();

    std::os::unix::fs::symlink(&victim, run.join("run.json.tmp")).unwrap();
    refused_naming(
        &train(&run, &["--set", "output.overwrite=true"]),
        "run.json.tmp",
    );
    untouched();
    std::fs::remove_file(run.join("run.json.tmp")).unwrap();

    let lock = run.join(".rtune.lock");
    let _ = std::fs::remove_file(&lock);
    std::os::unix::fs::symlink(&victim, &lock).unwrap();
    let out = tmp.path().join("peft");
    let o = rtune(&[
        "export",
        "--run",
        &s(&run),
        "--format",
        "peft",
        "--out",
        &s(&out),
    ]);
    let e = stderr(&o);
    assert_ne!(o.status.code(), Some(0), "{e}");
    assert!(
        e.contains(".rtune.lock") && e.contains("symbolic link"),
        "{e}"
    );
    assert!(!out.exists());
    untouched();
}

/// Before: `--force` deleted any directory whose names looked like export output (a user's model
/// directory, for `--format peft` too) and, for gguf-lora, replaced any regular file.
#[test]
fn export_force_replaces_only_what_an_export_wrote() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let o = train(&run, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r = s(&run);
    let model = tmp.path().join("my-model");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture("fixtures/tiny-llama").join(f), model.join(f)).unwrap();
    }
    for format in ["peft", "merged"] {
        let o = export_force(&r, format, &model);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{format}: {e}");
        assert!(e.contains("no .rtune-export marker"), "{e}");
    }
    assert_eq!(
        std::fs::read_dir(&model).unwrap().count(),
        3,
        "the model is whole"
    );
    let notes = tmp.path().join("notes.gguf");
    std::fs::write(&notes, "my notes").unwrap();
    let o = export_force(&r, "gguf-lora", &notes);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("no GGUF magic"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "my notes");
    // An export of its own is replaced, as before; one a user added to is not.
    let out = tmp.path().join("merged");
    for _ in 0..2 {
        let o = export_force(&r, "merged", &out);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    std::fs::write(out.join("README.md"), "my notes").unwrap();
    let o = export_force(&r, "merged", &out);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("README.md"), "{}", stderr(&o));
    assert!(out.join("README.md").exists());
}

/// Before: `convert` and `export --force` replaced an empty `$HOME` (as `train` refused it), and a
/// conversion into a symlink to an empty directory ran whole, then exited 1.
#[test]
fn home_and_linked_outputs_are_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let gguf = tmp.path().join("tiny.gguf");
    rtune_gguf::write_llama_gguf(
        &fixture("fixtures/tiny-llama"),
        &gguf,
        candle_core::quantized::GgmlDType::F32,
    )
    .unwrap();
    let env = [("HOME", home.to_str().unwrap())];
    let o = rtune_env(&["convert", "gguf", &s(&gguf), &s(&home)], &env);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("home directory"), "{}", stderr(&o));
    assert!(home.is_dir());

    let run = tmp.path().join("run");
    let o = train(&run, &["--set", "train.steps=2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = rtune_env(
        &[
            "export",
            "--run",
            &s(&run),
            "--format",
            "peft",
            "--out",
            &s(&home),
            "--force",
        ],
        &env,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("home directory"), "{}", stderr(&o));
    assert!(home.is_dir());

    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&empty, &link).unwrap();
    // Refused before the input is read: a missing input would be named otherwise.
    let o = rtune(&[
        "convert",
        "gguf",
        &s(&tmp.path().join("absent.gguf")),
        &s(&link),
    ]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("symbolic link") && e.contains(&s(&link)), "{e}");
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Before: SIGINT or SIGTERM during an export left `.NAME.tmp-PID/` that nothing removed.
#[test]
fn a_signal_during_an_export_removes_its_staging_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let o = train(&run, &["--set", "train.steps=2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = tmp.path().join("merged");
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_rtune"))
            .args([
                "export",
                "--run",
                &s(&run),
                "--format",
                "merged",
                "--out",
                &s(&out),
            ])
            .current_dir(crate::common::root())
            .env("RTUNE_FAULT_STALL_EXPORT_MS", "20000")
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let staging = tmp.path().join(format!(".merged.tmp-{}", child.id()));
        let t0 = Instant::now();
        while !staging.join(".rtune-export").exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no staging directory"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: signals a child process this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
        let status = child.wait().unwrap();
        // Ended by the signal, as without rtune's clean-up (a shell sees 128 + the signal).
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(sig)
        );
        assert!(t0.elapsed() < Duration::from_secs(15), "stopped at once");
        assert!(!staging.exists(), "staging directory left behind");
        assert!(!out.exists());
    }
}
