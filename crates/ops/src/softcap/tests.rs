//! The soft cap's forms: the tensor op and its two backwards against candle's autograd of the
//! formula, the bf16 rounding of each step, and the tiled kernels' f32 form ([`Cap`]) against the
//! tensor op.

use candle_core::{DType, Tensor, Var};

use super::{softcap, softcap_backward, softcap_logits, softcap_logits_backward, Cap};
use crate::test_util::*;

/// `cap·tanh(x·scale/cap)` by candle's ops, for autograd.
fn formula(x: &Tensor, scale: f64, cap: f64) -> Tensor {
    ((x * scale).unwrap() / cap)
        .unwrap()
        .tanh()
        .unwrap()
        .affine(cap, 0.0)
        .unwrap()
}

/// f32: forward and both backwards against autograd of the formula, within 1e-6 of the largest
/// entry (the same f32 ops in the same order forward; the backward's `1 − t²` is formed from the
/// same `t` autograd forms, a few ulps apart at most). Cap 2 on scores up to ±12 bends most of them.
#[test]
fn softcap_matches_autograd() {
    let (scale, cap) = (0.37, 2.0);
    let x = Var::from_tensor(&randn(&[7, 33], 1, 12.0)).unwrap();
    let dy = randn(&[7, 33], 2, 1.0);
    let want = formula(&x, scale, cap);
    let g = (want.clone() * &dy)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let got = softcap(&x, scale, cap).unwrap();
    assert_f32(&got, &want, "softcap forward");
    assert!(flat(&got).iter().all(|v| v.abs() < cap as f32));
    let dx = softcap_backward(&dy, &x, scale, cap).unwrap();
    assert_f32(&dx, g.get(&x).unwrap(), "softcap backward");
    // The logits' form: scale 1, backward from the output.
    let want = formula(&x, 1.0, cap);
    let g = (want.clone() * &dy)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let y = softcap_logits(&x, cap).unwrap();
    assert_eq!(bits(&y), bits(&softcap(&x, 1.0, cap).unwrap()));
    assert_f32(&y, &want, "softcap_logits forward");
    let dx = softcap_logits_backward(&dy, &y, cap).unwrap();
    assert_f32(&dx, g.get(&x).unwrap(), "softcap_logits backward");
}

/// bf16: each of torch's eager steps (`·scale`, `/cap`, `tanh`, `·cap`) rounded to bf16, exactly;
/// the logits' form returns those bits as bf16.
#[test]
fn softcap_rounds_each_step_like_torch_eager() {
    let (scale, cap) = (0.37, 2.0);
    let x = randn(&[5, 41], 3, 12.0).to_dtype(DType::BF16).unwrap();
    let r = |t: Tensor| {
        t.to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let xf = x.to_dtype(DType::F32).unwrap();
    let s = r((xf * scale).unwrap());
    let s = r((s / cap).unwrap());
    let t = r(s.tanh().unwrap());
    let want = r((t * cap).unwrap());
    let got = softcap(&x, scale, cap).unwrap();
    assert_eq!(got.dtype(), DType::F32);
    assert_eq!(bits(&got), bits(&want));
    let y = softcap_logits(&x, cap).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(bits(&y), bits(&softcap(&x, 1.0, cap).unwrap()));
}

/// The tiled kernels' form (`s·(1/cap)` on already scaled scores, f32) against the tensor op:
/// within 2e-7 of the cap (the reciprocal's rounding and tanh's ulp), forward and slope; `None`
/// and bad caps as the kernels take them.
#[test]
fn the_kernels_cap_is_the_op() {
    let (scale, cap) = (0.37f64, 2.0f64);
    let x = randn(&[3, 50], 4, 12.0);
    let want = flat(&softcap(&x, scale, cap).unwrap());
    let c = Cap::new("t", Some(cap)).unwrap().unwrap();
    let mut s: Vec<f32> = flat(&x).iter().map(|v| v * scale as f32).collect();
    let ts: Vec<f32> = s.iter().map(|&v| c.tanh(v)).collect();
    c.apply(&mut s);
    for ((a, b), t) in s.iter().zip(&want).zip(&ts) {
        assert!((a - b).abs() <= 2e-7 * cap as f32, "{a} vs {b}");
        assert_eq!(*a, c.of_tanh(*t));
        assert!((0.0..=1.0).contains(&Cap::slope(*t)));
    }
    assert!(Cap::new("t", None).unwrap().is_none());
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = Cap::new("flash_attn", Some(bad)).unwrap_err().to_string();
        assert!(e.contains("flash_attn: soft cap"), "{e}");
    }
}

/// The tiled kernels' form on bf16 inputs ([`Cap::eager`], one score at a time from the unscaled
/// product in f32) against the tensor op on the bf16 scores: the same bits, `z` and `t` (the
/// backward's slope); and not the f32 form's (the check sees the rounding).
#[test]
fn the_kernels_eager_cap_is_the_ops_bf16_steps() {
    let (scale, cap) = (24f64.powf(-0.5), 2.0f64);
    let raw = randn(&[4, 61], 5, 12.0);
    let xb = raw.to_dtype(DType::BF16).unwrap();
    let want_z = flat(&softcap(&xb, scale, cap).unwrap());
    let want_t = flat(&super::tanh_part(&xb, scale, cap).unwrap());
    let c = Cap::new("t", Some(cap)).unwrap().unwrap();
    let bf = |v: f32| half::bf16::from_f32(v).to_f32();
    let mut f32_differs = 0;
    for ((&x, &wz), &wt) in flat(&raw).iter().zip(&want_z).zip(&want_t) {
        let (t, z) = c.eager(x, scale as f32, bf);
        assert_eq!(
            (z.to_bits(), t.to_bits()),
            (wz.to_bits(), wt.to_bits()),
            "{x}"
        );
        f32_differs += usize::from(c.of_tanh(c.tanh(x * scale as f32)) != z);
    }
    assert!(f32_differs > want_z.len() / 2, "{f32_differs}");
}
