//! `[distributed] shard_base` under `mpirun` (issue 37): each rank keeps 1/world of the frozen
//! base and gathers each layer's weights before it computes.
//! - 2 ranks (dense f32, NF4, NF4 with double quantization) and 3 ranks (an odd world: shards of
//!   unequal size, one rank with an empty shard of some weights) train the adapter of one process
//!   with the accumulation of the world, bit for bit, with the same metrics — evaluation and the
//!   evaluation prompts' decoding included (every rank evaluates: each layer needs every rank),
//!   also with layers kept gathered for the backward and with the next layer prefetched on a
//!   second thread (MPI_THREAD_SERIALIZED);
//! - on a model whose base dominates memory each rank's peak RSS is at most 0.6× that of a rank
//!   holding the whole base, and `rtune estimate --world 2` is within ±10% of each rank's peak,
//!   also with layers kept gathered for the backward (`keep_gathered_layers`) or the next one
//!   prefetched (`prefetch`), which cost memory;
//! - `kill -9` of a rank ends the job within 60 s and `--resume` gives the uninterrupted adapter;
//! - `rtune check` under `mpirun` runs the gather check;
//! - a mixture of experts (the tiny Qwen3-MoE, LoRA on its expert stacks, NF4 expert stacks too)
//!   on 2 and 3 ranks trains the adapter of one process, bit for bit.

use super::*;

/// `config` with `[distributed] shard_base` (or not), `quantize`, and evaluation on held-out rows
/// with a decoded prompt every 2 steps.
fn sharded(dir: &Path, name: &str, grad_accum: usize, shard: bool, quantize: &str) -> PathBuf {
    let cfg = config(dir, name, grad_accum, 4, &smoke());
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = text
        .replace(
            "[model]\n",
            &format!("[model]\nquantize = \"{quantize}\"\n"),
        )
        .replace("shuffle = true\n", "shuffle = true\nvalid_fraction = 0.25\n")
        .replace(
            "warmup_steps = 1\n",
            "warmup_steps = 1\neval_every = 2\neval_prompts = [\"Q: What is Zephyr?\\nA:\"]\neval_max_new_tokens = 4\n",
        );
    let text = format!("{text}[distributed]\nshard_base = {shard}\n");
    std::fs::write(&cfg, text).unwrap();
    cfg
}

fn ranks(np: usize, cfg: &Path, extra: &[&str]) -> Output {
    let mut c = mpirun(np);
    c.args(train_args(cfg)).args(extra);
    run(c)
}

fn summary(out: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap()
}

/// Rank 0's outputs of the sharded run `shard-{tag}` against those of the one-process run
/// `one-{tag}` (both under `dir`): the same adapter bytes, metrics and files (rank 0 alone
/// writes). Returns the metrics, the base's bytes each of the `np` ranks held and the whole
/// base's bytes.
fn as_one_process(dir: &Path, tag: &str, np: usize) -> (Vec<serde_json::Value>, Vec<f64>, f64) {
    let (want, got) = (
        dir.join(format!("one-{tag}")),
        dir.join(format!("shard-{tag}")),
    );
    assert!(adapter(&got) == adapter(&want), "{tag}: adapters differ");
    let m = metrics(&got);
    assert_eq!(m, metrics(&want), "{tag}");
    assert_eq!(files(&got), files(&want), "{tag}: rank 0 alone writes");
    let held: Vec<f64> = summary(&got)["rank_model_bytes"]
        .as_array()
        .unwrap_or_else(|| panic!("{tag}: no rank_model_bytes"))
        .iter()
        .map(|h| h.as_f64().unwrap())
        .collect();
    assert_eq!(held.len(), np, "{tag}: {held:?}");
    (m, held, summary(&want)["model_bytes"].as_f64().unwrap())
}

/// Bit for bit the adapter, metrics and samples of one process accumulating the world's
/// micro-batches, for each quantization on 2 ranks and two on 3.
#[test]
fn a_sharded_base_on_2_and_3_ranks_trains_the_adapter_of_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    // (ranks, quantization, layers kept gathered from the forward for the backward, the next
    // layer gathered on another thread)
    for (np, quantize, keep, prefetch) in [
        (2, "none", 0, false),
        (2, "nf4", 0, true),
        (2, "nf4-dq", 1, false),
        (3, "none", 0, true),
        (3, "nf4-dq", 2, true),
    ] {
        let tag = format!("{np}-{quantize}-{keep}-{prefetch}");
        let reference = sharded(tmp.path(), &format!("one-{tag}"), np, false, quantize);
        let o = single(&reference, &[]);
        assert!(o.status.success(), "{tag}: {}", stderr(&o));
        let cfg = sharded(tmp.path(), &format!("shard-{tag}"), 1, true, quantize);
        let text = std::fs::read_to_string(&cfg).unwrap();
        let text = format!("{text}keep_gathered_layers = {keep}\nprefetch = {prefetch}\n");
        std::fs::write(&cfg, text).unwrap();
        let o = ranks(np, &cfg, &[]);
        assert!(o.status.success(), "{tag}: {}", stderr(&o));
        let (m, held, whole) = as_one_process(tmp.path(), &tag, np);
        assert_eq!(
            m.iter().filter(|l| l.get("valid_loss").is_some()).count(),
            2,
            "{tag}"
        );
        let samples = |d: &str| {
            std::fs::read_to_string(tmp.path().join(format!("{d}-{tag}/samples.jsonl"))).unwrap()
        };
        assert_eq!(samples("shard"), samples("one"), "{tag}");
        // The ranks' shards cover the base once (each piece keeps its code tables); dense
        // weights split evenly. (This model's NF4 weights are 1 to 3 double-quantization
        // groups of 16,384 elements: their shards cannot be even.)
        let total: f64 = held.iter().sum();
        assert!(
            total >= whole && total < whole * 1.1,
            "{tag}: {held:?} of {whole}"
        );
        if quantize == "none" {
            for h in &held {
                let share = whole / np as f64;
                assert!((h / share - 1.0).abs() < 0.02, "{tag}: {h} of {whole}");
            }
        }
    }
}

/// The tiny Qwen3-MoE (`tests/fixtures/tiny-qwen3-moe`: 3 layers, 0 and 2 sparse with 8 experts,
/// top-2, the load-balancing loss on at coefficient 0.1) with LoRA on q/k/v/o and on both expert
/// stacks (`target_parameters`), its linears in `quantize` (`nf4`: without double quantization;
/// with `experts`: its expert stacks in NF4 too), 3 steps over 12 pre-tokenized rows (the fixture has no tokenizer), a sharded base or
/// not.
fn moe(
    dir: &Path,
    name: &str,
    grad_accum: usize,
    shard: bool,
    quantize: &str,
    experts: bool,
) -> PathBuf {
    let data = dir.join("moe.jsonl");
    let rows: String = (0..12u32)
        .map(|r| {
            let ids: Vec<u32> = (0..20u32)
                .map(|j| 1 + (r * 37 + j * 11 + r * j) % 255)
                .collect();
            format!("{{\"input_ids\":{ids:?},\"labels\":{ids:?}}}\n")
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let text = format!(
        r#"[model]
path = "{model}"
quantize = "{quantize}"
double_quant = {dq}
quantize_experts = {experts}
[lora]
r = 4
alpha = 8
dropout = 0.0  # PEFT adapts expert stacks without dropout
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
[data]
train = "{data}"
max_seq_len = 32
shuffle = true
[train]
seed = 11
steps = 3
micro_batch_size = 2
grad_accum = {grad_accum}
lr = 5e-3
warmup_steps = 1
max_grad_norm = 0.5
gradient_checkpointing = true
[output]
dir = "{out}"
[distributed]
shard_base = {shard}
"#,
        model = fixture("fixtures/tiny-qwen3-moe").display(),
        data = data.display(),
        out = dir.join(name).display(),
        dq = quantize == "nf4-dq",
    );
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// A mixture of experts under `mpirun` with a sharded base (routers and expert stacks split by
/// expert and gathered with their layer): 2 ranks in f32 and with NF4 linears and NF4 expert
/// stacks (`quantize_experts`, double-quantized, the next layer prefetched), 3 ranks with NF4
/// experts (8 experts: shares of 3, 3 and 2) train the adapter of one process that accumulates
/// the world's micro-batches, bit for bit, with the same metrics (the aux loss included).
/// Tolerance: none. Every gathered weight is the unsharded model's bits, each rank's micro-batch
/// computes as in the one process, and the ranks' gradients and losses are summed in the order
/// the one process accumulates them (the dense model's test above holds the same way).
#[test]
fn a_sharded_moe_with_nf4_experts_on_2_and_3_ranks_trains_the_adapter_of_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    for (np, quantize, experts, prefetch) in [
        (2, "none", false, false),
        (2, "nf4-dq", true, true),
        (3, "nf4", true, false),
    ] {
        let tag = format!("moe-{np}-{quantize}-{experts}-{prefetch}");
        let reference = moe(
            tmp.path(),
            &format!("one-{tag}"),
            np,
            false,
            quantize,
            experts,
        );
        let o = single(&reference, &[]);
        assert!(o.status.success(), "{tag}: {}", stderr(&o));
        let cfg = moe(
            tmp.path(),
            &format!("shard-{tag}"),
            1,
            true,
            quantize,
            experts,
        );
        let text = std::fs::read_to_string(&cfg).unwrap();
        std::fs::write(&cfg, format!("{text}prefetch = {prefetch}\n")).unwrap();
        let o = ranks(np, &cfg, &[]);
        assert!(o.status.success(), "{tag}: {}", stderr(&o));
        let (m, held, whole) = as_one_process(tmp.path(), &tag, np);
        assert_eq!(m.len(), 3, "{tag}");
        assert!(
            m.iter()
                .all(|l| l["aux_loss"].as_f64().is_some_and(|a| a > 0.0)),
            "{tag}: the aux loss is logged: {m:?}"
        );
        // Each rank holds its share of the base: the experts split 4/4 (2 ranks) or 3/3/2.
        eprintln!("{tag}: ranks hold {held:?} B of {whole} B");
        assert!(
            held.iter()
                .all(|h| *h < whole * 0.45 * 2.0 / np as f64 + 65536.0),
            "{tag}: {held:?} of {whole}"
        );
    }
}

/// A Llama whose frozen base (16 layers of hidden 512, f32: 201 MB) dominates a rank's memory,
/// written to `dir` as one safetensors file, and 4 pre-tokenized rows.
fn big_model(dir: &Path) -> (PathBuf, PathBuf) {
    use candle_core::{Device, Tensor};
    let model = dir.join("big-model");
    std::fs::create_dir_all(&model).unwrap();
    let (d, i, layers, v) = (512usize, 1536usize, 16usize, 512usize);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": d, "intermediate_size": i, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": v, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2,
        "max_position_embeddings": 512, "torch_dtype": "float32",
    });
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let mut t = std::collections::HashMap::new();
    let mut add = |name: String, shape: &[usize], scale: f64| {
        let x = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
        t.insert(name, x.affine(scale, 0.0).unwrap());
    };
    add("model.embed_tokens.weight".into(), &[v, d], 0.02);
    add("model.norm.weight".into(), &[d], 0.0);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (m, o, inp) in [
            ("self_attn.q_proj", d, d),
            ("self_attn.k_proj", d, d),
            ("self_attn.v_proj", d, d),
            ("self_attn.o_proj", d, d),
            ("mlp.gate_proj", i, d),
            ("mlp.up_proj", i, d),
            ("mlp.down_proj", d, i),
        ] {
            add(format!("{p}.{m}.weight"), &[o, inp], 0.02);
        }
        add(format!("{p}.input_layernorm.weight"), &[d], 0.0);
        add(format!("{p}.post_attention_layernorm.weight"), &[d], 0.0);
    }
    // Norm weights 1 (randn · 0 + 1).
    for (k, x) in t.iter_mut() {
        if k.ends_with("norm.weight") {
            *x = (x.clone() + 1.0).unwrap();
        }
    }
    candle_core::safetensors::save(&t, model.join("model.safetensors")).unwrap();
    let data = dir.join("big.jsonl");
    let rows: String = (0..4)
        .map(|r| {
            let ids: Vec<u32> = (0..64).map(|j| (r * 37 + j * 11) % v as u32).collect();
            format!("{{\"input_ids\":{ids:?},\"labels\":{ids:?}}}\n")
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    (model, data)
}

/// Each rank of a sharded base peaks at ≤ 0.6× a replicated rank on a base-dominated model, and
/// the estimate for a rank (`rtune estimate --world 2 --data`, and the run's own in
/// summary.json) is within ±10% of every rank's measured peak; with 6 of the 16 layers kept
/// gathered for the backward, or the next layer prefetched, too, and the rank then holds more.
#[test]
fn a_sharded_rank_peaks_at_most_0_6_of_a_replicated_one_as_estimated() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, data) = big_model(tmp.path());
    let cfg = |name: &str, shard: bool, extra: &str| {
        let p = config(tmp.path(), name, 1, 2, &data);
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace(
                &fixture("fixtures/tiny-llama3").display().to_string(),
                &model.display().to_string(),
            )
            .replace("dropout = 0.1", "dropout = 0.0")
            .replace("save_every = 1", "save_every = 0");
        let text = format!("{text}[distributed]\nshard_base = {shard}\n{extra}");
        std::fs::write(&p, text).unwrap();
        p
    };
    let peaks = |name: &str, shard: bool, extra: &str| -> (Vec<f64>, f64, f64) {
        let c = cfg(name, shard, extra);
        let o = ranks(2, &c, &[]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let s = summary(&tmp.path().join(name));
        let rank = |k: &str| -> Vec<f64> {
            s[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        let est = s["estimated_peak_bytes"].as_f64().unwrap();
        let o = common::rtune(&[
            "estimate",
            "--config",
            c.to_str().unwrap(),
            "--json",
            "--world",
            "2",
            "--data",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let cli: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        eprintln!(
            "{name}: rank peaks {:?}, estimate {est}, estimate --world 2 {}",
            rank("rank_peak_memory_bytes"),
            cli["peak_bytes"]
        );
        (
            rank("rank_peak_memory_bytes"),
            est,
            cli["peak_bytes"].as_f64().unwrap(),
        )
    };
    let (whole, _, _) = peaks("replicated", false, "");
    let (shard, est, cli) = peaks("sharded", true, "");
    let (kept, kept_est, kept_cli) = peaks("kept", true, "keep_gathered_layers = 6\n");
    let (ahead, ahead_est, ahead_cli) = peaks("prefetched", true, "prefetch = true\n");
    for (r, p) in shard.iter().enumerate() {
        assert!(
            *p <= 0.6 * whole[r],
            "rank {r}: {p} vs replicated {}",
            whole[r]
        );
        for (e, p) in [
            (est, p),
            (cli, p),
            (kept_est, &kept[r]),
            (kept_cli, &kept[r]),
            (ahead_est, &ahead[r]),
            (ahead_cli, &ahead[r]),
        ] {
            assert!(
                (e / p - 1.0).abs() <= 0.10,
                "rank {r}: estimate {e} vs measured {p}"
            );
        }
    }
    // A layer is 13.6 MB: kept, 5 more are held at once (6 kept, where one was gathered
    // anyway); prefetched, 1 more (the next one in flight: proof that it was).
    assert!(kept_est > est + 60e6, "{kept_est} vs {est}");
    assert!(ahead_est > est + 13e6, "{ahead_est} vs {est}");
    for r in 0..2 {
        let (k, a, p) = (kept[r], ahead[r], shard[r]);
        assert!(k > p + 30e6, "rank {r}: kept {k} vs {p}");
        assert!(a > p + 7e6, "rank {r}: prefetched {a} vs {p}");
    }
}

/// `kill -9` of a rank of a sharded run (prefetching) ends the job within 60 s; two ranks resume
/// it (without prefetch: a `[distributed]` key may change) to the adapter of the run that was
/// never interrupted.
#[test]
fn kill_9_of_a_sharded_rank_ends_the_job_and_resume_is_the_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |name: &str, distributed: &str| {
        let p = config(tmp.path(), name, 1, 8, &smoke());
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, format!("{text}[distributed]\n{distributed}\n")).unwrap();
        p
    };
    let whole = cfg("whole", "shard_base = false");
    let o = ranks(2, &whole, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let shard = cfg("killed", "shard_base = true\nprefetch = true");
    let out = tmp.path().join("killed");
    let child = spawn_until_step(&shard, &out, 3, &[]);
    let pid = rank_pid(child.id(), 1).expect("rank 1's process");
    signal(pid, 9);
    let (o, took) = wait_timed(child);
    assert!(!o.status.success(), "mpirun exits non-zero");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert!(!out.join("summary.json").exists());
    let shard = cfg("killed", "shard_base = true\nprefetch = false");
    let o = ranks(2, &shard, &["--resume"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = tmp.path().join("whole");
    assert!(adapter(&out) == adapter(&want), "adapters differ");
    assert_eq!(metrics(&out), metrics(&want));
}

/// A rank of a prefetching sharded run that hangs (SIGSTOP) ends the job through the other's
/// watchdog, which watches the wait for a prefetched gather as any collective (the prefetching
/// thread itself, polling MPI, would wait forever).
#[test]
fn a_hung_rank_of_a_prefetching_sharded_run_ends_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let p = config(tmp.path(), "hung", 1, 400, &smoke());
    let text = std::fs::read_to_string(&p).unwrap();
    let text = format!("{text}[distributed]\nshard_base = true\nprefetch = true\n");
    std::fs::write(&p, text.replace("save_every = 1", "save_every = 0")).unwrap();
    let out = tmp.path().join("hung");
    let child = spawn_until_step(&p, &out, 2, &[("RTUNE_DIST_TIMEOUT", "5")]);
    let pid = rank_pid(child.id(), 1).expect("rank 1's process");
    signal(pid, 19); // SIGSTOP
    let (o, took) = wait_timed(child);
    // SAFETY: kill(2) of a pid this test stopped; it may already be gone (ESRCH, ignored).
    unsafe { libc_kill(pid, 9) };
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(took < Duration::from_secs(30), "took {took:?}: {err}");
    assert!(
        err.contains("rank 0: waited") && err.contains("rank 1 died or hangs"),
        "{err}"
    );
    // Where rank 0 waits depends on where rank 1 stopped: mostly for a prefetched layer (3 runs
    // of 3: "in the gather of layer 2 (prefetched)"), else a gather or the step's all-reduce on
    // the main thread. An unwatched wait for the prefetching thread would hang the job instead.
    eprintln!(
        "{took:?}: {}",
        err.lines().find(|l| l.contains("waited")).unwrap_or("")
    );
    assert!(err.contains("RTUNE_DIST_TIMEOUT = 5 s"), "{err}");
}

/// `rtune check` under `mpirun` with `shard_base`: every rank's checks (their scratch runs load
/// the base sharded over a world of one), the all-reduce, and the gather of unequal shares. The
/// learning rate is made too small for the overfit check to pass, so every rank fails a check:
/// the job must still print every rank's lines whole and end without an abort (a failing rank
/// used to abort the job and kill the other before it printed its gather line; the scratch runs'
/// `sustained throughput` check does fail now and then on these shared 2-core machines).
#[test]
fn rtune_check_under_mpirun_checks_the_sharded_gather() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = sharded_check_config(tmp.path());
    let mut c = mpirun(2);
    c.args([
        env!("CARGO_BIN_EXE_rtune"),
        "check",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "train.lr=1e-12",
    ]);
    let o = run(c);
    let said = String::from_utf8_lossy(&o.stdout);
    let err = stderr(&o);
    for rank in 0..2 {
        let line = |check: &str| {
            said.lines()
                .find(|l| l.starts_with(&format!("rank {rank}/2")) && l.contains(check))
                .unwrap_or_else(|| panic!("rank {rank}'s {check} check: {said}\n{err}"))
        };
        for check in ["all-reduce across ranks", "sharded-base gather"] {
            let l = line(check);
            assert!(l.contains("PASS") && l.contains("exact"), "{l}");
        }
        assert!(line("overfit 4 samples").contains("FAIL"), "{said}");
        assert!(
            err.contains(&format!("rank {rank} of 2: ")) && err.contains("overfit 4 samples"),
            "{err}"
        );
    }
    // Each rank ends by itself with the failure's exit status: no abort cuts the job short.
    assert!(!o.status.success(), "{said}\n{err}");
    assert!(!err.contains("MPI_ABORT"), "{err}");
}

/// The smoke config for 2 ranks with a sharded base, as `rtune check` tests take it.
fn sharded_check_config(dir: &Path) -> PathBuf {
    let cfg = config(dir, "check", 1, 2, &smoke());
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("{text}[distributed]\nshard_base = true\n")).unwrap();
    cfg
}

/// `rtune check` with one failing rank (MPMD: rank 0's learning rate too small for its overfit
/// check, rank 1's as configured): rank 0 fails, and rank 1 — whose own checks pass — still ends
/// with a failure, saying that another rank's checks failed; neither aborts the job. Rank 1's
/// `sustained throughput` check can fail by itself on a loaded 2-core machine (wall-clock rates);
/// then rank 1 must end on that failure instead, naming it.
#[test]
fn rtune_check_under_mpirun_fails_every_rank_when_one_rank_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = sharded_check_config(tmp.path());
    let check = |lr: Option<&str>| {
        let mut args = vec![
            env!("CARGO_BIN_EXE_rtune").to_string(),
            "check".into(),
            "--config".into(),
            cfg.display().to_string(),
        ];
        if let Some(lr) = lr {
            args.extend(["--set".into(), format!("train.lr={lr}")]);
        }
        args
    };
    let mut c = mpirun_base();
    c.args(["-np", "1"]).args(check(Some("1e-12"))).arg(":");
    c.args(["-np", "1"]).args(check(None));
    let o = run(c);
    let said = String::from_utf8_lossy(&o.stdout);
    let err = stderr(&o);
    let lines = |rank: usize| -> Vec<&str> {
        let at = format!("rank {rank}/2");
        said.lines().filter(|l| l.starts_with(&at)).collect()
    };
    let line = |rank: usize, check: &str| {
        lines(rank)
            .into_iter()
            .find(|l| l.contains(check))
            .unwrap_or_else(|| panic!("rank {rank}'s {check} check: {said}\n{err}"))
    };
    assert!(line(0, "overfit 4 samples").contains("FAIL"), "{said}");
    assert!(line(1, "overfit 4 samples").contains("PASS"), "{said}");
    for rank in 0..2 {
        let l = line(rank, "sharded-base gather");
        assert!(l.contains("PASS") && l.contains("exact"), "{l}");
    }
    let failed_on_1: Vec<&str> = lines(1)
        .into_iter()
        .filter(|l| l.contains("FAIL"))
        .collect();
    match failed_on_1.as_slice() {
        [] => assert!(
            err.contains("rank 1 of 2: all ")
                && err.contains("checks passed here, but another rank's failed"),
            "{err}"
        ),
        [l] => assert!(l.contains("sustained throughput"), "{said}"),
        more => panic!("rank 1 failed {more:?}"),
    }
    assert!(
        err.contains("rank 0 of 2: ") && err.contains("overfit 4 samples"),
        "{err}"
    );
    assert!(!o.status.success(), "{said}\n{err}");
    assert!(!err.contains("MPI_ABORT"), "{err}");
}

/// A rank that would load the whole base beside sharded ones, or keep another number of gathered
/// layers (its gathers would pair with the wrong layers'), is refused before anything loads,
/// naming the rank and the key (loading a sharded base is collective).
#[test]
fn a_rank_without_shard_base_is_refused_before_loading() {
    let tmp = tempfile::tempdir().unwrap();
    let with = |name: &str, distributed: &str| {
        let p = config(tmp.path(), name, 1, 2, &smoke());
        // Both ranks write the same run directory.
        let text = std::fs::read_to_string(&p)
            .unwrap()
            .replace(&format!("/{name}\""), "/run\"");
        std::fs::write(&p, format!("{text}[distributed]\n{distributed}\n")).unwrap();
        p
    };
    let sharded = with("sharded", "shard_base = true");
    let err = refused_mpmd(&sharded, &with("whole", "shard_base = false"));
    assert!(
        err.contains("rank 1 (of 2) does not run what rank 0 runs: distributed.shard_base is false on rank 1, true on rank 0"),
        "{err}"
    );
    let keeps = with("keeps", "shard_base = true\nkeep_gathered_layers = 2");
    let err = refused_mpmd(&keeps, &sharded);
    assert!(
        err.contains("rank 1 (of 2) does not run what rank 0 runs: distributed.keep_gathered_layers is 0 on rank 1, 2 on rank 0"),
        "{err}"
    );
    assert!(!tmp.path().join("run").exists(), "nothing is written");
}

/// DPO with a sharded base: every rank runs the reference pass's forwards (each layer needs every
/// rank), so the ranks agree on the reference cache first — here rank 0 finds the pairs' cached
/// reference log-probs in its own `cache_dir` and rank 1 does not: both compute them, and the run
/// trains the adapter of one process with twice the accumulation. A rank whose pairs differ is
/// refused before any reference forward, naming the file.
#[test]
fn a_sharded_dpo_run_agrees_on_the_reference_cache_and_on_the_pairs() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, more) = (
        pairs(tmp.path(), "pairs.jsonl", 8),
        pairs(tmp.path(), "more.jsonl", 9),
    );
    let dpo = |name: &str, out: &str, grad_accum: usize, data: &Path, extra: &str| {
        let cfg = config(tmp.path(), name, grad_accum, 4, data);
        let text = std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("[train]\n", "[train]\nobjective = \"dpo\"\nbeta = 0.5\n")
            .replace(&format!("/{name}\""), &format!("/{out}\""));
        std::fs::write(&cfg, format!("{text}{extra}")).unwrap();
        cfg
    };
    let cache = |d: &str| format!("[data]\ncache_dir = \"{}\"\n", tmp.path().join(d).display());
    let prepend = |cfg: &Path, head: &str| {
        // `[data]` keys go in the config's own [data] section.
        let text = std::fs::read_to_string(cfg).unwrap();
        let head = head.trim_start_matches("[data]\n");
        std::fs::write(
            cfg,
            text.replacen("[data]\n", &format!("[data]\n{head}"), 1),
        )
        .unwrap();
    };
    // One process, twice the accumulation; its reference log-probs cached in `warm/`.
    let one = dpo("one", "one", 2, &data, "");
    prepend(&one, &cache("warm"));
    let o = single(&one, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let sharded = "[distributed]\nshard_base = true\n";
    let (a, b) = (
        dpo("rank0", "run", 1, &data, sharded),
        dpo("rank1", "run", 1, &data, sharded),
    );
    prepend(&a, &cache("warm"));
    prepend(&b, &cache("cold"));
    let mut c = mpirun_base();
    c.args(["-np", "1"]).args(train_args(&a)).arg(":");
    c.args(["-np", "1"]).args(train_args(&b));
    let o = run(c);
    assert!(o.status.success(), "{}", stderr(&o));
    let (want, got) = (tmp.path().join("one"), tmp.path().join("run"));
    assert!(adapter(&got) == adapter(&want), "adapters differ");
    assert_eq!(metrics(&got), metrics(&want));
    // Rank 1 with a pair more: refused before the reference pass.
    let c = dpo("other", "refused", 1, &more, sharded);
    let a = dpo("same", "refused", 1, &data, sharded);
    let err = refused_mpmd(&a, &c);
    assert!(
        err.contains("rank 1 (of 2) does not run what rank 0 runs: data.train[0]"),
        "{err}"
    );
    assert!(!err.contains("waited"), "refused, not timed out: {err}");
}
