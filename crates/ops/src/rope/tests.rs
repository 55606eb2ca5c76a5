//! RoPE: the fused op against its plain reference (f32 and bf16), the backward against candle's
//! autograd, and the slice reference against textbook formulas in f64.

use super::reference::*;
use crate::test_util::*;
use candle_core::{DType, Device, Tensor, Var};
use rtune_backend::check::Rng;
use rtune_backend::Precision;

/// `cos, sin: (b, 1, t, dh)` for positions `3 + 2i`.

#[test]
fn rope_matches_plain() {
    // (2, 3, 5, 6): half 3; (2, 4, 33, 64): 16896 elements, split into row pieces of 256 rows.
    for (i, &[b, h, t, dh]) in [[2, 3, 5, 6], [2, 4, 33, 64]].iter().enumerate() {
        let s = 10 * i as u64;
        let x = randn(&[b, h, t, dh], s + 7, 2.0);
        let dy = randn(&[b, h, t, dh], s + 8, 1.0);
        let (cos, sin) = rand_tables(b, t, dh);
        let y = crate::rope::op::rope(&x, &cos, &sin).unwrap();
        assert_f32(
            &y,
            &crate::rope::apply_reference(&x, &cos, &sin).unwrap(),
            "rope f32",
        );
        let dx = crate::rope::op::rope_bwd(&dy, &cos, &sin).unwrap();
        let want = crate::rope::apply_backward_reference(&dy, &cos, &sin).unwrap();
        assert_f32(&dx, &want, "rope_bwd f32");

        let (x, dy, cos, sin) = (bf16(&x), bf16(&dy), bf16(&cos), bf16(&sin));
        let y = crate::rope::op::rope(&x, &cos, &sin).unwrap();
        assert_bf16(
            &y,
            &crate::rope::apply_reference(&x, &cos, &sin).unwrap(),
            "rope bf16",
        );
        let dx = crate::rope::op::rope_bwd(&dy, &cos, &sin).unwrap();
        let want = crate::rope::apply_backward_reference(&dy, &cos, &sin).unwrap();
        assert_bf16(&dx, &want, "rope_bwd bf16");
    }
}

#[test]
fn rope_broadcasts_a_table_of_batch_one() {
    let x = randn(&[3, 2, 4, 8], 9, 1.0);
    let (cos, sin) = rand_tables(1, 4, 8);
    let y = crate::rope::op::rope(&x, &cos, &sin).unwrap();
    assert_f32(
        &y,
        &crate::rope::apply_reference(&x, &cos, &sin).unwrap(),
        "rope batch-1 table",
    );
}

#[test]
fn rope_backward_is_the_transpose() {
    let x = Var::from_tensor(&randn(&[1, 2, 3, 8], 13, 1.0)).unwrap();
    let inv = vec![1.0f32, 0.5, 0.25, 0.125];
    let (cos, sin) = crate::rope::tables(&inv, &[0, 5, 9], 1, 3, DType::F32, &Device::Cpu).unwrap();
    let dy = randn(&[1, 2, 3, 8], 14, 1.0);
    let y = crate::rope::apply_reference(&x, &cos, &sin).unwrap();
    let grads = (y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = crate::rope::apply_backward(&dy, &cos, &sin).unwrap();
    assert_close_t(&dx, grads.get(&x).unwrap(), "rope dx");
}

/// Partial rotary (Phi-4-mini): tables of width 6 on heads of 8 rotate the first 6 dims with
/// rotate_half over those 6 (transformers' Phi-3 formula, the reference), the last 2 pass through
/// bit for bit; the backward equals autograd on the reference; a table wider than the head is an
/// error.
#[test]
fn partial_rotary_rotates_the_first_part_only() {
    let x = Var::from_tensor(&randn(&[2, 3, 4, 8], 21, 1.0)).unwrap();
    let inv = vec![1.0f32, 0.3, 0.05];
    let pos = [0, 1, 2, 3, 4, 5, 6, 7];
    let (cos, sin) = crate::rope::tables(&inv, &pos, 2, 4, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(cos.dims(), [2, 1, 4, 6]);
    let y = crate::rope::apply(&x, &cos, &sin).unwrap();
    assert_f32(
        &y,
        &apply_reference(&x, &cos, &sin).unwrap(),
        "partial rope",
    );
    let pass = |t: &candle_core::Tensor| flat(&t.narrow(3, 6, 2).unwrap());
    assert_eq!(pass(&y), pass(&x), "the last 2 dims pass through");
    let dy = randn(&[2, 3, 4, 8], 22, 1.0);
    let want = apply_reference(&x, &cos, &sin).unwrap();
    let grads = (want * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = crate::rope::apply_backward(&dy, &cos, &sin).unwrap();
    assert_close_t(&dx, grads.get(&x).unwrap(), "partial rope dx");
    let wide = randn(&[2, 1, 4, 10], 23, 1.0);
    let e = crate::rope::apply(&x, &wide, &wide).unwrap_err();
    assert!(e.to_string().contains("wider than the head"), "{e}");
}

/// cos/sin tables `(b, 1, t, dh)` of real rotations (angle `pos·f`, frequencies repeated over the
/// two halves, as rope.rs builds them).
fn slice_tables(rng: &mut Rng, b: usize, t: usize, dh: usize) -> (Vec<f32>, Vec<f32>) {
    let half = dh / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for _ in 0..b * t {
        let pos = rng.below(4096) as f32;
        let ang: Vec<f32> = (0..dh)
            .map(|d| pos / 10000f32.powf((2 * (d % half)) as f32 / dh as f32))
            .collect();
        cos.extend(ang.iter().map(|a| a.cos()));
        sin.extend(ang.iter().map(|a| a.sin()));
    }
    (cos, sin)
}

#[test]
fn rope_bwd_is_the_transpose_of_fwd() {
    let mut rng = Rng::new(4);
    let shape @ (b, h, t, dh) = (2, 3, 5, 8);
    let (cos, sin) = slice_tables(&mut rng, b, t, dh);
    let x = rng.normals(b * h * t * dh, 1.0, F32);
    let y = rng.normals(b * h * t * dh, 1.0, F32);
    let fx = rope_fwd(&x, &cos, &sin, shape, F32);
    let by = rope_bwd(&y, &cos, &sin, shape, F32);
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum::<f64>()
    };
    assert_close(
        dot(&fx, &y) as f32,
        dot(&x, &by),
        1e-5,
        "<R x, y> = <x, Rᵀ y>",
    );
    // A rotation: Rᵀ R x = x, and y = x for angle 0.
    let back = rope_bwd(&fx, &cos, &sin, shape, F32);
    for (a, b) in back.iter().zip(&x) {
        assert_close(*a, *b as f64, 1e-5, "Rᵀ R x");
    }
    let ones = vec![1f32; cos.len()];
    let zeros = vec![0f32; cos.len()];
    assert_eq!(rope_fwd(&x, &ones, &zeros, shape, F32), x);
    // The first pair by hand: y1 = x1·c − x2·s, y2 = x2·c + x1·s.
    let (c, s, x1, x2) = (cos[0], sin[0], x[0], x[dh / 2]);
    assert_eq!(fx[0], x1 * c + (-x2 * s));
    assert_eq!(fx[dh / 2], x2 * c + x1 * s);
}

/// The frequency tables of every scaling rule against transformers 5.24's own
/// (`tests/parity/rope_freqs.json`, made by `tests/parity/make_rope_goldens.py`): default, linear,
/// llama3, longrope (both sets) and YaRN (gpt-oss's `truncate: false`, Qwen's default truncation,
/// DeepSeek-style `mscale`/`mscale_all_dim` with other betas, an explicit attention factor, a
/// collapsed correction range): the same f32 and f64 steps in the same order, so each frequency
/// within 1 f32 ulp — torch's vectorized `base ** x` (Sleef's `powf_u10`) is not correctly
/// rounded, Rust's `powf` is: at base 150000 two of gpt-oss's 32 exponents land one ulp apart;
/// every other case here is bit for bit, which the test counts — and the attention factor to the
/// f64's last bit (within the JSON parser's ulp).
#[test]
fn freqs_equal_transformers() {
    use super::freqs::{Freqs, RopeScaling, Yarn};
    use serde_json::Value;
    let golden: Value = serde_json::from_str(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/parity/rope_freqs.json"
    )))
    .unwrap();
    let f32s = |v: &Value| -> Vec<f32> {
        let a = v.as_array().unwrap();
        a.iter().map(|x| x.as_f64().unwrap() as f32).collect()
    };
    let f64s = |v: &Value| -> Vec<f64> {
        let a = v.as_array().unwrap();
        a.iter().map(|x| x.as_f64().unwrap()).collect()
    };
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    let (mut yarns, mut off_by_one) = (0, 0);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let p = &case["rope_parameters"];
        let num = |k: &str| p.get(k).and_then(Value::as_f64);
        let theta = num("rope_theta").unwrap();
        let scaling = match p["rope_type"].as_str().unwrap() {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: num("factor").unwrap(),
            },
            "llama3" => RopeScaling::Llama3 {
                factor: num("factor").unwrap(),
                low_freq_factor: num("low_freq_factor").unwrap(),
                high_freq_factor: num("high_freq_factor").unwrap(),
                original_max_position_embeddings: num("original_max_position_embeddings").unwrap(),
            },
            "longrope" => RopeScaling::LongRope {
                short_factor: f64s(&p["short_factor"]),
                long_factor: f64s(&p["long_factor"]),
                original_max_position_embeddings: num("original_max_position_embeddings").unwrap()
                    as usize,
                attention_factor: case["attention_factor"].as_f64().unwrap(),
            },
            "yarn" => {
                yarns += 1;
                RopeScaling::Yarn(Yarn {
                    factor: num("factor").unwrap(),
                    original_max_position_embeddings: num("original_max_position_embeddings")
                        .unwrap(),
                    beta_fast: num("beta_fast"),
                    beta_slow: num("beta_slow"),
                    mscale: num("mscale"),
                    mscale_all_dim: num("mscale_all_dim"),
                    attention_factor: num("attention_factor"),
                    truncate: p.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                })
            }
            other => panic!("{name}: rope type {other}"),
        };
        let dim = case["dim"].as_u64().unwrap() as usize;
        let f = Freqs::new(dim, theta, &scaling);
        let want = f32s(&case["inv_freq"]);
        let mut ulp_apart = |got: &[f32], want: &[f32], what: &str| {
            assert_eq!(got.len(), want.len(), "{name}: {what}");
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let ulps = (g.to_bits() as i64 - w.to_bits() as i64).abs();
                assert!(ulps <= 1, "{name}: {what}[{i}] {g:e} vs transformers {w:e}");
                off_by_one += ulps as usize;
            }
        };
        ulp_apart(&f.inv_freq, &want, "inv_freq");
        if let Some(long) = case.get("inv_freq_long") {
            let (got, orig) = f.long.as_ref().unwrap();
            ulp_apart(got, &f32s(long), "long inv_freq");
            // transformers picks the long set past the pre-training length.
            assert_eq!(f.for_positions(&[*orig as u32 - 1]), &f.inv_freq[..]);
            assert_eq!(f.for_positions(&[*orig as u32]), &got[..]);
        }
        let att = case["attention_factor"].as_f64().unwrap();
        assert_eq!(f.scale, att as f32, "{name}: attention factor");
        if let RopeScaling::Yarn(y) = &scaling {
            // serde_json's default float parsing may land one f64 ulp off the written value.
            let got = super::freqs::yarn_attention_factor(y);
            assert!(
                (got - att).abs() <= 2.0 * f64::EPSILON * att,
                "{name}: {got} vs {att}"
            );
        }
    }
    assert_eq!(yarns, 5);
    // Measured: only torch's pow differs (gpt-oss's base); a wrong step of a rule moves far more.
    assert!(
        off_by_one <= 4,
        "{off_by_one} frequencies one ulp from transformers'"
    );
}

/// f32 tables with a bf16 `x` (OLMo 2): the rotation in f32 on `x` widened, rounded once — the
/// same bits as the f32 op's result rounded to bf16, and not the all-bf16 op's (whose tables and
/// products are rounded: the test would pass with the mode broken only if they agreed, which the
/// last assert rules out). Backward alike.
#[test]
fn f32_tables_rotate_a_bf16_x_in_f32_rounded_once() {
    let (b, h, t, dh) = (2, 3, 7, 16);
    let x = bf16(&randn(&[b, h, t, dh], 21, 2.0));
    let dy = bf16(&randn(&[b, h, t, dh], 22, 1.0));
    let (cos, sin) = rand_tables(b, t, dh);
    for (name, got, want, all_bf16) in [
        (
            "forward",
            crate::rope::apply(&x, &cos, &sin).unwrap(),
            crate::rope::op::rope(&x.to_dtype(DType::F32).unwrap(), &cos, &sin).unwrap(),
            crate::rope::apply(&x, &bf16(&cos), &bf16(&sin)).unwrap(),
        ),
        (
            "backward",
            crate::rope::apply_backward(&dy, &cos, &sin).unwrap(),
            crate::rope::op::rope_bwd(&dy.to_dtype(DType::F32).unwrap(), &cos, &sin).unwrap(),
            crate::rope::apply_backward(&dy, &bf16(&cos), &bf16(&sin)).unwrap(),
        ),
    ] {
        assert_eq!(got.dtype(), DType::BF16, "{name}");
        assert_eq!(
            flat(&got),
            flat(&bf16(&want)),
            "{name}: one rounding of the f32 result"
        );
        assert_ne!(
            flat(&got),
            flat(&all_bf16),
            "{name}: the all-bf16 op rounds more"
        );
    }
}

/// The in-place q/k kernels' slice reference (`reference::rope_qk`) against the op on tensors
/// (`rope::apply` / `apply_backward` on q and on k), bit for bit: full rotation with tables of x's
/// type and of batch B; partial rotary (12 of 16) with f32 tables of batch 1 on a bf16 x (the
/// copies and the f32 mode of `apply`); f16 with f16 tables. GQA shapes (more q heads than k).
#[test]
fn rope_qk_reference_equals_apply_on_q_and_k() {
    let (b, hq, hk, t, dh) = (2, 4, 2, 5, 16);
    let dev = Device::Cpu;
    for (dt, p, tdt, pc, bc, r) in [
        (
            DType::BF16,
            Precision::Bf16,
            DType::BF16,
            Precision::Bf16,
            b,
            dh,
        ),
        (DType::BF16, Precision::Bf16, DType::F32, F32, 1, 12),
        (
            DType::F16,
            Precision::F16,
            DType::F16,
            Precision::F16,
            b,
            10,
        ),
        (DType::F32, F32, DType::F32, F32, 1, dh),
    ] {
        let case = format!("{dt:?} x, {tdt:?} tables ({bc}, 1, {t}, {r})");
        let mut rng = Rng::new(9);
        let (cos, sin) = check_tables(&mut rng, (bc, t, r), pc);
        let q = rng.normals(b * hq * t * dh, 1.0, p);
        let k = rng.normals(b * hk * t * dh, 1.0, p);
        let tab = |v: &[f32]| {
            Tensor::from_vec(v.to_vec(), (bc, 1, t, r), &dev)
                .and_then(|x| x.to_dtype(tdt))
                .unwrap()
        };
        let (ct, st) = (tab(&cos), tab(&sin));
        let x = |v: &[f32], h| {
            Tensor::from_vec(v.to_vec(), (b, h, t, dh), &dev)
                .and_then(|x| x.to_dtype(dt))
                .unwrap()
        };
        for bwd in [false, true] {
            let f = |v: &[f32], h| match bwd {
                false => crate::rope::apply(&x(v, h), &ct, &st).unwrap(),
                true => crate::rope::apply_backward(&x(v, h), &ct, &st).unwrap(),
            };
            let (mut wq, mut wk) = (q.clone(), k.clone());
            let s5 = (b, hq, hk, t, dh);
            rope_qk(&mut wq, &mut wk, &cos, &sin, s5, (bc, r), (pc, p), bwd);
            assert_eq!(flat(&f(&q, hq)), wq, "{case} q, backward {bwd}");
            assert_eq!(flat(&f(&k, hk)), wk, "{case} k, backward {bwd}");
        }
    }
}
