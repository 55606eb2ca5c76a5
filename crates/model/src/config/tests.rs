//! config.json → ModelConfig: layouts, families, refusals.

use super::*;

fn cfg(extra: &str) -> Result<ModelConfig> {
    let text = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100{extra}}}"#
    );
    serde_json::from_str::<HfConfig>(&text)
        .unwrap()
        .into_config(Path::new("config.json"))
}

#[test]
fn v4_and_v5_rope_layouts_agree() {
    let v4 = cfg(r#","rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#).unwrap();
    let v5 = cfg(r#","rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#).unwrap();
    assert_eq!(v4.rope_theta, 500000.0);
    assert_eq!(v4.rope_theta, v5.rope_theta);
    assert_eq!(v4.rope_scaling, v5.rope_scaling);
    assert!(matches!(v4.rope_scaling, RopeScaling::Llama3 { .. }));
    let plain = cfg(r#","rope_parameters":{"rope_type":"default","rope_theta":1000.0}"#).unwrap();
    assert_eq!(
        (plain.rope_theta, plain.rope_scaling),
        (1000.0, RopeScaling::None)
    );
}

#[test]
fn unsupported_architecture_lists_supported() {
    let text = r#"{"architectures":["GPT2LMHeadModel"],"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100}"#;
    let e = serde_json::from_str::<HfConfig>(text)
        .unwrap()
        .into_config(Path::new("m/config.json"))
        .unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("GPT2LMHeadModel")
            && s.contains("Qwen2ForCausalLM")
            && s.contains("m/config.json"),
        "{s}"
    );
}

fn gemma(arch: &str, extra: &str) -> Result<ModelConfig> {
    let text = format!(
        r#"{{"architectures":["{arch}"],"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
        "vocab_size":100,"sliding_window":512,"query_pre_attn_scalar":256{extra}}}"#
    );
    serde_json::from_str::<HfConfig>(&text)
        .unwrap()
        .into_config(Path::new("config.json"))
}

/// Gemma 3 in transformers 4's keys (global rope_theta/rope_scaling, rope_local_base_freq,
/// sliding_window_pattern) and in 5's (rope_parameters per layer type, layer_types) read the
/// same; Gemma 2 without layer_types slides on its even layers.
#[test]
fn gemma_config_layouts_agree() {
    let v4 = gemma(
        "Gemma3ForCausalLM",
        r#","rope_theta":1000000.0,"rope_scaling":{"rope_type":"linear","factor":8.0},
        "rope_local_base_freq":10000.0,"sliding_window_pattern":6"#,
    )
    .unwrap();
    let v5 = gemma(
        "Gemma3ForCausalLM",
        r#","rope_parameters":{"full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":1000000.0},
        "sliding_attention":{"rope_type":"default","rope_theta":10000.0}},
        "layer_types":["sliding_attention","sliding_attention","sliding_attention",
        "sliding_attention","sliding_attention","full_attention"]"#,
    )
    .unwrap();
    for c in [&v4, &v5] {
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        assert_eq!(c.variant.local_rope, Some((1e4, RopeScaling::None)));
        assert_eq!(c.window_layers, [true, true, true, true, true, false]);
        assert!(c.variant.qk_norm && c.variant.sandwich_norms && c.variant.geglu);
        assert_eq!(c.variant.attn_scale, Some(1.0 / 16.0));
        assert_eq!(c.variant.embed_scale, Some(8.0));
        assert!(c.tie_word_embeddings);
    }
    let g2 = gemma(
        "Gemma2ForCausalLM",
        r#","attn_logit_softcapping":50.0,"final_logit_softcapping":30.0"#,
    )
    .unwrap();
    assert_eq!(g2.window_layers, [true, false, true, false, true, false]);
    assert_eq!(
        (g2.variant.attn_softcap, g2.variant.final_softcap),
        (Some(50.0), Some(30.0))
    );
    assert!(!g2.variant.qk_norm && g2.variant.local_rope.is_none());
    let e = gemma(
        "Gemma3ForCausalLM",
        r#","use_bidirectional_attention":true"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("embedding model"), "{e}");
    let e = gemma("Gemma2ForCausalLM", r#","hidden_activation":"relu""#).unwrap_err();
    assert!(e.to_string().contains("gelu_pytorch_tanh"), "{e}");
}

fn phi3(extra: &str) -> Result<ModelConfig> {
    let text = format!(
        r#"{{"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":96,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
        "max_position_embeddings":256{extra}}}"#
    );
    serde_json::from_str::<HfConfig>(&text)
        .unwrap()
        .into_config(Path::new("config.json"))
}

/// Phi-4-mini's keys in transformers 4's layout (top-level partial_rotary_factor and
/// original_max_position_embeddings, `rope_scaling` of type longrope) and 5's (all in
/// rope_parameters) read the same; the attention factor comes from 256 / 8; `su` is longrope.
#[test]
fn phi3_config_layouts_agree() {
    let short = "[1.0,1.1,1.3,1.6,2.0,2.5]";
    let long = "[1.0,1.5,2.5,4.0,6.0,9.0]";
    let v4 = phi3(&format!(
        r#","partial_rotary_factor":0.75,"original_max_position_embeddings":8,"rope_theta":10000.0,
        "rope_scaling":{{"type":"longrope","short_factor":{short},"long_factor":{long}}}"#
    ))
    .unwrap();
    let v5 = phi3(&format!(
        r#","original_max_position_embeddings":8,"rope_parameters":{{"rope_type":"longrope",
        "rope_theta":10000.0,"partial_rotary_factor":0.75,"original_max_position_embeddings":8,
        "short_factor":{short},"long_factor":{long}}}"#
    ))
    .unwrap();
    let su = phi3(&format!(
        r#","partial_rotary_factor":0.75,"original_max_position_embeddings":8,
        "rope_scaling":{{"type":"su","short_factor":{short},"long_factor":{long}}}"#
    ))
    .unwrap();
    for c in [&v4, &v5, &su] {
        assert_eq!((c.rotary_dim(), c.head_dim), (12, 16));
        assert!(c.variant.fused_proj);
        let RopeScaling::LongRope {
            original_max_position_embeddings,
            attention_factor,
            ..
        } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(original_max_position_embeddings, 8);
        let want = (1.0 + 32f64.ln() / 8f64.ln()).sqrt();
        assert!((attention_factor - want).abs() < 1e-12);
    }
    assert_eq!(v4.rope_scaling, v5.rope_scaling);
    // Without the key, Phi3Config's default pre-training length 4096 is used.
    let plain = phi3(r#","sliding_window":6"#).unwrap();
    assert_eq!(
        (plain.rotary_dim(), plain.rope_scaling.clone()),
        (16, RopeScaling::None)
    );
    assert_eq!(plain.window_layers, [true, true]);
    let e = phi3(&format!(
        r#","partial_rotary_factor":0.75,"rope_scaling":{{"type":"longrope","short_factor":[1.0],"long_factor":{long}}}"#
    ))
    .unwrap_err();
    assert!(
        e.to_string().contains("`short_factor` has 1 numbers"),
        "{e}"
    );
    let e = phi3(r#","resid_pdrop":0.1"#).unwrap_err();
    assert!(e.to_string().contains("resid_pdrop = 0.1"), "{e}");
    let e = cfg(r#","partial_rotary_factor":0.5"#).unwrap_err();
    assert!(e.to_string().contains("only Phi3ForCausalLM"), "{e}");
}

#[test]
fn head_dim_and_yarn() {
    assert_eq!(cfg("").unwrap().head_dim, 16);
    assert_eq!(cfg(r#","head_dim":32"#).unwrap().head_dim, 32);
    assert!(cfg(r#","rope_scaling":{"rope_type":"yarn","factor":4.0}"#).is_err());
}

/// The error of `r` (a refused config), checked to name `key` and `value`.
fn refused(r: Result<ModelConfig>, key: &str, value: &str) {
    let e = match r {
        Ok(c) => panic!("{key} = {value} accepted: {c:?}"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("config.json") && e.contains(key) && e.contains(value),
        "{key} = {value}: {e}"
    );
}

/// Gemma 2 without `query_pre_attn_scalar` (the helper above sets it), with `extra`.
fn gemma2_raw(extra: &str) -> Result<ModelConfig> {
    let text = format!(
        r#"{{"architectures":["Gemma2ForCausalLM"],"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
        "vocab_size":100{extra}}}"#
    );
    serde_json::from_str::<HfConfig>(&text)
        .unwrap()
        .into_config(Path::new("config.json"))
}

/// Issue 46: values that train to NaN (a soft cap or RoPE factor of 0 divides by zero, a
/// negative base or epsilon takes a NaN power or root, a window of 0 masks every key) are each
/// refused naming the key and the value.
#[test]
fn values_that_train_to_nan_are_refused() {
    let g2 = "Gemma2ForCausalLM";
    assert!(gemma2_raw(r#","attn_logit_softcapping":50.0,"sliding_window":4"#).is_ok());
    refused(
        gemma2_raw(r#","attn_logit_softcapping":0"#),
        "attn_logit_softcapping",
        "= 0",
    );
    refused(
        gemma(g2, r#","final_logit_softcapping":0.0"#),
        "final_logit_softcapping",
        "= 0",
    );
    refused(
        gemma2_raw(r#","query_pre_attn_scalar":0"#),
        "query_pre_attn_scalar",
        "= 0",
    );
    refused(
        gemma2_raw(r#","query_pre_attn_scalar":-4"#),
        "query_pre_attn_scalar",
        "= -4",
    );
    refused(
        gemma2_raw(r#","sliding_window":0"#),
        "sliding_window",
        "= 0",
    );
    refused(
        cfg(r#","model_type":"mistral","rms_norm_eps":-1e-5"#),
        "rms_norm_eps",
        "= -0.00001",
    );
    refused(cfg(r#","rope_theta":0"#), "rope_theta", "= 0");
    refused(cfg(r#","rope_theta":-10000"#), "rope_theta", "= -10000");
    refused(
        cfg(r#","rope_parameters":{"rope_type":"default","rope_theta":0}"#),
        "rope_parameters.rope_theta",
        "= 0",
    );
    refused(
        cfg(r#","rope_scaling":{"rope_type":"linear","factor":0}"#),
        "rope_scaling.factor",
        "= 0",
    );
    refused(
        cfg(
            r#","rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#,
        ),
        "rope_scaling.low_freq_factor",
        "= 0",
    );
    refused(
        gemma("Gemma3ForCausalLM", r#","rope_local_base_freq":0"#),
        "rope_local_base_freq",
        "= 0",
    );
    refused(
        gemma(
            "Gemma3ForCausalLM",
            r#","rope_parameters":{"full_attention":{"rope_type":"default","rope_theta":1e6},"sliding_attention":{"rope_type":"default","rope_theta":-1}}"#,
        ),
        "rope_parameters.sliding_attention.rope_theta",
        "= -1",
    );
    let (short, long) = ("[1.0,1.1,1.3,1.6,2.0,2.5]", "[1.0,1.5,2.5,4.0,6.0,9.0]");
    let zeros = "[0,0,0,0,0,0]";
    let lr = |short: &str, long: &str, extra: &str| {
        phi3(&format!(
            r#","partial_rotary_factor":0.75,"original_max_position_embeddings":8,
            "rope_scaling":{{"type":"longrope","short_factor":{short},"long_factor":{long}{extra}}}"#
        ))
    };
    assert!(lr(short, long, "").is_ok());
    refused(lr(zeros, long, ""), "rope_scaling.short_factor[0]", "= 0");
    refused(lr(short, zeros, ""), "rope_scaling.long_factor[0]", "= 0");
    refused(
        lr(short, long, r#","attention_factor":0"#),
        "rope_scaling.attention_factor",
        "= 0",
    );
    refused(
        lr(short, long, r#","factor":0"#),
        "rope_scaling.factor",
        "= 0",
    );
}

/// Issue 46: a present key of the wrong type was read as absent, and the run trained with the
/// default (`rope_theta: "1"` as 10000, `partial_rotary_factor: "0.5"` as the whole head, a list
/// for `rope_parameters` ignored): each is an error naming the key.
#[test]
fn wrongly_typed_keys_are_named() {
    refused(
        cfg(r#","rope_parameters":{"rope_type":"default","rope_theta":"1"}"#),
        "rope_parameters.rope_theta",
        "\"1\"",
    );
    refused(
        phi3(r#","rope_parameters":{"rope_type":"default","partial_rotary_factor":"0.5"}"#),
        "rope_parameters.partial_rotary_factor",
        "\"0.5\"",
    );
    refused(
        cfg(r#","rope_parameters":[{"rope_type":"default","rope_theta":1.0}]"#),
        "rope_parameters",
        "not an object",
    );
    refused(
        cfg(r#","rope_scaling":"linear""#),
        "rope_scaling",
        "not an object",
    );
    refused(
        cfg(r#","rope_scaling":{"rope_type":8,"factor":2.0}"#),
        "rope_scaling.rope_type",
        "= 8",
    );
    refused(
        gemma(
            "Gemma3ForCausalLM",
            r#","rope_parameters":{"full_attention":[1],"sliding_attention":{"rope_type":"default"}}"#,
        ),
        "rope_parameters.full_attention",
        "not an object",
    );
    // Top-level keys are typed by serde, whose message names no key: the reader names it.
    let dir = std::env::temp_dir().join(format!("rtune-typed-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    let read = |extra: &str| {
        let text = format!(
            r#"{{"architectures":["Phi3ForCausalLM"],"hidden_size":64,"intermediate_size":96,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100{extra}}}"#
        );
        std::fs::write(&path, text).unwrap();
        HfConfig::from_file(&path)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(read(r#","partial_rotary_factor":0.5"#), Ok(()));
    for (extra, key) in [
        (
            r#","partial_rotary_factor":"0.5""#,
            "`partial_rotary_factor`",
        ),
        (r#","rope_theta":"1""#, "`rope_theta`"),
        (r#","sliding_window":-1"#, "`sliding_window`"),
    ] {
        let e = read(extra).unwrap_err();
        assert!(e.contains(key) && e.contains("config.json"), "{extra}: {e}");
    }
    let e = read(r#","hidden_size":64"#).unwrap_err();
    assert!(e.contains("duplicate field `hidden_size`"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// OLMo 2 through its descriptor: post norms only, whole-width q/k norms in f32 (no `1 + w`),
/// `attention_bias` on q/k/v and o, no window even with `sliding_window` set (transformers'
/// Olmo2 attends fully), untied by default; `hidden_act` other than silu refused; a
/// `partial_rotary_factor` refused (it rotates whole heads).
#[test]
fn olmo2_maps_post_norms_and_whole_width_qk_norms() {
    let olmo2 = |extra: &str| {
        let text = format!(
            r#"{{"architectures":["Olmo2ForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "vocab_size":100{extra}}}"#
        );
        serde_json::from_str::<HfConfig>(&text)
            .unwrap()
            .into_config(Path::new("config.json"))
    };
    let c = olmo2(r#","attention_bias":true,"sliding_window":4"#).unwrap();
    assert_eq!(c.arch, &crate::family::OLMO2);
    let v = &c.variant;
    assert!(v.qk_norm && v.qk_norm_whole && v.sandwich_norms && v.f32_norms);
    assert!(!v.plus_one_norms && !v.geglu && v.embed_scale.is_none());
    assert!(c.qkv_bias && c.o_bias && !c.mlp_bias && !c.tie_word_embeddings);
    assert_eq!((c.head_dim, c.sliding_window), (16, None));
    assert_eq!(c.arch.norms.first(), "post_attention_layernorm");
    let e = olmo2(r#","hidden_act":"gelu""#).unwrap_err().to_string();
    assert!(e.contains("hidden_act `gelu`"), "{e}");
    let e = olmo2(r#","partial_rotary_factor":0.5"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("partial_rotary_factor"), "{e}");
}

fn qwen3_moe(extra: &str) -> Result<ModelConfig> {
    let text = format!(
        r#"{{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100{extra}}}"#
    );
    serde_json::from_str::<HfConfig>(&text)
        .unwrap()
        .into_config(Path::new("config.json"))
}

/// Qwen3-MoE: transformers' defaults (128 experts, top-8, no renormalisation, every layer
/// sparse, no aux loss unless `output_router_logits`), transformers 5's `num_local_experts`
/// spelling, `mlp_only_layers` and `decoder_sparse_step` as `Qwen3MoeDecoderLayer` reads them,
/// and a top-k beyond the experts refused.
#[test]
fn qwen3_moe_maps_experts_and_sparse_layers() {
    let c = qwen3_moe("").unwrap();
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.experts, m.top_k, m.intermediate), (128, 8, 768));
    assert_eq!(
        m.routing,
        rtune_experts::route::Routing::SoftmaxTopK { normalize: false }
    );
    assert_eq!(m.sparse_layers, [true; 4]);
    assert_eq!(m.aux_coef, None);
    assert!(c.variant.qk_norm && c.head_dim == 128);
    let c = qwen3_moe(
        r#","num_local_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,
        "moe_intermediate_size":32,"decoder_sparse_step":2,"mlp_only_layers":[3],
        "output_router_logits":true,"router_aux_loss_coef":0.01"#,
    )
    .unwrap();
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.experts, m.top_k, m.intermediate), (8, 2, 32));
    assert_eq!(
        m.routing,
        rtune_experts::route::Routing::SoftmaxTopK { normalize: true }
    );
    // (l + 1) % 2 == 0 and l not in mlp_only_layers: layer 1 only.
    assert_eq!(m.sparse_layers, [false, true, false, false]);
    assert_eq!(m.aux_coef, Some(0.01));
    let e = qwen3_moe(r#","num_experts":4,"num_experts_per_tok":5"#).unwrap_err();
    assert!(
        e.to_string()
            .contains("num_experts_per_tok = 5 of num_experts = 4"),
        "{e}"
    );
    let e = qwen3_moe(r#","decoder_sparse_step":0"#).unwrap_err();
    assert!(e.to_string().contains("decoder_sparse_step = 0"), "{e}");
}

/// Mixtral: transformers' defaults (8 experts, top-2, every layer sparse, the top k always
/// renormalised, `intermediate_size` the experts' width), the released layout's names, and
/// `router_jitter_noise` > 0 refused (random noise on the router's input).
#[test]
fn mixtral_maps_experts_and_refuses_router_noise() {
    let cfg = |extra: &str| {
        let text = format!(
            r#"{{"architectures":["MixtralForCausalLM"],"hidden_size":64,"intermediate_size":32,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100{extra}}}"#
        );
        serde_json::from_str::<HfConfig>(&text)
            .unwrap()
            .into_config(Path::new("config.json"))
    };
    let c = cfg("").unwrap();
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.experts, m.top_k, m.intermediate), (8, 2, 32));
    let e = cfg(r#","num_local_experts":2,"num_experts_per_tok":3"#).unwrap_err();
    assert!(
        e.to_string()
            .contains("num_experts_per_tok = 3 of num_local_experts = 2"),
        "{e}"
    );
    assert_eq!(
        m.routing,
        rtune_experts::route::Routing::SoftmaxTopK { normalize: true }
    );
    assert_eq!(m.sparse_layers, [true; 3]);
    assert_eq!(m.aux_coef, None);
    let r = m.released.expect("a released layout");
    assert_eq!(
        (r.module, r.names),
        ("block_sparse_moe", ["w1", "w3", "w2"])
    );
    let c = cfg(r#","num_local_experts":4,"output_router_logits":true,"router_jitter_noise":0.0"#)
        .unwrap();
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.experts, m.aux_coef), (4, Some(0.001)));
    let e = cfg(r#","router_jitter_noise":0.01"#).unwrap_err();
    assert!(e.to_string().contains("router_jitter_noise = 0.01"), "{e}");
}

/// gpt-oss's keys (transformers' `GptOssConfig` defaults where left out): biases on q/k/v/o,
/// sinks, even layers sliding with window 128, top-4 of 128 experts by `TopKSoftmax`, the clamped
/// SwiGLU's limit 7 and gain 1.702, stacks transposed, MXFP4 allowed; a zero limit refused; an
/// MXFP4 `quantization_config` refused on a family without MXFP4 experts.
#[test]
fn gpt_oss_maps_attention_and_experts() {
    let cfg = |arch: &str, extra: &str| {
        let text = format!(
            r#"{{"architectures":["{arch}"],"hidden_size":64,"intermediate_size":32,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100{extra}}}"#
        );
        serde_json::from_str::<HfConfig>(&text)
            .unwrap()
            .into_config(Path::new("config.json"))
    };
    let c = cfg("GptOssForCausalLM", "").unwrap();
    assert!(c.variant.attn_sinks && c.qkv_bias && c.o_bias && !c.tie_word_embeddings);
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.sliding_window, Some(128));
    assert_eq!(c.window_layers, [true, false, true]);
    assert_eq!(c.rope_theta, 150_000.0);
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.experts, m.top_k, m.intermediate), (128, 4, 32));
    assert_eq!(m.routing, rtune_experts::route::Routing::TopKSoftmax);
    assert_eq!(
        m.act,
        rtune_experts::moe::ExpertAct::Clamped {
            alpha: 1.702,
            limit: 7.0
        }
    );
    assert!(m.bias && m.transposed && m.mxfp4 && m.released.is_none());
    assert_eq!(m.router, "router");
    let c = cfg(
        "GptOssForCausalLM",
        r#","layer_types":["full_attention","sliding_attention","full_attention"],"sliding_window":8,"attention_bias":false"#,
    )
    .unwrap();
    assert_eq!(c.window_layers, [false, true, false]);
    assert_eq!(c.sliding_window, Some(8));
    assert!(!c.qkv_bias && !c.o_bias);
    let e = cfg("GptOssForCausalLM", r#","swiglu_limit":0.0"#).unwrap_err();
    assert!(e.to_string().contains("swiglu_limit"), "{e}");
    let q = r#","quantization_config":{"quant_method":"mxfp4"}"#;
    assert!(cfg("GptOssForCausalLM", q).is_ok());
    let e = cfg("MixtralForCausalLM", q).unwrap_err();
    assert!(e.to_string().contains("only GptOssForCausalLM"), "{e}");
}
