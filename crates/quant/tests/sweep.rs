//! Bit-exactness against bitsandbytes 0.50.2 over many sizes (`tests/fixtures/nf4_sweep.safetensors`,
//! made by `make_nf4_sweep.py` there): 1 element to 20000 blocks, partial last blocks, an odd count
//! (padding nibble), bf16 and f16 inputs, the second level over 1..79 groups of 256 (torch's cascade
//! summation order for the mean), and an FP4 layer read through the loader. Tolerance: none.

mod common;

use common::{assert_bits_eq, assert_bytes_eq, fixture, St};
use rtune_quant::{load_bnb_4bit, quantize_nf4, Absmax, QuantType};

const SWEEP: &str = "tests/fixtures/nf4_sweep.safetensors";
const CASES: [(&str, usize); 12] = [
    ("n1", 1),
    ("n63", 63),
    ("n65", 65),
    ("n1001", 1001),
    ("b255", 64 * 255),
    ("b256", 64 * 256),
    ("b257", 64 * 257 + 5),
    ("b1000", 64 * 1000),
    ("b4099", 64 * 4099 + 33),
    ("b20000", 64 * 20000),
    ("bf16", 64 * 300 + 7),
    ("f16", 64 * 300 + 8),
];

/// `det_input` of make_nf4_sweep.py: every operation is exact or one f32 rounding, so both sides agree.
fn det_input(n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let h = i.wrapping_mul(2654435761) & 0xFFFF_FFFF;
            let u = (h >> 8) as f32 * 2f32.powi(-24) - 0.5;
            let s = ((i / 64 * 7919) % 97 + 1) as f32 * 2f32.powi(-9);
            u * s
        })
        .collect()
}

#[test]
fn every_size_matches_bitsandbytes() {
    let bytes = fixture(SWEEP);
    let g = St::new(&bytes);
    for (case, n) in CASES {
        let input = format!("{case}.input");
        let x = if g.has(&input) {
            g.f32s(&input) // bf16 / f16 inputs, upcast exactly
        } else {
            det_input(n)
        };
        assert_eq!(x.len(), n, "{case}");
        let plain = quantize_nf4(&x, &[n], false).unwrap();
        let Absmax::Plain(a) = &plain.absmax else {
            unreachable!()
        };
        assert_bits_eq(case, a, &g.f32s(&format!("{case}.absmax")));
        if g.has(&format!("{case}.packed")) {
            assert_bytes_eq(case, &plain.packed, &g.u8s(&format!("{case}.packed")));
        }
        let dq = quantize_nf4(&x, &[n], true).unwrap();
        assert_eq!(
            dq.packed, plain.packed,
            "{case}: double quant changes only the scales"
        );
        let Absmax::Double {
            codes,
            nested_absmax,
            offset,
            ..
        } = &dq.absmax
        else {
            unreachable!()
        };
        assert_bits_eq(case, &[*offset], &g.f32s(&format!("{case}.dq.offset")));
        assert_bytes_eq(case, codes, &g.u8s(&format!("{case}.dq.absmax_u8")));
        assert_bits_eq(case, nested_absmax, &g.f32s(&format!("{case}.dq.absmax2")));
    }
}

#[test]
fn odd_count_pads_with_the_code_of_zero() {
    // bnb pads the scaled values with 0.0 before packing: the last low nibble is code 7.
    let w = quantize_nf4(&[1.0, -1.0, 0.5], &[3], false).unwrap();
    assert_eq!(w.packed, vec![0xF0, (12 << 4) | 7]);
}

#[test]
fn fp4_layer_loads_and_dequantizes_like_bitsandbytes() {
    let bytes = fixture(SWEEP);
    let g = St::new(&bytes);
    let fetch = |name: &str| match name {
        "L.weight" => g.raw("fp4.weight"),
        _ => name
            .strip_prefix("L.weight.")
            .and_then(|s| g.raw(&format!("fp4.{s}"))),
    };
    let w = load_bnb_4bit("L.weight", fetch).unwrap();
    assert_eq!(w.quant_type, QuantType::Fp4);
    assert_eq!(w.shape, vec![48, 128]);
    assert_bits_eq("fp4 dequant", &w.dequantize_f32(), &g.f32s("fp4.dequant"));
}
