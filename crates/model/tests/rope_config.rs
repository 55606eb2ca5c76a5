//! config.json to RoPE tables against transformers 5.24 (`tests/parity/rope_freqs.json`, made by
//! `tests/parity/make_rope_goldens.py`): each case's config keys read by rtune's config reader
//! (v4 `rope_scaling` with `type` or `rope_type`, v5 `rope_parameters`, a top-level
//! `original_max_position_embeddings` that wins over the set's as transformers'
//! `standardize_rope_params` makes it), then the op's frequencies: each within 1 f32 ulp of
//! transformers' (torch's vectorized `base ** x` is not correctly rounded; see
//! `rtune_ops::rope::freqs`), and the attention factor cos and sin are multiplied by to its f32.
//! The tables alone, from the parameters as transformers standardized them:
//! `rtune_ops::rope`'s `freqs_equal_transformers`.

use std::path::Path;

use rtune_model::{HfConfig, RopeScaling};
use serde_json::{json, Value};

#[test]
fn config_rope_equals_transformers() {
    let golden: Value = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/parity/rope_freqs.json"
    )))
    .unwrap();
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let rope_type = case["rope_parameters"]["rope_type"].as_str().unwrap();
        let arch = if rope_type == "longrope" {
            "Phi3ForCausalLM"
        } else {
            "LlamaForCausalLM"
        };
        let mut c = json!({
            "architectures": [arch],
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_key_value_heads": 2,
            "vocab_size": 16,
        });
        for (k, v) in case["config"].as_object().unwrap() {
            c[k] = v.clone();
        }
        let cfg = serde_json::from_value::<HfConfig>(c)
            .unwrap()
            .into_config(Path::new("config.json"))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            matches!(cfg.rope_scaling, RopeScaling::Yarn(_)),
            rope_type == "yarn",
            "{name}: {:?}",
            cfg.rope_scaling
        );
        let f = rtune_model::rope::freqs(&cfg);
        let within_an_ulp = |got: &[f32], want: &Value, what: &str| {
            let want = want.as_array().unwrap();
            assert_eq!(got.len(), want.len(), "{name}: {what}");
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let w = w.as_f64().unwrap() as f32;
                let ulps = (g.to_bits() as i64 - w.to_bits() as i64).abs();
                assert!(ulps <= 1, "{name}: {what}[{i}] {g:e} vs transformers {w:e}");
            }
        };
        within_an_ulp(&f.inv_freq, &case["inv_freq"], "inv_freq");
        if let Some(long) = case.get("inv_freq_long") {
            within_an_ulp(&f.long.as_ref().unwrap().0, long, "long inv_freq");
        }
        let att = case["attention_factor"].as_f64().unwrap() as f32;
        assert_eq!(f.scale, att, "{name}: attention factor");
    }
}

/// YaRN's keys that are not numbers where numbers belong, or `truncate` not a boolean, are errors
/// naming the key; a factor of 0 (frequencies divided by zero) is refused.
#[test]
fn bad_yarn_keys_are_named() {
    let read = |rope: Value| {
        let c = json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 16,
            "max_position_embeddings": 64, "rope_parameters": rope,
        });
        serde_json::from_value::<HfConfig>(c)
            .unwrap()
            .into_config(Path::new("config.json"))
            .map(|c| c.rope_scaling)
            .map_err(|e| e.to_string())
    };
    let ok = read(json!({"rope_type": "yarn", "factor": 4.0, "truncate": false})).unwrap();
    let RopeScaling::Yarn(y) = ok else {
        panic!("{ok:?}")
    };
    // No pre-training length anywhere: `max_position_embeddings`, as transformers defaults it.
    assert_eq!(
        (y.original_max_position_embeddings, y.truncate),
        (64.0, false)
    );
    let e = read(json!({"rope_type": "yarn", "factor": 4.0, "truncate": "no"})).unwrap_err();
    assert!(e.contains("rope_parameters.truncate"), "{e}");
    let e = read(json!({"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"})).unwrap_err();
    assert!(e.contains("rope_parameters.beta_fast"), "{e}");
    let e = read(json!({"rope_type": "yarn", "factor": 0.0})).unwrap_err();
    assert!(e.contains("rope_parameters.factor"), "{e}");
}
