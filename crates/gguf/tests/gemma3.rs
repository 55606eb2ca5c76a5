//! tests/fixtures/tiny-gemma3 → a `gemma3` GGUF (written as convert_hf_to_gguf.py's `Gemma3Model`
//! lays it out: norms stored as `w + 1`, no q/k permutation, a SentencePiece vocabulary) → a
//! Hugging Face directory again: the same config, the same tensors, the same logits, and the
//! tokenizer transformers builds from the file.

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

use rtune_gguf::SpmVocab;
use rtune_model::{Inputs, Model};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-gemma3")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rtune-gguf-g3-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The fixture with `query_pre_attn_scalar` = head_dim (24): a gemma3 GGUF has no key for it and
/// llama.cpp scales by 1/√head_dim, so only such a model survives the round trip.
fn gguf_able_fixture(d: &Path) -> PathBuf {
    let dir = d.join("tiny-gemma3");
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = json(&fixture().join("config.json"));
    c["query_pre_attn_scalar"] = serde_json::json!(24);
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    for f in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    dir
}

/// A 256-token Gemma-style SentencePiece vocabulary (the fixture's vocab_size): Gemma's special
/// tokens at Gemma's ids 0–4, `<start_of_turn>` / `<end_of_turn>`, user-defined newline and
/// whitespace runs (stored with real spaces, as Gemma's tokenizer.model has them), the bytes
/// 0x80–0xFF for byte fallback, single characters, every prefix of a few words (so BPE can reach
/// them), and `<unusedN>` control tokens up to 256.
fn vocab() -> SpmVocab {
    let mut v = SpmVocab {
        bos: 2,
        eos: 1,
        unk: 3,
        pad: 0,
        ..Default::default()
    };
    let mut push = |t: &str, ty: i32| {
        // Scores rising with the id: the reverse of the merge order (as Gemma's scores do not
        // follow it), so a converter ranking merges by score instead of by id encodes otherwise.
        let score = if ty == 1 { v.tokens.len() as f32 } else { 0.0 };
        v.tokens.push(t.to_string());
        v.scores.push(score);
        v.types.push(ty);
    };
    for t in [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<mask>",
        "<start_of_turn>",
        "<end_of_turn>",
    ] {
        push(t, 3);
    }
    for t in ["\n", "\n\n", "  ", "   ", "[multimodal]"] {
        push(t, 4);
    }
    for b in 0x80..=0xffu32 {
        push(&format!("<0x{b:02X}>"), 6);
    }
    let mut normal: Vec<String> = vec!["\u{2581}".into()];
    normal.extend(('a'..='z').map(String::from));
    normal.extend("ZHW0123456789.,?!:'".chars().map(String::from));
    for w in [
        "\u{2581}hello",
        "\u{2581}world",
        "\u{2581}Zephyr",
        "\u{2581}battery",
        "\u{2581}the",
        "ing",
        "\u{2581}last",
        "er",
    ] {
        let chars: Vec<char> = w.chars().collect();
        for k in 2..=chars.len() {
            let p: String = chars[..k].iter().collect();
            if !normal.contains(&p) {
                normal.push(p);
            }
        }
    }
    for t in &normal {
        push(t, 1);
    }
    let mut i = 0;
    while v.tokens.len() < 256 {
        let t = format!("<unused{i}>");
        v.tokens.push(t);
        v.scores.push(0.0);
        v.types.push(3);
        i += 1;
    }
    v
}

fn logits(dir: &Path) -> Tensor {
    let ids: Vec<u32> = vec![2, 5, 77, 140, 12, 9, 200, 1, 255, 64, 33, 34];
    let m = Model::load(dir, DType::F32, &Device::Cpu).unwrap();
    m.forward(&Inputs::new(ids.clone(), 1, ids.len()), None, false)
        .unwrap()
        .logits
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// A model whose `query_pre_attn_scalar` is not head_dim cannot be written (the file could not
/// say so); the error names the key.
#[test]
fn gemma3_writer_refuses_a_scalar_the_file_cannot_carry() {
    let d = tmp("refuse");
    let e = rtune_gguf::write_gemma3_gguf(&fixture(), &d.join("x.gguf"), GgmlDType::F32, &vocab())
        .unwrap_err()
        .to_string();
    assert!(e.contains("query_pre_attn_scalar 20"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// f32 GGUF: the config is the fixture's (layer types from the written per-layer flags, both RoPE
/// bases, the global layers' linear ×4 scaling, window, scalar), every tensor is the fixture's
/// exactly — the norms as f32 `(w + 1) − 1`, which is what the file can hold — and the logits
/// equal the fixture's within 1e-5 relative (the only change is that rounding of the norms, ~1 ulp
/// of 1). Forgetting to subtract the 1 or permuting q/k as for a llama changes tensors exactly and
/// the logits by O(1).
#[test]
fn f32_gemma3_gguf_round_trips() {
    let d = tmp("f32");
    let src = gguf_able_fixture(&d);
    let gguf = d.join("tiny.gguf");
    rtune_gguf::write_gemma3_gguf(&src, &gguf, GgmlDType::F32, &vocab()).unwrap();
    let out = d.join("hf");
    let c = rtune_gguf::convert(&gguf, &out).unwrap();
    assert_eq!(c.tensors, 2 * 13 + 2);
    assert!(c.tied_embeddings && !c.chat_template);
    assert!(c.tokenizer.starts_with("SentencePiece"), "{}", c.tokenizer);

    let (a, b) = (
        json(&src.join("config.json")),
        json(&out.join("config.json")),
    );
    for k in [
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "rope_parameters",
        "tie_word_embeddings",
        "final_logit_softcapping",
        "hidden_activation",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "max_position_embeddings",
    ] {
        assert_eq!(a[k], b[k], "config.json `{k}`");
    }
    // <end_of_turn> (id 6) stops generation as in llama.cpp and Google's generation_config.
    assert_eq!(
        json(&out.join("generation_config.json"))["eos_token_id"],
        serde_json::json!([1, 6])
    );

    let dev = Device::Cpu;
    let orig = candle_core::safetensors::load(src.join("model.safetensors"), &dev).unwrap();
    let conv = candle_core::safetensors::load(out.join("model.safetensors"), &dev).unwrap();
    assert_eq!(orig.len(), conv.len());
    for (name, o) in &orig {
        let want = if name.ends_with("norm.weight") {
            o.affine(1.0, 1.0).unwrap().affine(1.0, -1.0).unwrap()
        } else {
            o.clone()
        };
        assert_eq!(max_abs(&conv[name], &want), 0.0, "{name}");
    }
    let (want, got) = (logits(&src), logits(&out));
    let scale = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let rel = max_abs(&got, &want) / scale;
    assert!(rel <= 1e-5, "logits differ by {rel:e} relative");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A random Gemma 3 directory wide enough for the k-quants' 256-element blocks: hidden 256,
/// 2 layers, 2 heads / 1 KV head of 256, feed-forward 512, vocabulary 256, tied.
fn wide_model(d: &Path) -> PathBuf {
    let dir = d.join("wide");
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = json(&fixture().join("config.json"));
    for (k, v) in [
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("num_attention_heads", 2),
        ("num_key_value_heads", 1),
        ("head_dim", 256),
        ("query_pre_attn_scalar", 256),
    ] {
        c[k] = serde_json::json!(v);
    }
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let dev = Device::Cpu;
    let (h, f, hd) = (256usize, 512usize, 256usize);
    let mut t = std::collections::HashMap::new();
    let mut add = |name: String, shape: &[usize]| {
        let x = Tensor::randn(0f32, 0.5, shape, &dev).unwrap();
        t.insert(name, x);
    };
    add("model.embed_tokens.weight".into(), &[256, h]);
    add("model.norm.weight".into(), &[h]);
    for l in 0..2 {
        let p = format!("model.layers.{l}");
        for (n, shape) in [
            ("input_layernorm", vec![h]),
            ("post_attention_layernorm", vec![h]),
            ("pre_feedforward_layernorm", vec![h]),
            ("post_feedforward_layernorm", vec![h]),
            ("self_attn.q_norm", vec![hd]),
            ("self_attn.k_norm", vec![hd]),
            ("self_attn.q_proj", vec![2 * hd, h]),
            ("self_attn.k_proj", vec![hd, h]),
            ("self_attn.v_proj", vec![hd, h]),
            ("self_attn.o_proj", vec![h, 2 * hd]),
            ("mlp.gate_proj", vec![f, h]),
            ("mlp.up_proj", vec![f, h]),
            ("mlp.down_proj", vec![h, f]),
        ] {
            add(format!("{p}.{n}.weight"), &shape);
        }
    }
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    dir
}

/// Q4_K, Q5_0, Q6_K and Q8_0 matrices (the types of the real Gemma 3 270M file): each converted
/// tensor is exactly the original quantized and dequantized again, norms `(w + 1) − 1` in f32
/// (tolerance 0: both sides run candle's ggml block code; `scripts/check_gemma3_gguf.py` shows that
/// code equal to transformers' and gguf-py's dequantization on the real file). A wrong block
/// layout, a transposed tensor or a permuted q/k shows up as an exact mismatch.
#[test]
fn quantized_gemma3_gguf_dequantizes_to_the_quantized_weights() {
    let d = tmp("quant");
    let src = wide_model(&d);
    let dev = Device::Cpu;
    let orig = candle_core::safetensors::load(src.join("model.safetensors"), &dev).unwrap();
    for ty in [
        GgmlDType::Q4K,
        GgmlDType::Q5_0,
        GgmlDType::Q6K,
        GgmlDType::Q8_0,
    ] {
        let gguf = d.join(format!("wide-{ty:?}.gguf"));
        rtune_gguf::write_gemma3_gguf(&src, &gguf, ty, &vocab()).unwrap();
        let out = d.join(format!("hf-{ty:?}"));
        let c = rtune_gguf::convert(&gguf, &out).unwrap();
        assert_eq!(c.ggml_types.get(&format!("{ty:?}")), Some(&(2 * 7 + 1)));
        let conv = candle_core::safetensors::load(out.join("model.safetensors"), &dev).unwrap();
        assert_eq!(orig.len(), conv.len());
        for (name, o) in &orig {
            let want = if o.rank() == 2 {
                QTensor::quantize(o, ty).unwrap().dequantize(&dev).unwrap()
            } else {
                o.affine(1.0, 1.0).unwrap().affine(1.0, -1.0).unwrap()
            };
            assert_eq!(max_abs(&conv[name], &want), 0.0, "{ty:?} {name}");
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// The tokenizer converted from the file encodes as transformers 5.24's tokenizer loaded from the
/// same file. Expected ids: `RTUNE_GEMMA3_GGUF_OUT=/tmp/tiny-g3.gguf cargo test -p rtune-gguf
/// --test gemma3 tokenizer` keeps the GGUF; then, with the reference venv,
/// `AutoTokenizer.from_pretrained("/tmp", gguf_file="tiny-g3.gguf")(text)["input_ids"]`.
#[test]
fn sentencepiece_vocab_encodes_as_transformers_does() {
    let d = tmp("tok");
    let src = gguf_able_fixture(&d);
    let gguf = d.join("tiny.gguf");
    rtune_gguf::write_gemma3_gguf(&src, &gguf, GgmlDType::F32, &vocab()).unwrap();
    if let Ok(keep) = std::env::var("RTUNE_GEMMA3_GGUF_OUT") {
        std::fs::copy(&gguf, keep).unwrap();
    }
    let out = d.join("hf");
    rtune_gguf::convert(&gguf, &out).unwrap();
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    // The whitespace runs are respelled "▁▁" / "▁▁▁" (ids 9, 10), so they are vocabulary tokens,
    // not added ones.
    assert_eq!(tok.token_to_id("\u{2581}\u{2581}"), Some(9));
    assert_eq!(tok.token_to_id("  "), None);
    for (text, want) in EXPECTED {
        let got = tok.encode(*text, true).unwrap();
        assert_eq!(got.get_ids(), *want, "{text:?}");
    }
    let tc = json(&out.join("tokenizer_config.json"));
    assert_eq!(tc["add_bos_token"], true);
    assert_eq!(tc["bos_token"], "<bos>");
    assert_eq!(tc["unk_token"], "<unk>");
    std::fs::remove_dir_all(&d).unwrap();
}

/// transformers 5.24's ids (see the test above); "G" has neither a piece nor a byte token: `<unk>`.
const EXPECTED: &[(&str, &[u32])] = &[
    ("hello world", &[2, 148, 145, 152, 152, 155, 195]),
    (
        "Hello  world",
        &[2, 168, 145, 152, 152, 155, 9, 163, 155, 158, 152, 144],
    ),
    (
        "How long does the Zephyr battery last?",
        &[
            2, 168, 155, 163, 214, 155, 154, 147, 140, 144, 155, 145, 159, 211, 201, 208, 217, 182,
        ],
    ),
    (
        "<start_of_turn>user\nhello<end_of_turn>\n\n",
        &[2, 5, 161, 159, 218, 7, 148, 145, 152, 152, 155, 6, 8],
    ),
    (
        "  the   battery\n\n\nlasting",
        &[
            2, 9, 160, 148, 145, 10, 142, 141, 160, 160, 218, 165, 8, 7, 152, 141, 159, 160, 213,
        ],
    ),
    (
        "Größe ☃ 北",
        &[
            2, 3, 158, 79, 66, 79, 43, 145, 140, 110, 36, 15, 140, 113, 24, 35,
        ],
    ),
    ("[multimodal] <bos>z", &[2, 11, 140, 2, 166]),
    ("", &[2]),
];

/// A metadata-only GGUF (no tensors) with `md`; what `convert` says about it.
fn convert_error(name: &str, md: &[(&str, Value)]) -> String {
    let d = tmp(name);
    let gguf = d.join("m.gguf");
    let mut f = std::fs::File::create(&gguf).unwrap();
    let refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut f, &refs, &[]).unwrap();
    drop(f);
    let e = rtune_gguf::convert(&gguf, &d.join("hf")).unwrap_err();
    assert!(e.is_input_error(), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
    e.to_string()
}

/// Errors name the file's key and say what is read: another architecture, a missing size, a
/// per-layer window pattern of the wrong length.
#[test]
fn gemma3_metadata_errors_name_the_key() {
    let e = convert_error(
        "arch",
        &[("general.architecture", Value::String("gemma2".into()))],
    );
    assert!(
        e.contains("general.architecture `gemma2`") && e.contains("`gemma3`"),
        "{e}"
    );
    let mut md = vec![
        ("general.architecture", Value::String("gemma3".into())),
        ("gemma3.block_count", Value::U32(3)),
        ("gemma3.feed_forward_length", Value::U32(8)),
        ("gemma3.attention.head_count", Value::U32(2)),
        ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
    ];
    let e = convert_error("size", &md);
    assert!(
        e.contains("gemma3.embedding_length") && e.contains("missing"),
        "{e}"
    );
    md.extend([
        ("gemma3.embedding_length", Value::U32(4)),
        ("gemma3.attention.sliding_window", Value::U32(4)),
        (
            "gemma3.attention.sliding_window_pattern",
            Value::Array(vec![Value::Bool(true), Value::Bool(false)]),
        ),
    ]);
    let e = convert_error("pattern", &md);
    assert!(
        e.contains("gemma3.attention.sliding_window_pattern") && e.contains("2 flags for 3 layers"),
        "{e}"
    );
}
