//! gpt-oss MXFP4 dequantization against transformers 5.24 on `tests/fixtures/mxfp4_golden.safetensors`
//! (see the README there). Tolerance: none, bit for bit — every value is an FP4 code times a power
//! of two, exact in f32 and bf16 (or ±∞ past the largest).

mod common;

use candle_core::{DType, Device};
use common::{fixture, St};
use rtune_quant::mxfp4;

fn tensor(g: &St, k: &str) -> candle_core::Tensor {
    let v = g.0.tensor(k).unwrap();
    let dtype = match v.dtype() {
        safetensors::Dtype::U8 => DType::U8,
        other => panic!("{k}: {other:?}"),
    };
    candle_core::Tensor::from_raw_buffer(v.data(), dtype, v.shape(), &Device::Cpu).unwrap()
}

fn check(case: &str, dtype: DType, suffix: &str) {
    let bytes = fixture("tests/fixtures/mxfp4_golden.safetensors");
    let g = St::new(&bytes);
    let blocks = tensor(&g, &format!("{case}.blocks"));
    let scales = tensor(&g, &format!("{case}.scales"));
    let got = mxfp4::dequantize(
        case,
        &blocks,
        &scales,
        mxfp4::Layout::Transformers,
        dtype,
        &Device::Cpu,
    )
    .unwrap();
    let want_view = g.0.tensor(&format!("{case}.{suffix}")).unwrap();
    assert_eq!(
        got.dims(),
        want_view.shape(),
        "{case}: (E, C, R) as transformers"
    );
    let got: Vec<f32> = got
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let want = g.f32s(&format!("{case}.{suffix}"));
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            a.to_bits() == b.to_bits(),
            "{case}.{suffix}[{i}]: {a:e} vs transformers {b:e}"
        );
    }
}

#[test]
fn gate_up_f32_is_transformers() {
    check("gate_up", DType::F32, "f32");
}

#[test]
fn gate_up_bf16_is_transformers() {
    check("gate_up", DType::BF16, "bf16");
}

/// Every byte value, and the extreme scales (2^-127: subnormals; 2^127 and 2^128: overflow to ±∞
/// except the zero codes).
#[test]
fn edge_scales_are_transformers() {
    check("edge", DType::F32, "f32");
}
