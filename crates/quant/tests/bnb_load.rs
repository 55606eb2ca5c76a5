//! bnb-4bit checkpoint tensors: the `q.*` layers of the PEFT+bitsandbytes QLoRA goldens
//! (`tests/parity/golden_tiny_qlora_nf4{,dq}.safetensors`, from `tests/fixtures/tiny-llama`) load,
//! equal rtune's own quantization of the original weights bit for bit, and re-quantizing their
//! dequantized values gives back the stored codes; malformed checkpoints get typed errors that name
//! the tensor. Tolerance: none (codes and scales are bit-exact).

mod common;

use common::{assert_bits_eq, assert_bytes_eq, fixture, St};
use rtune_quant::bnb::{is_bnb_4bit, is_bnb_companion, BnbParts};
use rtune_quant::{load_bnb_4bit, quantize_nf4, Absmax, Bnb, Nf4Weight, QuantError, RawTensor};
use safetensors::Dtype;

const PLAIN: &str = "../../tests/parity/golden_tiny_qlora_nf4.safetensors";
const DOUBLE: &str = "../../tests/parity/golden_tiny_qlora_nf4dq.safetensors";
const TINY: &str = "../../tests/fixtures/tiny-llama/model.safetensors";

fn layers(g: &St) -> Vec<String> {
    let mut v: Vec<String> =
        g.0.names()
            .into_iter()
            .filter(|k| k.starts_with("q.") && k.ends_with(".weight"))
            .map(|k| k.to_string())
            .collect();
    v.sort();
    v
}

fn load(g: &St, weight: &str) -> Result<Nf4Weight, QuantError> {
    load_bnb_4bit(weight, |n| g.raw(n))
}

#[test]
fn qlora_golden_layers_load_and_match_rtune_quantization() {
    let tiny_bytes = fixture(TINY);
    let tiny = St::new(&tiny_bytes);
    for (file, dq) in [(PLAIN, false), (DOUBLE, true)] {
        let bytes = fixture(file);
        let g = St::new(&bytes);
        let names = layers(&g);
        assert_eq!(
            names.len(),
            14,
            "{file}: 7 linear layers × 2 decoder layers"
        );
        for name in names {
            assert!(is_bnb_4bit(&name, |n| g.has(n)));
            assert!(!is_bnb_companion(&name) && is_bnb_companion(&format!("{name}.absmax")));
            let w = load(&g, &name).unwrap();
            assert_eq!(w.absmax.is_double(), dq, "{name}");
            // The original f32 weight, quantized by rtune: identical codes, scales and offsets.
            let orig = name.strip_prefix("q.").unwrap();
            let mut mine = quantize_nf4(&tiny.f32s(orig), &tiny.shape(orig), dq).unwrap();
            mine.dtype = w.dtype;
            assert_eq!(mine, w, "{name}");
            // Re-quantizing the dequantized weight reproduces the stored codes: each block's largest
            // value is ±absmax exactly, and every other value lands back on its own table entry.
            let again = quantize_nf4(&w.dequantize_f32(), &w.shape, dq).unwrap();
            assert_bytes_eq(&name, &again.packed, &w.packed);
            if let (Absmax::Plain(a), Absmax::Plain(b)) = (&again.absmax, &w.absmax) {
                assert_bits_eq(&name, a, b);
            }
        }
    }
}

/// The parts of one double-quant golden layer, to break one at a time.
fn parts(g: &St<'static>) -> (String, BnbParts<'static>) {
    let name = "q.model.layers.0.self_attn.q_proj.weight".to_string();
    let p = BnbParts::fetch(&name, |n| g.raw(n));
    assert!(Nf4Weight::from_bnb(&name, p.clone()).is_ok());
    (name, p)
}

fn with_json(p: &mut BnbParts<'static>, edit: impl FnOnce(&mut serde_json::Value)) {
    let (suffix, t) = p.quant_state.take().unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&t.data).unwrap();
    edit(&mut v);
    let b = v.to_string().into_bytes();
    p.quant_state = Some((suffix, RawTensor::new(Dtype::U8, vec![b.len()], b)));
}

fn err(name: &str, p: BnbParts<'static>) -> (QuantError, String) {
    let e = Nf4Weight::from_bnb(name, p).unwrap_err();
    let msg = e.to_string();
    (e, msg)
}

#[test]
fn malformed_checkpoints_get_clear_errors() {
    let bytes: &'static [u8] = Box::leak(fixture(DOUBLE).into_boxed_slice());
    let g: &'static St<'static> = Box::leak(Box::new(St::new(bytes)));
    let (name, good) = parts(g);

    let mut p = good.clone();
    p.quant_state = None;
    let (e, msg) = err(&name, p);
    assert!(matches!(e, QuantError::MissingTensor { .. }), "{msg}");
    assert!(
        msg.contains(&format!("{name}.quant_state.bitsandbytes__nf4")),
        "{msg}"
    );

    for (field, label) in [
        (0, "absmax"),
        (1, "nested_absmax"),
        (2, "nested_quant_map"),
        (3, "quant_map"),
    ] {
        let mut p = good.clone();
        match field {
            0 => p.absmax = None,
            1 => p.nested_absmax = None,
            2 => p.nested_quant_map = None,
            _ => p.quant_map = None,
        }
        let (e, msg) = err(&name, p);
        assert!(matches!(e, QuantError::MissingTensor { .. }), "{msg}");
        assert!(
            msg.contains(&format!("`{name}.{label}` is missing")),
            "{msg}"
        );
    }

    let mut p = good.clone();
    with_json(&mut p, |v| v["blocksize"] = 128.into());
    let (e, msg) = err(&name, p);
    assert!(
        matches!(e, QuantError::Blocksize { blocksize: 128, .. }),
        "{msg}"
    );
    assert!(
        msg.contains("blocksize 128") && msg.contains(&name),
        "{msg}"
    );

    let mut p = good.clone();
    with_json(&mut p, |v| v["quant_type"] = "int8".into());
    let (e, msg) = err(&name, p);
    assert!(matches!(e, QuantError::QuantType { .. }), "{msg}");
    assert!(msg.contains("`int8`"), "{msg}");

    let mut p = good.clone();
    with_json(&mut p, |v| {
        v.as_object_mut().unwrap().remove("shape");
    });
    let (e, msg) = err(&name, p);
    assert!(matches!(e, QuantError::QuantState { .. }), "{msg}");
    assert!(msg.contains("no `shape`"), "{msg}");

    let mut p = good.clone();
    with_json(&mut p, |v| {
        v.as_object_mut().unwrap().remove("nested_offset");
    });
    let (e, msg) = err(&name, p);
    assert!(matches!(e, QuantError::QuantState { .. }), "{msg}");

    let mut p = good.clone();
    p.quant_state = Some((
        rtune_quant::bnb::QUANT_STATE_NF4,
        RawTensor::new(Dtype::U8, vec![3], b"{x}".to_vec()),
    ));
    let (e, msg) = err(&name, p);
    assert!(
        matches!(e, QuantError::QuantState { .. }) && msg.contains("not JSON"),
        "{msg}"
    );

    let mut p = good.clone();
    let w = p.weight.take().unwrap();
    p.weight = Some(RawTensor::new(Dtype::U8, vec![10], w.data[..10].to_vec()));
    let (e, msg) = err(&name, p);
    assert!(
        matches!(e, QuantError::BadTensor { .. }) && msg.contains("holds 10 bytes"),
        "{msg}"
    );

    let mut p = good.clone();
    let mut qm = p.quant_map.take().unwrap().data.into_owned();
    qm[0..4].copy_from_slice(&0.5f32.to_le_bytes());
    p.quant_map = Some(RawTensor::new(Dtype::F32, vec![16], qm));
    let (e, msg) = err(&name, p);
    assert!(
        matches!(e, QuantError::BadTensor { .. }) && msg.contains("quant_map"),
        "{msg}"
    );

    let mut p = good.clone();
    let am = p.absmax.take().unwrap();
    p.absmax = Some(RawTensor::new(Dtype::F32, vec![am.data.len() / 4], am.data));
    let (e, msg) = err(&name, p);
    assert!(
        matches!(e, QuantError::BadTensor { .. }) && msg.contains("absmax"),
        "{msg}"
    );
}

#[test]
fn round_trip_through_bnb_tensors() {
    let x: Vec<f32> = (0..3 * 100 + 1).map(|i| (i as f32 * 0.37).sin()).collect();
    for dq in [false, true] {
        let w = quantize_nf4(&x, &[301], dq).unwrap();
        let tensors = w.to_bnb("m.weight");
        let back = load_bnb_4bit("m.weight", |n| {
            tensors.iter().find(|(k, _)| k == n).map(|(_, t)| t.clone())
        })
        .unwrap();
        assert_eq!(back, w);
    }
}
