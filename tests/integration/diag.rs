//! The diagnostics end to end on the CPU-only build:
//! - `rtune selftest --device cpu` with one check made to fail (the `RTUNE_SELFTEST_INJECT_FAIL`
//!   test hook) prints every other check's line, writes the JSON with all checks and exits 1;
//! - `benches/gpu/run.sh --dry-run` (the device script, small shapes, this binary) runs end to end
//!   and writes `report.json` with every section.

use std::process::Command;

use crate::common::{root, rtune_env, stderr};

const INJECTED: &str = "train step bf16 + nf4-dq, checkpointing:";

#[test]
fn selftest_reports_every_check_when_one_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("selftest.json");
    let json_s = json.to_str().unwrap();
    let o = rtune_env(
        &[
            "selftest",
            "--device",
            "cpu",
            "--seed",
            "42",
            "--json-out",
            json_s,
        ],
        &[("RTUNE_SELFTEST_INJECT_FAIL", INJECTED)],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(1), "{out}\n{}", stderr(&o));
    assert!(out.contains("seed 42"), "the seed is printed: {out}");
    // The Llama's f32 (2 cases) + bf16 (3) + bf16 over NF4 (3), then Qwen3 (2), Gemma 2 (3),
    // Gemma 3 (3), Phi-3 (3), Phi-4 (2): the 20 others pass, the injected one fails.
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("PASS") || l.starts_with("FAIL"))
        .collect();
    assert_eq!(lines.len(), 21, "{out}");
    let failed: Vec<&&str> = lines.iter().filter(|l| l.starts_with("FAIL")).collect();
    assert_eq!(failed.len(), 1, "{out}");
    assert!(failed[0].contains(INJECTED) && failed[0].contains("injected failure"));
    // Every family's steps ran; the f16 ones say the loss scale they backed off to.
    for family in ["qwen3", "gemma2", "gemma3", "phi3", "phi4"] {
        let name = format!("train step {family} bf16, checkpointing:");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("PASS") && l.contains(&name)),
            "{name}: {out}"
        );
    }
    assert!(lines
        .iter()
        .any(|l| l.contains("train step gemma2 f16:") && l.contains("loss scale")));
    assert!(
        stderr(&o).contains("1 of 21 checks failed"),
        "{}",
        stderr(&o)
    );

    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["seed"], 42);
    let checks = r["checks"].as_array().unwrap();
    assert_eq!(checks.len(), 21);
    let fails: Vec<&str> = checks
        .iter()
        .filter(|c| c["pass"] == false)
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(fails.len(), 1);
    assert!(fails[0].starts_with(INJECTED));
    // CPU against CPU: the computations are identical.
    assert!(checks
        .iter()
        .filter(|c| c["pass"] == true)
        .all(|c| c["max_rel_err"] == 0.0));
}

#[test]
fn gpu_script_dry_run_writes_every_section() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new("bash")
        .arg("benches/gpu/run.sh")
        .arg("--dry-run")
        .current_dir(root())
        .env("RTUNE", env!("CARGO_BIN_EXE_rtune"))
        .env("OUT", tmp.path())
        .output()
        .expect("run bash");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    let report = std::fs::read(tmp.path().join("report.json")).expect("report.json");
    let r: serde_json::Value = serde_json::from_slice(&report).unwrap();
    assert_eq!(r["meta"]["mode"], "dry");
    let names: Vec<&str> = r["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "selftest",
            "rtune bench tiny",
            "rtune bench",
            "peft bench",
            "roofline",
            "rtune bench unfused=cudnn",
            "rtune bench unfused=lora_bf16",
            "rtune bench unfused=add_norm",
            "rtune bench unfused=nf4_group",
            "rtune bench unfused=all",
        ],
        "the steps, in order"
    );
    // rtune's three sections ran and hold their results.
    assert_eq!(r["selftest"]["status"], "ok", "{out}");
    assert_eq!(
        r["selftest"]["result"]["checks"].as_array().unwrap().len(),
        21
    );
    for sec in ["rtune_tiny", "rtune"] {
        assert_eq!(r[sec]["status"], "ok", "{sec}: {out}");
        let res = &r[sec]["result"];
        assert!(res["tokens_per_s"].as_f64().unwrap() > 0.0, "{sec}");
        assert!(res["peak_memory_bytes"].as_u64().unwrap() > 0, "{sec}");
        assert!(
            res["memory_before_steps_bytes"].as_u64().unwrap() > 0,
            "{sec}"
        );
    }
    assert_eq!(r["rtune"]["result"]["options"]["seq"], 128);
    // PEFT and the roofline: run where torch is importable, else skipped with the reason.
    for sec in ["peft", "roofline"] {
        let s = &r[sec];
        assert!(
            s["status"] == "ok" || s["skipped"] == "no torch",
            "{sec}: {s}"
        );
    }
    assert!(r["summary"]["goals"].is_object());
    // The toggles (issue 48, item 6): each fast path's switch this build has ran the bench with
    // it off (on the CPU nothing is fused, so only the plumbing is tested); a name it lacks is
    // skipped, not failed. `add_norm` and `all` are in every build.
    let toggles = r["toggles"].as_object().unwrap();
    assert_eq!(toggles.len(), 5, "{out}");
    for (name, t) in toggles {
        let ran = t["status"] == "ok";
        assert!(ran || t["skipped"] == "not in this build", "{name}: {t}");
        if ran {
            let res = &t["result"];
            assert!(res["tokens_per_s"].as_f64().unwrap() > 0.0, "{name}");
            assert!(r["summary"]["toggles"][name]["share"].is_number(), "{name}");
        }
    }
    for name in ["add_norm", "all"] {
        assert_eq!(toggles[name]["status"], "ok", "{name}: {out}");
    }
}

/// `rtune bench`'s report (issue 47): both GEMM ceilings, f32 and bf16, each probe shape with the
/// engine that served it, and which engine served each class of the timed steps' products —
/// frozen, LoRA and attention — on stdout and in the JSON. A tiny bf16 bench on the CPU.
#[test]
fn bench_reports_both_ceilings_and_the_engine_of_each_gemm_class() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = rtune_env(
        &[
            "bench",
            "--hidden",
            "64",
            "--layers",
            "2",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--intermediate",
            "96",
            "--vocab",
            "256",
            "--seq",
            "80",
            "--batch",
            "2",
            "--r",
            "4",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--dtype",
            "bf16",
            "--json-out",
            json.to_str().unwrap(),
        ],
        &[],
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    let line = out
        .lines()
        .find(|l| l.starts_with("gemm ceilings: "))
        .unwrap_or_else(|| panic!("no ceilings line: {out}"));
    assert!(
        line.contains("f32 ") && line.contains("bf16 ") && line.contains("GFLOP/s"),
        "{line}"
    );
    for dt in ["f32", "bf16"] {
        assert!(
            out.lines()
                .any(|l| l.starts_with("gemm ceiling: ") && l.contains(&format!(" {dt} "))),
            "no {dt} probe line: {out}"
        );
    }
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let served = j["served"].as_array().expect("served in the JSON");
    for class in ["frozen", "LoRA", "attention"] {
        let l = out
            .lines()
            .find(|l| l.starts_with(&format!("served: {class} ")))
            .unwrap_or_else(|| panic!("no served line for {class}: {out}"));
        // The engine's name ends the line (`... calls)  <engine>`).
        let engine = l.rsplit(")  ").next().unwrap_or("");
        assert!(!engine.trim().is_empty(), "{l}");
        assert!(
            served
                .iter()
                .any(|s| s["class"] == class && s["engine"].as_str().is_some_and(|e| !e.is_empty())),
            "{class}: {served:?}"
        );
    }
    // With oneDNN serving bf16 (its name on the bf16 probe lines), the tiled attention's score
    // products are its too (seq 80: two 64-query tiles), named as such.
    let onednn = out
        .lines()
        .any(|l| l.starts_with("gemm ceiling: ") && l.contains(" bf16 ") && l.contains("oneDNN"));
    if onednn {
        assert!(
            out.lines()
                .any(|l| l.starts_with("served: attention") && l.contains("oneDNN bf16 tiles")),
            "{out}"
        );
    }
    let c = &j["ceiling"];
    assert!(
        c["f32_best_gflops"].as_f64().unwrap() > 0.0
            && c["bf16_best_gflops"].as_f64().unwrap() > 0.0,
        "{c}"
    );
}
