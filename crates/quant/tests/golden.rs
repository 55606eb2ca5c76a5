//! Bit-exactness against bitsandbytes 0.50.2 on `tests/fixtures/nf4_golden.safetensors` (see the
//! README there): code tables, packed codes, absmax, double-quant tensors, dequantized values, the
//! tensors of a bnb-4bit checkpoint. Tolerance everywhere: none (bit-exact) — quantization is a
//! deterministic sequence of f32 operations that rtune performs in bitsandbytes' order.

mod common;

use candle_core::{DType, Device};
use common::{assert_bits_eq, assert_bytes_eq, fixture, via_bf16, St};
use rtune_quant::{load_bnb_4bit, quantize_nf4, Absmax, Bnb, DYNAMIC_SIGNED, NF4};

const GOLDEN: &str = "tests/fixtures/nf4_golden.safetensors";
/// (case, input is bf16)
const CASES: [(&str, bool); 3] = [("w", false), ("odd", false), ("wbf16", true)];

#[test]
fn code_tables_match_bitsandbytes() {
    let bytes = fixture(GOLDEN);
    let g = St::new(&bytes);
    assert_bits_eq("nf4 table", &NF4, &g.f32s("nf4_table"));
    assert_bits_eq("dynamic map", &DYNAMIC_SIGNED, &g.f32s("w.dq.code2"));
    assert_bits_eq(
        "stored nested_quant_map",
        &DYNAMIC_SIGNED,
        &g.f32s("qs.nested_quant_map"),
    );
}

fn unpack(packed: &[u8], n: usize) -> Vec<u8> {
    packed
        .iter()
        .flat_map(|b| [b >> 4, b & 15])
        .take(n)
        .collect()
}

/// The dequantized weight as bitsandbytes returns it: in the input dtype (bf16 rounds), upcast.
fn dequant_like_bnb(w: &rtune_quant::Nf4Weight, bf16: bool) -> Vec<f32> {
    let d = w.dequantize_f32();
    if bf16 {
        via_bf16(&d)
    } else {
        d
    }
}

#[test]
fn plain_quantization_is_bit_exact() {
    let bytes = fixture(GOLDEN);
    let g = St::new(&bytes);
    for (case, bf16) in CASES {
        let x = g.f32s(&format!("{case}.input"));
        let shape = g.shape(&format!("{case}.input"));
        let w = quantize_nf4(&x, &shape, false).unwrap();
        assert_bytes_eq(case, &w.packed, &g.u8s(&format!("{case}.packed")));
        assert_bytes_eq(
            case,
            &unpack(&w.packed, x.len()),
            &g.u8s(&format!("{case}.codes")),
        );
        let Absmax::Plain(a) = &w.absmax else {
            panic!("plain quant made {:?}", w.absmax)
        };
        assert_bits_eq(case, a, &g.f32s(&format!("{case}.absmax")));
        let want = g.f32s(&format!("{case}.dequant"));
        assert_bits_eq(case, &dequant_like_bnb(&w, bf16), &want);
    }
}

#[test]
fn double_quantization_is_bit_exact() {
    let bytes = fixture(GOLDEN);
    let g = St::new(&bytes);
    for (case, bf16) in CASES {
        let x = g.f32s(&format!("{case}.input"));
        let shape = g.shape(&format!("{case}.input"));
        let w = quantize_nf4(&x, &shape, true).unwrap();
        assert_bytes_eq(case, &w.packed, &g.u8s(&format!("{case}.packed")));
        let Absmax::Double {
            codes,
            nested_absmax,
            nested_quant_map,
            offset,
            nested_blocksize,
        } = &w.absmax
        else {
            panic!("double quant made {:?}", w.absmax)
        };
        assert_eq!(*nested_blocksize, 256);
        assert_bytes_eq(case, codes, &g.u8s(&format!("{case}.dq.absmax_u8")));
        assert_bits_eq(case, &[*offset], &g.f32s(&format!("{case}.dq.offset")));
        assert_bits_eq(case, nested_absmax, &g.f32s(&format!("{case}.dq.absmax2")));
        assert_bits_eq(case, nested_quant_map, &g.f32s(&format!("{case}.dq.code2")));
        let want = g.f32s(&format!("{case}.dq.dequant"));
        assert_bits_eq(case, &dequant_like_bnb(&w, bf16), &want);
    }
}

#[test]
fn to_tensor_rounds_like_bitsandbytes() {
    // bnb dequantizes a bf16 weight to bf16: f32 product, then round to nearest even.
    let bytes = fixture(GOLDEN);
    let g = St::new(&bytes);
    let x = g.f32s("wbf16.input");
    let w = quantize_nf4(&x, &g.shape("wbf16.input"), false).unwrap();
    let t = w.to_tensor(DType::BF16, &Device::Cpu).unwrap();
    assert_eq!(t.dims(), &[64, 96]);
    let got = t
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_bits_eq("wbf16 to_tensor", &got, &g.f32s("wbf16.dequant"));
    // f16 and f32 tensors are the same f32 products, rounded once.
    let f32s = w.dequantize_f32();
    let t16 = w.to_tensor(DType::F16, &Device::Cpu).unwrap();
    let got16 = t16.flatten_all().unwrap().to_vec1::<half::f16>().unwrap();
    for (a, b) in got16.iter().zip(&f32s) {
        assert_eq!(a.to_bits(), half::f16::from_f32(*b).to_bits());
    }
}

#[test]
fn checkpoint_tensors_load_and_are_reproduced() {
    let bytes = fixture(GOLDEN);
    let g = St::new(&bytes);
    // The `qs.*` tensors of case `w` are what a checkpoint stores next to `<layer>.weight`.
    let fetch = |name: &str| match name {
        "L.weight" => g.raw("w.packed"),
        _ => name
            .strip_prefix("L.weight.")
            .and_then(|s| g.raw(&format!("qs.{s}"))),
    };
    let w = load_bnb_4bit("L.weight", fetch).unwrap();
    assert_eq!(w.shape, vec![96, 160]);
    assert_eq!(w.dtype, DType::F32);
    assert!(w.absmax.is_double());
    assert_bits_eq("qs dequant", &w.dequantize_f32(), &g.f32s("w.dq.dequant"));

    // Quantizing `w.input` here writes the same tensors (JSON compared as values: Python and Rust
    // print floats differently but both print the shortest round-trip form).
    let mine = quantize_nf4(&g.f32s("w.input"), &[96, 160], true).unwrap();
    assert_eq!(mine, w);
    for (name, t) in mine.to_bnb("L.weight") {
        let key = if name == "L.weight" {
            "w.packed".to_string()
        } else {
            format!("qs.{}", name.strip_prefix("L.weight.").unwrap())
        };
        let want = g.raw(&key).unwrap();
        assert_eq!(t.dtype, want.dtype, "{name}");
        if key.ends_with("bitsandbytes__nf4") {
            let a: serde_json::Value = serde_json::from_slice(&t.data).unwrap();
            let b: serde_json::Value = serde_json::from_slice(&want.data).unwrap();
            assert_eq!(a, b, "{name}");
        } else {
            assert_bytes_eq(&name, &t.data, &want.data);
        }
    }
}

#[test]
fn resident_bytes_are_half_a_byte_per_param_plus_scales() {
    // Issue 4 part 6: 0.5 byte/param + 0.5 bit/param (plain) or + 0.127 bit/param (double quant),
    // within 2%. 4096×4096: the 1028 bytes of tables are noise.
    let n: usize = 4096 * 4096;
    let x: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32) - 500.0).collect();
    for (dq, extra_bits) in [(false, 0.5), (true, 0.127)] {
        let w = quantize_nf4(&x, &[4096, 4096], dq).unwrap();
        let want = n as f64 * (0.5 + extra_bits / 8.0);
        let got = w.resident_bytes() as f64;
        assert!(
            (got / want - 1.0).abs() < 0.02,
            "dq={dq}: {got} bytes, model {want}"
        );
    }
}
