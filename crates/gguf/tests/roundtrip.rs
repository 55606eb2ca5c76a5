//! tests/fixtures/tiny-llama → GGUF (written as convert_hf_to_gguf.py lays it out: llama.cpp
//! names, q/k rows permuted) → Hugging Face directory again: the model gives the same logits and
//! the tokenizer the same ids and text.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::path::{Path, PathBuf};

use rtune_model::{Inputs, Model};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rtune-gguf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const IDS: [u32; 10] = [1, 5, 77, 300, 12, 9, 400, 2, 511, 64];

fn logits(dir: &Path) -> Tensor {
    let m = Model::load(dir, DType::F32, &Device::Cpu).unwrap();
    m.forward(&Inputs::new(IDS.to_vec(), 1, IDS.len()), None, false)
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

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// f32 GGUF: every weight survives bit for bit (the q/k permutation is a row move and is undone),
/// so the same kernels give identical logits: tolerance 0. Skipping the un-permute changes the
/// attention scores and the logits by O(1e-2) on this model.
#[test]
fn f32_gguf_gives_the_hf_models_logits_exactly() {
    let d = tmp("f32");
    let gguf = d.join("tiny.gguf");
    rtune_gguf::write_llama_gguf(&fixture(), &gguf, GgmlDType::F32).unwrap();
    let out = d.join("hf");
    let c = rtune_gguf::convert(&gguf, &out).unwrap();
    assert_eq!(c.tensors, 2 * 9 + 3);
    assert!(!c.tied_embeddings && c.chat_template);
    assert_eq!(c.tokenizer_pre, "gpt-2");
    let want = logits(&fixture());
    let got = logits(&out);
    assert_eq!(max_abs(&got, &want), 0.0);

    // The config keys the model reads are the fixture's.
    let (a, b) = (
        json(&fixture().join("config.json")),
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
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "max_position_embeddings",
    ] {
        assert_eq!(a[k], b[k], "config.json `{k}`");
    }
    let (a, b) = (
        json(&fixture().join("tokenizer_config.json")),
        json(&out.join("tokenizer_config.json")),
    );
    for k in [
        "bos_token",
        "eos_token",
        "pad_token",
        "chat_template",
        "add_bos_token",
    ] {
        assert_eq!(a[k], b[k], "tokenizer_config.json `{k}`");
    }
    // A second conversion into the same place is refused, not merged.
    let e = rtune_gguf::convert(&gguf, &out).unwrap_err().to_string();
    assert!(e.contains("already exists"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// Q8_0 matrices: each converted tensor is exactly the original quantized to Q8_0 and
/// dequantized again (tolerance 0: both sides run the same ggml block code, and the q/k row
/// permutation commutes with quantization, whose 32-element blocks run along rows). A wrong block
/// layout, a skipped un-permute or a transposed tensor all show up as exact mismatches.
#[test]
fn q8_0_gguf_dequantizes_to_the_quantized_weights() {
    let d = tmp("q8");
    let gguf = d.join("tiny-q8.gguf");
    rtune_gguf::write_llama_gguf(&fixture(), &gguf, GgmlDType::Q8_0).unwrap();
    let out = d.join("hf");
    let c = rtune_gguf::convert(&gguf, &out).unwrap();
    assert_eq!(c.ggml_types.get("Q8_0"), Some(&(2 * 7 + 2)));
    let dev = Device::Cpu;
    let orig = candle_core::safetensors::load(fixture().join("model.safetensors"), &dev).unwrap();
    let conv = candle_core::safetensors::load(out.join("model.safetensors"), &dev).unwrap();
    assert_eq!(orig.len(), conv.len());
    for (name, o) in &orig {
        let o = o.to_dtype(DType::F32).unwrap();
        let want = if o.rank() == 2 {
            QTensor::quantize(&o, GgmlDType::Q8_0)
                .unwrap()
                .dequantize(&dev)
                .unwrap()
        } else {
            o
        };
        assert_eq!(max_abs(&conv[name], &want), 0.0, "{name}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// The tokenizer rebuilt from `tokenizer.ggml.*` encodes to the same ids (BOS included) and decodes
/// to the same text as the original tokenizer.json.
#[test]
fn tokenizer_from_gguf_metadata_round_trips() {
    let d = tmp("tok");
    let gguf = d.join("tiny.gguf");
    rtune_gguf::write_llama_gguf(&fixture(), &gguf, GgmlDType::F32).unwrap();
    let out = d.join("hf");
    rtune_gguf::convert(&gguf, &out).unwrap();
    let orig = tokenizers::Tokenizer::from_file(fixture().join("tokenizer.json")).unwrap();
    let conv = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    assert_eq!(orig.get_vocab_size(true), conv.get_vocab_size(true));
    for text in [
        "Q: Who makes Zephyr?\nA: Nimbus Labs, Oslo.",
        "  leading spaces, tabs\tand 12345 digits; ünïcödé — 日本語 🙂",
        "<s>special</s> tokens <pad> inside text",
        "",
    ] {
        for add_special in [true, false] {
            let a = orig.encode(text, add_special).unwrap();
            let b = conv.encode(text, add_special).unwrap();
            assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
            assert_eq!(a.get_offsets(), b.get_offsets(), "{text:?}");
            for skip in [true, false] {
                assert_eq!(
                    orig.decode(a.get_ids(), skip).unwrap(),
                    conv.decode(b.get_ids(), skip).unwrap(),
                    "{text:?}"
                );
            }
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}
