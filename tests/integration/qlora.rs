//! QLoRA: the tiny model with every decoder linear layer in bitsandbytes NF4 (plain and double
//! quant) against transformers + PEFT + bitsandbytes 0.50.2 goldens (`tests/parity/README.md`).
//!
//! Tolerances are the f32 ones of the parity tests (logits/loss 1e-5, LoRA grads and AdamW 1e-4
//! relative): the NF4 codes and scales are bit-exact, and dequantization (table value × absmax in
//! f32) is exact arithmetic, so the quantized model differs from bitsandbytes' only in summation
//! order, like the unquantized one.

use candle_core::{DType, Device};
use std::collections::HashMap;

use rtune_model::{Model, Quantize};

use crate::common::fixture;
use crate::parity::{case_with, check_adamw, check_forward_and_grads};

const GOLDENS: [(&str, bool); 2] = [
    ("parity/golden_tiny_qlora_nf4.safetensors", false),
    ("parity/golden_tiny_qlora_nf4dq.safetensors", true),
];

/// Quantizing the f32 checkpoint while loading reproduces bitsandbytes' QLoRA forward, backward
/// and AdamW steps.
#[test]
fn quantized_on_load_matches_peft_bitsandbytes() {
    for (golden, double_quant) in GOLDENS {
        eprintln!("{golden}");
        let c = case_with(
            &fixture("fixtures/tiny-llama"),
            golden,
            DType::F32,
            Quantize::linears(double_quant),
        );
        check_forward_and_grads(&c);
        check_adamw(&c);
    }
}

/// Writes a bnb-4bit checkpoint directory (as `save_pretrained` of a 4-bit model stores it): the
/// golden's `q.*` tensors for the linear layers, the fixture's other tensors, and config.json
/// with the golden's `quantization_config`.
pub(crate) fn bnb_checkpoint(golden: &str, dir: &std::path::Path) {
    let src = fixture("fixtures/tiny-llama");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(fixture(golden)).unwrap();
    let g = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["config"]).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = meta["model_config"]["quantization_config"].clone();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let base_bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let base = safetensors::SafeTensors::deserialize(&base_bytes).unwrap();
    let mut out: HashMap<String, safetensors::tensor::TensorView> = HashMap::new();
    for (name, view) in g.tensors() {
        if let Some(n) = name.strip_prefix("q.") {
            out.insert(n.to_string(), view);
        }
    }
    for (name, view) in base.tensors() {
        out.entry(name).or_insert(view);
    }
    safetensors::serialize_to_file(&out, None, &dir.join("model.safetensors")).unwrap();
}

/// A pre-quantized bnb-4bit checkpoint loads as stored (no requantisation) and computes the same
/// logits as bitsandbytes; its resident size is the packed one.
#[test]
fn bnb_4bit_checkpoint_loads_as_stored() {
    for (golden, double_quant) in GOLDENS {
        let tmp = tempfile::tempdir().unwrap();
        bnb_checkpoint(golden, tmp.path());
        let c = case_with(tmp.path(), golden, DType::F32, Quantize::None);
        check_forward_and_grads(&c);

        // Memory: 0.5 byte/param + scales for the quantized layers, the rest dense f32.
        let dense = Model::load(&fixture("fixtures/tiny-llama"), DType::F32, &Device::Cpu).unwrap();
        let q = &c.model;
        let linear_params: usize = (dense.num_params() as f64
            - (dense.cfg.vocab_size * dense.cfg.hidden_size * 2) as f64
            - (dense.cfg.hidden_size * (2 * dense.cfg.num_layers + 1)) as f64)
            as usize;
        let per_param = if double_quant {
            0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0)
        } else {
            0.5 + 4.0 / 64.0
        };
        let other = dense.resident_bytes() - 4 * linear_params;
        let want = other as f64 + per_param * linear_params as f64;
        let got = q.resident_bytes() as f64;
        eprintln!("{golden}: resident {got} bytes, expected {want:.0}");
        // Each layer adds its 16-entry code table (64 B) and, with double quant, a 256-entry
        // second-level map (1 KiB): at this tiny size that is a few percent, so 10% here.
        assert!((got - want).abs() / want < 0.10, "{got} vs {want}");
    }
}

/// A bnb checkpoint missing a quant-state tensor is refused with the tensor's name.
#[test]
fn bnb_checkpoint_missing_absmax_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    bnb_checkpoint(GOLDENS[0].0, tmp.path());
    let path = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: HashMap<String, safetensors::tensor::TensorView> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.mlp.up_proj.weight.absmax")
        .collect();
    let out = tmp.path().join("m2.safetensors");
    safetensors::serialize_to_file(&kept, None, &out).unwrap();
    std::fs::rename(&out, &path).unwrap();
    let e = Model::load(tmp.path(), DType::F32, &Device::Cpu)
        .err()
        .expect("missing absmax must fail")
        .to_string();
    assert!(
        e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("absmax"),
        "{e}"
    );
}

/// `rtune train` on the smoke config with an NF4 base memorises the smoke set as the f32 run does.
#[test]
fn smoke_run_in_nf4_memorises() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("nf4");
    let o = crate::common::rtune(&[
        "train",
        "--config",
        "configs/smoke.toml",
        "--set",
        "model.quantize=nf4",
        "--set",
        &format!("output.dir={}", out.display()),
    ]);
    assert!(o.status.success(), "{}", crate::common::stderr(&o));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let loss = summary["final_loss"].as_f64().unwrap();
    assert!(loss < 0.05, "final loss {loss}");
    let cfg = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(cfg.contains("quantize = \"nf4\""), "{cfg}");
}

/// Merging a QLoRA adapter: by default into the dequantized NF4 weights it was trained against
/// (the merged model then computes what base-in-NF4 + adapter computes), or with
/// `--merge-into original` into the unquantized base. f32 throughout, so both equalities hold to
/// 1e-5 (summation order only); the two merges differ by the quantization error (> 1e-3).
#[test]
fn qlora_merge_into_dequantized_or_original_weights() {
    use crate::common::{rtune, stderr};
    let tmp = tempfile::tempdir().unwrap();
    let p = |n: &str| tmp.path().join(n).display().to_string();
    let o = rtune(&[
        "train",
        "--config",
        "configs/smoke.toml",
        "--set",
        "model.path=tests/fixtures/tiny-llama",
        "--set",
        "model.quantize=nf4",
        "--set",
        "train.steps=20",
        "--set",
        "train.warmup_steps=0",
        "--set",
        &format!("output.dir={}", p("run")),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for (out, extra) in [("deq", None), ("orig", Some("original"))] {
        let mut args = vec![
            "export".to_string(),
            "--run".into(),
            p("run"),
            "--format".into(),
            "merged".into(),
            "--out".into(),
            p(out),
        ];
        if let Some(w) = extra {
            args.extend(["--merge-into".into(), w.into()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = rtune(&args);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let logits = |model: &str, adapter: Option<&str>, quantize: &str, name: &str| {
        let dump = p(name);
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "Q: Who makes Zephyr?\nA:",
            "--max-new-tokens",
            "1",
            "--quantize",
            quantize,
            "--dump-logits",
            &dump,
        ];
        let a;
        if let Some(ad) = adapter {
            a = ad.to_string();
            args.extend(["--adapter", &a]);
        }
        let o = rtune(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        candle_core::safetensors::load(&dump, &Device::Cpu).unwrap()["logits"].clone()
    };
    let base = "tests/fixtures/tiny-llama";
    let run = p("run");
    let qlora = logits(base, Some(&run), "nf4-dq", "a.st");
    let merged_deq = logits(&p("deq"), None, "none", "b.st");
    let plain = logits(base, Some(&run), "none", "c.st");
    let merged_orig = logits(&p("orig"), None, "none", "d.st");
    let rel = crate::common::rel_err;
    let (e1, e2, gap) = (
        rel(&merged_deq, &qlora),
        rel(&merged_orig, &plain),
        rel(&merged_orig, &qlora),
    );
    eprintln!("merged(deq) vs QLoRA {e1:e}; merged(orig) vs base+adapter {e2:e}; the two {gap:e}");
    assert!(e1 < 1e-5 && e2 < 1e-5, "{e1:e} {e2:e}");
    assert!(
        gap > 1e-3,
        "the merges should differ by the quantization error: {gap:e}"
    );
}
