//! Arithmetic of the estimate on tiny shapes; monotonicity and the fitting search.

use super::*;
use rtune_model::HfConfig;
use std::path::Path;

/// Llama: hidden 8, 2 heads of 4 (1 kv head), intermediate 16, vocab 32, `layers` layers.
fn tiny(layers: usize) -> ModelConfig {
    let text = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":8,"intermediate_size":16,
        "num_hidden_layers":{layers},"num_attention_heads":2,"num_key_value_heads":1,"vocab_size":32}}"#
    );
    serde_json::from_str::<HfConfig>(&text)
        .unwrap()
        .into_config(Path::new("config.json"))
        .unwrap()
}

/// bench-small (`rtune bench`'s default shape, as `rtune_diag::bench::model_config` builds it):
/// hidden 512, 8 layers, 8/2 heads, intermediate 1376, vocab 32000, untied lm_head, no biases.
fn bench_small() -> ModelConfig {
    ModelConfig {
        arch: &rtune_model::family::LLAMA,
        hidden_size: 512,
        intermediate_size: 1376,
        num_layers: 8,
        num_heads: 8,
        num_kv_heads: 2,
        head_dim: 64,
        vocab_size: 32000,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: rtune_model::RopeScaling::None,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        sliding_window: None,
        window_layers: vec![false; 8],
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        pad_token_id: None,
        variant: Default::default(),
        moe: None,
    }
}

#[test]
fn lora_and_adamw_terms_are_r_in_plus_out_times_4_bytes() {
    let c = tiny(3);
    let mut s = Settings::new(2, 1, 4, false);
    // With gradient accumulation every layer's gradients exist during the backward.
    s.grad_accum = 2;
    // in + out per module: q 8+8, k 8+4, v 8+4, o 8+8, gate 8+16, up 8+16, down 16+8.
    let all: u64 = 16 + 12 + 12 + 16 + 24 + 24 + 24;
    let est = estimate(&c, &s);
    let one = 2 * all * 4 * 3;
    assert_eq!(est.get(names::LORA), one);
    assert_eq!(est.get(names::GRADS), one);
    assert_eq!(est.get(names::ADAMW), 2 * one);
    assert_eq!(est.get(names::MASTER), one);
    s.targets = vec!["q_proj".into(), "v_proj".into()];
    let est = estimate(&c, &s);
    assert_eq!(est.get(names::LORA), 2 * (16 + 12) * 4 * 3);
    assert_eq!(est.get(names::ADAMW), 2 * 2 * (16 + 12) * 4 * 3);
    assert_eq!(
        est.breakdown.iter().map(|(_, b)| b).sum::<u64>(),
        est.peak_bytes
    );
}

/// Phi-3's fused modules are one adapter each, as PEFT's: `all-linear` counts r·(in + out) for
/// qkv_proj (64 → 128), o_proj, gate_up_proj (64 → 192) and down_proj; the frozen weights are the
/// split model's (the same rows, fused).
#[test]
fn phi3_counts_one_adapter_per_fused_module() {
    let text = r#"{"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":96,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":256}"#;
    let phi3 = serde_json::from_str::<HfConfig>(text)
        .unwrap()
        .into_config(Path::new("config.json"))
        .unwrap();
    let s = Settings::new(4, 1, 16, false);
    // The tiny-phi3 adapter PEFT makes: 5888 parameters (tests/parity/golden_tiny_phi3).
    let per_layer = 4 * ((64 + 128) + (64 + 64) + (64 + 192) + (96 + 64));
    assert_eq!(lora_params(&phi3, &s), 2 * per_layer);
    assert_eq!(2 * per_layer, 5888);
    let mut llama = phi3.clone();
    llama.arch = &rtune_model::family::LLAMA;
    llama.variant.fused_proj = false;
    let (a, b) = (estimate(&phi3, &s), estimate(&llama, &s));
    assert_eq!(a.get(names::WEIGHTS), b.get(names::WEIGHTS));
    assert!(a.get(names::LORA) < b.get(names::LORA));
}

/// Issue 35: at a rank where the adapter dwarfs the activations the peak is a checkpoint after
/// an optimizer step: params, master copy and two moments (static), the step's gradients and
/// their flat copy (still the heap's high-water mark), and the serialised moments on top.
#[test]
fn a_huge_rank_peaks_at_a_checkpoint_with_eight_adapter_copies() {
    let c = tiny(3);
    let mut s = Settings::new(100_000, 1, 4, false);
    s.targets = vec!["q_proj".into()];
    s.runtime_bytes = 0;
    s.matmul_workspace = 0;
    let est = estimate(&c, &s);
    // q_proj: in 8 + out 8, three layers, f32.
    let one = 100_000 * 16 * 4 * 3;
    assert_eq!(est.phase, Phase::Checkpoint.name());
    assert_eq!(est.get(names::SERIALIZED), 2 * one);
    let adapter_copies = est.peak_bytes - est.get(names::WEIGHTS);
    // 8 copies, and one A (r, 8) being replaced by its update (one / 6) besides the tiny
    // model's activations.
    assert!(
        adapter_copies >= 8 * one && adapter_copies < 8 * one + one / 5,
        "{adapter_copies} vs 8 × {one}"
    );
}

#[test]
fn base_weights_by_dtype_and_nf4_constants() {
    let c = tiny(2);
    let mut s = Settings::new(2, 1, 4, false);
    // embed + lm_head (32·8 each), 5 norms of 8, 2 layers of 8·8 + 8·4 + 8·4 + 8·8 + 3·8·16.
    let params: u64 = 2 * 32 * 8 + 5 * 8 + 2 * (64 + 32 + 32 + 64 + 3 * 128);
    assert_eq!(estimate(&c, &s).get(names::WEIGHTS), params * 4);
    s.dtype = DType::BF16;
    assert_eq!(estimate(&c, &s).get(names::WEIGHTS), params * 2);
    // NF4: 4 bits a weight, one f32 scale per 64 (a started block counts) and the code table.
    assert_eq!(
        frozen_bytes(128, 2, Quantize::linears(false)),
        (64, 2 * 4 + 64)
    );
    assert_eq!(frozen_bytes(4096, 2, Quantize::None), (8192, 0));
    let (_, dq) = frozen_bytes(64 * 512, 2, Quantize::linears(true));
    assert_eq!(dq, 512 + 4 * 2 + 4 * 256 + 4 + 64);
    s.quantize = Quantize::linears(false);
    let est = estimate(&c, &s);
    let linear: u64 = 2 * (64 + 32 + 32 + 64 + 3 * 128);
    assert_eq!(
        est.get(names::WEIGHTS),
        (2 * 32 * 8 + 5 * 8) * 2 + linear / 2
    );
    // Per layer: 7 weights, each with one block (q 64, k 32, v 32, o 64) or two (128).
    assert_eq!(est.get(names::QUANT), 2 * ((4 + 3 * 2) * 4 + 7 * 64));
}

#[test]
fn longer_rows_and_bigger_batches_need_more() {
    let c = bench_small();
    for ckpt in [false, true] {
        let peak = |b, t| estimate(&c, &Settings::new(16, b, t, ckpt)).peak_bytes;
        let mut last = 0;
        for t in [16, 64, 256, 512, 1024, 2048, 4096] {
            let p = peak(4, t);
            assert!(p > last, "ckpt {ckpt}: seq {t}: {p} <= {last}");
            last = p;
        }
        assert!(peak(8, 512) > peak(4, 512));
    }
    // Checkpointing saves at least the other layers' activations.
    let full = estimate(&c, &Settings::new(16, 4, 2048, false));
    let ckpt = estimate(&c, &Settings::new(16, 4, 2048, true));
    assert!(full.peak_bytes > ckpt.peak_bytes + full.get(names::ACTS) / 2);
}

#[test]
fn fitting_search_is_monotone_and_tight() {
    let c = bench_small();
    let s = Settings::new(16, 4, 512, true);
    let mut last = Fit {
        max_micro_batch_size: 0,
        max_seq_len: 0,
    };
    for gb in [0.2, 0.5, 1.0, 2.0, 4.0, 16.0] {
        let budget = (gb * 1e9) as u64;
        let fit = largest_fitting(&c, &s, budget);
        assert!(
            fit.max_micro_batch_size >= last.max_micro_batch_size,
            "{gb} GB"
        );
        assert!(fit.max_seq_len >= last.max_seq_len, "{gb} GB");
        for (b, t, max) in [
            (fit.max_micro_batch_size, 512, true),
            (4, fit.max_seq_len, false),
        ] {
            let (b1, t1) = if max { (b + 1, t) } else { (b, t + 1) };
            if b > 0 && t > 0 {
                let at = |b, t| {
                    estimate(
                        &c,
                        &Settings {
                            micro_batch_size: b,
                            seq_len: t,
                            ..s.clone()
                        },
                    )
                    .peak_bytes
                };
                assert!(
                    at(b, t) <= budget && at(b1, t1) > budget,
                    "{gb} GB: {b}×{t}"
                );
            }
        }
        last = fit;
    }
    // The runtime and weights alone exceed 0.2 GB: nothing fits.
    assert_eq!(largest_fitting(&c, &s, 200_000_000).max_micro_batch_size, 0);
}

#[test]
fn bench_small_phases_match_measured_live_tensors() {
    // Live heap bytes at the peak, counted by a tracking allocator on this code (f32, r 16, the
    // plain attention path): T=512 without checkpointing 1145.6 MB (at the cross-entropy), with
    // it 461.2 MB (attention backward). The estimate adds the runtime and allocator terms on top
    // of these. Since the layers stopped keeping `silu(gate)·up` (8 × (2048, 1376) f32 = 90.2 MB)
    // the full figure is 1145.6 − 90.2 MB (derived, not re-counted; RSS measured 1152.3 → 1091.8
    // MB with `RTUNE_ATTN=plain rtune bench --steps 1`, the estimate within 2.2% of it).
    let c = bench_small();
    let live = |ckpt| {
        let e = estimate_on(&c, &Settings::new(16, 4, 512, ckpt), AttnPath::Plain);
        let extra = e.get(names::RUNTIME) + e.get(names::HEAP_HWM) + e.get(names::FRAG);
        (e.peak_bytes - extra, e.phase)
    };
    let (full, phase) = live(false);
    assert!(
        (full as f64 / (1145.6e6 - 90.2e6) - 1.0).abs() < 0.01,
        "{full}"
    );
    assert_eq!(phase, Phase::CrossEntropy.name());
    let (ckpt, phase) = live(true);
    assert!((ckpt as f64 / 461.2e6 - 1.0).abs() < 0.01, "{ckpt}");
    assert_eq!(phase, Phase::AttentionBackward.name());
}

#[test]
fn dropout_keeps_nothing_for_the_backward() {
    // The model regenerates every mask from its key, so a dropout run peaks where the same run
    // without dropout does. Measured on the shipped recipe (configs/smollm2-135m-lora.toml, 20
    // steps, no checkpointing): peak RSS 1229.9 MB with dropout 0.05, 1229.3 MB with 0; the
    // estimate counted an (N, in) f32 mask per adapted module and layer until 2026-12-03 (1605.6
    // MB predicted, 1.30× the measured peak), 1260.6 MB now.
    for ckpt in [false, true] {
        let c = bench_small();
        let plain = Settings::new(16, 4, 512, ckpt);
        let dropped = Settings {
            dropout: 0.05,
            ..plain.clone()
        };
        assert_eq!(
            estimate(&c, &dropped).peak_bytes,
            estimate(&c, &plain).peak_bytes,
            "checkpointing {ckpt}"
        );
    }
}

#[test]
fn data_sizes_the_batch_by_its_longest_rows() {
    // Lengths 5, 9, 3 with 2, 4, 1 target tokens after the shift (labels[0] never counts).
    let ex = |len: usize, targets: usize| rtune_data::Example {
        input_ids: vec![1; len],
        labels: (0..len)
            .map(|i| if (1..=targets).contains(&i) { 1 } else { -100 })
            .collect(),
    };
    let data = [ex(5, 2), ex(9, 4), ex(3, 1)];
    let mut s = Settings::new(8, 2, 64, true);
    let before = s.runtime_bytes;
    fit_to_data(&mut s, &data, 64);
    assert_eq!((s.seq_len, s.target_rows), (9, Some(6)));
    assert_eq!(s.runtime_bytes - before, 17 * 12);
    let mut s = Settings::new(8, 2, 64, true);
    fit_to_data(&mut s, &data, 8); // longer rows were truncated to max_seq_len
    assert_eq!(s.seq_len, 8);
    let mut s = Settings {
        packing: true,
        ..Settings::new(8, 2, 12, true)
    };
    fit_to_data(&mut s, &data, 12); // packed rows fill up to max_seq_len
    assert_eq!((s.seq_len, s.target_rows), (12, Some(7)));
}

#[test]
fn tiled_backward_partials_follow_the_task_split() {
    // 32 (row, head) pairs or more: one chunk each, its partial over all T keys.
    assert_eq!(partial_bytes(2048, 4, 8, 64, None), vec![2048 * 64 * 4]);
    // 8 pairs: 4 chunks of 8 query tiles (512 queries), each over the keys 0..q_end.
    assert_eq!(
        partial_bytes(2048, 1, 8, 64, None),
        (1..=4).map(|c| c * 512 * 64 * 4).collect::<Vec<u64>>()
    );
    // Odd T: the last chunk ends at T. A sliding window of 100: each chunk's keys start 99
    // before its first query.
    assert_eq!(
        partial_bytes(1000, 1, 8, 64, Some(100)),
        vec![
            256 * 256,
            (512 - 157) * 256,
            (768 - 413) * 256,
            (1000 - 669) * 256
        ]
    );
}

#[test]
fn tiled_attention_keeps_no_t_squared_tensor() {
    let c = bench_small();
    for ckpt in [false, true] {
        let s = Settings::new(16, 4, 2048, ckpt);
        let plain = estimate_on(&c, &s, AttnPath::Plain);
        let tiled = estimate_on(&c, &s, AttnPath::Tiled);
        assert_eq!(tiled.get(names::PROBS) + tiled.get(names::SCORES), 0);
        // The starts (1, T) u32, cos and sin (B, 1, T, Dh) f32, ids/positions/targets.
        assert_eq!(
            tiled.get(names::BATCH),
            2048 * 4 + 2 * 4 * 2048 * 64 * 4 + 4 * 2048 * 16
        );
        assert!(plain.get(names::BATCH) > 2048 * 2048 * 4);
        assert!(
            tiled.peak_bytes < plain.peak_bytes,
            "ckpt {ckpt}: {} vs {}",
            tiled.peak_bytes,
            plain.peak_bytes
        );
        if tiled.phase == Phase::AttentionBackward.name() {
            // 4·8 (row, head) pairs: one dK and one dV partial of T × Dh f32 each, and the
            // reduction's pair per working thread.
            let threads = candle_core::utils::get_num_threads().min(8) as u64;
            let want = (2 * 32 + 2 * threads) * 2048 * 64 * 4;
            assert_eq!(tiled.get(names::PARTIALS), want);
        }
    }
    // The default path is the model's: tiled from 64 tokens on the CPU, unless RTUNE_ATTN says.
    let env = std::env::var("RTUNE_ATTN").ok();
    if env.is_none() {
        assert_eq!(attn_path(63), AttnPath::Plain);
        assert_eq!(attn_path(64), AttnPath::Tiled);
        let s = Settings::new(16, 4, 2048, true);
        assert_eq!(
            estimate(&c, &s).peak_bytes,
            estimate_on(&c, &s, AttnPath::Tiled).peak_bytes
        );
    }
}

#[test]
fn tiled_checkpointing_counts_the_last_layers_cache_at_the_cross_entropy() {
    // bench-small with 2 layers, batch 1, seq 2048, checkpointing: `rtune bench` measured 377.8 MB
    // with the peak at the cross-entropy, where the last layer's activations (kept from the
    // forward, never recomputed) are alive; 329.8 MB was estimated without them.
    let mut c = bench_small();
    c.num_layers = 2;
    c.window_layers = vec![false; 2];
    let s = Settings::new(16, 1, 2048, true);
    let e = estimate_on(&c, &s, AttnPath::Tiled);
    assert_eq!(e.phase, Phase::CrossEntropy.name());
    assert!(
        e.get(names::ACTS_ONE) > 50_000_000,
        "{}",
        e.get(names::ACTS_ONE)
    );
}

#[test]
fn tiled_checkpointing_counts_the_kept_attention_outputs() {
    // The L − 1 recomputed layers keep their attention's output (N, H·Dh) and log-sum-exp
    // (N, H) f32 on the tiled path (the recompute skips the attention); the plain path keeps none.
    // bench-small, batch 4, seq 2048 measured 1302 MB with them, 1132 MB before.
    let c = bench_small();
    let s = Settings::new(16, 4, 2048, true);
    let n = 4 * 2048u64;
    let each = n * 512 * 4 + n * 8 * 4;
    let tiled = estimate_on(&c, &s, AttnPath::Tiled);
    assert_eq!(tiled.get(names::KEPT_ATTN), 7 * each);
    assert_eq!(
        estimate_on(&c, &s, AttnPath::Plain).get(names::KEPT_ATTN),
        0
    );
    let mut off = s.clone();
    off.gradient_checkpointing = false;
    assert_eq!(
        estimate_on(&c, &off, AttnPath::Tiled).get(names::KEPT_ATTN),
        0
    );
}

/// `auto` leaves checkpointing off exactly when the run's estimate without it, times the
/// headroom, fits the budget (the boundary checked on both sides), turns it on when the budget
/// cannot be read, and `true`/`false` are obeyed whatever the budget.
#[test]
fn auto_checkpointing_follows_the_estimate_and_the_budget() {
    use rtune_config::Checkpointing;
    let c = bench_small();
    // The settings' own flag must not matter: the decision estimates the run without it.
    let s = Settings::new(16, 4, 512, true);
    let mut off = s.clone();
    off.gradient_checkpointing = false;
    let peak = estimate(&c, &off).peak_bytes;
    assert!(
        peak > estimate(&c, &s).peak_bytes,
        "checkpointing saves memory here"
    );
    let need = (peak as f64 * HEADROOM).ceil() as u64;
    let auto = |b: Budget| choose_checkpointing(Checkpointing::Auto, &c, &s, b);
    let fits = auto(Some((need, "available RAM")));
    assert!(!fits.on, "{}", fits.describe());
    assert!(fits.reason.contains("fits in"), "{}", fits.reason);
    assert_eq!(fits.setting, "auto");
    let tight = auto(Some((need - 2, "available RAM")));
    assert!(tight.on, "{}", tight.describe());
    assert!(tight.reason.contains("does not fit"), "{}", tight.reason);
    assert!(auto(None).on);
    for (setting, on) in [(Checkpointing::On, true), (Checkpointing::Off, false)] {
        for b in [Some((1, "x")), Some((u64::MAX, "x")), None] {
            let ch = choose_checkpointing(setting, &c, &s, b);
            assert_eq!(ch.on, on);
            assert_eq!(ch.reason, "set in the config");
        }
    }
}

/// DoRA, as `rtune_model::dora` holds it: per module and layer a magnitude `(out,)` that trains
/// (parameter, gradient, AdamW's m and v, the master copy), its cached row norms `(out,)` f32 for
/// the whole step, and in each kept layer cache `z: (N, out)` f32 with `k, n: (1, out)` f32.
/// Trainable token rows: `hidden` f32 per row, with the same optimizer state.
#[test]
fn dora_and_trainable_tokens_are_counted() {
    let c = bench_small();
    let plain = Settings::new(16, 4, 512, false);
    let dora = Settings {
        dora: true,
        ..plain.clone()
    };
    let (p, d) = (estimate(&c, &plain), estimate(&c, &dora));
    let (dd, dq, dkv, i) = (512u64, 512u64, 128u64, 1376u64);
    let outs = dq + 2 * dkv + dd + 2 * i + dd; // q, k, v, o, gate, up, down
    let (l, n) = (8u64, 4 * 512u64);
    assert_eq!(d.phase, p.phase);
    assert_eq!(d.get(names::LORA) - p.get(names::LORA), l * outs * 4);
    assert_eq!(d.get(names::ADAMW) - p.get(names::ADAMW), 2 * l * outs * 4);
    assert_eq!(d.get(names::MASTER) - p.get(names::MASTER), l * outs * 4);
    // At the cross-entropy without checkpointing every layer's cache is alive.
    assert_eq!(d.phase, Phase::CrossEntropy.name());
    assert_eq!(
        d.get(names::DORA),
        l * outs * 4 + l * (n * outs * 4 + 2 * outs * 4)
    );
    assert!(d.peak_bytes >= p.peak_bytes + l * n * outs * 4);
    // With checkpointing one layer's cache is alive at a time.
    let ck = |s: &Settings| {
        estimate(
            &c,
            &Settings {
                gradient_checkpointing: true,
                ..s.clone()
            },
        )
    };
    let (pc, dc) = (ck(&plain), ck(&dora));
    assert_eq!(dc.phase, pc.phase);
    assert_eq!(
        dc.get(names::DORA),
        l * outs * 4 + n * outs * 4 + 2 * outs * 4
    );
    let tokens = estimate(
        &c,
        &Settings {
            trainable_tokens: 3,
            ..plain.clone()
        },
    );
    assert_eq!(tokens.get(names::LORA) - p.get(names::LORA), 3 * 512 * 4);
    assert_eq!(
        tokens.get(names::ADAMW) - p.get(names::ADAMW),
        2 * 3 * 512 * 4
    );
}

/// Gemma's sandwich norms keep two more `(N, D)` inputs a layer (and their `(N, 1)` f32 1/rms);
/// q/k norms keep q and k before the norm, `(N, Dq + Dkv)`: every layer's activations grow by
/// exactly that when nothing is recomputed.
#[test]
fn sandwich_and_qk_norms_add_their_inputs_to_each_layer() {
    let plain = tiny(3);
    let mut gemma = plain.clone();
    gemma.variant.sandwich_norms = true;
    gemma.variant.qk_norm = true;
    let s = Settings::new(2, 2, 8, false);
    let (a, b) = (estimate(&plain, &s), estimate(&gemma, &s));
    // N = 2·8 rows, f32: D = 8, Dq = 2·4, Dkv = 4.
    let n = 16u64;
    let per_layer = 2 * n * 8 * 4 + 2 * n * 4 + n * (8 + 4) * 4;
    assert_eq!(b.get(names::ACTS) - a.get(names::ACTS), 3 * per_layer);
}

/// Gemma 2's soft-capped scores take the path every family takes (issue 43: they ran on the plain
/// path whatever the row length, its scores growing with T², before the tiled kernels had the
/// cap): plain below `TILED_MIN_T` tokens, tiled from it — so the attention's share of the peak
/// grows linearly in T: at 1024, 2048 and 4096 tokens the peak's second difference is a small
/// fraction of the plain path's (whose T² scores make it large).
#[test]
fn soft_capped_attention_is_estimated_on_the_models_path() {
    let mut c = tiny(3);
    c.variant.attn_softcap = Some(50.0);
    for t in [32, 256, 2048] {
        let s = Settings::new(2, 1, t, false);
        let path = attn_path(t);
        assert_eq!(
            estimate(&c, &s).peak_bytes,
            estimate_on(&c, &s, path).peak_bytes,
            "T = {t}"
        );
    }
    assert_eq!(attn_path(2048), AttnPath::Tiled);
    let peak = |t, path| estimate_on(&c, &Settings::new(2, 1, t, false), path).peak_bytes as f64;
    let second = |path| peak(4096, path) - 2.0 * peak(2048, path) + peak(1024, path);
    let (tiled, plain) = (second(AttnPath::Tiled), second(AttnPath::Plain));
    assert!(
        tiled.abs() < 0.05 * plain,
        "second difference tiled {tiled} vs plain {plain}"
    );
}

/// A sharded base's gathered weights by phase: the lm_head at the cross-entropy plus the layers
/// kept gathered for the backward; in the last layer's backward that layer (and one weight's
/// transient gather) or the kept layers, and a prefetched one unless it is kept.
#[test]
fn a_sharded_base_counts_the_layers_kept_gathered() {
    let c = bench_small();
    let (d, i, v) = (512u64, 1376u64, 32000u64);
    // q, o (D, D); k, v (D/4, D); gate, up, down (I, D): f32.
    let layer = 4 * (2 * d * d + 2 * d * d / 4 + 3 * i * d);
    let largest = 4 * i * d;
    let gathered_with = |keep: usize, prefetch: bool, phase: Phase| {
        let mut s = Settings::new(8, 1, 64, true);
        (s.shard, s.keep_gathered, s.prefetch) = (Some(2), keep, prefetch);
        phase_items(&c, &s, phase, AttnPath::Tiled)
            .iter()
            .filter(|it| it.name == names::GATHERED)
            .map(|it| it.each * it.count)
            .sum::<u64>()
    };
    let gathered = |keep, phase| gathered_with(keep, false, phase);
    for (keep, kept) in [(0, 0), (1, 1), (3, 3), (20, 8)] {
        assert_eq!(
            gathered(keep, Phase::CrossEntropy),
            4 * v * d + kept * layer,
            "keep {keep}"
        );
        let backward = match kept {
            0 => layer + largest,
            k => k * layer,
        };
        assert_eq!(
            gathered(keep, Phase::AttentionBackward),
            backward,
            "keep {keep}"
        );
        assert_eq!(gathered(keep, Phase::OptimizerStep), 0, "keep {keep}");
        // Prefetched, the next layer is alive too in the backward unless it is kept.
        let ahead = if kept < 2 { layer } else { 0 };
        let phase = Phase::AttentionBackward;
        assert_eq!(
            gathered_with(keep, true, phase),
            backward + ahead,
            "keep {keep}"
        );
        let ce = Phase::CrossEntropy;
        assert_eq!(gathered_with(keep, true, ce), gathered(keep, ce));
    }
}

/// Qwen3-30B-A3B's config.json (the keys that size it).
fn qwen3_30b_a3b() -> ModelConfig {
    let text = r#"{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":2048,
        "intermediate_size":6144,"moe_intermediate_size":768,"num_hidden_layers":48,
        "num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"vocab_size":151936,
        "num_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,
        "tie_word_embeddings":false}"#;
    serde_json::from_str::<HfConfig>(text)
        .unwrap()
        .into_config(Path::new("config.json"))
        .unwrap()
}

/// `benches/moe_vs_peft.sh`'s model (Qwen3-30B-A3B's sparse layer scaled down: 2 layers, D 512,
/// 128 experts top-8 of width 192, 8 : 1 heads of 64, vocab 4096, f32, saved by transformers in
/// the per-expert layout) at its run (B 4 × T 512, LoRA r 16 on q/k/v/o and both stacks, no
/// checkpointing), each estimate within 10% of the peak RSS `rtune train` measured and not below
/// it:
/// - f32: the training step's estimate against the run's peak (MEASURED_MOE_BENCH; the load
///   peaks lower, 642-666 MB);
/// - NF4 linears and experts: the whole run's estimate against the run's peak
///   (MEASURED_MOE_BENCH_NF4, the step's: the load peaks lower, ~463 MB), and the loading
///   estimate against a run that only loads (T 16, B 1, 1 step: MEASURED_MOE_LOAD_NF4).
///
/// History: before the experts' backward was counted (`moe::backward_items`, in place of a dense
/// SwiGLU's buffers of the unused `intermediate_size` 2048) the step was estimated at 843.1 MB,
/// 0.91× the 942 MB measured then. Loading the per-expert layout then held every expert's
/// pieces beside the gate/up stack (+100 MB at each layer, the runs' peaks: 800.2 MB f32,
/// 649.6 MB NF4, release b95f0bc), against which the estimates were 994.2 MB (1.24×: the
/// grouped path's cache and backward counted as the per-expert path's) and 596.9 MB (0.92×).
/// NF4 experts loaded with both dense stacks of a layer alive before either was quantized (the
/// load's peak then, 545-548 MB, above the step's); each is now quantized before the next is
/// read.
#[test]
fn moe_bench_step_covers_its_measured_peak() {
    let text = r#"{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":512,
        "intermediate_size":2048,"moe_intermediate_size":192,"num_hidden_layers":2,
        "num_attention_heads":8,"num_key_value_heads":1,"head_dim":64,"vocab_size":4096,
        "num_local_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,
        "output_router_logits":true,"router_aux_loss_coef":0.01,"mlp_only_layers":[],
        "decoder_sparse_step":1,"tie_word_embeddings":false}"#;
    let c = serde_json::from_str::<HfConfig>(text)
        .unwrap()
        .into_config(Path::new("config.json"))
        .unwrap();
    let mut s = Settings::new(16, 4, 512, false);
    s.targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        .map(String::from)
        .to_vec();
    s.target_parameters = rtune_lora::KNOWN_PARAMETERS.map(String::from).to_vec();
    // As `rtune estimate` sets them for a run (`run::settings_for`): the checkpoint's size, the
    // training runtime (no tokenizer file).
    s.checkpoint_bytes = 324_114_856;
    s.runtime_bytes = RUNTIME_BYTES + TRAIN_RUNTIME_BYTES;
    let path = attn_path(s.seq_len);
    for phase in [
        Phase::CrossEntropy,
        Phase::SwigluBackward,
        Phase::AttentionBackward,
        Phase::RopeBackward,
        Phase::OptimizerStep,
    ] {
        let items = phase_items(&c, &s, phase, path);
        let total: u64 = items.iter().map(|i| i.each * i.count).sum();
        eprintln!(
            "{}: {:.1} MB besides the static items",
            phase.name(),
            total as f64 / 1e6
        );
    }
    // Estimated bytes against measured ones: within [1.0, 1.1].
    let covers = |what: &str, bytes: u64, phase: &str, measured: u64| {
        let ratio = bytes as f64 / measured as f64;
        eprintln!(
            "{what}: estimated {:.1} MB at {phase}, measured {:.1} MB: {ratio:.3}x",
            bytes as f64 / 1e6,
            measured as f64 / 1e6
        );
        assert!((1.0..=1.1).contains(&ratio), "{what}: {ratio}");
    };
    let est = estimate(&c, &s);
    covers("step", est.step_peak_bytes, est.phase, MEASURED_MOE_BENCH);
    // With NF4 linears and experts (plain NF4): the whole run's peak, loading included.
    s.quantize = Quantize::Nf4 {
        double_quant: false,
        experts: true,
    };
    let est = estimate(&c, &s);
    covers(
        "NF4 experts",
        est.peak_bytes,
        est.phase,
        MEASURED_MOE_BENCH_NF4,
    );
    // Loading only: layer 1's dense gate/up stack beside the mapped checkpoint and the NF4
    // weights.
    (s.micro_batch_size, s.seq_len) = (1, 16);
    let est = estimate(&c, &s);
    assert_eq!(est.phase, Phase::Loading.name());
    covers(
        "NF4 experts, loading",
        est.peak_bytes,
        est.phase,
        MEASURED_MOE_LOAD_NF4,
    );
}

/// Peak RSS of `benches/moe_vs_peft.sh`'s rtune run (its config, 4 steps), `peak_memory_bytes` in
/// its summary.json: `target/debug/rtune train --config runs/bench-moe/rtune.toml` (the dev
/// profile is optimized; its peak RSS agreed with the release binary's within 0.5% on this
/// model: 646.7 against 649.6 MB), of 5670f58 with the per-expert layout read in place, on
/// 2026-12-07, AMD EPYC 2 cores at load 10-14: 812.7, 783.6 and 814.2 MB (the step's peak moves
/// with the experts' jobs' order over the threads); the largest.
const MEASURED_MOE_BENCH: u64 = 814_190_592;
/// The same run with `quantize = "nf4"`, `double_quant = false`, `quantize_experts = true`,
/// release binary with each stack quantized before the next is read, 2026-12-07, the same CPU,
/// load 1-2: 532.9, 527.0, 538.5, 519.7 and 518.3 MB (the step's peak moves as the f32 run's);
/// the largest, to 0.1 MB. The same runs before that change peaked loading: 546.5 and 548.5 MB.
const MEASURED_MOE_BENCH_NF4: u64 = 538_500_000;
/// That NF4 config loading only (`max_seq_len = 16`, `micro_batch_size = 1`, `steps = 1`), the
/// same binary and day: 463.6, 463.0, 463.1, 463.5 and 462.5 MB; the largest, to 0.1 MB (548.2
/// and 547.8 MB before).
const MEASURED_MOE_LOAD_NF4: u64 = 463_600_000;

/// `quant = "nf4"` on a mixture of experts quantizes the linear layers only (attention here: every
/// layer is sparse), as bitsandbytes' `load_in_4bit` and so rtune's loading do (the fused expert
/// stacks and the routers stay in the compute dtype: `tests/integration/moe.rs`'s
/// `qwen3_moe_qlora_quantizes_the_linears_as_bitsandbytes`): on Qwen3-30B-A3B the weights shrink
/// by exactly the attention's NF4 saving, and the experts' bf16 bytes stay in them.
#[test]
fn nf4_on_a_mixture_of_experts_quantizes_the_linears_only() {
    let c = qwen3_30b_a3b();
    let mut s = Settings::new(8, 1, 512, true);
    s.dtype = DType::BF16;
    let dense = estimate(&c, &s).get(names::WEIGHTS);
    s.quantize = Quantize::linears(false);
    let nf4 = estimate(&c, &s).get(names::WEIGHTS);
    let saving: u64 = (0..c.num_layers)
        .flat_map(|l| c.linears_of(l))
        .map(|m| (m.in_features * m.out_features) as u64)
        .map(|n| 2 * n - n.div_ceil(2))
        .sum();
    assert!(saving > 0);
    assert_eq!(dense - nf4, saving);
    // 128 experts × (gate_up 2·768·2048 + down 2048·768) × 48 layers, 2 bytes each.
    let experts = 128 * 3 * 768 * 2048 * 48 * 2;
    assert!(nf4 > experts, "{nf4} < the experts' {experts}");
}

/// `[distributed] shard_base` on a mixture of experts: a rank holds 1/world of the routers and
/// expert stacks as of the linears (`rtune_model::moe::MoeShards`; on Qwen3-30B-A3B they are
/// 94% of the weights), and a layer's backward has its experts gathered whole.
#[test]
fn a_sharded_base_divides_the_experts_among_the_ranks() {
    let c = qwen3_30b_a3b();
    let mut s = Settings::new(8, 1, 512, true);
    s.dtype = DType::BF16;
    let whole = estimate(&c, &s).get(names::WEIGHTS);
    s.shard = Some(4);
    let rank = estimate(&c, &s).get(names::WEIGHTS);
    // The RMSNorm weights (2 a layer and the final one) stay whole on every rank.
    let norms = (2 * 48 + 1) * 2048 * 2;
    // Each weight's share rounded up: at most 1 byte more per weight (7 a layer, 2 tables).
    let pieces = 48 * 7 + 2;
    let (split, shares) = (whole - norms, rank - norms);
    assert!(
        4 * shares >= split && 4 * shares <= split + 4 * pieces,
        "{rank} B a rank of {whole} B"
    );
    // One layer's experts, gathered in its backward: 128 × (gate_up 2·768·2048 + down
    // 2048·768) + the router 128·2048, bf16.
    let experts = (128 * 3 * 768 * 2048 + 128 * 2048) * 2;
    let gathered: u64 = phase_items(&c, &s, Phase::AttentionBackward, AttnPath::Tiled)
        .iter()
        .filter(|it| it.name == names::GATHERED)
        .map(|it| it.each * it.count)
        .sum();
    assert!(gathered > experts, "{gathered} B gathered");
}

/// A sharded base divides NF4 expert stacks (`quantize_experts`) among the ranks by whole
/// experts, as the dense ones: on Qwen3-30B-A3B (128 experts, 4 ranks: 32 each) what NF4 saves
/// a rank on the stacks is a quarter of what it saves the whole base (nothing else differs
/// between the two).
#[test]
fn a_sharded_base_divides_the_nf4_experts_among_the_ranks() {
    let c = qwen3_30b_a3b();
    let mut s = Settings::new(8, 1, 512, true);
    s.dtype = DType::BF16;
    let weights = |s: &Settings, experts: bool| {
        let mut s = s.clone();
        s.quantize = Quantize::Nf4 {
            double_quant: false,
            experts,
        };
        estimate(&c, &s).get(names::WEIGHTS)
    };
    let whole = weights(&s, false) - weights(&s, true);
    s.shard = Some(4);
    let rank = weights(&s, false) - weights(&s, true);
    assert!(whole > 30_000_000_000, "{whole} B saved by NF4 experts");
    assert_eq!(4 * rank, whole, "{rank} B a rank of {whole} B");
}

/// `[model] quantize_experts` on Qwen3-30B-A3B: the expert stacks counted in NF4 expert by
/// expert, each `(out, in)` as one NF4 weight (`n/2` codes + 4 bytes a block of 64 + the 64-byte
/// code table: ≈ 0.56 byte a parameter, 0.28× their bf16 bytes), the routers still bf16; and one
/// dequantized f32 expert per compute thread while the products run.
#[test]
fn nf4_experts_shrink_the_expert_stacks() {
    let c = qwen3_30b_a3b();
    let mut s = Settings::new(8, 1, 512, true);
    s.dtype = DType::BF16;
    s.quantize = Quantize::linears(false);
    let linears = estimate(&c, &s);
    s.quantize = Quantize::Nf4 {
        double_quant: false,
        experts: true,
    };
    let experts = estimate(&c, &s);
    // 48 sparse layers of 128 experts: gate_up (1536, 2048) and down (2048, 768) each.
    let per_expert = |n: u64| n / 2 + 4 * n.div_ceil(64) + 64;
    let (gu, dn) = (1536 * 2048, 2048 * 768);
    let bf16 = 48 * 128 * (gu + dn) * 2;
    let nf4 = 48 * 128 * (per_expert(gu) + per_expert(dn));
    let (w0, w1) = (linears.get(names::WEIGHTS), experts.get(names::WEIGHTS));
    assert_eq!(w0 - w1, bf16 - nf4);
    let ratio = nf4 as f64 / bf16 as f64;
    assert!((0.28..0.282).contains(&ratio), "{ratio}");
    eprintln!(
        "Qwen3-30B-A3B bf16 weights: {:.2} GB with the stacks bf16, {:.2} GB with NF4 experts",
        w0 as f64 / 1e9,
        w1 as f64 / 1e9
    );
    // In the backward the larger of the largest linear's bf16 copy (q_proj, 4096 × 2048) and one
    // f32 gate_up expert a compute thread.
    let threads = candle_core::utils::get_num_threads().max(1) as u64;
    let dequant: u64 = phase_items(&c, &s, Phase::SwigluBackward, AttnPath::Plain)
        .iter()
        .filter(|i| i.name == names::DEQUANT)
        .map(|i| i.each * i.count)
        .sum();
    assert_eq!(dequant, (gu * 4 * threads).max(4096 * 2048 * 2));
    // Off unless asked: quantize = "nf4" alone leaves the stacks bf16.
    assert!(!Quantize::linears(true).experts());
}

/// Qwen3-30B-A3B: its model card says 30.5 B parameters, 3.3 B activated. Counted to 1%, and the
/// experts' LoRA as PEFT's `ParamWrapper` sizes it.
#[test]
fn mixture_of_experts_counts_total_and_active_parameters() {
    let c = qwen3_30b_a3b();
    let (total, active) = parameters(&c);
    assert!((total as f64 / 30.5e9 - 1.0).abs() < 0.01, "{total}");
    assert!((active as f64 / 3.3e9 - 1.0).abs() < 0.02, "{active}");
    // LoRA r 8 on q/k/v/o of 48 layers; on both expert stacks r·E·(in + out) each.
    let mut s = Settings::new(8, 1, 512, true);
    s.targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        .map(String::from)
        .to_vec();
    let attn = 8 * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048)) * 48;
    assert_eq!(lora_params(&c, &s), attn);
    s.target_parameters = rtune_lora::KNOWN_PARAMETERS.map(String::from).to_vec();
    let experts = 8 * 128 * ((2048 + 2 * 768) + (768 + 2048)) * 48;
    assert_eq!(lora_params(&c, &s), attn + experts);
    // The experts are in the base weights: ~30.5 B f32 parameters.
    let est = estimate(&c, &s);
    let weights = est.get(names::WEIGHTS);
    assert!(weights.abs_diff(total * 4) < 4_000_000, "{weights}");
}

// GRPO's sampling phase (`sampling.rs`); here, not in that file, since the row test reads
// `run.rs`'s `fit_to_data`, which reads `sampling.rs`.

/// Llama: hidden 8, 2 heads of 4 (2 kv heads), intermediate 16, vocab 32, 2 layers.
fn grpo_tiny() -> ModelConfig {
    let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8,"intermediate_size":16,
        "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":2,"vocab_size":32}"#;
    serde_json::from_str::<HfConfig>(text)
        .unwrap()
        .into_config(std::path::Path::new("config.json"))
        .unwrap()
}

/// 2 completion rows a micro-batch from a generation batch of `completions`.
fn grpo_settings(completions: usize, prompt_len: usize, max_completion: usize) -> Settings {
    let mut s = Settings::new(2, 2, prompt_len + max_completion, false);
    s.sampling = Some(Sampling {
        completions,
        prompt_len,
        max_completion,
        keeps_old: true,
        reference: true,
    });
    s
}

/// Where sampling is the peak (64 completions decoded together, 2 trained at a time), one
/// more completion token adds the KV cache's two copies of one slot of every completion,
/// `2·C·kv_bytes_per_slot`, and the kept batch's id and two log-probs, `3·4·C`: exactly,
/// since the heap's high-water mark is the sampling phase's. Dropping the cache or the kept
/// batch changes the difference.
#[test]
fn sampling_grows_by_the_cache_and_the_kept_batch_per_completion_token() {
    let c = grpo_tiny();
    let (cs, prompt) = (64u64, 20);
    let at = |n: usize| estimate(&c, &grpo_settings(cs as usize, prompt, n));
    let (a, b) = (at(100), at(101));
    assert_eq!(a.phase, Phase::Sampling.name());
    assert_eq!(b.phase, Phase::Sampling.name());
    // 2 layers × (k, v) × 2 kv heads × 4 dims × 4 bytes.
    let per_slot = kv_bytes_per_slot(&c, &grpo_settings(1, 1, 1));
    assert_eq!(per_slot, 2 * 2 * 2 * 4 * 4);
    assert_eq!(a.get(names::KV_CACHE), 2 * cs * 120 * per_slot);
    assert_eq!(b.peak_bytes - a.peak_bytes, 2 * cs * per_slot + 3 * 4 * cs);
    // The training pass alone (no generation batch) is lower.
    let mut plain = grpo_settings(cs as usize, prompt, 100);
    plain.sampling = None;
    let p = estimate(&c, &plain);
    assert!(
        p.peak_bytes < a.peak_bytes,
        "{} vs {}",
        p.peak_bytes,
        a.peak_bytes
    );
    assert_eq!(p.get(names::KV_CACHE) + p.get(names::GENERATION), 0);
}

/// The training pass of a GRPO step is the longest prompt plus a whole completion, every
/// completion token a target (the prompts are data, not targets); the cache's prompt is the
/// longest prompt.
#[test]
fn grpo_rows_are_the_longest_prompt_and_a_whole_completion() {
    let prompt = |n: usize| rtune_data::Example {
        input_ids: vec![1; n],
        labels: vec![rtune_data::IGNORE; n],
    };
    let mut s = grpo_settings(16, 90, 32);
    fit_to_data(&mut s, &[prompt(7), prompt(12), prompt(9)], 128);
    assert_eq!(s.seq_len, 12 + 32);
    assert_eq!(s.target_rows, Some(2 * 32));
    assert_eq!(s.sampling.unwrap().prompt_len, 12);
    assert_eq!(s.sampling.unwrap().slots(), 44);
}
