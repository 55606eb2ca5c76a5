//! `[model] quantize_experts` (issue 45): rtune's own NF4 expert stacks, beyond bitsandbytes
//! (which quantizes `nn.Linear`s only; that stays the default, `moe.rs`'s
//! `qwen3_moe_qlora_quantizes_the_linears_as_bitsandbytes`). Each expert's `(out, in)` matrix is
//! NF4 as bitsandbytes would quantize it alone (`rtune_experts::moe::stack`, checked against
//! bitsandbytes there), dequantized per expert while its products run.
//!
//! On the tiny Qwen3-MoE: the model with NF4 experts computes exactly as the same model whose
//! stacks were dequantized beforehand (a checkpoint holding them); through `rtune train` its
//! losses stay near f32's; the key is refused without NF4 or on a model without experts; the
//! merged export merges into the experts' NF4 round trip.

use candle_core::{DType, Device, Tensor};
use rtune_experts::moe::StackWeights;
use rtune_model::Quantize;
use std::collections::HashMap;
use std::path::Path;

use crate::common::{fixture, golden_loop_config, rel_err, rtune, stderr, train_losses, Golden};
use crate::moe::{EXPERT_TARGETS, QWEN3_MOE};
use crate::parity::{case_with, loss_and_grads, Case};

const NF4_GOLDEN: &str = "parity/golden_tiny_qwen3_moe_nf4.safetensors";

fn nf4_experts(double_quant: bool) -> Quantize {
    Quantize::Nf4 {
        double_quant,
        experts: true,
    }
}

/// A fused copy of the checkpoint in `dir` (per-expert layout) whose expert stacks are `c`'s NF4
/// stacks dequantized to f32: the plain path's input.
fn dequantized_copy(dir: &Path, c: &Case) -> tempfile::TempDir {
    let per = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut out: HashMap<String, Tensor> = per
        .into_iter()
        .filter(|(k, _)| !k.contains(".experts."))
        .collect();
    for l in 0..c.model.num_layers() {
        let Some(m) = &c.model.layer(l).unwrap().moe else {
            continue;
        };
        for (name, s) in [("gate_up_proj", &m.gate_up), ("down_proj", &m.down)] {
            let StackWeights::Nf4(q) = s else {
                panic!("layer {l}'s {name} is not NF4 with quantize_experts");
            };
            let t = q.dequantize(DType::F32, &Device::Cpu).unwrap();
            out.insert(format!("model.layers.{l}.mlp.experts.{name}"), t);
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("config.json"), tmp.path().join("config.json")).unwrap();
    candle_core::safetensors::save(&out, tmp.path().join("model.safetensors")).unwrap();
    tmp
}

/// The model with NF4 experts against the plain path on the same stacks dequantized beforehand
/// (loaded as a checkpoint, the attention NF4 in both): logits, loss and every LoRA gradient
/// (experts' included, with and without checkpointing) bit-equal — each expert dequantizes to
/// the same f32 values and runs the same products in the same order — where the f32 model holds
/// its stacks row-major as the NF4 experts are read. Where it holds them in panels
/// (`rtune_experts::moe::panels::fast`: AVX2 without AVX-512) its frozen expert products sum in
/// another order: within 1e-5 relative (f32 rounding of sums of a few hundred terms through two
/// layers; a wrong expert, row or scale is O(1e-2) or more). The resident expert stacks
/// shrink to ≈ 0.56 byte a parameter (f32: 4), and the loss moves off the linears-only NF4
/// golden's (else the stacks were not quantized).
#[test]
fn nf4_experts_compute_as_their_dequantized_stacks() {
    let dir = fixture(QWEN3_MOE.0);
    for dq in [false, true] {
        let a = case_with(&dir, NF4_GOLDEN, DType::F32, nf4_experts(dq));
        let copy = dequantized_copy(&dir, &a);
        let b = case_with(copy.path(), NF4_GOLDEN, DType::F32, Quantize::linears(dq));
        let lc = crate::parity::ctx(&a.adapter);
        let la = a.model.forward(&a.inputs, Some(&lc), false).unwrap().logits;
        let lb = b.model.forward(&b.inputs, Some(&lc), false).unwrap().logits;
        let tol = if rtune_experts::moe::panels::fast() {
            1e-5
        } else {
            0.0
        };
        let e = rel_err(&la, &lb);
        eprintln!("logits (double quant {dq}): {e:.2e} from the f32 model's (tolerance {tol:e})");
        assert!(e <= tol, "logits (double quant {dq}): {e:e}");
        for checkpoint in [false, true] {
            let (loss_a, ga) = loss_and_grads(&a, &a.adapter, checkpoint);
            let (loss_b, gb) = loss_and_grads(&b, &b.adapter, checkpoint);
            let e = (loss_a - loss_b).abs() / loss_b.abs();
            assert!(e <= tol, "loss (double quant {dq}): {loss_a} vs {loss_b}");
            for (i, name) in a.adapter.names.iter().enumerate() {
                for (x, y) in [(&ga.a[i], &gb.a[i]), (&ga.b[i], &gb.b[i])] {
                    let e = rel_err(x.as_ref().unwrap(), y.as_ref().unwrap());
                    assert!(
                        e <= tol,
                        "{name} (double quant {dq}, checkpoint {checkpoint}): {e:e}"
                    );
                }
            }
            // The linears-only golden (bitsandbytes: experts f32) is not this model's.
            let golden = a.golden.get("loss").to_vec1::<f32>().unwrap()[0] as f64;
            let moved = (loss_a - golden).abs() / golden;
            eprintln!(
                "double quant {dq}: loss {loss_a} vs the linears-only NF4 {golden} ({moved:.2e})"
            );
            assert!(moved > 1e-5, "NF4 experts changed nothing: {moved:e}");
        }
        // Resident bytes: the stacks at their packed size against the f32 copy's. Per expert
        // matrix of n elements: n/2 codes, a 64-entry f32 code table, and per block of 64 an f32
        // scale (plain) or a u8 code + per 256 blocks an f32 + the 256-entry map and offset
        // (double quant): ≈ 0.56 (0.52) byte a parameter once the matrices are large; these are
        // tiny (3072 and 1536 elements), so the tables weigh more.
        let cfg = a.model.cfg.moe.as_ref().unwrap();
        let (h, i) = (a.model.cfg.hidden_size, cfg.intermediate);
        let layers = cfg.sparse_layers.iter().filter(|&&s| s).count();
        let packed = |n: usize| {
            let blocks = n.div_ceil(64);
            let scales = match dq {
                true => blocks + 4 * blocks.div_ceil(256) + 4 * 256 + 4,
                false => 4 * blocks,
            };
            n.div_ceil(2) + scales + 64
        };
        let params = layers * cfg.experts * 3 * i * h;
        let nf4 = layers * cfg.experts * (packed(2 * i * h) + packed(h * i));
        let saved = b.model.resident_bytes() - a.model.resident_bytes();
        assert_eq!(saved, 4 * params - nf4, "double quant {dq}");
        let per = nf4 as f64 / params as f64;
        eprintln!(
            "NF4 experts (double quant {dq}): {per:.3} bytes a parameter ({params} parameters)"
        );
        let want = if dq { 0.8..0.9 } else { 0.57..0.59 };
        assert!(want.contains(&per), "{per} bytes a parameter");
    }
}

/// `rtune train` on the tiny Qwen3-MoE with `quantize = "nf4"` and `quantize_experts = true`
/// (LoRA on q/k/v/o and both stacks, the golden's init and batch, 3 AdamW steps): it runs, logs
/// the aux loss, and each step's loss is within 3% of the f32 run's (PEFT's f32 golden). Why 3%:
/// the NF4 round trip moves each weight by up to half a code step (≈ 0.08 of its block's largest),
/// and the linears alone already move this random tiny model's loss by 1.0% (bitsandbytes' golden,
/// 6.408 against f32's 6.342); the experts add errors of the same size. A wrong dequantization
/// (a wrong scale, a transposed expert) puts the loss tens of percent off.
#[test]
fn qwen3_moe_trains_with_nf4_experts_near_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let g = Golden::load(&fixture(QWEN3_MOE.1));
    let cfg = golden_loop_config(
        &g,
        t,
        &fixture(QWEN3_MOE.0),
        "dtype = \"f32\"\nquantize = \"nf4\"\nquantize_experts = true",
        EXPERT_TARGETS,
    );
    let o = rtune(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want: Vec<f32> = g.get("adamw.loss").to_vec1().unwrap();
    let losses = train_losses(&t.join("out"));
    assert_eq!(losses.len(), want.len(), "{losses:?}");
    for (l, w) in losses.iter().zip(&want) {
        let e = (l - *w as f64).abs() / *w as f64;
        eprintln!("NF4 experts loss {l} vs f32 {w}: {e:.2e}");
        assert!(e <= 0.03, "loss {l} vs f32's {w}: {e:e}");
    }
    let metrics = std::fs::read_to_string(t.join("out/metrics.jsonl")).unwrap();
    assert!(metrics.contains("aux_loss"), "{metrics}");
    let run: serde_json::Value =
        serde_json::from_slice(&std::fs::read(t.join("out/run.json")).unwrap()).unwrap();
    assert_eq!(run["config"]["model"]["quantize_experts"], true, "{run}");
    merged_into_the_nf4_experts(&t.join("out"), &t.join("merged"));
}

/// `rtune export --format merged` of a run with NF4 experts (plain NF4, double quant on by
/// default): each adapted expert tensor of the released per-expert checkpoint is its expert's NF4
/// round trip as training held it (gate and up quantized together as the stack's `(2I, H)` rows)
/// plus `ΔW_e`, within 1e-6 of the largest entry (the same f32 sum; the check's `ΔW_e` is formed
/// apart), and not the unquantized base plus `ΔW_e`.
fn merged_into_the_nf4_experts(run: &Path, dest: &Path) {
    let base = fixture(QWEN3_MOE.0);
    crate::common::export_merged(run, &base, dest);
    let spec = rtune_export::adapter_spec(run).unwrap();
    let model =
        rtune_model::Model::load_with(&base, DType::F32, &Device::Cpu, nf4_experts(true)).unwrap();
    let adapter =
        rtune_lora::Adapter::load_peft(run, &spec, &model.lora_modules(&spec), &Device::Cpu)
            .unwrap();
    let load = |d: &Path| {
        candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    let (orig, merged) = (load(&base), load(dest));
    let moe = model.cfg.moe.as_ref().unwrap();
    let i = moe.intermediate;
    let mut checked = 0;
    for l in 0..model.num_layers() {
        let Some(m) = &model.layer(l).unwrap().moe else {
            continue;
        };
        let StackWeights::Nf4(gu) = &m.gate_up else {
            panic!("layer {l}: gate_up not NF4");
        };
        let name = format!("model.layers.{l}.mlp.experts.base_layer");
        let slot = adapter.index_of(&name).expect("gate_up adapted");
        let pair = &adapter.pairs[slot];
        for e in 0..moe.experts {
            let l_e = rtune_experts::moe::ExpertLora {
                a: &pair.a,
                b: &pair.b,
                scale: spec.scaling(),
            };
            let (a, b) = rtune_experts::moe::expert_factors(&l_e, e, moe.experts).unwrap();
            let delta = (b.matmul(&a).unwrap() * spec.scaling()).unwrap();
            let want = (gu.expert(e, DType::F32, &Device::Cpu).unwrap() + &delta).unwrap();
            for (proj, rows) in [("gate_proj", 0), ("up_proj", i)] {
                let key = format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight");
                let want = want.narrow(0, rows, i).unwrap();
                let e1 = rel_err(&merged[&key], &want);
                assert!(e1 <= 1e-6, "{key}: {e1:e}");
                let plain = (&orig[&key] + delta.narrow(0, rows, i).unwrap()).unwrap();
                let e2 = rel_err(&merged[&key], &plain);
                assert!(
                    e2 > 1e-3,
                    "{key}: merged into the unquantized weight ({e2:e})"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0);
}

/// `quantize_experts = true` without NF4, or on a model without experts: exit 2 before anything
/// is written, naming the key (and the config file).
#[test]
fn quantize_experts_is_refused_without_nf4_or_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let g = Golden::load(&fixture("parity/golden_tiny_qwen3.safetensors"));
    g.write_batch(&t.join("batch.jsonl"));
    for (model, quantize, want) in [
        (QWEN3_MOE.0, "none", "model.quantize_experts"),
        (
            "fixtures/tiny-qwen3",
            "nf4",
            "Qwen3ForCausalLM has no experts",
        ),
    ] {
        let cfg = format!(
            "[model]\npath = \"{}\"\nquantize = \"{quantize}\"\nquantize_experts = true\n\
             [lora]\ntargets = [\"q_proj\"]\n[data]\ntrain = \"{}\"\n[train]\nsteps = 1\n\
             [output]\ndir = \"{}\"\n",
            fixture(model).display(),
            t.join("batch.jsonl").display(),
            t.join("out").display(),
        );
        std::fs::write(t.join("run.toml"), cfg).unwrap();
        let o = rtune(&["train", "--config", t.join("run.toml").to_str().unwrap()]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(want) && err.contains("quantize_experts"),
            "{err}"
        );
        assert!(!t.join("out").exists());
    }
}
