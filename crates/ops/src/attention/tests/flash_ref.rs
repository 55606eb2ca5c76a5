//! The CUDA tiled attention's CPU reference (`crate::attention::flash_ref`: the kernels' tiling of 32
//! queries × 32 keys, their online-softmax order and their roundings of P and dS to the input
//! type) against the plain attention path ([`crate::attend`] with [`crate::AttnPath::Plain`]), both
//! inside the model's attention (RoPE before, its backward after, as [`crate::attention_tiled`] /
//! [`crate::attention_backward`] wrap the tiled op). Shapes: causal GQA 8/2, causal MQA, sliding
//! window 5 over 12 tokens, packed rows of 3 samples (per-row starts), packed with a window and
//! MQA; T odd (not a multiple of the tiles) and several tiles per head; head dims 64, 96 and 128
//! (those the kernels are built for).

use super::{
    assert_attention_bf16, assert_attention_f32, attend_on, bf16, flat, rand_tables, randn,
    AttnCase,
};
use crate::attention::flash_ref::{self, FlashShape};
use candle_core::{DType, Device, Tensor};
use rtune_backend::Precision;

/// `(out, dq, dk, dv)` of the model's attention with the tiled op replaced by the kernels'
/// reference, on the inputs [`attend_on`] draws (same seeds), in `dt` (rounded through bf16 first
/// when `via_bf16`).
fn attend_ref(c: &AttnCase, dt: DType, via_bf16: bool) -> [Tensor; 4] {
    let (b, t, h, hkv, dh) = c.dims;
    let n = b * t;
    let cast = |x: Tensor| {
        let x = if via_bf16 { bf16(&x) } else { x };
        x.to_dtype(dt).unwrap()
    };
    let q = cast(randn(&[n, h * dh], 70, 1.5));
    let k = cast(randn(&[n, hkv * dh], 71, 1.5));
    let v = cast(randn(&[n, hkv * dh], 72, 1.0));
    let d_out = cast(randn(&[n, h * dh], 73, 1.0));
    let (cos, sin) = rand_tables(b, t, dh);
    let (cos, sin) = (cast(cos), cast(sin));
    let segs: Option<Vec<u32>> = c.packed.as_ref().map(|rows| {
        rows.iter()
            .flat_map(|lens| {
                lens.iter()
                    .enumerate()
                    .flat_map(|(i, &l)| std::iter::repeat_n(i as u32, l))
            })
            .collect()
    });
    let mask = crate::AttnMask::new(segs.as_deref(), b, t, c.window, &Device::Cpu).unwrap();
    // As crate::attention_tiled: (N, H·Dh) -> (B, H, T, Dh), then RoPE on q and k.
    let heads = |x: &Tensor, nh: usize| {
        x.reshape((b, t, nh, dh))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let q4 = crate::rope::apply(&heads(&q, h), &cos, &sin).unwrap();
    let k4 = crate::rope::apply(&heads(&k, hkv), &cos, &sin).unwrap();
    let v4 = heads(&v, hkv);
    let p = match dt {
        DType::F32 => Precision::F32,
        DType::BF16 => Precision::Bf16,
        DType::F16 => Precision::F16,
        other => panic!("no precision for {other:?}"),
    };
    let shape = FlashShape {
        b,
        h,
        hkv,
        t,
        dh,
        sb: mask.starts.dim(0).unwrap(),
    };
    let st: Vec<u32> = mask.starts.flatten_all().unwrap().to_vec1().unwrap();
    let scale = (1.0 / (dh as f64).sqrt()) as f32;
    let (qv, kv, vv) = (flat(&q4), flat(&k4), flat(&v4));
    let (o, lse) = flash_ref::forward(&shape, &qv, &kv, &vv, &st, scale, p);
    // d_out: (N, H·Dh) = (B, T, H, Dh), the reference's layout of dO.
    let dov = flat(&d_out);
    let (dq, dk, dv) = flash_ref::backward(&shape, &qv, &kv, &vv, &o, &dov, &lse, &st, scale, p);
    let tensor = |x: Vec<f32>, s: (usize, usize, usize, usize)| {
        Tensor::from_vec(x, s, &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    };
    // As crate::attention_backward's tiled branch: RoPE backward, then (B, heads, T, Dh) -> (N, ·).
    let back = |x: Tensor, nh: usize, rope: bool| {
        let x = if rope {
            crate::rope::apply_backward(&x, &cos, &sin).unwrap()
        } else {
            x
        };
        x.transpose(1, 2).unwrap().reshape((n, nh * dh)).unwrap()
    };
    [
        tensor(o, (b, t, h, dh)).reshape((n, h * dh)).unwrap(),
        back(tensor(dq, (b, h, t, dh)), h, true),
        back(tensor(dk, (b, hkv, t, dh)), hkv, true),
        back(tensor(dv, (b, hkv, t, dh)), hkv, false),
    ]
}

fn cases() -> Vec<AttnCase> {
    vec![
        AttnCase {
            dims: (2, 77, 8, 2, 64),
            window: None,
            packed: None,
            softcap: None,
            what: "causal GQA 8/2",
        },
        AttnCase {
            dims: (1, 130, 4, 1, 128),
            window: None,
            packed: None,
            softcap: None,
            what: "causal MQA",
        },
        AttnCase {
            dims: (2, 12, 4, 2, 64),
            window: Some(5),
            packed: None,
            softcap: None,
            what: "sliding window 5 over 12",
        },
        AttnCase {
            dims: (2, 99, 4, 2, 64),
            window: None,
            packed: Some(vec![vec![30, 50, 19], vec![1, 70, 28]]),
            softcap: None,
            what: "packed rows of 3 samples",
        },
        AttnCase {
            dims: (2, 99, 4, 1, 96),
            window: Some(20),
            packed: Some(vec![vec![10, 60, 29], vec![65, 33, 1]]),
            softcap: None,
            what: "packed rows of 3 samples, window 20, MQA",
        },
    ]
}

#[test]
fn cuda_reference_matches_plain_f32() {
    // Both in f32: the reference sums its dot products as f32 fused multiply-add chains, rescales
    // by e^(m_old − m_new) per key tile and takes P = e^(s − lse), D = rowsum(dO∘O) in the
    // backward: the tiled rule (1e-5 of the largest element).
    for c in &cases() {
        let plain = attend_on(c, DType::F32, crate::AttnPath::Plain, false);
        let got = attend_ref(c, DType::F32, false);
        assert_attention_f32(c, &got, &plain);
    }
}

#[test]
fn cuda_reference_bf16_matches_plain_within_its_rounding() {
    // bf16 inputs; the reference rounds P and dS to bf16 before their tile products (as the
    // kernels feed the tensor cores) and each output once: held to the tiled bf16 rule (the plain
    // bf16 path's own error plus one rounding, and 2% overall).
    for c in &cases() {
        let truth = attend_on(c, DType::F32, crate::AttnPath::Plain, true);
        let plain = attend_on(c, DType::BF16, crate::AttnPath::Plain, false);
        let got = attend_ref(c, DType::BF16, false);
        assert_attention_bf16(c, &got, &plain, &truth);
    }
}
