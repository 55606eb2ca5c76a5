//! `rtune check`: every pre-flight check runs on the smoke config, and a failing one makes the
//! command exit 1.

use crate::common::{rtune, stderr};

const CHECKS: [&str; 7] = [
    "runtime and device",
    "data and loss masks",
    "forward + backward",
    "free disk",
    "overfit 4 samples",
    "sustained throughput",
    "checkpoint, resume, generate",
];

#[test]
fn smoke_config_passes_the_deterministic_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let never = tmp.path().join("never");
    let o = rtune(&[
        "check",
        "--config",
        "configs/smoke.toml",
        "--set",
        &format!("output.dir={}", never.display()),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    for name in CHECKS {
        assert!(out.contains(name), "{name} missing:\n{out}");
    }
    // The dtype as resolved (the smoke config says f32).
    assert!(out.contains("; dtype: f32"), "{out}");
    // Throughput depends on the machine's load; the others must pass.
    for line in out.lines().filter(|l| l.starts_with("FAIL")) {
        assert!(
            line.contains("sustained throughput"),
            "{line}\n{}",
            stderr(&o)
        );
    }
    assert!(
        out.contains("adapter identical to the uninterrupted run's"),
        "{out}"
    );
    // Scratch runs only: the configured output directory is never written.
    assert!(!never.exists());
}

#[test]
fn a_failing_check_exits_1() {
    // A learning rate too small to move the loss in 30 steps: the overfit check must fail.
    let o = rtune(&[
        "check",
        "--config",
        "configs/smoke.toml",
        "--set",
        "train.lr=1e-9",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}\n{}", stderr(&o));
    let line = out
        .lines()
        .find(|l| l.contains("overfit 4 samples"))
        .unwrap();
    assert!(line.starts_with("FAIL"), "{line}");
    assert!(stderr(&o).contains("overfit 4 samples"), "{}", stderr(&o));
}
