//! `rtune export`: the merged model computes what base + adapter compute (f32 logits; bf16 sharded
//! weights rounded once from the f32 merge), the GGUF LoRA file has llama.cpp's layout (read back
//! with candle's GGUF reader), the PEFT export's base path resolves, and bad input exits 2.

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use rtune_fsio::Privacy;
use rtune_lora::{Adapter, LoraSpec};
use rtune_model::{Inputs, LoraCtx, Model};

use crate::common::{fixture, rel_err, root, rtune, stderr};

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// A 4-step run on tests/fixtures/tiny-llama (f32) with checkpoints at 2 and 4; lr 1e-2 moves B
/// well away from its zero init.
fn train_tiny(run: &Path) {
    train_tiny_on(run, "tests/fixtures/tiny-llama");
}

/// [`train_tiny`] on the base at `model` (a path relative to the repository root, or absolute).
fn train_tiny_on(run: &Path, model: &str) {
    let o = train_tiny_with(run, model, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `rtune train` of [`train_tiny`]'s run on `model`, `extra` arguments after its own (a later
/// `--set` of a key wins): the output, whatever the exit status.
pub(crate) fn train_tiny_with(run: &Path, model: &str, extra: &[&str]) -> std::process::Output {
    let model = format!("model.path={model}");
    let dir = format!("output.dir={}", s(run));
    let mut a = vec![
        "train",
        "--config",
        "configs/smoke.toml",
        "--set",
        &model,
        "--set",
        "train.steps=4",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "output.save_every=2",
        "--set",
        &dir,
    ];
    a.extend_from_slice(extra);
    rtune(&a)
}

fn export(args: &[&str]) -> std::process::Output {
    let mut a = vec!["export"];
    a.extend_from_slice(args);
    rtune(&a)
}

fn logits(model: &Model, lora: Option<&LoraCtx>) -> Tensor {
    let ids = vec![
        1u32, 40, 41, 42, 43, 44, 45, 46, 1, 7, 8, 9, 200, 300, 400, 500,
    ];
    model
        .forward(&Inputs::new(ids, 2, 8), lora, false)
        .unwrap()
        .logits
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn raw_bytes(t: &Tensor) -> Vec<u8> {
    safetensors::View::data(t).into_owned()
}

/// `adapter` with B set to fixed non-zero values (A keeps PEFT's init), saved as a PEFT directory.
fn random_adapter(base: &Path, spec: LoraSpec, dir: &Path) -> Adapter {
    let model = Model::load(base, DType::F32, &Device::Cpu).unwrap();
    let modules = model.lora_modules(&spec);
    let mut ad = Adapter::init(spec, &modules, 7, &Device::Cpu).unwrap();
    for (k, p) in ad.pairs.iter_mut().enumerate() {
        let (out, r) = p.b.dims2().unwrap();
        let v: Vec<f32> = (0..out * r)
            .map(|i| (((i * 7 + k * 13) % 17) as f32 - 8.0) * 0.01)
            .collect();
        p.b = Tensor::from_vec(v, (out, r), &Device::Cpu).unwrap();
    }
    ad.save_peft(dir, &s(base), Privacy::PRIVATE).unwrap();
    ad
}

#[test]
fn merged_f32_logits_equal_base_plus_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run);
    let out = tmp.path().join("merged");
    let o = export(&["--run", &s(&run), "--format", "merged", "--out", &s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let base_dir = fixture("fixtures/tiny-llama");
    for f in [
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        assert!(out.join(f).is_file(), "{f}");
    }
    assert!(!out.join("model.safetensors.index.json").exists());
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(base_dir.join("tokenizer.json")).unwrap()
    );

    let spec = rtune_export::adapter_spec(&run).unwrap();
    let mut base = Model::load(&base_dir, DType::F32, &Device::Cpu).unwrap();
    let adapter = Adapter::load_peft(&run, &spec, &base.lora_modules(&spec), &Device::Cpu).unwrap();
    base.attach(&adapter);
    let lc = LoraCtx {
        adapter: &adapter,
        scaling: spec.scaling(),
        dropout: 0.0,
        seed: 0,
    };
    assert_merge_is_base_plus_adapter(&base, &lc, &base_dir, &out, logits);
}

/// The merged f32 model in `merged` against `base` with its adapter (`lc`), by `logits`: equal
/// within 1e-5 (x·(W + s·B·A) vs x·W + s·(x·Aᵀ)·Bᵀ differ only by summation order, ~1e-7
/// relative), the adapter's effect over 1e-3 (else the test is too weak), and every tensor of
/// `base_dir`'s single-file checkpoint but the adapted projections copied byte for byte.
fn assert_merge_is_base_plus_adapter(
    base: &Model,
    lc: &LoraCtx,
    base_dir: &Path,
    merged: &Path,
    logits: impl Fn(&Model, Option<&LoraCtx>) -> Tensor,
) {
    let want = logits(base, Some(lc));
    let got = logits(
        &Model::load(merged, DType::F32, &Device::Cpu).unwrap(),
        None,
    );
    let err = rel_err(&got, &want);
    assert!(err < 1e-5, "merged vs base+adapter: {err:e}");
    let effect = rel_err(&logits(base, None), &want);
    assert!(
        effect > 1e-3,
        "the adapter barely changes the logits ({effect:e}): test too weak"
    );
    let (b, m) = (
        tensors(&base_dir.join("model.safetensors")),
        tensors(&merged.join("model.safetensors")),
    );
    assert_eq!(b.len(), m.len());
    for (name, t) in &b {
        let adapted = name.ends_with("_proj.weight");
        assert_eq!(raw_bytes(t) == raw_bytes(&m[name]), !adapted, "{name}");
    }
}

#[test]
fn merged_bf16_sharded_is_the_f32_merge_rounded_once() {
    let tmp = tempfile::tempdir().unwrap();
    let base_dir = fixture("fixtures/tiny-llama3"); // bf16, 2 shards, tied embeddings
    let adapter_dir = tmp.path().join("adapter");
    let spec = LoraSpec::new(4, 8.0, 0.0, false, &["all-linear".into()]).unwrap();
    let ad = random_adapter(&base_dir, spec.clone(), &adapter_dir);
    let out = tmp.path().join("merged");
    let o = export(&[
        "--run",
        &s(&adapter_dir),
        "--format",
        "merged",
        "--out",
        &s(&out),
        "--max-shard-size",
        "100KB",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));

    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let shards: BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    assert!(shards.len() >= 3, "{shards:?}");
    let mut merged = HashMap::new();
    let mut total = 0u64;
    for sh in &shards {
        assert!(
            sh.starts_with("model-")
                && sh.ends_with(&format!("-of-{:05}.safetensors", shards.len()))
        );
        let t = tensors(&out.join(sh));
        for (name, x) in t {
            assert_eq!(map[&name].as_str().unwrap(), *sh, "{name}");
            total += raw_bytes(&x).len() as u64;
            merged.insert(name, x);
        }
    }
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), total);

    let mut base = HashMap::new();
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        base.extend(tensors(&base_dir.join(f)));
    }
    assert_eq!(base.len(), map.len());
    let scaling = spec.scaling() as f32;
    let mut changed = 0usize;
    for (name, w) in &base {
        let got = &merged[name];
        assert_eq!(got.dtype(), DType::BF16, "{name}");
        let Some(k) = name.strip_suffix(".weight").and_then(|m| ad.index_of(m)) else {
            assert_eq!(raw_bytes(got), raw_bytes(w), "{name} copied as is");
            continue;
        };
        // Reference: plain loops, f32 W + scaling·Σ_r B[i,r]·A[r,j] accumulated in f64.
        let (out_f, in_f) = w.dims2().unwrap();
        let wv: Vec<f32> = w
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let a: Vec<f32> = ad.pairs[k].a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = ad.pairs[k].b.flatten_all().unwrap().to_vec1().unwrap();
        let g: Vec<f32> = got
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let r = spec.r;
        for i in 0..out_f {
            for j in 0..in_f {
                let d: f64 = (0..r)
                    .map(|q| b[i * r + q] as f64 * a[q * in_f + j] as f64)
                    .sum();
                let want = wv[i * in_f + j] + scaling * d as f32;
                let e = (g[i * in_f + j] - want).abs();
                // One rounding to bf16 (8 significant bits): at most half a unit in the last place.
                assert!(
                    e <= want.abs() * 2f32.powi(-8) + 1e-30,
                    "{name}[{i},{j}]: {} vs {want}",
                    g[i * in_f + j]
                );
                changed += usize::from(g[i * in_f + j] != wv[i * in_f + j]);
            }
        }
    }
    assert!(changed > 1000, "only {changed} weights changed");
    // rtune's own loader reads the re-sharded directory.
    Model::load(&out, DType::BF16, &Device::Cpu).unwrap();
}

/// A `(rows, r)` matrix's rows in GGML's order for one attention projection with `heads` heads:
/// within a head of `hd` rows, GGUF row `i` is HF row `(i % 2)·hd/2 + i/2`.
fn ggml_rows(b: &[f32], rows: usize, r: usize, heads: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = Vec::with_capacity(b.len());
    for h in 0..heads {
        for i in 0..hd {
            let src = h * hd + (i % 2) * hd / 2 + i / 2;
            out.extend_from_slice(&b[src * r..(src + 1) * r]);
        }
    }
    out
}

#[test]
fn gguf_lora_has_llama_cpp_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let base_dir = fixture("fixtures/tiny-llama"); // 2 layers, 4 heads / 2 kv heads, head_dim 16
    let adapter_dir = tmp.path().join("adapter");
    let spec = LoraSpec::new(4, 8.0, 0.0, false, &["all-linear".into()]).unwrap();
    let ad = random_adapter(&base_dir, spec, &adapter_dir);
    let out = tmp.path().join("lora.gguf");
    let o = export(&[
        "--run",
        &s(&adapter_dir),
        "--base",
        &s(&base_dir),
        "--format",
        "gguf-lora",
        "--out",
        &s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));

    let mut f = std::fs::File::open(&out).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    assert_eq!(c.magic, gguf_file::VersionedMagic::GgufV3);
    let md = |k: &str| c.metadata.get(k).unwrap_or_else(|| panic!("no {k}"));
    assert_eq!(md("general.architecture").to_string().unwrap(), "llama");
    assert_eq!(md("general.type").to_string().unwrap(), "adapter");
    assert_eq!(md("adapter.type").to_string().unwrap(), "lora");
    assert!(matches!(
        md("general.quantization_version"),
        gguf_file::Value::U32(2)
    ));
    // llama.cpp reads alpha with gguf_get_val_f32: the type must be f32. scale = alpha / r.
    assert!(matches!(md("adapter.lora.alpha"), gguf_file::Value::F32(a) if *a == 8.0));

    let hf = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    let gg = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    let mut want_names = BTreeSet::new();
    for l in 0..2 {
        for (h, g) in hf.iter().zip(gg) {
            let part = if h.starts_with("gate") || h.starts_with("up") || h.starts_with("down") {
                "mlp"
            } else {
                "self_attn"
            };
            let module = format!("model.layers.{l}.{part}.{h}");
            let k = ad.index_of(&module).unwrap();
            let (a, b) = (&ad.pairs[k].a, &ad.pairs[k].b);
            let (out_f, r) = b.dims2().unwrap();
            for (suffix, t) in [("lora_a", a), ("lora_b", b)] {
                let name = format!("blk.{l}.{g}.weight.{suffix}");
                let info = &c.tensor_infos[&name];
                // candle lists dims slowest first (GGUF's ne reversed): A (r, in), B (out, r),
                // i.e. ne = [in, r] and [r, out] as llama-adapter.cpp checks. Stored as f32.
                assert_eq!(info.shape.dims(), t.dims(), "{name}");
                assert_eq!(
                    info.ggml_dtype,
                    candle_core::quantized::GgmlDType::F32,
                    "{name}"
                );
                let q = c.tensor(&mut f, &name, &Device::Cpu).unwrap();
                let got: Vec<f32> = q
                    .dequantize(&Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let mut want: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                if suffix == "lora_b" && (*h == "q_proj" || *h == "k_proj") {
                    let heads = if *h == "q_proj" { 4 } else { 2 };
                    want = ggml_rows(&want, out_f, r, heads);
                }
                assert_eq!(got, want, "{name}");
                want_names.insert(name);
            }
        }
    }
    let names: BTreeSet<String> = c.tensor_infos.keys().cloned().collect();
    assert_eq!(names, want_names);

    // rsLoRA: llama.cpp's alpha / r must equal PEFT's alpha / √r, so alpha·√r is stored.
    let spec = LoraSpec::new(4, 8.0, 0.0, true, &["q_proj".into()]).unwrap();
    let rs_dir = tmp.path().join("rs");
    random_adapter(&base_dir, spec, &rs_dir);
    let rs_out = tmp.path().join("rs.gguf");
    let o = export(&[
        "--run",
        &s(&rs_dir),
        "--format",
        "gguf-lora",
        "--out",
        &s(&rs_out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let c = gguf_file::Content::read(&mut std::fs::File::open(&rs_out).unwrap()).unwrap();
    assert!(matches!(c.metadata["adapter.lora.alpha"], gguf_file::Value::F32(a) if a == 16.0));
    assert_eq!(c.tensor_infos.len(), 4);
}

/// OLMo 2 (`tests/fixtures/tiny-olmo2`: post norms only, whole-width q/k norms) exports as the
/// other families: the merged model's logits equal base + adapter (f32: summation order only,
/// 1e-5 as [`merged_f32_logits_equal_base_plus_adapter`]) with every tensor but the adapted
/// projections copied byte for byte; the LoRA GGUF names llama.cpp's `olmo2` architecture, its
/// tensors `blk.N.<attn_q|...|ffn_down>.weight.lora_{a,b}` exactly the adapter's, q/k rows
/// unpermuted (convert_hf_to_gguf.py's Olmo2Model is no LlamaModel: llama.cpp rotates it
/// NeoX-style).
#[test]
fn olmo2_exports_merged_and_gguf_lora() {
    let tmp = tempfile::tempdir().unwrap();
    let base_dir = fixture("fixtures/tiny-olmo2");
    let adapter_dir = tmp.path().join("adapter");
    let spec = LoraSpec::new(4, 8.0, 0.0, false, &["all-linear".into()]).unwrap();
    let ad = random_adapter(&base_dir, spec.clone(), &adapter_dir);

    let merged = tmp.path().join("merged");
    let o = export(&[
        "--run",
        &s(&adapter_dir),
        "--format",
        "merged",
        "--out",
        &s(&merged),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut base = Model::load(&base_dir, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(base.cfg.arch, &rtune_model::family::OLMO2);
    base.attach(&ad);
    let lc = LoraCtx {
        adapter: &ad,
        scaling: spec.scaling(),
        dropout: 0.0,
        seed: 0,
    };
    // Ids inside the fixture's 256-token vocabulary.
    let ids: Vec<u32> = (0..16u32).map(|i| 1 + i * 15).collect();
    let logits = |m: &Model, lora: Option<&LoraCtx>| {
        let inp = Inputs::new(ids.clone(), 2, 8);
        m.forward(&inp, lora, false).unwrap().logits
    };
    assert_merge_is_base_plus_adapter(&base, &lc, &base_dir, &merged, logits);

    let out = tmp.path().join("lora.gguf");
    let o = export(&[
        "--run",
        &s(&adapter_dir),
        "--format",
        "gguf-lora",
        "--out",
        &s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut f = std::fs::File::open(&out).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let arch = c.metadata["general.architecture"].to_string().unwrap();
    assert_eq!(arch, "olmo2");
    let gg = [
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    let mut want_names = BTreeSet::new();
    for l in 0..2 {
        for (hf, g) in gg {
            let k = ad.index_of(&format!("model.layers.{l}.{hf}")).unwrap();
            for (suffix, t) in [("lora_a", &ad.pairs[k].a), ("lora_b", &ad.pairs[k].b)] {
                let name = format!("blk.{l}.{g}.weight.{suffix}");
                let q = c.tensor(&mut f, &name, &Device::Cpu).unwrap();
                let got = q.dequantize(&Device::Cpu).unwrap();
                assert_eq!(got.dims(), t.dims(), "{name}");
                assert_eq!(
                    raw_bytes(&got),
                    raw_bytes(t),
                    "{name}: rows as transformers has them"
                );
                want_names.insert(name);
            }
        }
    }
    let names: BTreeSet<String> = c.tensor_infos.keys().cloned().collect();
    assert_eq!(names, want_names);
}

#[test]
fn peft_export_and_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run);
    let out = tmp.path().join("peft");
    let o = export(&["--run", &s(&run), "--format", "peft", "--out", &s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let read_cfg = |d: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(d.join("adapter_config.json")).unwrap()).unwrap()
    };
    let (orig, got) = (read_cfg(&run), read_cfg(&out));
    // The run recorded the path relative to where it trained; the export names the base absolutely.
    assert_eq!(orig["base_model_name_or_path"], "tests/fixtures/tiny-llama");
    let abs = fixture("fixtures/tiny-llama").canonicalize().unwrap();
    assert_eq!(got["base_model_name_or_path"], s(&abs));
    for k in [
        "r",
        "lora_alpha",
        "target_modules",
        "use_rslora",
        "peft_type",
    ] {
        assert_eq!(got[k], orig[k], "{k}");
    }
    let w = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
    assert_eq!(w(&out), w(&run));
    // The adapter's two files and the marker `--force` checks.
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            ".rtune-export",
            "adapter_config.json",
            "adapter_model.safetensors"
        ]
    );

    // An existing output is refused, then replaced with --force.
    let o = export(&["--run", &s(&run), "--format", "peft", "--out", &s(&out)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("already exists; pass --force"),
        "{}",
        stderr(&o)
    );
    let args = [
        "--run",
        &s(&run),
        "--format",
        "peft",
        "--out",
        &s(&out),
        "--checkpoint",
        "2",
        "--force",
    ];
    let o = export(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(w(&out), w(&run.join("checkpoint-2")));
    assert_ne!(w(&out), w(&run));

    // Never onto the run itself, even with --force.
    let o = export(&[
        "--run",
        &s(&run),
        "--format",
        "peft",
        "--out",
        &s(&run),
        "--force",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("choose another --out"),
        "{}",
        stderr(&o)
    );

    // A checkpoint that does not exist, and one that fails its manifest.
    let o = export(&[
        "--run",
        &s(&run),
        "--format",
        "peft",
        "--out",
        &s(&tmp.path().join("x")),
        "--checkpoint",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("no checkpoint-3 (available: 2, 4)"),
        "{}",
        stderr(&o)
    );
    let bad = run.join("checkpoint-2/adapter_model.safetensors");
    let mut bytes = std::fs::read(&bad).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 1;
    std::fs::write(&bad, bytes).unwrap();
    let o = export(&[
        "--run",
        &s(&run),
        "--format",
        "peft",
        "--out",
        &s(&tmp.path().join("x")),
        "--checkpoint",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("manifest.json"), "{}", stderr(&o));
    assert!(!tmp.path().join("x").exists());
}

#[test]
fn bad_input_exits_2_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let out = |n: &str| s(&tmp.path().join(n));

    // Unknown format: clap's usage error.
    let o = export(&["--run", "x", "--format", "onnx", "--out", &out("o")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("onnx"), "{}", stderr(&o));

    // A run that did not finish: no final adapter; the message says how to export a checkpoint.
    let unfinished = tmp.path().join("unfinished");
    std::fs::create_dir_all(unfinished.join("checkpoint-5")).unwrap();
    std::fs::write(
        unfinished.join("run.json"),
        r#"{"model_path": "tests/fixtures/tiny-llama"}"#,
    )
    .unwrap();
    let o = export(&[
        "--run",
        &s(&unfinished),
        "--format",
        "merged",
        "--out",
        &out("m"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("no final adapter") && e.contains("--checkpoint N (available: 5)"),
        "{e}"
    );

    // Not a directory at all.
    let o = export(&[
        "--run",
        &out("missing"),
        "--format",
        "peft",
        "--out",
        &out("p"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("not a directory"), "{}", stderr(&o));

    // A base that cannot be found: merged refuses and says what to pass; peft keeps the name.
    let adapter_dir = tmp.path().join("adapter");
    let spec = LoraSpec::new(2, 4.0, 0.0, false, &["q_proj".into()]).unwrap();
    random_adapter(&fixture("fixtures/tiny-llama"), spec, &adapter_dir);
    let cfg_path = adapter_dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    let base_abs = s(&fixture("fixtures/tiny-llama"));
    std::fs::write(&cfg_path, text.replace(&base_abs, "no/such-model")).unwrap();
    let o = export(&[
        "--run",
        &s(&adapter_dir),
        "--format",
        "merged",
        "--out",
        &out("m"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("no/such-model") && stderr(&o).contains("--base DIR"),
        "{}",
        stderr(&o)
    );
    let o = export(&[
        "--run",
        &s(&adapter_dir),
        "--format",
        "peft",
        "--out",
        &out("p"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg = std::fs::read_to_string(tmp.path().join("p/adapter_config.json")).unwrap();
    assert!(
        cfg.contains("\"base_model_name_or_path\": \"no/such-model\""),
        "{cfg}"
    );

    // A base of another shape: the adapter does not fit it.
    let o = export(&[
        "--run",
        &s(&adapter_dir),
        "--base",
        &s(&root().join("tests/fixtures/tiny-llama3")),
        "--format",
        "gguf-lora",
        "--out",
        &out("x.gguf"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("lora_A"), "{}", stderr(&o));
    assert!(!PathBuf::from(out("x.gguf")).exists());
}

/// Every file under `dir` (recursively) with its bytes: what must be unchanged after a refusal.
/// The run's lock file is left out: each export takes the lock, and writes its pid there.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if e.file_name() == rtune_fsio::LOCK_FILE {
            continue;
        }
        if e.file_type().unwrap().is_dir() {
            v.extend(snapshot(&p));
        } else {
            v.push((p.clone(), std::fs::read(&p).unwrap()));
        }
    }
    v.sort();
    v
}

/// Issue 35, a hostile trial: `--out RUN/adapter_model.safetensors --force` replaced the trained
/// adapter with a GGUF file, and `--out MODEL/config.json` (or a weight file of the base) the
/// base's file. Any `--out` inside (or equal to) the run or the base model directory, reached
/// directly, through `..` or through a symlink, is refused in every format, with or without
/// --force: exit 2, one line naming the path, nothing written. `--force` still replaces a file an
/// earlier export wrote, but not a symlink to a file elsewhere.
#[test]
fn export_never_writes_into_the_run_or_the_base() {
    let tmp = tempfile::tempdir().unwrap();
    // A copy of the base: a bug here must not damage the repository's fixture.
    let base = tmp.path().join("models/base");
    std::fs::create_dir_all(&base).unwrap();
    for e in std::fs::read_dir(fixture("fixtures/tiny-llama")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), base.join(e.file_name())).unwrap();
    }
    let run = tmp.path().join("run");
    train_tiny_on(&run, &s(&base));
    std::os::unix::fs::symlink(&run, tmp.path().join("run-link")).unwrap();
    let (run_before, base_before) = (snapshot(&run), snapshot(&base));
    let targets = [
        run.join("adapter_model.safetensors"),
        run.join("adapter_config.json"),
        run.join("checkpoint-2/adapter_model.safetensors"),
        run.join("new/sub/lora.gguf"),
        run.join("export"),
        base.join("config.json"),
        base.join("model.safetensors"),
        base.join("merged"),
        tmp.path().join("run-link/adapter_model.safetensors"),
        tmp.path().join("models/other/../base/config.json"),
        tmp.path().join("nope/../run/summary.json"),
    ];
    let r = s(&run);
    for format in ["gguf-lora", "peft", "merged"] {
        for out in &targets {
            for force in [true, false] {
                let mut args = vec!["--run", &r, "--format", format];
                let o_s = s(out);
                args.extend(["--out", &o_s]);
                if force {
                    args.push("--force");
                }
                let o = export(&args);
                let e = stderr(&o);
                assert_eq!(o.status.code(), Some(2), "{format} {out:?} {force}: {e}");
                assert_eq!(e.trim().lines().count(), 1, "one line: {e}");
                assert!(
                    e.contains(&o_s) && (e.contains("is inside") || e.contains("holds one")),
                    "{format} {out:?}: {e}"
                );
            }
        }
    }
    assert!(snapshot(&run) == run_before, "the run changed");
    assert!(snapshot(&base) == base_before, "the base changed");
    assert!(!tmp.path().join("nope").exists() && !tmp.path().join("models/other").exists());

    // --force replaces a file an earlier export wrote ...
    let gguf = tmp.path().join("lora.gguf");
    let gguf_s = s(&gguf);
    let args = ["--run", &r, "--format", "gguf-lora", "--out", &gguf_s];
    let o = export(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = export(&[&args[..], &["--force"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    // ... but neither a symlink to a file elsewhere nor a directory.
    let mine = tmp.path().join("mine.txt");
    std::fs::write(&mine, "mine").unwrap();
    let link = tmp.path().join("link.gguf");
    std::os::unix::fs::symlink(&mine, &link).unwrap();
    let dir = tmp.path().join("dir.gguf");
    std::fs::create_dir(&dir).unwrap();
    for out in [&link, &dir] {
        let o = export(&[
            "--run",
            &r,
            "--format",
            "gguf-lora",
            "--out",
            &s(out),
            "--force",
        ]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{out:?}: {e}");
        assert!(e.contains("not a file of its own"), "{e}");
    }
    assert_eq!(std::fs::read_to_string(&mine).unwrap(), "mine");
    assert!(link.is_symlink() && dir.is_dir());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

/// Issue 35: export checked a checkpoint against its manifest.json only when there was one, and
/// the final adapter against nothing, so a flipped byte was exported silently. The final adapter
/// is checked against the hashes run.json recorded when the run completed, a checkpoint against
/// its manifest (required): a mismatch, a missing manifest or missing hashes exit 2 with one line
/// naming the file, and nothing is written.
#[test]
fn export_refuses_an_adapter_it_cannot_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train_tiny(&run);
    let out = tmp.path().join("out");
    let refused = |args: &[&str], want: &[&str]| {
        let mut a = args.to_vec();
        let o_s = s(&out);
        a.extend(["--out", &o_s]);
        let o = export(&a);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
        assert_eq!(e.trim().lines().count(), 1, "one line: {e}");
        for w in want {
            assert!(e.contains(w), "{args:?}: no `{w}` in {e}");
        }
        assert!(!out.exists(), "{args:?}: nothing written");
    };
    let flip = |p: &Path| {
        let mut b = std::fs::read(p).unwrap();
        let n = b.len();
        b[n / 2] ^= 0x10;
        std::fs::write(p, b).unwrap();
    };
    let r = s(&run);
    let weights = run.join("adapter_model.safetensors");
    let good = std::fs::read(&weights).unwrap();

    // The run recorded its final adapter's hashes.
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("run.json")).unwrap()).unwrap();
    let files = record["adapter_files"].as_array().unwrap();
    assert_eq!(files.len(), 2, "{files:?}");

    // A flipped byte in the final adapter: refused in every format.
    flip(&weights);
    for format in ["peft", "merged", "gguf-lora"] {
        refused(
            &["--run", &r, "--format", format],
            &[&s(&weights), "run.json"],
        );
    }
    std::fs::write(&weights, &good).unwrap();
    // So is a changed adapter_config.json.
    let cfg = run.join("adapter_config.json");
    let cfg_good = std::fs::read(&cfg).unwrap();
    std::fs::write(&cfg, [&cfg_good[..], b" "].concat()).unwrap();
    refused(&["--run", &r, "--format", "peft"], &[&s(&cfg), "run.json"]);
    std::fs::write(&cfg, &cfg_good).unwrap();

    // A run.json without the hashes (an older rtune's): refused, saying what to do.
    let mut old = record.clone();
    old.as_object_mut().unwrap().remove("adapter_files");
    std::fs::write(run.join("run.json"), old.to_string()).unwrap();
    refused(
        &["--run", &r, "--format", "peft"],
        &["run.json", "records no SHA-256", "--checkpoint N"],
    );
    std::fs::write(run.join("run.json"), record.to_string()).unwrap();

    // A checkpoint without its manifest: refused, asked for or given as --run.
    let ck = run.join("checkpoint-2");
    std::fs::remove_file(ck.join("manifest.json")).unwrap();
    refused(
        &["--run", &r, "--format", "peft", "--checkpoint", "2"],
        &[&s(&ck.join("manifest.json"))],
    );
    refused(
        &["--run", &s(&ck), "--format", "peft"],
        &[&s(&ck.join("manifest.json"))],
    );

    // With everything back in place the export goes through.
    let o = export(&["--run", &r, "--format", "peft", "--out", &s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
        good
    );
}
