//! The data pipeline through the binary: `rtune data inspect`, packing, the validation split and
//! evaluation, the tokenized cache, and `[data]` config errors.

use crate::common::{rtune, rtune_env, stderr};

fn lines(out: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn inspect_json_gives_ids_and_masked_labels() {
    let o = rtune(&[
        "data",
        "inspect",
        "--config",
        "configs/smoke.toml",
        "--json",
        "-n",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = lines(&o.stdout);
    assert_eq!(rows.len(), 2);
    let first = std::fs::read_to_string("tests/fixtures/smoke.jsonl").unwrap();
    let row: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    let r = &rows[0];
    let text = r["text"].as_str().unwrap();
    assert!(text.starts_with("<s>"), "one BOS: {text}");
    assert!(!text.starts_with("<s><s>"), "BOS doubled: {text}");
    assert!(text.ends_with(&format!("{}</s>", row["completion"].as_str().unwrap())));
    let ids = r["input_ids"].as_array().unwrap();
    let labels = r["labels"].as_array().unwrap();
    assert_eq!(ids.len(), labels.len());
    // prompt+completion: the prompt is masked, the completion and its EOS are trained as-is.
    let first_trained = labels.iter().position(|l| l != -100).unwrap();
    assert!(first_trained > 3);
    for (i, l) in ids.iter().zip(labels).skip(first_trained) {
        assert_eq!(i, l);
    }
}

#[test]
fn inspect_marks_trained_text_and_prints_a_histogram() {
    let o = rtune(&[
        "data",
        "inspect",
        "--config",
        "configs/smoke.toml",
        "-n",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    // Not a terminal: trained tokens in brackets, the EOS inside them.
    assert!(out.contains("A:[[ A kettle that sings.</s>]]"), "{out}");
    assert!(out.contains("6 training examples"), "{out}");
    assert!(out.contains("lengths (max_seq_len 64)"), "{out}");
}

#[test]
fn packed_run_with_validation_evaluates_and_reuses_the_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let run = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut args = vec![
            "train".to_string(),
            "--config".into(),
            "configs/smoke.toml".into(),
        ];
        for s in [
            format!("output.dir={}", out.display()),
            "train.steps=40".into(),
            "train.eval_every=20".into(),
            "data.valid_fraction=0.34".into(),
            format!("data.cache_dir={}", cache.display()),
        ]
        .iter()
        .map(String::as_str)
        .chain(extra.iter().copied())
        {
            args.push("--set".into());
            args.push(s.to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = rtune_env(&args, &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        (out, stderr(&o))
    };
    let (out, err) = run("packed", &["data.packing=true"]);
    assert!(err.contains("tokenised at"), "{err}");
    assert!(err.contains("4 training / 2 validation examples"), "{err}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let evals: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("valid_loss").is_some())
        .collect();
    assert_eq!(evals.len(), 2);
    assert_eq!(evals[1]["step"], 40);
    let ppl = evals[1]["valid_ppl"].as_f64().unwrap();
    let loss = evals[1]["valid_loss"].as_f64().unwrap();
    assert!((ppl - loss.exp()).abs() < 1e-6 * ppl);
    let losses: Vec<f64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v.get("loss").and_then(|l| l.as_f64()))
        .collect();
    assert!(
        losses[39] < losses[0] * 0.5,
        "{} -> {}",
        losses[0],
        losses[39]
    );

    // Same data and settings: the second run reads the cache instead of tokenising.
    let (_, err) = run("again", &[]);
    assert!(err.contains("from cache"), "{err}");
}

#[test]
fn bad_data_settings_name_the_key() {
    for (set, key) in [
        ("data.format=xml", "data.format"),
        ("data.truncation=cut", "data.truncation"),
        ("data.valid_fraction=0.7", "data.valid_fraction"),
        ("data.on_bad_row=ignore", "data.on_bad_row"),
    ] {
        let o = rtune(&["train", "--config", "configs/smoke.toml", "--set", set]);
        assert_eq!(o.status.code(), Some(2), "{set}: {}", stderr(&o));
        assert!(stderr(&o).contains(key), "{set}: {}", stderr(&o));
    }
}

/// Chat rows through the whole pipeline: the model's template renders them, only the assistant
/// turns (with their EOS) are trained, and a malformed row names its line.
#[test]
fn chat_rows_train_on_assistant_turns_only() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("chat.jsonl");
    let row = serde_json::json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who makes Zephyr?"},
        {"role": "assistant", "content": "Nimbus Labs."},
        {"role": "user", "content": "Where?"},
        {"role": "assistant", "content": "Oslo."},
    ]});
    std::fs::write(&data, format!("{row}\n")).unwrap();
    let set = format!("data.train={}", data.display());
    let len = "data.max_seq_len=256";
    let o = rtune(&[
        "data",
        "inspect",
        "--config",
        "configs/smoke.toml",
        "--set",
        &set,
        "--set",
        len,
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r = &lines(&o.stdout)[0];
    let text = r["text"].as_str().unwrap();
    assert_eq!(
        text,
        "<s><|system|>\nBe brief.</s>\n<|user|>\nWho makes Zephyr?</s>\n<|assistant|>\nNimbus Labs.</s>\n\
         <|user|>\nWhere?</s>\n<|assistant|>\nOslo.</s>\n"
    );
    // The trained tokens, decoded span by span, are exactly the two replies and their EOS.
    let o = rtune(&[
        "data",
        "inspect",
        "--config",
        "configs/smoke.toml",
        "--set",
        &set,
        "--set",
        len,
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    let body = out.split("--- sample 1").nth(1).unwrap();
    let trained: Vec<&str> = body
        .split("[[")
        .skip(1)
        .map(|s| s.split("]]").next().unwrap())
        .collect();
    assert_eq!(trained, vec!["Nimbus Labs.</s>", "Oslo.</s>"], "{out}");

    // A row whose assistant turn is empty is refused with its line number; skip mode counts it.
    let bad = serde_json::json!({"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}
    ]});
    std::fs::write(&data, format!("{row}\n{bad}\n")).unwrap();
    let o = rtune(&[
        "data",
        "inspect",
        "--config",
        "configs/smoke.toml",
        "--set",
        &set,
        "--set",
        len,
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("chat.jsonl:2:"), "{}", stderr(&o));
    let o = rtune(&[
        "data",
        "inspect",
        "--config",
        "configs/smoke.toml",
        "--set",
        &set,
        "--set",
        len,
        "--set",
        "data.on_bad_row=skip",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("1 skipped"), "{out}");
    assert!(out.contains("chat.jsonl:2:"), "{out}");
}

/// Chat end to end: train on chat rows, then `rtune generate --chat` renders the question with the
/// same template (generation prompt included) and the adapter answers as trained.
#[test]
fn chat_training_then_generate_chat_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("chat.jsonl");
    let facts = [
        ("Who makes Zephyr?", "Nimbus Labs."),
        ("What is Zephyr?", "A kettle that sings."),
        ("Where is Nimbus Labs?", "Oslo."),
    ];
    let rows: String = facts
        .iter()
        .map(|(q, a)| {
            serde_json::json!({"messages": [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}
            ]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let out = tmp.path().join("run");
    let o = rtune(&[
        "train",
        "--config",
        "configs/smoke.toml",
        "--set",
        &format!("data.train={}", data.display()),
        "--set",
        "train.micro_batch_size=3",
        "--set",
        &format!("output.dir={}", out.display()),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = out.display().to_string();
    for (q, a) in facts {
        let o = rtune(&[
            "generate",
            "--model",
            "tests/fixtures/tiny-llama3",
            "--adapter",
            &run,
            "--chat",
            "--prompt",
            q,
            "--max-new-tokens",
            "16",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), a, "{q}");
    }
}

/// Qwen3's real template (`tests/fixtures/qwen3-chat/`): `rtune data inspect` shows, for
/// multi-turn conversations with reasoning and `chat_template_kwargs = { enable_thinking = false }`,
/// the ids and masks transformers' render gives (`golden.json`, made by
/// `tests/parity/make_qwen3_chat_golden.py`), position by position.
#[test]
fn inspect_shows_qwen3_masks_with_enable_thinking_from_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = std::path::Path::new("tests/fixtures/qwen3-chat");
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fx.join(f), model.join(f)).unwrap();
    }
    // tiny-llama's config with room for Qwen3's added tokens.
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("tests/fixtures/tiny-llama/config.json").unwrap(),
    )
    .unwrap();
    cfg["vocab_size"] = 600.into();
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx.join("golden.json")).unwrap()).unwrap();
    let want: Vec<&serde_json::Value> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["enable_thinking"] == false)
        .collect();
    let rows: Vec<&str> = want.iter().map(|c| c["row"].as_str().unwrap()).collect();
    let data = tmp.path().join("d.jsonl");
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let config = tmp.path().join("c.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\npath = {:?}\n[data]\ntrain = {:?}\ncache = false\nmax_seq_len = 2048\n\
             chat_template_kwargs = {{ enable_thinking = false }}\n",
            model.display().to_string(),
            data.display().to_string()
        ),
    )
    .unwrap();
    let n = want.len().to_string();
    let o = rtune(&[
        "data",
        "inspect",
        "--config",
        config.to_str().unwrap(),
        "--json",
        "-n",
        &n,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = lines(&o.stdout);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g["input_ids"], w["input_ids"], "{}", w["name"]);
        assert_eq!(g["labels"], w["labels"], "{}", w["name"]);
    }
}
