//! The LoRA variants of issue 17 through `rtune train`, against PEFT 0.21.2 goldens made by
//! `tests/parity/make_variant_goldens.py` (tiny-llama, r 8, α 16, all-linear, golden_tiny's batch, 3
//! AdamW steps at lr 1e-3, f32): every step's loss within 1e-5 relative and the saved adapter within
//! 1e-4 relative (max |diff| / max |golden|; f32 arithmetic in another order over 3 steps, as
//! `cli.rs`), and the one-line errors of bad variant settings. PEFT loading the converted adapters
//! on the original base (0 missing / unexpected keys, logits within 1e-5) and `export --format
//! merged` against PEFT's merge were checked by hand with scripts/check_export.py (needs torch).
//!
//! PiSSA's singular vectors have arbitrary signs (LAPACK's and nalgebra's differ), so PiSSA adapters
//! are compared after aligning each rank component's sign with the golden's (B·A does not depend
//! on it). OLoRA's QR follows LAPACK's sign convention and is compared as is.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::common::{fixture, rel_err, rtune, stderr, Golden};

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// `tests/fixtures/tiny-llama` with the golden's `base.*` tensors in place of the originals.
fn model_with_golden_base(g: &Golden, dir: &Path) {
    let src = fixture("fixtures/tiny-llama");
    std::fs::create_dir_all(dir).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "model.safetensors" {
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
    }
    let mut w =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut replaced = 0;
    for (k, t) in &g.t {
        if let Some(name) = k.strip_prefix("base.") {
            assert!(w.contains_key(name), "{name}");
            w.insert(name.to_string(), t.clone());
            replaced += 1;
        }
    }
    assert_eq!(replaced, 14, "the 7 linears of 2 layers");
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
}

/// Trains on the golden's batch as the golden's PEFT loop does; `model` is the base directory.
fn run(tmp: &Path, g: &Golden, model: &Path, lora: &str, train: &str) -> PathBuf {
    let ids = g.get("input_ids").to_vec2::<i64>().unwrap();
    let labels = g.get("labels").to_vec2::<i64>().unwrap();
    let mut jsonl = String::new();
    for (i, l) in ids.iter().zip(&labels) {
        jsonl += &serde_json::json!({"input_ids": i, "labels": l}).to_string();
        jsonl.push('\n');
    }
    std::fs::write(tmp.join("batch.jsonl"), jsonl).unwrap();
    let out = tmp.join("out");
    let cfg = format!(
        "[model]\npath = \"{model}\"\n[lora]\nr = 8\nalpha = 16\ntargets = \"all-linear\"\n{lora}\n\
         [data]\ntrain = \"{data}\"\nmax_seq_len = 16\nshuffle = false\n\
         [train]\nsteps = 3\nmicro_batch_size = 2\nlr = 1e-3\nschedule = \"constant\"\n\
         max_grad_norm = 0.0\ngradient_checkpointing = false\n{train}\n[output]\ndir = \"{out}\"\n",
        model = path_str(model),
        data = path_str(&tmp.join("batch.jsonl")),
        out = path_str(&out),
    );
    let path = tmp.join("variant.toml");
    std::fs::write(&path, cfg).unwrap();
    let o = rtune(&["train", "--config", &path_str(&path)]);
    assert!(o.status.success(), "{}", stderr(&o));
    out
}

fn check_losses(out: &Path, g: &Golden) {
    let want: Vec<f32> = g.get("adamw.loss").to_vec1().unwrap();
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), want.len());
    for (line, w) in metrics.lines().zip(&want) {
        let m: serde_json::Value = serde_json::from_str(line).unwrap();
        let l = m["loss"].as_f64().unwrap();
        assert!(
            (l - *w as f64).abs() / (*w as f64) <= 1e-5,
            "loss {l} vs {w}"
        );
    }
}

/// The saved adapter against the golden's `adamw.*`; with `align`, rank component k (row k of A
/// and column k of B, and the same for the initial half k + r) takes the sign that makes its
/// initial half agree with the golden's.
fn check_adapter(out: &Path, g: &Golden, align: bool) {
    let adapter =
        candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let n_golden =
        g.t.keys()
            .filter(|k| k.starts_with("adamw.base_model"))
            .count();
    assert_eq!(adapter.len(), n_golden);
    let mut signs: HashMap<String, Vec<f32>> = HashMap::new();
    if align {
        for (k, a) in &adapter {
            let Some(module) = k.strip_suffix(".lora_A.weight") else {
                continue;
            };
            let mine: Vec<Vec<f32>> = a.to_vec2().unwrap();
            let theirs: Vec<Vec<f32>> = g.get(&format!("adamw.{k}")).to_vec2().unwrap();
            let r = mine.len() / 2;
            let s: Vec<f32> = (0..r)
                .map(|i| {
                    let dot: f32 = mine[r + i]
                        .iter()
                        .zip(&theirs[r + i])
                        .map(|(x, y)| x * y)
                        .sum();
                    if dot < 0.0 {
                        -1.0
                    } else {
                        1.0
                    }
                })
                .collect();
            signs.insert(module.to_string(), s);
        }
    }
    for (k, t) in &adapter {
        let t = match (align, k.rsplit_once(".lora_")) {
            (true, Some((module, which))) => {
                let s = &signs[module];
                let r = s.len();
                let mut v: Vec<Vec<f32>> = t.to_vec2().unwrap();
                if which.starts_with('A') {
                    for (i, row) in v.iter_mut().enumerate() {
                        row.iter_mut().for_each(|x| *x *= s[i % r]);
                    }
                } else {
                    for row in v.iter_mut() {
                        row.iter_mut().enumerate().for_each(|(j, x)| *x *= s[j % r]);
                    }
                }
                Tensor::new(v, &Device::Cpu).unwrap()
            }
            _ => t.clone(),
        };
        let e = rel_err(&t, g.get(&format!("adamw.{k}")));
        assert!(e <= 1e-4, "{k}: rel err {e:e}");
    }
}

/// LoRA+ (ratio 16, weight decay 0.01) from golden_tiny's init adapter equals PEFT's
/// create_loraplus_optimizer: both groups and the decay.
#[test]
fn loraplus_matches_peft() {
    let tmp = tempfile::tempdir().unwrap();
    let g = Golden::load(&fixture("parity/golden_tiny_loraplus.safetensors"));
    let init = format!(
        "init_from = \"{}\"",
        path_str(&fixture("parity/adapter_tiny_init"))
    );
    let train = "loraplus_lr_ratio = 16.0\nweight_decay = 0.01";
    let out = run(
        tmp.path(),
        &g,
        &fixture("fixtures/tiny-llama"),
        &init,
        train,
    );
    check_losses(&out, &g);
    check_adapter(&out, &g, false);
}

/// PiSSA, pissa_niter_4 and OLoRA from the config: the loss of every step, and the adapter saved
/// against the original base (rank 16, alpha 32) equal PEFT's converted adapter.
#[test]
fn pissa_and_olora_match_peft() {
    for (init, align) in [("pissa", true), ("pissa_niter_4", true), ("olora", false)] {
        let tmp = tempfile::tempdir().unwrap();
        let g = Golden::load(&fixture(&format!("parity/golden_tiny_{init}.safetensors")));
        let model = tmp.path().join("model");
        model_with_golden_base(&g, &model);
        let out = run(tmp.path(), &g, &model, &format!("init = \"{init}\""), "");
        check_losses(&out, &g);
        check_adapter(&out, &g, align);
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["r"], 16, "{init}");
        assert_eq!(cfg["lora_alpha"].as_f64(), Some(32.0), "{init}");
        // A checkpoint is relative to the residual base: exporting one is refused, not done wrong.
        let dest = tmp.path().join("export");
        let o = rtune(&[
            "export",
            "--run",
            &path_str(&out),
            "--checkpoint",
            "3",
            "--format",
            "peft",
            "--out",
            &path_str(&dest),
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("residual base"), "{}", stderr(&o));
        assert!(!dest.exists());
    }
}

/// Runs `rtune train` on a config that must fail: exit 2, one `error:` line with every needle,
/// no output directory.
fn assert_fails(tmp: &Path, model: &Path, lora: &str, needles: &[&str]) {
    let out = tmp.join("out-bad");
    let cfg = format!(
        "[model]\npath = \"{}\"\n[lora]\n{lora}\n[data]\ntrain = \"{}\"\n[train]\nsteps = 1\n\
         [output]\ndir = \"{}\"\n",
        path_str(model),
        path_str(&fixture("fixtures/smoke.jsonl")),
        path_str(&out)
    );
    let path = tmp.join("bad.toml");
    std::fs::write(&path, cfg).unwrap();
    let o = rtune(&["train", "--config", &path_str(&path)]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    for n in needles {
        assert!(lines[0].contains(n), "`{n}` not in: {}", lines[0]);
    }
    assert!(!out.exists(), "output dir created for a failed run");
}

#[test]
fn bad_variant_settings_are_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let llama = fixture("fixtures/tiny-llama");
    assert_fails(
        tmp.path(),
        &llama,
        "init = \"pisa\"",
        &[
            "lora.init",
            "default, gaussian, pissa, pissa_niter_N, olora",
            "did you mean `pissa`",
        ],
    );
    assert_fails(
        tmp.path(),
        &llama,
        "init = \"pissa_niter_x\"",
        &["lora.init"],
    );
    // A pre-quantized bnb-4bit base has no full-precision W to split.
    let bnb = tmp.path().join("bnb");
    std::fs::create_dir_all(&bnb).unwrap();
    crate::qlora::bnb_checkpoint("parity/golden_tiny_qlora_nf4.safetensors", &bnb);
    assert_fails(
        tmp.path(),
        &bnb,
        "init = \"pissa\"",
        &["bnb-4bit", "quantize = \"nf4\""],
    );
}
