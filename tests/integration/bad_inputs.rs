//! Runs the whole bad-input corpus in `tests/bad_inputs/` (see its README).

use std::process::Command;

use crate::common::fixture;

#[test]
fn every_bad_input_gives_one_line_and_exit_2() {
    let corpus = fixture("bad_inputs");
    let mut cases: Vec<_> = std::fs::read_dir(&corpus)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    cases.sort();
    assert!(cases.len() >= 25, "corpus has {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let out_dir = case.join("runs");
        // A pickle checkpoint is never committed (not even a fake one): the case makes its own.
        let pickle = case.join("model/pytorch_model.bin");
        if name == "model-pickle-only" {
            std::fs::write(&pickle, b"PK\x03\x04 not a real checkpoint").unwrap();
        }
        let o = Command::new(env!("CARGO_BIN_EXE_rtune"))
            .args([
                "train",
                "--config",
                "config.toml",
                "--set",
                "output.dir=runs",
            ])
            .current_dir(case)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
        let expect = std::fs::read_to_string(case.join("expect")).unwrap();
        let missing: Vec<&str> = expect
            .lines()
            .filter(|n| !lines.first().is_some_and(|l| l.contains(n)))
            .collect();
        let ok = o.status.code() == Some(2)
            && lines.len() == 1
            && missing.is_empty()
            && !err.contains("panicked")
            && !out_dir.exists();
        if !ok {
            failures.push(format!(
                "{name}: exit {:?}, missing {missing:?}, stderr:\n{err}",
                o.status.code()
            ));
        }
        let _ = std::fs::remove_dir_all(&out_dir);
        if name == "model-pickle-only" {
            let _ = std::fs::remove_file(&pickle);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
