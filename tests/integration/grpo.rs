//! GRPO (issue 44) through `rtune train` on the tiny Llama: completions sampled in the step,
//! scored by a built-in `regex` reward and the Python `command` example
//! (`examples/rewards/contains_answer.py`), rollouts.jsonl's shape, TRL's metric names, the
//! progress line's reward and completion length, and a run killed (-9) and resumed equal to one
//! never interrupted, bit for bit.

use std::path::Path;

use crate::common::{fixture, root, stderr};

/// Prompts with an `answer` column (the command reward reads it).
fn write_prompts(path: &Path) {
    let rows = [
        ("the cat sat on", "e"),
        ("one two three", "a"),
        ("hello world, this is", "o"),
        ("a story about", "t"),
    ];
    let text: String = rows
        .iter()
        .map(|(p, a)| serde_json::json!({"prompt": p, "answer": a}).to_string() + "\n")
        .collect();
    std::fs::write(path, text).unwrap();
}

fn config(t: &Path, out: &Path) -> std::path::PathBuf {
    let cfg = format!(
        r#"[model]
path = "{model}"
[lora]
r = 4
alpha = 8
[data]
train = "{data}"
max_seq_len = 32
[train]
seed = 11
steps = 6
micro_batch_size = 8
grad_accum = 1
lr = 2e-2
objective = "grpo"
num_generations = 4
max_completion_length = 8
temperature = 0.9
top_k = 64
beta = 0.04
num_iterations = 2
[output]
dir = "{out}"
save_every = 2

[[reward]]
name = "format"
kind = "regex"
pattern = "e"

[[reward]]
name = "judge"
kind = "command"
command = ["python3", "{script}"]
weight = 0.5
"#,
        model = fixture("fixtures/tiny-llama").display(),
        data = t.join("prompts.jsonl").display(),
        out = out.display(),
        script = root().join("examples/rewards/contains_answer.py").display(),
    );
    let p = t.join(format!(
        "{}.toml",
        out.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&p, cfg).unwrap();
    p
}

fn rollouts(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("rollouts.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Six steps, two per generation batch (`num_iterations = 2`): three batches of 2 prompts × 4
/// completions in rollouts.jsonl, each line with every field, its `train_row` a shuffle of the
/// batch; each group's advantages sum to 0
/// (scale_rewards = "group", 1e-4: f32 sums of ~1-sized values); TRL's metric names; step 1's
/// KL is 0 (the reference is the base and the fresh adapter adds nothing: 1e-6, f32 rounding
/// of two forwards). Killed after step 3 and resumed: the same adapter, metrics and rollouts.
#[test]
fn grpo_trains_writes_rollouts_and_resumes_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    write_prompts(&t.join("prompts.jsonl"));
    let reference = t.join("reference");
    let o = crate::resume::train(&config(t, &reference), &[]);
    assert!(o.status.success(), "{}", stderr(&o));

    let lines = rollouts(&reference);
    assert_eq!(lines.len(), 3 * 8, "3 generation batches of 8 completions");
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"].as_u64().unwrap(), 1 + 2 * (i / 8) as u64, "{l}");
        let ids = l["completion_ids"].as_array().unwrap();
        assert!((1..=8).contains(&ids.len()), "{l}");
        // EOS (2) ends a completion and stays in it; a truncated one has none.
        let ends_eos = ids.last().unwrap().as_u64() == Some(2);
        assert_eq!(l["truncated"].as_bool().unwrap(), !ends_eos, "{l}");
        assert!(!l["prompt_ids"].as_array().unwrap().is_empty(), "{l}");
        assert!(l["completion"].is_string(), "{l}");
        assert!(l["prompt_index"].as_u64().unwrap() < 4, "{l}");
        let r = l["rewards"].as_object().unwrap();
        let (f, j) = (r["format"].as_f64().unwrap(), r["judge"].as_f64().unwrap());
        let text = l["completion"].as_str().unwrap();
        assert_eq!(f, f64::from(u8::from(text.contains('e'))), "{l}");
        let total = l["reward"].as_f64().unwrap();
        assert!((total - (f + 0.5 * j)).abs() <= 1e-6, "{l}");
        assert!(l["advantage"].as_f64().unwrap().is_finite(), "{l}");
    }
    // TRL shuffles a generation batch before splitting it into micro-batches: each line's
    // `train_row` is its row in the shuffled batch, a permutation of the batch's rows.
    let orders: Vec<Vec<u64>> = (lines.chunks(8))
        .map(|b| b.iter().map(|l| l["train_row"].as_u64().unwrap()).collect())
        .collect();
    for o in &orders {
        let mut sorted = o.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..8).collect::<Vec<u64>>(), "{o:?}");
    }
    assert!(
        orders
            .iter()
            .any(|o| o.iter().enumerate().any(|(i, &k)| k != i as u64)),
        "no batch was shuffled: {orders:?}"
    );
    for g in lines.chunks(4) {
        let p = g[0]["prompt_index"].as_u64();
        assert!(
            g.iter().all(|l| l["prompt_index"].as_u64() == p),
            "a group is one prompt"
        );
        let sum: f64 = g.iter().map(|l| l["advantage"].as_f64().unwrap()).sum();
        assert!(sum.abs() <= 1e-4, "group advantages sum to {sum}");
    }

    let metrics = crate::resume::metrics(&reference);
    let steps: Vec<_> = metrics.iter().filter(|m| m["loss"].is_f64()).collect();
    assert_eq!(steps.len(), 6);
    for m in &steps {
        for k in [
            "reward",
            "reward_std",
            "rewards/format/mean",
            "rewards/format/std",
            "rewards/judge/mean",
            "frac_reward_zero_std",
            "completions/mean_length",
            "completions/min_length",
            "completions/max_length",
            "completions/clipped_ratio",
            "kl",
            "entropy",
            "clip_ratio/region_mean",
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
        ] {
            assert!(m.get(k).is_some(), "{k} missing: {m}");
        }
        assert!(m["loss"].as_f64().unwrap().is_finite(), "{m}");
        // A mean token entropy: above 0 (sampled at T = 0.9 from a near-uniform tiny model),
        // at most ln(vocab) = ln(512) (the replay parity checks its value against TRL's).
        let h = m["entropy"].as_f64().unwrap();
        assert!(h > 0.0 && h <= (512f64).ln() + 1e-4, "entropy {h}: {m}");
    }
    // The progress line (plain on a pipe) shows the step's reward and completion length.
    let last = steps[5];
    let line = format!(
        "reward {:.3}  len {:.1}",
        last["reward"].as_f64().unwrap(),
        last["completions/mean_length"].as_f64().unwrap()
    );
    let err = stderr(&o);
    assert!(
        err.lines()
            .any(|l| l.contains("step     6/6") && l.contains(&line)),
        "no progress line with `{line}`: {err}"
    );
    assert!(
        steps[0]["kl"].as_f64().unwrap().abs() <= 1e-6,
        "{}",
        steps[0]
    );
    // Step 2 trains on step 1's batch after one update: a KL to the reference now.
    assert!(steps[1]["kl"].as_f64().unwrap() > 0.0, "{}", steps[1]);

    let out = t.join("killed");
    let cfg = config(t, &out);
    crate::resume::kill_then_resume_equals(&cfg, &out, 3, &reference);
    assert_eq!(crate::resume::metrics(&out), metrics, "metrics differ");
    assert_eq!(rollouts(&out), lines, "rollouts differ");
}

/// Issue 46's rule for the new file: a link planted at rollouts.jsonl in a run directory is
/// refused before anything is written, and what it points to is left as it was.
#[test]
fn a_linked_rollouts_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    write_prompts(&t.join("prompts.jsonl"));
    let out = t.join("linked");
    std::fs::create_dir(&out).unwrap();
    let victim = t.join("victim.txt");
    std::fs::write(&victim, "keep me").unwrap();
    std::os::unix::fs::symlink(&victim, out.join("rollouts.jsonl")).unwrap();
    let o = crate::resume::train(&config(t, &out), &[]);
    assert!(!o.status.success(), "a linked rollouts.jsonl was accepted");
    assert!(stderr(&o).contains("rollouts.jsonl"), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
}
