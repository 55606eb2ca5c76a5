//! Preference training (`[train] objective`) through `rtune train` against TRL 1.16's trainers
//! (`tests/parity/make_pref_goldens.py`, which says how the batch is fixed on both sides): the
//! same text pairs (TRL's tokenization repeated), the golden's starting adapter (`init_from`: TRL's
//! frozen "ref" copy is the reference policy), one micro-batch of all 4 pairs, 3 AdamW steps.
//!
//! Tolerances (f32 CPU): each step's loss and TRL's metrics within 1e-5 of max(1, |value|): a
//! relative 1e-5 for values above 1, absolute below, since some are differences of log-probs of
//! magnitude ~20 (the rewards start at exactly 0 on TRL's side; hinge's 1 − β·Δ loses digits to
//! the cancellation: measured 5e-6 at 0.38); the trained adapter within 1e-4 of its largest
//! entry. Two f32 implementations summing in different orders stay well inside.

use crate::common::{fixture, rel_err, rtune, stderr, write_init_adapter, Golden};
use std::path::Path;

/// TRL's logged metrics, each compared where the golden's trainer logs it (KTO: no accuracies,
/// a `kl`; SimPO and ORPO: an `nll_loss`; a mixture-of-experts model: `aux_loss`).
const METRICS: [&str; 9] = [
    "aux_loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
    "kl",
];

fn golden() -> Golden {
    Golden::load(&fixture("parity/golden_pref.safetensors"))
}

/// The data a variant trains on: DPO's TRL text rows, or (`pretokenized`) the ids TRL's DPO
/// tokenization gave, under TRL's column names; `dpo_chat`'s conversational rows (rendered with
/// the tiny model's chat template); SimPO's and ORPO's the ids their trainers tokenized
/// (`free_pairs`).
fn write_pairs(g: &Golden, variant: &str, path: &Path, pretokenized: bool) {
    let rows = match &g.meta["free_pairs"][variant] {
        serde_json::Value::Array(rows) => rows,
        _ if variant.starts_with("kto") => g.meta["kto_rows"].as_array().unwrap(),
        _ if variant == "dpo_chat" => g.meta["chat_pairs"].as_array().unwrap(),
        _ if pretokenized => g.meta["pairs"].as_array().unwrap(),
        _ => g.meta["text_pairs"].as_array().unwrap(),
    };
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(path, text).unwrap();
}

/// `[train]` lines for the golden's variant (objective and TRL's knobs).
fn train_keys(g: &Golden, variant: &str) -> String {
    if let Some(v) = g.meta["kto_variants"].get(variant) {
        return format!(
            "objective = \"kto\"\nbeta = {}\ndesirable_weight = {}\nundesirable_weight = {}\n",
            v["beta"], v["desirable_weight"], v["undesirable_weight"]
        );
    }
    if let Some(v) = g.meta["free_variants"].get(variant) {
        return match v.get("loss_type") {
            Some(_) => format!(
                "objective = \"simpo\"\nbeta = {}\nsimpo_gamma = {}\ncpo_alpha = {}\nlabel_smoothing = {}\n",
                v["beta"], v["simpo_gamma"], v["cpo_alpha"], v["label_smoothing"]
            ),
            None => format!("objective = \"orpo\"\nbeta = {}\n", v["beta"]),
        };
    }
    let v = &g.meta["variants"][variant];
    format!(
        "objective = \"dpo\"\nloss_type = \"{}\"\nbeta = {}\nlabel_smoothing = {}\n",
        v["loss_type"].as_str().unwrap(),
        v["beta"],
        v["label_smoothing"]
    )
}

/// Trains the golden's variant through the CLI and returns the run directory's metrics lines.
fn train(g: &Golden, variant: &str, pretokenized: bool, t: &Path) -> Vec<serde_json::Value> {
    write_pairs(g, variant, &t.join("pairs.jsonl"), pretokenized);
    train_on(
        g,
        variant,
        "fixtures/tiny-llama",
        "targets = \"all-linear\"",
        t,
    )
}

/// Trains the golden's variant on `t/pairs.jsonl` through the CLI, the model `model` (under
/// tests/) with `[lora]` lines `targets` and the golden's init adapter; the metrics lines.
pub(crate) fn train_on(
    g: &Golden,
    variant: &str,
    model: &str,
    targets: &str,
    t: &Path,
) -> Vec<serde_json::Value> {
    write_init_adapter(g, &t.join("init"));
    let cfg = format!(
        r#"[model]
path = "{model}"
[lora]
r = {r}
alpha = {alpha}
{targets}
init_from = "{init}"
[data]
train = "{data}"
max_seq_len = 64
shuffle = false
cache_dir = "{cache}"
[train]
steps = 3
micro_batch_size = {mbs}
lr = 1e-3
schedule = "constant"
max_grad_norm = 0.0
gradient_checkpointing = true
{keys}[output]
dir = "{out}"
"#,
        model = fixture(model).display(),
        r = g.meta["r"],
        alpha = g.meta["lora_alpha"],
        init = t.join("init").display(),
        data = t.join("pairs.jsonl").display(),
        keys = train_keys(g, variant),
        cache = t.join("cache").display(),
        // One batch of all rows: KTO's 8 unpaired rows (its KL completions are cycled within a
        // batch), or 4 pairs.
        mbs = if variant.starts_with("kto") { 8 } else { 4 },
        out = t.join("out").display(),
    );
    std::fs::write(t.join("run.toml"), cfg).unwrap();
    let o = rtune(&["train", "--config", t.join("run.toml").to_str().unwrap()]);
    assert!(o.status.success(), "{variant}: {}", stderr(&o));
    let metrics = std::fs::read_to_string(t.join("out/metrics.jsonl")).unwrap();
    metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The run in `t/out` repeated the golden's variant: losses, TRL's metrics, the adapter (A and
/// B of 7 modules in 2 layers).
fn assert_as_trl(g: &Golden, variant: &str, lines: &[serde_json::Value], t: &Path) {
    assert_as_trl_with(g, variant, lines, t, 2 * 7 * 2);
}

/// [`assert_as_trl`] for an adapter of `tensors` tensors.
pub(crate) fn assert_as_trl_with(
    g: &Golden,
    variant: &str,
    lines: &[serde_json::Value],
    t: &Path,
    tensors: usize,
) {
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|l| l["loss"].is_f64()).collect();
    let want: Vec<f32> = g.get(&format!("{variant}.loss")).to_vec1().unwrap();
    assert_eq!(steps.len(), want.len());
    let mut worst = 0f64;
    for (m, w) in steps.iter().zip(&want) {
        let (l, w) = (m["loss"].as_f64().unwrap(), *w as f64);
        worst = worst.max((l - w).abs() / w.abs().max(1.0));
        assert!(
            (l - w).abs() <= 1e-5 * w.abs().max(1.0),
            "{variant}: loss {l} vs TRL's {w}"
        );
        for k in METRICS
            .iter()
            .filter(|k| g.t.contains_key(&format!("{variant}.{k}")))
        {
            let want: Vec<f32> = g.get(&format!("{variant}.{k}")).to_vec1().unwrap();
            let i = m["step"].as_u64().unwrap() as usize - 1;
            let (got, w) = (m[k].as_f64().unwrap(), want[i] as f64);
            assert!(
                (got - w).abs() <= 1e-5 * w.abs().max(1.0),
                "{variant} step {}: {k} {got} vs TRL's {w}",
                i + 1
            );
        }
    }
    let adapter = candle_core::safetensors::load(
        t.join("out/adapter_model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert_eq!(adapter.len(), tensors, "{variant}: the adapter's tensors");
    let mut worst_adapter = 0f64;
    for (k, a) in &adapter {
        let e = rel_err(a, g.get(&format!("{variant}.adamw.{k}")));
        worst_adapter = worst_adapter.max(e);
        assert!(e <= 1e-4, "{variant}: {k}: rel err {e:e}");
    }
    eprintln!(
        "{variant}: loss err {worst:e} (of max(1, |loss|)), adapter rel err {worst_adapter:e}"
    );
}

/// DPO's sigmoid loss (TRL's default) from text pairs: TRL's tokenization, loss, metrics, adapter.
#[test]
fn dpo_sigmoid_trains_as_trl() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let lines = train(&g, "dpo_sigmoid", false, tmp.path());
    assert_as_trl(&g, "dpo_sigmoid", &lines, tmp.path());
    // The reference pass ran once: one forward pass for the 4 pairs (micro-batch 4), before
    // training, none after.
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("out/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["reference_passes"], 1, "{summary}");
    assert_eq!(summary["examples"], 4, "{summary}");
    // Again on the same pairs, model and starting adapter: the reference log-probs come from
    // the cache beside the token cache (no pass), and the run is the same to the bit.
    let first = std::fs::read(tmp.path().join("out/adapter_model.safetensors")).unwrap();
    std::fs::rename(tmp.path().join("out"), tmp.path().join("first")).unwrap();
    train(&g, "dpo_sigmoid", false, tmp.path());
    let (out, first_dir) = (tmp.path().join("out"), tmp.path().join("first"));
    assert_eq!(
        crate::resume::metrics(&out),
        crate::resume::metrics(&first_dir),
        "metrics of the cached run"
    );
    let summary = std::fs::read_to_string(tmp.path().join("out/summary.json")).unwrap();
    assert!(!summary.contains("reference_passes"), "no pass: {summary}");
    let adapter = std::fs::read(tmp.path().join("out/adapter_model.safetensors")).unwrap();
    assert!(
        adapter == first,
        "the cached reference trains the same adapter"
    );
    // A different starting adapter is another reference: computed again.
    let init = tmp.path().join("init/adapter_model.safetensors");
    let mut t = candle_core::safetensors::load(&init, &candle_core::Device::Cpu).unwrap();
    let k = t.keys().next().unwrap().clone();
    let bumped = (t[&k].clone() * 1.01).unwrap();
    t.insert(k, bumped);
    candle_core::safetensors::save(&t, &init).unwrap();
    std::fs::remove_dir_all(tmp.path().join("out")).unwrap();
    let o = rtune(&[
        "train",
        "--config",
        tmp.path().join("run.toml").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("out/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["reference_passes"], 1, "recomputed: {summary}");
}

/// Issue 46: the reference cache had no integrity check: finite garbage of the right size
/// trained to loss 0 and accuracy 1 (a NaN, to "try a lower lr"). A file whose content does not
/// match its checksum is recomputed with a warning naming it, and the run is the first one's.
#[test]
fn a_corrupt_reference_cache_is_recomputed() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let first = train(&g, "dpo_sigmoid", false, tmp.path());
    let dir = tmp.path().join("cache/reference");
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one cache file");
    let path = files[0].path();
    let mut bytes = std::fs::read(&path).unwrap();
    for (garbage, what) in [(-1e3f64, "finite garbage"), (f64::NAN, "a NaN")] {
        // The first pair's chosen reference, as the file lays it out (after magic and count).
        bytes[16..24].copy_from_slice(&garbage.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        std::fs::remove_dir_all(tmp.path().join("out")).unwrap();
        let o = rtune(&[
            "train",
            "--config",
            tmp.path().join("run.toml").to_str().unwrap(),
        ]);
        let log = stderr(&o);
        assert!(o.status.success(), "{what}: {log}");
        assert!(
            log.contains(&path.display().to_string()) && log.contains("do not verify"),
            "{what}: {log}"
        );
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(tmp.path().join("out/summary.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(summary["reference_passes"], 1, "{what}: {summary}");
        let again = crate::resume::metrics(&tmp.path().join("out"));
        let want: Vec<serde_json::Value> = first.iter().map(|l| l["loss"].clone()).collect();
        let got: Vec<serde_json::Value> = again.iter().map(|l| l["loss"].clone()).collect();
        assert_eq!(got, want, "{what}: the losses of the uncorrupted run");
    }
}

/// Conversational rows (TRL's format: messages rendered with the model's chat template, the
/// completion split where the prompt's render with the generation prompt ends).
#[test]
fn dpo_conversational_rows_train_as_trl() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let lines = train(&g, "dpo_chat", false, tmp.path());
    assert_as_trl(&g, "dpo_chat", &lines, tmp.path());
}

/// Each other DPO loss type (sigmoid at another β, hinge, IPO's per-token averages, robust), from
/// TRL's pre-tokenized columns.
#[test]
fn dpo_loss_types_train_as_trl() {
    let g = golden();
    for variant in ["dpo_sigmoid_b05", "dpo_hinge", "dpo_ipo", "dpo_robust"] {
        let tmp = tempfile::tempdir().unwrap();
        let lines = train(&g, variant, true, tmp.path());
        assert_as_trl(&g, variant, &lines, tmp.path());
    }
}

/// SimPO (TRL's CPOTrainer with loss_type "simpo": per-token averages, the margin γ, the NLL term
/// weighted by cpo_alpha; also with label smoothing) and ORPO (the NLL over prompt and response,
/// the odds ratio): reference-free, so no reference pass runs.
#[test]
fn simpo_and_orpo_train_as_trl() {
    let g = golden();
    for variant in ["simpo", "simpo_ls", "orpo"] {
        let tmp = tempfile::tempdir().unwrap();
        let lines = train(&g, variant, true, tmp.path());
        assert_as_trl(&g, variant, &lines, tmp.path());
        let summary = std::fs::read_to_string(tmp.path().join("out/summary.json")).unwrap();
        assert!(!summary.contains("reference_passes"), "{summary}");
    }
}

/// A new adapter's reference is the base (TRL disables the adapter): with B = 0 the policy is the
/// base, so step 1's DPO loss is log 2 and its rewards 0 (to f32 rounding, 1e-6). Validation
/// reports TRL's `eval_` metrics and no perplexity. A run killed (-9) after step 5 and resumed
/// equals one never interrupted, bit for bit (dropout, shuffling across epochs, accumulation,
/// the reference log-probs computed again from the starting adapter).
#[test]
fn dpo_fresh_adapter_validates_and_resumes_bitwise() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    write_pairs(&g, "dpo_sigmoid", &t.join("pairs.jsonl"), false);
    let config = |out: &Path| {
        let cfg = format!(
            r#"[model]
path = "{model}"
[lora]
r = 4
alpha = 8
dropout = 0.1
[data]
train = "{data}"
valid = "{data}"
max_seq_len = 64
[train]
seed = 7
steps = 12
micro_batch_size = 1
grad_accum = 2
lr = 5e-3
eval_every = 4
objective = "dpo"
beta = 0.5
[output]
dir = "{out}"
save_every = 3
"#,
            model = fixture("fixtures/tiny-llama").display(),
            data = t.join("pairs.jsonl").display(),
            out = out.display(),
        );
        let p = t.join(format!(
            "{}.toml",
            out.file_name().unwrap().to_string_lossy()
        ));
        std::fs::write(&p, cfg).unwrap();
        p
    };
    let reference = t.join("reference");
    let o = crate::resume::train(&config(&reference), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = crate::resume::metrics(&reference);
    let first = &lines[0];
    assert!(
        (first["loss"].as_f64().unwrap() - 2f64.ln()).abs() <= 1e-6,
        "{first}"
    );
    for k in ["rewards/chosen", "rewards/rejected", "rewards/margins"] {
        assert!(first[k].as_f64().unwrap().abs() <= 1e-6, "{k}: {first}");
    }
    let evals: Vec<_> = lines.iter().filter(|l| l["valid_loss"].is_f64()).collect();
    assert_eq!(evals.len(), 3, "steps 4, 8, 12");
    for e in &evals {
        assert!(e.get("valid_ppl").is_none(), "{e}");
        let acc = e["eval_rewards/accuracies"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc), "{e}");
    }
    let out = t.join("killed");
    let cfg = config(&out);
    crate::resume::kill_then_resume_equals(&cfg, &out, 5, &reference);
    assert_eq!(crate::resume::metrics(&reference), lines);
    assert_eq!(crate::resume::metrics(&out), lines, "metrics differ");
}

/// Issue 46: LongRoPE picks its factors per batch (the long ones past 8 positions in the tiny
/// Phi-4), and the reference pass batched the pairs in file order: a 4-token pair batched with
/// an 11-token one got the long factors' reference, then trained in a batch of short pairs
/// under the short ones (or the reverse). At step 0 the policy is the reference, for every
/// batching: the first loss is log 2 and every reward 0, on the training data and the held-out.
#[test]
fn longrope_references_match_the_policy_in_any_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let pair = |prompt: &[u32], chosen: &[u32], rejected: &[u32]| {
        serde_json::json!({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
            .to_string()
    };
    // 4 tokens (short), 11 (long), 4, 4, in file order: the reference pass's batches of 2 were
    // {4, 11} (long) and {4, 4} (short); shuffled training batches pair them otherwise.
    let rows = [
        pair(&[1, 5], &[6, 2], &[7, 2]),
        pair(
            &[1, 5, 9, 10, 11, 12, 13],
            &[14, 15, 16, 2],
            &[17, 18, 19, 2],
        ),
        pair(&[1, 20], &[21, 2], &[22, 2]),
        pair(&[1, 30], &[31, 2], &[32, 2]),
    ];
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(t.join("pairs.jsonl"), text).unwrap();
    for seed in [1, 2, 3] {
        let out = t.join(format!("out-{seed}"));
        let cfg = format!(
            r#"[model]
path = "{model}"
[lora]
r = 4
alpha = 8
[data]
train = "{data}"
valid = "{data}"
max_seq_len = 32
shuffle = true
[train]
seed = {seed}
steps = 1
micro_batch_size = 2
grad_accum = 2
lr = 1e-9
eval_every = 1
objective = "dpo"
[output]
dir = "{out}"
"#,
            model = fixture("fixtures/tiny-phi4").display(),
            data = t.join("pairs.jsonl").display(),
            out = out.display(),
        );
        let path = t.join(format!("run-{seed}.toml"));
        std::fs::write(&path, cfg).unwrap();
        let o = rtune(&["train", "--config", path.to_str().unwrap()]);
        assert!(o.status.success(), "{}", stderr(&o));
        let lines = crate::resume::metrics(&out);
        let first = &lines[0];
        let loss = first["loss"].as_f64().unwrap();
        assert!((loss - 2f64.ln()).abs() <= 1e-6, "seed {seed}: {first}");
        for k in ["rewards/chosen", "rewards/rejected", "rewards/margins"] {
            assert!(
                first[k].as_f64().unwrap().abs() <= 1e-6,
                "seed {seed}: {k}: {first}"
            );
        }
        // The held-out pass batches in file order, {4, 11} and {4, 4}, after one update of
        // lr 1e-9 (an adapter still at the reference to 1e-6): its rewards are 0 too.
        let eval = lines.iter().find(|l| l["valid_loss"].is_f64()).unwrap();
        let loss = eval["valid_loss"].as_f64().unwrap();
        assert!((loss - 2f64.ln()).abs() <= 1e-6, "seed {seed}: {eval}");
        for k in ["rewards/chosen", "rewards/rejected", "rewards/margins"] {
            let v = eval[format!("eval_{k}")].as_f64().unwrap();
            assert!(v.abs() <= 1e-6, "seed {seed}: eval {k}: {eval}");
        }
    }
}

/// KTO (TRL's KTOTrainer): unpaired text rows with boolean labels, the KL estimate from each row's
/// prompt with the previous row's completion (cycled within the batch, as TRL builds them), the
/// desirable and undesirable weights; reference-based, so the reference pass covers the KL rows.
#[test]
fn kto_trains_as_trl() {
    let g = golden();
    for variant in ["kto", "kto_weighted"] {
        let tmp = tempfile::tempdir().unwrap();
        let lines = train(&g, variant, false, tmp.path());
        assert_as_trl(&g, variant, &lines, tmp.path());
    }
}

/// DPO on the other training paths — NF4 base, bf16, DoRA, bf16-autocast — each with
/// checkpointing and a new adapter: step 1 is the base against itself (loss log 2 within 1e-3:
/// DoRA's magnitude and bf16's rounding move the policy off the base by rounding only), and the
/// run ends with a finite loss and TRL's metrics.
#[test]
fn dpo_runs_on_qlora_bf16_dora_and_autocast() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    write_pairs(&g, "dpo_sigmoid", &t.join("pairs.jsonl"), false);
    for (name, model, lora) in [
        ("nf4", "quantize = \"nf4\"", ""),
        ("bf16", "dtype = \"bf16\"", ""),
        ("dora", "", "dora = true"),
        ("autocast", "dtype = \"bf16-autocast\"", ""),
    ] {
        let out = t.join(name);
        let cfg = format!(
            "[model]\npath = \"{}\"\n{model}\n[lora]\n{lora}\n[data]\ntrain = \"{}\"\n\
             max_seq_len = 64\n[train]\nsteps = 3\nmicro_batch_size = 2\n\
             gradient_checkpointing = true\nobjective = \"dpo\"\n[output]\ndir = \"{}\"\n",
            fixture("fixtures/tiny-llama").display(),
            t.join("pairs.jsonl").display(),
            out.display()
        );
        let path = t.join(format!("{name}.toml"));
        std::fs::write(&path, cfg).unwrap();
        let o = rtune(&["train", "--config", path.to_str().unwrap()]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let lines = crate::resume::metrics(&out);
        let first = lines[0]["loss"].as_f64().unwrap();
        assert!(
            (first - 2f64.ln()).abs() <= 1e-3,
            "{name}: step 1 loss {first}"
        );
        let last = lines.last().unwrap();
        assert!(last["loss"].as_f64().unwrap().is_finite(), "{name}: {last}");
        assert!(last["rewards/accuracies"].is_f64(), "{name}: {last}");
    }
}

/// `rtune data inspect` on pairs: each pair's two sequences, labelled, with their trained
/// (completion) tokens marked, and the pairs counted as pairs.
#[test]
fn inspect_shows_both_sides_of_each_pair() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    write_pairs(&g, "dpo_sigmoid", &t.join("pairs.jsonl"), false);
    let cfg = format!(
        "[model]\npath = \"{}\"\n[data]\ntrain = \"{}\"\nmax_seq_len = 64\n[train]\nobjective = \
         \"dpo\"\n[output]\ndir = \"{}\"\n",
        fixture("fixtures/tiny-llama").display(),
        t.join("pairs.jsonl").display(),
        t.join("out").display()
    );
    std::fs::write(t.join("run.toml"), cfg).unwrap();
    let o = rtune(&[
        "data",
        "inspect",
        "--config",
        t.join("run.toml").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.contains("--- sample 1 (pair 1, chosen)"), "{said}");
    assert!(said.contains("--- sample 2 (pair 1, rejected)"), "{said}");
    // The first pair's completions, marked as trained (the prompt is not).
    assert!(said.contains("A:[[ 4</s>]]"), "{said}");
    assert!(said.contains("A:[[ five, I think</s>]]"), "{said}");
    assert!(said.contains("8 sequences of 4 training pairs"), "{said}");
}
