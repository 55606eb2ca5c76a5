//! Preference training of a mixture-of-experts model against TRL 1.16 (issue 45; golden by
//! `tests/parity/make_pref_goldens.py --moe`): the tiny Qwen3-MoE of moe.rs
//! (`output_router_logits`, `router_aux_loss_coef` 0.1, routers drawn wide so routing is mixed),
//! LoRA on q/k/v/o and on both expert stacks (`target_parameters`), from the golden's adapter.
//! TRL adds `router_aux_loss_coef · aux_loss` of the policy's forward to every loss:
//! `DPOTrainer` and the experimental `CPOTrainer` (SimPO) and `ORPOTrainer` over the whole batch
//! (chosen rows, then rejected), `KTOTrainer` over its completion rows (its KL rows run in a
//! separate forward whose aux it drops); the reference forwards add nothing. The aux term is
//! 0.24–0.26 of losses of 0.7–7, so a run without it is far outside the tolerances.
//!
//! Tolerances: preference.rs's (f32 CPU): each step's loss (aux term included) and TRL's
//! metrics, `aux_loss` among them (the aux before its coefficient), within 1e-5 of
//! max(1, |value|); the adapter after 3 AdamW steps within 1e-4 of each tensor's largest entry.

use crate::common::{fixture, Golden};
use crate::preference::{assert_as_trl_with, train_on};
use std::path::Path;

const MODEL: &str = "fixtures/tiny-qwen3-moe";
const LORA: &str = r#"targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]"#;
/// A and B of q/k/v/o on 3 layers and of the 2 expert stacks on the 2 sparse layers.
const TENSORS: usize = 2 * (3 * 4 + 2 * 2);

fn golden() -> Golden {
    Golden::load(&fixture("parity/golden_pref_moe.safetensors"))
}

/// The ids TRL's trainer of `variant` tokenized (the fixture has no tokenizer): DPO's
/// `moe_pairs`, SimPO's and ORPO's `moe_free_pairs`, KTO's unpaired `moe_kto_ids` (its KL
/// completions left for rtune to assign as TRL does).
fn write_rows(g: &Golden, variant: &str, path: &Path) {
    let rows: Vec<serde_json::Value> = match variant {
        "kto" => g.meta["moe_kto_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                serde_json::json!({
                    "prompt_ids": r["prompt_ids"],
                    "completion_ids": r["completion_ids"],
                    "label": r["label"],
                })
            })
            .collect(),
        "dpo" => g.meta["moe_pairs"].as_array().unwrap().clone(),
        _ => g.meta["moe_free_pairs"][variant]
            .as_array()
            .unwrap()
            .clone(),
    };
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(path, text).unwrap();
}

/// DPO (sigmoid), ORPO, SimPO and KTO each add `0.1 · aux_loss` as TRL does: every step's loss
/// and `aux_loss` as TRL's, and the adapter after 3 steps, whose gradients carry the aux term's
/// through the routers (the router-side path SFT uses).
#[test]
fn preference_objectives_add_the_aux_loss_as_trl() {
    let g = golden();
    assert_eq!(g.meta["router_aux_loss_coef"], 0.1);
    for variant in ["dpo", "orpo", "simpo", "kto"] {
        let tmp = tempfile::tempdir().unwrap();
        write_rows(&g, variant, &tmp.path().join("pairs.jsonl"));
        let lines = train_on(&g, variant, MODEL, LORA, tmp.path());
        let aux: Vec<f64> = lines
            .iter()
            .filter_map(|l| l["aux_loss"].as_f64())
            .collect();
        eprintln!("{variant}: aux_loss {aux:?}");
        assert_eq!(aux.len(), 3, "{variant}: aux_loss logged every step");
        assert_as_trl_with(&g, variant, &lines, tmp.path(), TENSORS);
    }
}
