//! Mixture-of-experts families against transformers + PEFT (issue 45; goldens by
//! `tests/parity/make_moe_goldens.py`): LoRA on q/k/v/o and, through `target_parameters`, on the
//! expert stacks; the load-balancing loss in the loss. The tolerances are parity.rs's (f32: loss
//! 1e-5 relative, gradients and AdamW weights 1e-4 of the tensor's largest entry).

use candle_core::{DType, Device, Tensor};
use rtune_lora::Adapter;
use rtune_model::{Inputs, LoraCtx, Model};
use std::collections::HashMap;
use std::path::Path;

use crate::common::{
    assert_trained_as_golden, fixture, golden_loop_config, rel_err, rtune, stderr, train_losses,
    Golden,
};
use crate::parity::{case, check_adamw_limits, check_forward_and_grads};

pub(crate) const QWEN3_MOE: (&str, &str) = (
    "fixtures/tiny-qwen3-moe",
    "parity/golden_tiny_qwen3_moe.safetensors",
);
pub(crate) const MIXTRAL: (&str, &str) = (
    "fixtures/tiny-mixtral",
    "parity/golden_tiny_mixtral.safetensors",
);
pub(crate) const GPT_OSS: (&str, &str) = (
    "fixtures/tiny-gpt-oss",
    "parity/golden_tiny_gpt_oss.safetensors",
);
/// The `[lora]` lines of the goldens' adapter: q/k/v/o and both expert stacks.
pub(crate) const EXPERT_TARGETS: &str = r#"targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]"#;

/// Logits, hidden states, loss (aux included), every LoRA gradient (with and without
/// checkpointing), the aux loss alone as transformers' `aux_loss`, and three AdamW steps as PEFT;
/// `near_zero`, `degenerate`: first gradients below f32 noise allowed (see `check_adamw_limits`).
fn moe_matches_peft(c: &crate::parity::Case, near_zero: usize, degenerate: usize) {
    check_forward_and_grads(c);
    let want = c.golden.get("aux_loss").to_vec1::<f32>().unwrap()[0] as f64;
    let got = c.model.last_aux_loss().expect("aux loss");
    eprintln!("aux loss {got} vs {want}");
    assert!((got - want).abs() / want <= 1e-5, "aux {got} vs {want}");
    check_adamw_limits(c, near_zero, degenerate);
}

/// Qwen3-MoE: layers 0 and 2 sparse (8 experts, top-2, renormalised), layer 1 dense
/// (`mlp_only_layers`); routers drawn wide so tokens spread; `output_router_logits` with
/// coefficient 0.1. Logits, hidden states, loss (aux included), every LoRA gradient (experts'
/// included, with and without checkpointing) and three AdamW steps as PEFT; the aux loss on its
/// own as transformers' `aux_loss`.
#[test]
fn qwen3_moe_experts_and_aux_loss_match_peft() {
    let c = case(QWEN3_MOE.0, QWEN3_MOE.1);
    let cfg = &c.model.cfg;
    assert_eq!(cfg.arch, &rtune_model::family::QWEN3_MOE);
    let moe = cfg.moe.as_ref().expect("a sparse model");
    assert_eq!(moe.sparse_layers, [true, false, true]);
    assert_eq!((moe.experts, moe.top_k, moe.aux_coef), (8, 2, Some(0.1)));
    // q/k/v/o on three layers, two expert stacks on two.
    assert_eq!(c.adapter.pairs.len(), 3 * 4 + 2 * 2);
    assert!(c
        .adapter
        .names
        .contains(&"model.layers.0.mlp.experts.base_layer".to_string()));
    // 13 entries seen (of 14k in the expert stacks), 4 in the dense goldens.
    moe_matches_peft(&c, 16, 2);
}

/// QLoRA (`quant = "nf4"`) on Qwen3-MoE against transformers + bitsandbytes 0.50.2 + PEFT
/// (`golden_tiny_qwen3_moe_nf4`): bitsandbytes' `load_in_4bit` quantizes the `nn.Linear`s only, so
/// the attention and the dense layer's MLP are NF4 and the fused 3-D expert stacks and the routers
/// stay in the compute dtype, adapted through `target_parameters` as in f32; rtune quantizes what
/// bitsandbytes does. The f32 tolerances of [`moe_matches_peft`] (NF4 dequantizes exactly, see
/// qlora.rs): a quantized expert stack or an unquantized projection would be far outside them
/// (the NF4 golden's loss is 6.408, the f32 one's 6.342).
#[test]
fn qwen3_moe_qlora_quantizes_the_linears_as_bitsandbytes() {
    let golden = "parity/golden_tiny_qwen3_moe_nf4.safetensors";
    let c = crate::parity::case_with(
        &fixture(QWEN3_MOE.0),
        golden,
        DType::F32,
        rtune_model::Quantize::linears(false),
    );
    assert_eq!(c.golden.meta["quant"], "nf4");
    // Seen: 38 first-gradient entries below 1e-5 of their tensor's largest and 4 below 1e-6 (the
    // f32 golden: 13 and 2), held as `check_adamw_limits` holds them; every other entry within
    // 1e-4 after AdamW (worst seen 1.5e-6).
    moe_matches_peft(&c, 40, 4);
}

/// Mixtral: every layer sparse (8 experts of width `intermediate_size`, top-2, the softmax's top
/// k renormalised), Mistral's attention; loaded from the released per-expert layout
/// (`block_sparse_moe.experts.N.w1/w3/w2`) into transformers 5's stacks, adapted under
/// transformers 5's names (`mlp.experts.*`) as PEFT names them. As Qwen3-MoE against PEFT.
#[test]
fn mixtral_experts_and_aux_loss_match_peft() {
    let per =
        candle_core::safetensors::load(fixture(MIXTRAL.0).join("model.safetensors"), &Device::Cpu)
            .unwrap();
    assert!(per.contains_key("model.layers.1.block_sparse_moe.experts.7.w3.weight"));
    let c = case(MIXTRAL.0, MIXTRAL.1);
    let cfg = &c.model.cfg;
    assert_eq!(cfg.arch, &rtune_model::family::MIXTRAL);
    let moe = cfg.moe.as_ref().expect("a sparse model");
    assert_eq!(moe.sparse_layers, [true, true]);
    assert_eq!((moe.experts, moe.top_k, moe.aux_coef), (8, 2, Some(0.1)));
    assert_eq!(c.adapter.pairs.len(), 2 * 4 + 2 * 2);
    moe_matches_peft(&c, 16, 2);
}

/// gpt-oss: every layer sparse (8 experts of width 32, top-2 of the router's biased logits then
/// softmax; experts stored `(E, H, 2I)` with gate/up interleaved, biases, the clamped SwiGLU at
/// limit 1.0 so the clamp acts), attention with q/k/v/o biases and random sinks, layer 0 sliding
/// (window 4 of 16 tokens) and layer 1 full, YaRN RoPE. As Qwen3-MoE against PEFT.
#[test]
fn gpt_oss_experts_sinks_and_aux_loss_match_peft() {
    let c = case(GPT_OSS.0, GPT_OSS.1);
    let cfg = &c.model.cfg;
    assert_eq!(cfg.arch, &rtune_model::family::GPT_OSS);
    assert!(cfg.variant.attn_sinks && cfg.qkv_bias && cfg.o_bias);
    assert_eq!(
        (cfg.sliding_window, &cfg.window_layers[..]),
        (Some(4), &[true, false][..])
    );
    assert!(matches!(
        cfg.rope_scaling,
        rtune_model::RopeScaling::Yarn(_)
    ));
    let moe = cfg.moe.as_ref().expect("a sparse model");
    assert_eq!((moe.experts, moe.top_k, moe.aux_coef), (8, 2, Some(0.1)));
    assert_eq!(moe.routing, rtune_experts::route::Routing::TopKSoftmax);
    assert_eq!(c.adapter.pairs.len(), 2 * 4 + 2 * 2);
    // Seen: 14 entries below 1e-6 of their tensor's largest first gradient and 31 below 1e-5 (of
    // 20k), all in the expert stacks' LoRA, where the clamp (limit 1.0) zeroes most tokens'
    // gradient of a gate column; the former are held within AdamW's reach, every other entry
    // within 1e-4 (worst seen 1.6e-6).
    moe_matches_peft(&c, 32, 14);
}

/// gpt-oss's release stores the expert stacks in MXFP4 (`*_blocks`, `*_scales`;
/// tests/fixtures/tiny-gpt-oss-mxfp4, quantized by make_moe_goldens.py as the release is):
/// rtune's dequantization equals transformers' (`convert_moe_packed_tensors`, which its
/// dequantizing `from_pretrained` gives: golden_gpt_oss_mxfp4.safetensors) bit for bit, and the
/// model loaded from the MXFP4 checkpoint equals the one loaded from those dense tensors, bit for
/// bit.
#[test]
fn gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them() {
    let dir = fixture("fixtures/tiny-gpt-oss-mxfp4");
    let q = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let want = candle_core::safetensors::load(
        fixture("parity/golden_gpt_oss_mxfp4.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(want.len(), 4);
    let mut dense: HashMap<String, Tensor> = HashMap::new();
    for (k, t) in &q {
        if k.ends_with("_blocks") || k.ends_with("_scales") {
            continue;
        }
        dense.insert(k.clone(), t.clone());
    }
    for (k, w) in &want {
        let got = rtune_quant::mxfp4::dequantize(
            k,
            &q[&format!("{k}_blocks")],
            &q[&format!("{k}_scales")],
            rtune_quant::mxfp4::Layout::Transformers,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(got.dims(), w.dims(), "{k}");
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        assert_eq!(bits(&got), bits(w), "{k}: not transformers' bits");
        dense.insert(k.clone(), w.clone());
    }
    let tmp = tempfile::tempdir().unwrap();
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization_config"]["quant_method"], "mxfp4");
    std::fs::copy(
        fixture(GPT_OSS.0).join("config.json"),
        tmp.path().join("config.json"),
    )
    .unwrap();
    candle_core::safetensors::save(&dense, tmp.path().join("model.safetensors")).unwrap();
    let a = Model::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let b = Model::load(tmp.path(), DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..24).map(|i| 3 + (i * 37) % 250).collect();
    let inp = Inputs::new(ids, 2, 12);
    let la = a.forward(&inp, None, false).unwrap().logits;
    let lb = b.forward(&inp, None, false).unwrap().logits;
    assert_eq!(rel_err(&la, &lb), 0.0);
}

/// Released checkpoints store each expert apart (`experts.N.gate_proj` ...; transformers 5.24
/// itself saves so), transformers 5 holds them fused (`experts.gate_up_proj: (E, 2I, H)`,
/// `experts.down_proj: (E, H, I)`): both load to the same model, bit for bit.
#[test]
fn qwen3_moe_fused_and_per_expert_layouts_load_alike() {
    let dir = fixture(QWEN3_MOE.0);
    let tmp = fused_copy(&dir);
    let a = Model::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let b = Model::load(tmp.path(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(rel_err(&logits(&a, None), &logits(&b, None)), 0.0);
}

/// A copy of the Qwen3-MoE checkpoint in `dir` (per-expert layout) with its experts fused as
/// transformers 5 holds them: `experts.gate_up_proj: (E, 2I, H)`, `experts.down_proj: (E, H, I)`.
fn fused_copy(dir: &Path) -> tempfile::TempDir {
    let per = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(per.contains_key("model.layers.0.mlp.experts.7.up_proj.weight"));
    let mut fused: HashMap<String, Tensor> = HashMap::new();
    let mut experts: HashMap<String, Vec<(usize, String, Tensor)>> = HashMap::new();
    for (k, t) in per {
        match k.split_once(".experts.") {
            Some((p, rest)) => {
                let (n, proj) = rest.split_once('.').unwrap();
                let e = (n.parse().unwrap(), proj.to_string(), t);
                experts.entry(p.to_string()).or_default().push(e);
            }
            None => {
                fused.insert(k, t);
            }
        }
    }
    for (p, mut v) in experts {
        v.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let e = v.len() / 3;
        let get = |n: usize, proj: &str| {
            v.iter()
                .find(|x| x.0 == n && x.1 == format!("{proj}.weight"))
                .unwrap()
                .2
                .clone()
        };
        let gu: Vec<Tensor> = (0..e)
            .map(|n| Tensor::cat(&[get(n, "gate_proj"), get(n, "up_proj")], 0).unwrap())
            .collect();
        let dn: Vec<Tensor> = (0..e).map(|n| get(n, "down_proj")).collect();
        fused.insert(
            format!("{p}.experts.gate_up_proj"),
            Tensor::stack(&gu, 0).unwrap(),
        );
        fused.insert(
            format!("{p}.experts.down_proj"),
            Tensor::stack(&dn, 0).unwrap(),
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("config.json"), tmp.path().join("config.json")).unwrap();
    candle_core::safetensors::save(&fused, tmp.path().join("model.safetensors")).unwrap();
    tmp
}

/// The model's logits on two fixed rows of 12 tokens, with the adapter in `lora` if given.
fn logits(model: &Model, lora: Option<&LoraCtx>) -> Tensor {
    let ids: Vec<u32> = (0..24).map(|i| 3 + (i * 37) % 250).collect();
    let inp = Inputs::new(ids, 2, 12);
    model.forward(&inp, lora, false).unwrap().logits
}

/// A mixture-of-experts family through `rtune train` from the golden's init adapter (`[lora] targets` q/k/v/o,
/// `target_parameters` the two expert stacks), with checkpointing: every step's loss (aux term
/// included) within 1e-5 relative of PEFT's, the adapter within 1e-4 of each tensor's largest
/// entry after 3 AdamW steps; `aux_loss` logged apart; the adapter saved under exactly the keys
/// PEFT's `get_peft_model_state_dict` gave (the golden's `peft_keys`), its config naming the
/// parameters, so PEFT loads it with no missing or unexpected key.
fn trains_as_peft_through_the_cli(
    (model, golden): (&str, &str),
) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = crate::families::train_matches_golden_with(model, golden, EXPERT_TARGETS);
    let out = tmp.path().join("out");
    let g = Golden::load(&fixture(golden));
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    let want = g.get("aux_loss").to_vec1::<f32>().unwrap()[0] as f64;
    let aux = first["aux_loss"].as_f64().expect("aux_loss logged");
    assert!(
        (aux - want).abs() / want <= 1e-5,
        "aux_loss {aux} vs {want}"
    );
    let saved = candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
        .unwrap();
    let mut keys: Vec<&String> = saved.keys().collect();
    keys.sort();
    let peft: Vec<&str> = g.meta["peft_keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap())
        .collect();
    assert_eq!(keys, peft);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["target_parameters"], g.meta["target_parameters"]);
    assert_eq!(cfg["target_modules"], g.meta["target_modules"]);
    (tmp, out)
}

/// Qwen3-MoE through the CLI ([`trains_as_peft_through_the_cli`]), then its expert adapter
/// exported merged from the released per-expert checkpoint and from a fused copy
/// ([`merged_is_base_plus_adapter`]); gguf-lora refused (exit 2, naming `target_parameters`),
/// nothing written.
#[test]
fn qwen3_moe_trains_as_peft_through_the_cli() {
    let (tmp, out) = trains_as_peft_through_the_cli(QWEN3_MOE);
    let t = tmp.path();
    let dir = fixture(QWEN3_MOE.0);
    merged_is_base_plus_adapter(&dir, &out, &t.join("merged"));
    let fused = fused_copy(&dir);
    merged_is_base_plus_adapter(fused.path(), &out, &t.join("merged-fused"));
    let gguf = t.join("adapter.gguf");
    let o = rtune(&[
        "export",
        "--run",
        out.to_str().unwrap(),
        "--format",
        "gguf-lora",
        "--out",
        gguf.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("target_parameters"), "{err}");
    assert!(!gguf.exists());
}

/// `rtune export --format merged --base <base>` of the run in `run` (LoRA on q/k/v/o and on both
/// expert stacks) into `dest`: the merged model's logits equal the base's with the adapter
/// within 1e-5 relative (x·(W + s·B·A) against x·W + s·(x·Aᵀ)·Bᵀ: summation order only), the
/// adapter's effect on them over 1e-4 (else the check is too weak); the expert tensors and the
/// attention projections changed, every other tensor copied byte for byte, the base's layout
/// kept.
fn merged_is_base_plus_adapter(base: &Path, run: &Path, dest: &Path) {
    crate::common::export_merged(run, base, dest);
    let spec = rtune_export::adapter_spec(run).unwrap();
    assert_eq!(spec.target_parameters.len(), 2);
    let mut model = Model::load(base, DType::F32, &Device::Cpu).unwrap();
    let adapter = Adapter::load_peft(run, &spec, &model.lora_modules(&spec), &Device::Cpu).unwrap();
    model.attach(&adapter);
    let lc = LoraCtx {
        adapter: &adapter,
        scaling: spec.scaling(),
        dropout: 0.0,
        seed: 0,
    };
    let want = logits(&model, Some(&lc));
    let merged = Model::load(dest, DType::F32, &Device::Cpu).unwrap();
    let err = rel_err(&logits(&merged, None), &want);
    let effect = rel_err(&logits(&model, None), &want);
    eprintln!("merged vs base+adapter {err:e}; the adapter's effect {effect:e}");
    assert!(err < 1e-5, "merged vs base+adapter: {err:e}");
    assert!(
        effect > 1e-4,
        "the adapter barely changes the logits ({effect:e})"
    );
    let load = |d: &Path| {
        candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    let (b, m) = (load(base), load(dest));
    assert_eq!(b.len(), m.len());
    for (name, t) in &b {
        let same = safetensors::View::data(t) == safetensors::View::data(&m[name]);
        let adapted = (name.contains(".experts.") && !name.ends_with("_bias"))
            || (name.contains("self_attn.") && name.ends_with("_proj.weight"));
        assert_eq!(same, !adapted, "{name}");
    }
}

/// Mixtral through the CLI, from its released per-expert checkpoint, then exported merged into
/// that layout (`block_sparse_moe.experts.N.w1/w3/w2`: [`merged_is_base_plus_adapter`]).
#[test]
fn mixtral_trains_as_peft_through_the_cli() {
    let (tmp, out) = trains_as_peft_through_the_cli(MIXTRAL);
    merged_is_base_plus_adapter(&fixture(MIXTRAL.0), &out, &tmp.path().join("merged"));
}

/// gpt-oss through the CLI (sinks, biases, the clamped SwiGLU, YaRN), then exported merged into
/// its `(E, in, out)` stacks ([`merged_is_base_plus_adapter`]); its MXFP4 checkpoint cannot be
/// merged into: exit 2 naming the stack, nothing written.
#[test]
fn gpt_oss_trains_as_peft_through_the_cli() {
    let (tmp, out) = trains_as_peft_through_the_cli(GPT_OSS);
    let t = tmp.path();
    merged_is_base_plus_adapter(&fixture(GPT_OSS.0), &out, &t.join("merged"));
    let dest = t.join("merged-mxfp4");
    let o = rtune(&[
        "export",
        "--run",
        out.to_str().unwrap(),
        "--base",
        fixture("fixtures/tiny-gpt-oss-mxfp4").to_str().unwrap(),
        "--format",
        "merged",
        "--out",
        dest.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("MXFP4"), "{err}");
    assert!(!dest.exists());
}

/// `target_parameters` on a model without experts (Qwen3, dense): exit 2 before anything is
/// written, naming the key.
#[test]
fn target_parameters_on_a_dense_model_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let g = Golden::load(&fixture("parity/golden_tiny_qwen3.safetensors"));
    g.write_batch(&t.join("batch.jsonl"));
    let cfg = format!(
        r#"[model]
path = "{model}"
[lora]
targets = ["q_proj"]
target_parameters = ["mlp.experts.gate_up_proj"]
[data]
train = "{data}"
[train]
steps = 1
[output]
dir = "{out}"
"#,
        model = fixture("fixtures/tiny-qwen3").display(),
        data = t.join("batch.jsonl").display(),
        out = t.join("out").display(),
    );
    std::fs::write(t.join("run.toml"), cfg).unwrap();
    let o = rtune(&["train", "--config", t.join("run.toml").to_str().unwrap()]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("Qwen3ForCausalLM has no experts") && err.contains("target_parameters"),
        "{err}"
    );
    assert!(!t.join("out").exists());
}

/// Padding stays out of the load-balancing loss, as transformers' attention mask leaves it out:
/// with each row's length given (`Inputs::lens`, which every training batch sets), what the pad
/// ids are changes nothing (1e-6 relative: only the experts' group sizes change, which may round
/// a real token's product in another order); without the lengths the pad tokens are routed and
/// counted, and the loss moves by far more.
#[test]
fn padding_is_left_out_of_the_aux_loss() {
    let c = case(QWEN3_MOE.0, QWEN3_MOE.1);
    let (b, t, real) = (2, 12, [12, 4]);
    let ids = |pad: u32| -> Vec<u32> {
        (0..b * t)
            .map(|i| match i < t || i - t < real[1] {
                true => 3 + (i as u32 * 37) % 250,
                false => pad + i as u32,
            })
            .collect()
    };
    // Next-token targets on the real tokens only.
    let targets: Vec<Option<u32>> = (0..b * t)
        .map(|i| {
            let (r, p) = (i / t, i % t);
            (p + 1 < real[r]).then(|| ids(0)[i + 1])
        })
        .collect();
    let loss = |pad: u32, lens: Option<Vec<usize>>| {
        let mut inp = Inputs::new(ids(pad), b, t);
        inp.lens = lens;
        c.model.eval_loss(&inp, &targets, None).unwrap()
    };
    let lens = Some(real.to_vec());
    let (a, z) = (loss(0, lens.clone()), loss(200, lens));
    let (ua, uz) = (loss(0, None), loss(200, None));
    eprintln!("masked {a} {z}; unmasked {ua} {uz}");
    assert!((a - z).abs() <= 1e-6 * a.abs(), "{a} vs {z}");
    assert!((ua - uz).abs() > 1e-4 * ua.abs(), "{ua} vs {uz}");
    assert!((a - ua).abs() > 1e-4 * a.abs(), "{a} vs {ua}");
}

/// The load-balancing loss under the per-token heads (the preference objectives' `PerToken`,
/// GRPO's `Tempered`) takes SFT's router-side path: with `weigh` the mean NLL over the targets
/// and the aux's whole share, either head gives transformers' SFT loss (CE + 0.1 · aux) and
/// every LoRA gradient of the Qwen3-MoE golden, with and without checkpointing (the tolerances
/// of `check_forward_and_grads`: loss 1e-5 relative, gradients 1e-4 of each tensor's largest);
/// a share of 0 leaves the CE alone (0.1 · aux, about 0.22, lower). The aux's tokens named per
/// row (KTO's and GRPO's `tokens`) cover what they name: all of them, the same as none named.
#[test]
fn per_token_heads_add_the_aux_loss_as_sft() {
    use rtune_model::{AuxShare, HeadLoss};
    let c = case(QWEN3_MOE.0, QWEN3_MOE.1);
    let g = &c.golden;
    let want = g.get("loss").to_vec1::<f32>().unwrap()[0] as f64;
    let aux = g.get("aux_loss").to_vec1::<f32>().unwrap()[0] as f64;
    let n = c.targets.iter().filter(|t| t.is_some()).count() as f32;
    let has: Vec<bool> = c.targets.iter().map(Option::is_some).collect();
    // The mean NLL over the targets: transformers' CE.
    let mean = |nll: &[f32]| {
        let w: Vec<f32> = has.iter().map(|&h| if h { 1.0 / n } else { 0.0 }).collect();
        let loss = nll.iter().zip(&w).map(|(l, w)| f64::from(l * w)).sum();
        Ok::<_, candle_core::Error>((loss, w))
    };
    let lc = crate::parity::ctx(&c.adapter);
    let run = |tempered: bool, share: f64, tokens: Option<Vec<usize>>, ckpt: bool| {
        let aux = AuxShare {
            share,
            grad_scale: share,
            tokens,
        };
        let (mut plain, mut temp) = (mean, |nll: &[f32], _: &[f32]| mean(nll));
        let head = match tempered {
            false => HeadLoss::PerToken {
                weigh: &mut plain,
                aux,
            },
            true => HeadLoss::Tempered {
                temperature: 1.0,
                weigh: &mut temp,
                aux,
            },
        };
        let mut grads = rtune_model::Grads::new(c.adapter.pairs.len());
        let mut none = |_: usize, _: &rtune_model::Grads| Ok(());
        let loss = (c.model)
            .train_pass(
                &c.inputs, &c.targets, &lc, head, ckpt, &mut grads, &mut none,
            )
            .unwrap();
        (loss, grads)
    };
    let every = Some(vec![c.inputs.t; c.inputs.b]);
    for (tempered, tokens, ckpt) in [
        (false, None, false),
        (false, None, true),
        (true, None, false),
        (false, every, false),
    ] {
        let (loss, grads) = run(tempered, 1.0, tokens, ckpt);
        let e = (loss - want).abs() / want;
        eprintln!("tempered {tempered} checkpoint {ckpt}: loss rel err {e:e}");
        assert!(e <= 1e-5, "loss {loss} vs {want}");
        for (i, name) in c.adapter.names.iter().enumerate() {
            for (which, got) in [("lora_A", &grads.a[i]), ("lora_B", &grads.b[i])] {
                let w = g.get(&format!("grad.base_model.model.{name}.{which}.weight"));
                let e = rel_err(got.as_ref().unwrap(), w);
                assert!(e <= 1e-4, "grad {name}.{which} rel err {e:e}");
            }
        }
    }
    let (ce, _) = run(false, 0.0, None, false);
    let e = (ce - (want - 0.1 * aux)).abs() / want;
    assert!(e <= 1e-5, "no share: {ce} vs {}", want - 0.1 * aux);
}

/// `[train] router_aux_loss_coef` (TRL 1.16's rule, over config.json's `output_router_logits`),
/// through `rtune train` on the Qwen3-MoE golden's loop (LoRA on q/k/v/o and both stacks):
/// - on a copy of the fixture whose config.json says `output_router_logits: false`, the golden's
///   coefficient (0.1) reproduces PEFT's run with the aux term (`assert_trained_as_golden`: each
///   loss within 1e-5 relative, the adapter within 1e-4), while the copy without the key adds no
///   aux loss (its first loss is PEFT's less `0.1 · aux`, 1e-5 relative: f32 sums);
/// - 0 on the fixture as made drops the term the same way;
/// - a dense model refuses the key: exit 2, naming it, nothing written.
#[test]
fn router_aux_loss_coef_adds_the_aux_loss_as_trl() {
    let g = Golden::load(&fixture(QWEN3_MOE.1));
    let src = fixture(QWEN3_MOE.0);
    let off = tempfile::tempdir().unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        off.path().join("model.safetensors"),
    )
    .unwrap();
    let mut hf: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    assert_eq!(hf["output_router_logits"], true);
    assert_eq!(hf["router_aux_loss_coef"], 0.1);
    hf["output_router_logits"] = false.into();
    std::fs::write(off.path().join("config.json"), hf.to_string()).unwrap();

    let train = |model: &Path, set: Option<&str>| {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = golden_loop_config(&g, tmp.path(), model, "", EXPERT_TARGETS);
        let mut args = vec!["train", "--config", cfg.to_str().unwrap()];
        args.extend(set.iter().flat_map(|s| ["--set", *s]));
        let o = rtune(&args);
        assert!(o.status.success(), "{set:?}: {}", stderr(&o));
        tmp
    };
    let want = g.get("adamw.loss").to_vec1::<f32>().unwrap()[0] as f64;
    let aux = g.get("aux_loss").to_vec1::<f32>().unwrap()[0] as f64;
    let without = want - 0.1 * aux;
    assert!(
        0.1 * aux > 1e-3 * want,
        "the aux term {aux} is too small to tell"
    );
    let first_loss = |run: &tempfile::TempDir| train_losses(&run.path().join("out"))[0];

    let trl = train(off.path(), Some("train.router_aux_loss_coef=0.1"));
    assert_trained_as_golden(&trl.path().join("out"), &g);
    for (what, run) in [
        ("output_router_logits false", train(off.path(), None)),
        (
            "coefficient 0",
            train(&src, Some("train.router_aux_loss_coef=0")),
        ),
    ] {
        let l = first_loss(&run);
        assert!(
            (l - without).abs() / without <= 1e-5,
            "{what}: first loss {l}, PEFT's without the aux term {without} (with it {want})"
        );
    }

    let dense = tempfile::tempdir().unwrap();
    let d = fixture("parity/golden_tiny_qwen3.safetensors");
    let gd = Golden::load(&d);
    let cfg = golden_loop_config(&gd, dense.path(), &fixture("fixtures/tiny-qwen3"), "", "");
    let o = rtune(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--set",
        "train.router_aux_loss_coef=0.001",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("router_aux_loss_coef") && err.contains("Qwen3ForCausalLM has no experts"),
        "{err}"
    );
    assert!(!dense.path().join("out").exists());
}
