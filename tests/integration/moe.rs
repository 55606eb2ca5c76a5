//! Mixture-of-experts families against transformers + PEFT (issue 45; goldens by
//! `tests/parity/make_moe_goldens.py`): LoRA on q/k/v/o and, through `target_parameters`, on the
//! expert stacks; the load-balancing loss in the loss. The tolerances are parity.rs's (f32: loss
//! 1e-5 relative, gradients and AdamW weights 1e-4 of the tensor's largest entry).

use candle_core::{DType, Device, Tensor};
use rtune_model::{Inputs, Model};
use std::collections::HashMap;

use crate::common::{fixture, rel_err};
use crate::parity::{case, check_adamw_allowing, check_forward_and_grads};

const QWEN3_MOE: (&str, &str) = (
    "fixtures/tiny-qwen3-moe",
    "parity/golden_tiny_qwen3_moe.safetensors",
);

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
    check_forward_and_grads(&c);
    let want = c.golden.get("aux_loss").to_vec1::<f32>().unwrap()[0] as f64;
    let got = c.model.last_aux_loss().expect("aux loss");
    eprintln!("aux loss {got} vs {want}");
    assert!((got - want).abs() / want <= 1e-5, "aux {got} vs {want}");
    // 13 entries seen (of 14k in the expert stacks), 4 in the dense goldens.
    check_adamw_allowing(&c, 16);
}

/// Released checkpoints store each expert apart (`experts.N.gate_proj` ...; transformers 5.24
/// itself saves so), transformers 5 holds them fused (`experts.gate_up_proj: (E, 2I, H)`,
/// `experts.down_proj: (E, H, I)`): both load to the same model, bit for bit.
#[test]
fn qwen3_moe_fused_and_per_expert_layouts_load_alike() {
    let dir = fixture(QWEN3_MOE.0);
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
    let a = Model::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let b = Model::load(tmp.path(), DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..24).map(|i| 3 + (i * 37) % 250).collect();
    let inp = Inputs::new(ids, 2, 12);
    let la = a.forward(&inp, None, false).unwrap().logits;
    let lb = b.forward(&inp, None, false).unwrap().logits;
    assert_eq!(rel_err(&la, &lb), 0.0);
}
