//! Shared helpers: paths, golden files, relative errors.

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(rel: &str) -> PathBuf {
    root().join("tests").join(rel)
}

pub struct Golden {
    pub t: HashMap<String, Tensor>,
    pub meta: serde_json::Value,
}

impl Golden {
    pub fn load(path: &Path) -> Self {
        let t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
        let bytes = std::fs::read(path).unwrap();
        let (_, st_meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let cfg = st_meta
            .metadata()
            .as_ref()
            .unwrap()
            .get("config")
            .unwrap()
            .clone();
        Self {
            t,
            meta: serde_json::from_str(&cfg).unwrap(),
        }
    }

    pub fn get(&self, k: &str) -> &Tensor {
        self.t.get(k).unwrap_or_else(|| panic!("golden has no {k}"))
    }

    /// The golden's batch as a JSONL data file (`input_ids` and `labels` per row, already
    /// tokenized), what the CLI trains on to repeat the golden's AdamW loop.
    pub fn write_batch(&self, path: &Path) {
        let ids = self.get("input_ids").to_vec2::<i64>().unwrap();
        let labels = self.get("labels").to_vec2::<i64>().unwrap();
        let mut jsonl = String::new();
        for (i, l) in ids.iter().zip(&labels) {
            jsonl += &serde_json::json!({"input_ids": i, "labels": l}).to_string();
            jsonl.push('\n');
        }
        std::fs::write(path, jsonl).unwrap();
    }
}

/// `max|got − want| / max|want|`.
pub fn rel_err(got: &Tensor, want: &Tensor) -> f64 {
    let got = got.to_dtype(candle_core::DType::F64).unwrap();
    let want = want.to_dtype(candle_core::DType::F64).unwrap();
    assert_eq!(got.dims(), want.dims());
    let scale = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
        .max(1e-30);
    let err = (got - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    err / scale
}

/// Runs the `rtune` binary in the repository root with extra environment variables.
pub fn rtune_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rtune"));
    c.args(args).current_dir(root());
    // The tokenized-data cache of tests stays out of the user's cache directory.
    c.env(
        "RTUNE_CACHE",
        std::env::temp_dir().join(format!("rtune-test-cache-{}", std::process::id())),
    );
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run rtune")
}

pub fn rtune(args: &[&str]) -> Output {
    rtune_env(args, &[])
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The run's `adapter_model.safetensors`, checked to hold as many tensors as the golden's trained
/// adapter (`adamw.base_model.*`).
pub fn trained_adapter(
    out: &Path,
    g: &Golden,
) -> std::collections::HashMap<String, candle_core::Tensor> {
    let adapter = candle_core::safetensors::load(
        out.join("adapter_model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let n_golden =
        g.t.keys()
            .filter(|k| k.starts_with("adamw.base_model"))
            .count();
    assert_eq!(adapter.len(), n_golden);
    adapter
}

/// The run in `out` repeated the golden's AdamW loop: each step's loss in metrics.jsonl within
/// 1e-5 relative of PEFT's, and every trained tensor within 1e-4 of its largest entry (f32 CPU:
/// two implementations summing in different orders stay well inside).
pub fn assert_trained_as_golden(out: &Path, g: &Golden) {
    for (k, t) in &trained_adapter(out, g) {
        let e = rel_err(t, g.get(&format!("adamw.{k}")));
        assert!(e <= 1e-4, "{k}: rel err {e:e}");
    }
    let want: Vec<f32> = g.get("adamw.loss").to_vec1().unwrap();
    let losses = train_losses(out);
    assert_eq!(losses.len(), want.len(), "{losses:?}");
    for (l, w) in losses.iter().zip(&want) {
        let w = *w as f64;
        assert!((l - w).abs() / w <= 1e-5, "loss {l} vs PEFT's {w}");
    }
}

/// Writes under `t` a run that repeats the golden's AdamW loop through `rtune train`: the
/// golden's batch (`batch.jsonl`), its `init.*` adapter (`init/`) and `run.toml` with `[model]`
/// `path = model` and `model_lines`, `[lora]` with the golden's r and α and `lora_lines` (what is
/// adapted), 3 constant-lr steps over the whole batch, no clipping, checkpointing, output in
/// `out/`. Returns the config's path.
pub fn golden_loop_config(
    g: &Golden,
    t: &Path,
    model: &Path,
    model_lines: &str,
    lora_lines: &str,
) -> PathBuf {
    g.write_batch(&t.join("batch.jsonl"));
    write_init_adapter(g, &t.join("init"));
    let (b, seq) = g.get("input_ids").dims2().unwrap();
    let cfg = format!(
        r#"[model]
path = "{model}"
{model_lines}
[lora]
r = {r}
alpha = {alpha}
{lora_lines}
init_from = "{init}"
[data]
train = "{data}"
max_seq_len = {seq}
shuffle = false
[train]
steps = 3
micro_batch_size = {b}
lr = 1e-3
schedule = "constant"
max_grad_norm = 0.0
gradient_checkpointing = true
[output]
dir = "{out}"
"#,
        model = model.display(),
        r = g.meta["r"],
        alpha = g.meta["lora_alpha"],
        init = t.join("init").display(),
        data = t.join("batch.jsonl").display(),
        out = t.join("out").display(),
    );
    let path = t.join("run.toml");
    std::fs::write(&path, cfg).unwrap();
    path
}

/// `rtune export --run run --base base --format merged --out dest`, which must succeed.
pub fn export_merged(run: &Path, base: &Path, dest: &Path) {
    let o = rtune(&[
        "export",
        "--run",
        run.to_str().unwrap(),
        "--base",
        base.to_str().unwrap(),
        "--format",
        "merged",
        "--out",
        dest.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Every training step's `loss` in the run `out`'s metrics.jsonl, in order.
pub fn train_losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|m| m["loss"].as_f64())
        .collect()
}

/// Writes the golden's `init.*` LoRA weights as a PEFT adapter directory (what `init_from`
/// reads): `adapter_model.safetensors` under PEFT's names and an `adapter_config.json`.
pub fn write_init_adapter(g: &Golden, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let init: std::collections::HashMap<String, candle_core::Tensor> =
        g.t.iter()
            .filter_map(|(k, t)| Some((k.strip_prefix("init.")?.to_string(), t.clone())))
            .collect();
    candle_core::safetensors::save(&init, dir.join("adapter_model.safetensors")).unwrap();
    let cfg = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": g.meta["r"],
        "lora_alpha": g.meta["lora_alpha"],
        "target_modules": g.meta["target_modules"],
        "target_parameters": g.meta["target_parameters"],
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": false,
        "use_dora": false,
    });
    std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).unwrap();
}
