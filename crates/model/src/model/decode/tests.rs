//! Cached, batched decoding against the full forward of each row alone: every family fixture,
//! rows of unequal prompt lengths, steps of one and of two tokens, rows dropped and repeated;
//! LoRA, DoRA, bf16, bf16 autocast and NF4 on one fixture.

use super::*;
use crate::{Inputs, Quantize};
use candle_core::{Device, IndexOp};
use rtune_lora::{Adapter, LoraSpec};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .and_then(|a| a.max_all())
        .and_then(|m| m.to_scalar::<f32>())
        .unwrap()
}

/// Row `r`'s tokens: a seeded walk over the first 200 ids past the special ones.
fn tokens(r: usize, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + 5 + 61 * r as u32) % 200 + 3)
        .collect()
}

/// The full forward of `ids` alone (positions 0..): its last position's logits, `(V)` f32.
fn alone(model: &Model, ids: &[u32], lora: Option<&LoraCtx>) -> Tensor {
    let full = model
        .forward(&Inputs::new(ids.to_vec(), 1, ids.len()), lora, false)
        .unwrap();
    full.logits.i((0, ids.len() - 1)).unwrap()
}

/// Decodes rows of prompt lengths `prompts` to `total` tokens each (a step of two tokens, then
/// steps of one; after the third step row 1 is dropped and row 0 repeated), and checks each
/// step's `(B, V)` logits against every row's full forward alone: `|Δ| ≤ tol · max |logit|`.
/// Returns the largest relative difference seen.
fn check(
    name: &str,
    model: &Model,
    lora: Option<&LoraCtx>,
    prompts: &[usize],
    total: usize,
    tol: f32,
) -> f32 {
    let mut rows: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(r, &n)| tokens(r, total + r)[..n].to_vec())
        .collect();
    // The tokens each row goes on with (its own walk, so rows stay distinct).
    let walk: Vec<Vec<u32>> = (0..prompts.len()).map(|r| tokens(r, total + r)).collect();
    let mut origin: Vec<usize> = (0..prompts.len()).collect();
    let mut cache = KvCache::default();
    let mut got = model.decode_rows(&rows, &mut cache, lora).unwrap();
    let mut worst = 0f32;
    let mut step = 0;
    loop {
        assert_eq!(got.dims(), &[rows.len(), model.cfg.vocab_size]);
        for (r, row) in rows.iter().enumerate() {
            assert_eq!(cache.tokens(r), row.len(), "{name}: row {r}'s tokens");
            let want = alone(model, row, lora);
            let err = max_abs(&(got.i(r).unwrap() - &want).unwrap());
            let rel = err / max_abs(&want);
            worst = worst.max(rel);
            assert!(
                rel <= tol,
                "{name} step {step}, row {r} ({} tokens): {err} vs max {}",
                row.len(),
                max_abs(&want)
            );
        }
        step += 1;
        if step == 3 {
            // Row 1 done; row 0 sampled twice from here (a group of completions).
            cache.select_rows(&[0, 2, 0]).unwrap();
            rows = vec![rows[0].clone(), rows[2].clone(), rows[0].clone()];
            origin = vec![origin[0], origin[2], origin[0]];
        }
        let k = if step == 1 { 2 } else { 1 };
        if rows.iter().any(|r| r.len() + k > total) {
            break;
        }
        // The repeated row goes on with another token than its twin.
        let next: Vec<Vec<u32>> = rows
            .iter()
            .enumerate()
            .map(|(r, row)| {
                let w = &walk[origin[r]];
                let mut t = w[row.len()..row.len() + k].to_vec();
                if step > 3 && r == 2 {
                    t[0] = (t[0] + 1) % 200 + 3;
                }
                t
            })
            .collect();
        for (row, t) in rows.iter_mut().zip(&next) {
            row.extend_from_slice(t);
        }
        got = model.decode_rows(&next, &mut cache, lora).unwrap();
    }
    assert!(step >= 5, "{name}: only {step} steps");
    worst
}

/// Every family: Llama, Llama 3's RoPE scaling, Mistral's sliding window (5, crossed: 12
/// tokens), Qwen2's biases and one sliding layer, Qwen3's q/k norms, Gemma 2's sandwich norms,
/// GeGLU, scaled embeddings and both soft caps, Gemma 3's local RoPE, Phi-3's fused projections
/// and Phi-4-mini's partial rotary with LongRoPE. f32: the same ops on the same values, grouped
/// into other GEMMs (a row alone vs three, one step's keys vs all): rounding only, 1e-5 of the
/// largest logit (seen: 1.3e-6 at most, tiny-llama3).
#[test]
fn cached_decoding_equals_the_full_forward() {
    for name in [
        "tiny-llama",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-phi3",
        "tiny-phi4",
    ] {
        let model = Model::load(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        // tiny-phi4 (LongRoPE): within its original length of 8, where the short factors hold
        // for every position (past it transformers switches the whole sequence to the long
        // factors, which a cache of rotated keys cannot; transformers' own cache cannot either).
        let (prompts, total) = match name {
            "tiny-phi4" => (&[2, 1, 2][..], 8),
            _ => (&[5, 2, 4][..], 12),
        };
        let worst = check(name, &model, None, prompts, total, 1e-5);
        eprintln!("{name}: {worst:e}");
    }
}

/// A random adapter on all linear layers (B non-zero; DoRA: a magnitude per row).
fn adapter(model: &Model, dora: bool) -> Adapter {
    let dev = Device::Cpu;
    let spec = LoraSpec::new(4, 8.0, 0.0, false, &["all-linear".into()])
        .unwrap()
        .with_dora(dora);
    let mut a = Adapter::init(spec.clone(), &model.lora_modules(&spec), 3, &dev).unwrap();
    for (i, p) in a.pairs.iter_mut().enumerate() {
        p.b = crate::test_util::randn(p.b.dims(), 100 + i as u64)
            .unwrap()
            .affine(0.1, 0.0)
            .unwrap();
        if dora {
            let out = p.b.dims()[0];
            p.m = Some(
                crate::test_util::randn(&[out], 200 + i as u64)
                    .unwrap()
                    .affine(0.25, 1.0)
                    .unwrap(),
            );
        }
    }
    a
}

/// The live adapter (LoRA and DoRA), and the frozen base in bf16, bf16 autocast and NF4: the
/// decoded logits equal the full forward's of the same model. bf16 (and autocast's bf16
/// products) round each product's result (or operands) to 8 bits: another grouping of the same
/// sums moves a logit by a few of its units in the last place, through two layers: 2e-2 of the
/// largest logit; NF4 dequantizes the same codes on both sides and computes in f32: 1e-5.
#[test]
fn cached_decoding_with_adapters_and_quantized_bases() {
    let dev = Device::Cpu;
    let dir = fixture("tiny-llama3");
    let cases: [(&str, DType, Quantize, bool, f32); 5] = [
        ("lora", DType::F32, Quantize::None, false, 1e-5),
        ("dora", DType::F32, Quantize::None, true, 1e-5),
        (
            "nf4 + lora",
            DType::F32,
            Quantize::linears(true),
            false,
            1e-5,
        ),
        ("bf16 + lora", DType::BF16, Quantize::None, false, 2e-2),
        ("autocast + dora", DType::F32, Quantize::None, true, 2e-2),
    ];
    for (name, dtype, quantize, dora, tol) in cases {
        let mut model = Model::load_with(&dir, dtype, &dev, quantize).unwrap();
        if name.starts_with("autocast") {
            model.set_autocast().unwrap();
        }
        let a = adapter(&model, dora);
        model.attach(&a);
        let lc = LoraCtx {
            adapter: &a,
            scaling: a.spec.scaling(),
            dropout: 0.0,
            seed: 0,
        };
        let worst = check(name, &model, Some(&lc), &[3, 6, 1], 10, tol);
        eprintln!("{name}: {worst:e}");
        // The adapter is live: the base alone decodes something else.
        let mut cache = KvCache::default();
        let with = model.decode(&tokens(0, 5), &mut cache, Some(&lc)).unwrap();
        let mut cache = KvCache::default();
        let without = model.decode(&tokens(0, 5), &mut cache, None).unwrap();
        assert!(
            max_abs(&(with - without).unwrap()) > 1e-3,
            "{name}: adapter not applied"
        );
    }
}

/// Rows that do not fit the cache are refused with what was given; dropping every row empties it.
#[test]
fn decoding_refuses_ragged_steps() {
    let model = Model::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let mut cache = KvCache::default();
    let e = model
        .decode_rows(&[vec![5u32], vec![]], &mut cache, None)
        .unwrap_err();
    assert!(e.to_string().contains("[1, 0]"), "{e}");
    model
        .decode_rows(&[vec![5u32, 6], vec![7]], &mut cache, None)
        .unwrap();
    assert_eq!((cache.len(), cache.rows(), cache.tokens(1)), (2, 2, 1));
    let e = model
        .decode_rows(&[vec![5u32, 6], vec![7]], &mut cache, None)
        .unwrap_err();
    assert!(
        e.to_string().contains("[2, 1] after a cache of 2 rows"),
        "{e}"
    );
    let e = model
        .decode_rows(&[vec![5u32]], &mut cache, None)
        .unwrap_err();
    assert!(e.to_string().contains("[1] after a cache of 2 rows"), "{e}");
    assert!(cache.select_rows(&[2]).is_err());
    // Row 1 alone: its padding slot is cut.
    cache.select_rows(&[1]).unwrap();
    assert_eq!((cache.len(), cache.rows(), cache.tokens(0)), (1, 1, 1));
    cache.select_rows(&[]).unwrap();
    assert!(cache.is_empty() && cache.rows() == 0);
}

/// Greedy choice: the first of the largest logits (transformers' argmax).
fn greedy(_: usize, logits: &[f32]) -> u32 {
    let best = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    logits.iter().position(|&v| v == best).unwrap_or(0) as u32
}

/// Greedy decoding equals transformers' greedy `generate` token for token, every family, a batch
/// of three left-padded prompts of 5, 2 and 4 tokens, 8 new tokens each
/// (`tests/parity/golden_greedy.json`, made by `tests/parity/make_greedy_goldens.py`; its
/// smallest gap between the two best logits is 3.8e-4, far above f32 rounding's ~1e-6).
#[test]
fn greedy_decoding_equals_transformers_generate() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/parity/golden_greedy.json");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let max_new = golden["max_new_tokens"].as_u64().unwrap() as usize;
    let fixtures = golden["fixtures"].as_object().unwrap();
    assert_eq!(fixtures.len(), 9);
    let ids = |v: &serde_json::Value| -> Vec<Vec<u32>> {
        let rows = v.as_array().unwrap();
        rows.iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect()
    };
    for (name, case) in fixtures {
        let model = Model::load(&fixture(name), DType::F32, &Device::Cpu).unwrap();
        let (prompts, want) = (ids(&case["prompts"]), ids(&case["tokens"]));
        let got = model
            .complete_rows(&prompts, 1, max_new, &[], None, &mut greedy)
            .unwrap();
        let got: Vec<Vec<u32>> = got.into_iter().map(|c| c.tokens).collect();
        assert_eq!(got, want, "{name}");
    }
}

/// A batch of groups completes each prompt as it completes alone: two prompts × a group of two
/// (the group's rows told apart by their picks), rows stopping at different steps, one cut at
/// the most new tokens; `pick` sees the completions in increasing order at every step.
#[test]
fn batched_groups_complete_as_each_row_alone() {
    let model = Model::load(&fixture("tiny-qwen3"), DType::F32, &Device::Cpu).unwrap();
    let prompts = vec![tokens(0, 5), tokens(1, 2)];
    // Completion c takes the (c % 2 + 1)-th best token: the two of a group differ.
    let ranked = |c: usize, logits: &[f32]| -> u32 {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        idx[c % 2] as u32
    };
    let free = |prompt: &[u32], c: usize, stop: &[u32]| -> Completion {
        let mut pick = |_: usize, l: &[f32]| ranked(c, l);
        let out = model.complete_rows(&[prompt.to_vec()], 1, 10, stop, None, &mut pick);
        out.unwrap().remove(0)
    };
    // Stop tokens from the completions themselves: the 3rd token of completion 0, the 6th of
    // completion 3; completion 1 and 2 run on (or stop where these tokens come up in them).
    let (c0, c3) = (free(&prompts[0], 0, &[]), free(&prompts[1], 3, &[]));
    let stop = [c0.tokens[2], c3.tokens[5]];
    let mut order = Vec::new();
    let mut pick = |c: usize, l: &[f32]| {
        order.push(c);
        ranked(c, l)
    };
    let got = model
        .complete_rows(&prompts, 2, 10, &stop, None, &mut pick)
        .unwrap();
    for (c, g) in got.iter().enumerate() {
        assert_eq!(g, &free(&prompts[c / 2], c, &stop), "completion {c}");
    }
    assert!(got[0].stopped && got[0].tokens.len() <= 2, "{:?}", got[0]);
    assert!(
        got.iter().any(|g| !g.stopped && g.tokens.len() == 10),
        "{got:?}"
    );
    // The first step picks for every completion, in order.
    assert_eq!(&order[..4], &[0, 1, 2, 3]);
}
