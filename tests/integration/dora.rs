//! DoRA (`[lora] dora = true`, PEFT's `use_dora`) against transformers + PEFT 0.21.2 goldens
//! (`tests/parity/make_goldens.py`: `golden_tiny_dora`, `golden_tiny_l3_dora_rslora_wd`,
//! `golden_tiny_qdora_nf4dq`).
//!
//! - the model: PEFT's magnitude init, the loss and the A, B and m gradients of one batch, with and
//!   without checkpointing;
//! - `rtune train` from the golden's init adapter (a PEFT DoRA adapter written here): every step's
//!   loss and the adapter after 3 AdamW steps, magnitudes included, over all-linear (untied, GQA
//!   4/2), a subset with rsLoRA and weight decay (tied, GQA 4/1), and NF4 double quant (QDoRA);
//! - DoRA from a plain-LoRA `init_from` is a one-line input error; `gguf-lora` refuses DoRA.
//!
//! Tolerances as in `parity.rs` (f32): loss 1e-5 relative (summation order only), gradients and
//! weights after AdamW 1e-4 relative to the tensor's largest entry (AdamW's first step divides g by
//! |g|, which amplifies the relative error of tiny gradient entries).

use candle_core::{DType, Tensor};
use std::path::{Path, PathBuf};

use crate::common::{fixture, rel_err, rtune, stderr, Golden};
use crate::parity::case_with;
use rtune_model::{Grads, Quantize};

const GOLDENS: [(&str, &str, Quantize); 3] = [
    (
        "parity/golden_tiny_dora.safetensors",
        "fixtures/tiny-llama",
        Quantize::None,
    ),
    (
        "parity/golden_tiny_l3_dora_rslora_wd.safetensors",
        "fixtures/tiny-llama3",
        Quantize::None,
    ),
    (
        "parity/golden_tiny_qdora_nf4dq.safetensors",
        "fixtures/tiny-llama",
        Quantize::linears(true),
    ),
];

fn path_str(p: &Path) -> String {
    p.to_str().unwrap().replace('\\', "/")
}

/// Magnitude init, loss and gradients of the golden batch.
#[test]
fn model_matches_peft_dora() {
    for (golden, model, quantize) in GOLDENS {
        eprintln!("{golden}");
        let c = case_with(&fixture(model), golden, DType::F32, quantize);
        let g = &c.golden;
        assert!(c.adapter.spec.dora && c.adapter.pairs.iter().all(|p| p.m.is_some()));
        // PEFT's init formula on the golden's A and B: m = ‖W + s·B·A‖ (W dequantized for NF4).
        let mut fresh = c.adapter.clone();
        fresh.pairs.iter_mut().for_each(|p| p.m = None);
        c.model.init_dora(&mut fresh).unwrap();
        for (name, p) in fresh.names.iter().zip(&fresh.pairs) {
            let want = g.get(&format!(
                "init.base_model.model.{name}.lora_magnitude_vector"
            ));
            let e = rel_err(p.m.as_ref().unwrap(), want);
            assert!(e <= 1e-6, "init m {name}: rel err {e:e}");
        }
        let n = c.targets.iter().filter(|t| t.is_some()).count() as f64;
        let want_loss = g.get("loss").to_vec1::<f32>().unwrap()[0] as f64;
        for checkpoint in [false, true] {
            let mut grads = Grads::new(c.adapter.pairs.len());
            let lc = crate::parity::ctx(&c.adapter);
            let loss = c
                .model
                .forward_backward(&c.inputs, &c.targets, &lc, 1.0 / n, checkpoint, &mut grads)
                .unwrap()
                / n;
            assert!(
                (loss - want_loss).abs() / want_loss <= 1e-5,
                "loss {loss} vs {want_loss}"
            );
            let mut worst = 0f64;
            for (i, name) in c.adapter.names.iter().enumerate() {
                for (key, got) in [
                    (format!("{name}.lora_A.weight"), &grads.a[i]),
                    (format!("{name}.lora_B.weight"), &grads.b[i]),
                    (format!("{name}.lora_magnitude_vector"), &grads.m[i]),
                ] {
                    let want = g.get(&format!("grad.base_model.model.{key}"));
                    let e = rel_err(got.as_ref().unwrap(), want);
                    worst = worst.max(e);
                    assert!(
                        e <= 1e-4,
                        "grad {key}: rel err {e:e} (checkpoint {checkpoint})"
                    );
                }
            }
            eprintln!("  loss {loss}, worst grad rel err {worst:e} (checkpoint {checkpoint})");
        }
    }
}

/// Writes the golden's init weights as a PEFT DoRA adapter directory (what PEFT's
/// `save_pretrained` writes: keys without `.default`, the magnitude without `.weight`).
fn init_adapter(g: &Golden, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let tensors: std::collections::HashMap<String, Tensor> =
        g.t.iter()
            .filter_map(|(k, t)| k.strip_prefix("init.").map(|k| (k.to_string(), t.clone())))
            .collect();
    candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors")).unwrap();
    let m = &g.meta;
    let cfg = serde_json::json!({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": m["r"], "lora_alpha": m["lora_alpha"],
        "lora_dropout": 0.0, "target_modules": m["target_modules"], "bias": "none",
        "use_rslora": m["use_rslora"], "use_dora": true,
    });
    std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).unwrap();
}

/// A config training on the golden's batch from its init adapter as the golden's AdamW loop.
fn golden_config(tmp: &Path, golden: &str, model: &str, quantize: Quantize) -> (PathBuf, Golden) {
    let g = Golden::load(&fixture(golden));
    g.write_batch(&tmp.join("batch.jsonl"));
    init_adapter(&g, &tmp.join("init"));
    let m = &g.meta;
    let targets: Vec<String> = m["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| format!("\"{}\"", v.as_str().unwrap()))
        .collect();
    let quant = match quantize {
        Quantize::None => String::new(),
        Quantize::Nf4 { double_quant, .. } => {
            format!("quantize = \"nf4\"\ndouble_quant = {double_quant}\n")
        }
    };
    let cfg = format!(
        r#"[model]
path = "{model}"
{quant}[lora]
r = {r}
alpha = {alpha}
rslora = {rslora}
targets = [{targets}]
dora = true
init_from = "{init}"
[data]
train = "{data}"
max_seq_len = {seq}
shuffle = false
[train]
steps = 3
micro_batch_size = {batch}
lr = 1e-3
weight_decay = {wd}
schedule = "constant"
max_grad_norm = 0.0
gradient_checkpointing = false
[output]
dir = "{out}"
"#,
        model = path_str(&fixture(model)),
        r = m["r"],
        alpha = m["lora_alpha"].as_f64().unwrap(),
        rslora = m["use_rslora"],
        targets = targets.join(", "),
        init = path_str(&tmp.join("init")),
        data = path_str(&tmp.join("batch.jsonl")),
        seq = m["seq"],
        batch = m["batch"],
        wd = m["adamw"]["weight_decay"].as_f64().unwrap(),
        out = path_str(&tmp.join("out")),
    );
    std::fs::write(tmp.join("dora.toml"), cfg).unwrap();
    (tmp.join("dora.toml"), g)
}

fn check_run(out: &Path, g: &Golden) {
    let adapter = crate::common::trained_adapter(out, g);
    let (mut worst, mut degenerate) = (0f64, 0);
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let lr = g.meta["adamw"]["lr"].as_f64().unwrap();
    for (k, t) in &adapter {
        let (got, want) = (flat(t), flat(g.get(&format!("adamw.{k}"))));
        let g0 = flat(g.get(&format!("grad.{k}")));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        let gmax = g0.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        for i in 0..want.len() {
            let err = (got[i] - want[i]).abs() as f64;
            // As parity.rs: a first gradient entry within 10× of f32 summation noise (1e-5 of its
            // tensor's largest) has a noise sign, and AdamW's first step moves it by ±lr whatever
            // its size; such an entry must stay within AdamW's reach, and be rare.
            if (g0[i].abs() as f64) < 1e-5 * gmax {
                degenerate += 1;
                assert!(
                    err <= 2.0 * 3.0 * lr,
                    "{k}[{i}]: {err:e} beyond AdamW's reach"
                );
            } else {
                worst = worst.max(err / scale);
                assert!(err / scale <= 1e-4, "{k}[{i}]: rel err {:e}", err / scale);
            }
        }
    }
    assert!(degenerate <= 4, "{degenerate} degenerate gradient entries");
    assert!(adapter
        .keys()
        .any(|k| k.ends_with(".lora_magnitude_vector")));
    let want: Vec<f32> = g.get("adamw.loss").to_vec1().unwrap();
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let losses: Vec<f64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(losses.len(), want.len());
    for (l, w) in losses.iter().zip(&want) {
        assert!(
            (l - *w as f64).abs() / (*w as f64) <= 1e-5,
            "loss {l} vs {w}"
        );
    }
    eprintln!("  losses {losses:?}, adapter worst rel err {worst:e}, {degenerate} degenerate");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["use_dora"], true);
}

/// `rtune train` equals PEFT's 3 AdamW steps for every DoRA golden; the first one also with
/// gradient checkpointing.
#[test]
fn cli_dora_training_matches_peft_adamw() {
    for (golden, model, quantize) in GOLDENS {
        eprintln!("{golden}");
        let tmp = tempfile::tempdir().unwrap();
        let (cfg, g) = golden_config(tmp.path(), golden, model, quantize);
        let o = rtune(&["train", "--config", &path_str(&cfg)]);
        assert!(o.status.success(), "{}", stderr(&o));
        check_run(&tmp.path().join("out"), &g);
    }
    let tmp = tempfile::tempdir().unwrap();
    let (golden, model, quantize) = GOLDENS[0];
    let (cfg, g) = golden_config(tmp.path(), golden, model, quantize);
    let o = rtune(&[
        "train",
        "--config",
        &path_str(&cfg),
        "--set",
        "train.gradient_checkpointing=true",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    check_run(&tmp.path().join("out"), &g);
}

/// DoRA continuing a plain LoRA adapter (no magnitudes): one `error:` line, exit 2, no output.
#[test]
fn dora_from_plain_lora_adapter_is_an_input_error() {
    let tmp = tempfile::tempdir().unwrap();
    let (golden, model, quantize) = GOLDENS[0];
    let (cfg, _) = golden_config(tmp.path(), golden, model, quantize);
    let plain = path_str(&fixture("parity/adapter_tiny_init"));
    let o = rtune(&[
        "train",
        "--config",
        &path_str(&cfg),
        "--set",
        &format!("lora.init_from={plain}"),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].contains("use_dora false") && lines[0].contains("dora = true"),
        "{}",
        lines[0]
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(!tmp.path().join("out").exists());
}

/// A DoRA run exports `merged` (the magnitudes folded in: the merged model's logits equal the
/// DoRA model's) and refuses `gguf-lora`, naming `merged`, writing nothing.
#[test]
fn dora_exports_merged_and_refuses_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let (golden, model, quantize) = GOLDENS[0];
    let (cfg, _) = golden_config(tmp.path(), golden, model, quantize);
    let o = rtune(&["train", "--config", &path_str(&cfg)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = path_str(&tmp.path().join("out"));
    let gguf = tmp.path().join("a.gguf");
    let o = rtune(&[
        "export",
        "--run",
        &run,
        "--format",
        "gguf-lora",
        "--out",
        &path_str(&gguf),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("DoRA") && err.contains("--format merged"),
        "{err}"
    );
    assert!(!gguf.exists());
    let merged = tmp.path().join("merged");
    let o = rtune(&[
        "export",
        "--run",
        &run,
        "--format",
        "merged",
        "--out",
        &path_str(&merged),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Logits: the merged model alone vs base + DoRA adapter (rtune generate --dump-logits).
    let prompt = "Q: What is Zephyr?";
    let dump = |args: &[&str], name: &str| -> Tensor {
        let f = tmp.path().join(name);
        let mut a = args.to_vec();
        let fs = path_str(&f);
        a.extend([
            "--prompt",
            prompt,
            "--max-new-tokens",
            "1",
            "--dump-logits",
            &fs,
        ]);
        let o = rtune(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        candle_core::safetensors::load(&f, &candle_core::Device::Cpu).unwrap()["logits"].clone()
    };
    let m = path_str(&fixture(model));
    let with = dump(
        &["generate", "--model", &m, "--adapter", &run],
        "a.safetensors",
    );
    let folded = dump(
        &["generate", "--model", &path_str(&merged)],
        "b.safetensors",
    );
    let e = rel_err(&folded, &with);
    eprintln!("merged vs adapter logits rel err {e:e}");
    // f32 merge: W' = k⊙(W + ΔW) rounded once vs the factored product, ~1e-7 per weight.
    assert!(e <= 1e-5, "merged logits rel err {e:e}");
}

/// A DoRA run (with LoRA dropout, so the recomputed base product is on the path) killed with
/// SIGKILL after step 6 and resumed ends bitwise-identical to an uninterrupted one: the
/// magnitudes and their AdamW moments are in the checkpoints.
#[test]
fn dora_kill_then_resume_is_bitwise_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let dora_cfg = |out: &Path| -> PathBuf {
        let p = crate::resume::config(tmp.path(), out, "");
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.contains("dropout = 0.1\n"));
        std::fs::write(
            &p,
            text.replace("dropout = 0.1\n", "dropout = 0.1\ndora = true\n"),
        )
        .unwrap();
        p
    };
    let reference = tmp.path().join("reference");
    let o = crate::resume::train(&dora_cfg(&reference), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = tmp.path().join("killed");
    let cfg = dora_cfg(&out);
    crate::resume::kill_then_resume_equals(&cfg, &out, 6, &reference);
    let losses = |d: &Path| -> Vec<String> {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].to_string())
            .collect()
    };
    assert_eq!(losses(&reference).len(), 30);
    assert_eq!(losses(&reference), losses(&out));
    let st = candle_core::safetensors::load(
        out.join("adapter_model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert!(st.keys().any(|k| k.ends_with(".lora_magnitude_vector")));
}
