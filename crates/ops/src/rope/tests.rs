//! RoPE: the fused op against its plain reference (f32 and bf16), the backward against candle's
//! autograd, and the slice reference against textbook formulas in f64.

use super::reference::*;
use crate::test_util::*;
use candle_core::{DType, Device, Var};
use rtune_backend::check::Rng;

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
