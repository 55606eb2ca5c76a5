//! RMSNorm: the fused op against its plain reference (f32 and bf16), the backward against candle's
//! autograd, and the slice reference against textbook formulas in f64.

use super::reference::*;
use super::*;
use crate::test_util::*;
use candle_core::Var;
use rtune_backend::check::Rng;
use rtune_backend::Precision;

#[test]
fn rms_norm_matches_plain() {
    // (7, 37): one task, a 5-element tail; (40, 515): several tasks of 31 rows.
    for (i, &(n, d)) in [(7, 37), (40, 515)].iter().enumerate() {
        let s = 10 * i as u64;
        let x = randn(&[n, d], s + 1, 3.0);
        let w = randn(&[d], s + 2, 1.5);
        let dy = randn(&[n, d], s + 3, 1.0);
        let eps = 1e-5;
        let y = crate::norm::op::rms_norm(&x, &w, eps).unwrap();
        assert_f32(
            &y,
            &crate::norm::rms_norm_reference(&x, &w, eps).unwrap(),
            "rms_norm f32",
        );
        let dx = crate::norm::op::rms_norm_bwd(&dy, &x, &w, eps).unwrap();
        let want = crate::norm::rms_norm_backward_reference(&dy, &x, &w, eps).unwrap();
        assert_f32(&dx, &want, "rms_norm_bwd f32");

        let (x, w, dy) = (bf16(&x), bf16(&w), bf16(&dy));
        let y = crate::norm::op::rms_norm(&x, &w, eps).unwrap();
        assert_bf16(
            &y,
            &crate::norm::rms_norm_reference(&x, &w, eps).unwrap(),
            "rms_norm bf16",
        );
        let dx = crate::norm::op::rms_norm_bwd(&dy, &x, &w, eps).unwrap();
        let want = crate::norm::rms_norm_backward_reference(&dy, &x, &w, eps).unwrap();
        assert_bf16(&dx, &want, "rms_norm_bwd bf16");
    }
}

#[test]
fn rms_norm_matches_autograd() {
    let x = Var::from_tensor(&randn(&[6, 8], 1, 1.0)).unwrap();
    let w = randn(&[8], 2, 1.0);
    let dy = randn(&[6, 8], 3, 1.0);
    let r = (x.sqr().unwrap().mean_keepdim(1).unwrap() + 1e-5)
        .unwrap()
        .sqrt()
        .unwrap()
        .recip()
        .unwrap();
    let y = x.broadcast_mul(&r).unwrap().broadcast_mul(&w).unwrap();
    let grads = (y.clone() * &dy)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (y2, cache) = rms_norm(&x, &w, 1e-5).unwrap();
    assert_close_t(&y2, &y, "rms_norm forward");
    let dx = rms_norm_backward(&dy, &w, &cache).unwrap();
    assert_close_t(&dx, grads.get(&x).unwrap(), "rms_norm dx");
}

#[test]
fn rms_norm_fwd_is_x_over_rms_times_w() {
    let mut rng = Rng::new(1);
    let (rows, dim) = (3, 37);
    let x = rng.normals(rows * dim, 2.0, F32);
    let w = rng.normals(dim, 1.0, F32);
    let y = rms_norm_fwd(&x, &w, rows, dim, 1e-5, F32);
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        let ms = xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
        for c in 0..dim {
            let want = xr[c] as f64 / (ms + 1e-5f32 as f64).sqrt() * w[c] as f64;
            assert_close(y[r * dim + c], want, 1e-6, "rms_norm_fwd");
        }
    }
    // bf16: every output is a bf16 value
    let xb: Vec<f32> = x.iter().map(|&v| Precision::Bf16.round(v)).collect();
    let wb: Vec<f32> = w.iter().map(|&v| Precision::Bf16.round(v)).collect();
    let yb = rms_norm_fwd(&xb, &wb, rows, dim, 1e-5, Precision::Bf16);
    assert!(yb.iter().all(|&v| Precision::Bf16.round(v) == v));
}

#[test]
fn rms_norm_bwd_is_the_gradient_of_fwd() {
    let mut rng = Rng::new(2);
    let (rows, dim, eps) = (2, 9, 1e-5f32);
    let x = rng.normals(rows * dim, 1.5, F32);
    let w = rng.normals(dim, 1.0, F32);
    let dy = rng.normals(rows * dim, 1.0, F32);
    let dx = rms_norm_bwd(&dy, &x, &w, rows, dim, eps, F32);
    // L(x) = Σ dy·y(x), in f64
    let loss = |x: &[f64]| -> f64 {
        let mut l = 0.0;
        for r in 0..rows {
            let xr = &x[r * dim..(r + 1) * dim];
            let ms = xr.iter().map(|v| v * v).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for c in 0..dim {
                l += dy[r * dim + c] as f64 * xr[c] * inv * w[c] as f64;
            }
        }
        l
    };
    let xf = f64s(&x);
    for (i, &g) in dx.iter().enumerate() {
        assert_close(g, fd(&loss, &xf, i), 1e-4, "rms_norm_bwd");
    }
}

/// Gemma's `(1 + w)` norm: f32 is [`rms_norm`] with `w1` bit for bit; bf16 rounds once from the
/// f32 result computed on the bf16 inputs (so within half a bf16 ulp, 2⁻⁹ relative, of the f32
/// path on the same values), and its backward within one bf16 ulp (2⁻⁸) of the f32 backward.
#[test]
fn rms_norm_plus_one_rounds_once() {
    let dev = candle_core::Device::Cpu;
    let mut rng = Rng::new(5);
    let (n, d) = (6, 40);
    let x = Tensor::from_vec(
        (0..n * d).map(|_| rng.normal()).collect::<Vec<f32>>(),
        (n, d),
        &dev,
    )
    .unwrap();
    let w1 = Tensor::from_vec(
        (0..d)
            .map(|_| 1.0 + 0.1 * rng.normal())
            .collect::<Vec<f32>>(),
        d,
        &dev,
    )
    .unwrap();
    let dy = Tensor::from_vec(
        (0..n * d).map(|_| rng.normal()).collect::<Vec<f32>>(),
        (n, d),
        &dev,
    )
    .unwrap();
    let (y32, c32) = rms_norm_plus_one(&x, &w1, 1e-6).unwrap();
    let (y, c) = rms_norm(&x, &w1, 1e-6).unwrap();
    assert_eq!(y32.to_vec2::<f32>().unwrap(), y.to_vec2::<f32>().unwrap());
    let dx32 = rms_norm_plus_one_backward(&dy, &w1, &c32).unwrap();
    let dx = rms_norm_backward(&dy, &w1, &c).unwrap();
    assert_eq!(dx32.to_vec2::<f32>().unwrap(), dx.to_vec2::<f32>().unwrap());
    // bf16: the f32 path on the bf16 values, rounded once.
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let (xb, dyb) = (bf(&x), bf(&dy));
    let (yb, cb) = rms_norm_plus_one(&xb, &w1, 1e-6).unwrap();
    let (want, cw) = rms_norm(&f32_of(&xb), &w1, 1e-6).unwrap();
    let rel = |got: &Tensor, want: &Tensor| -> f32 {
        let (g, w) = (
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap(),
        );
        g.iter()
            .flatten()
            .zip(w.iter().flatten())
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
            .fold(0f32, f32::max)
    };
    // One rounding to bf16 (7 stored mantissa bits): at most half an ulp, 2^-8 relative.
    let e = rel(&f32_of(&yb), &want);
    assert!(e <= 2f32.powi(-8), "forward {e:e}");
    let dxb = rms_norm_plus_one_backward(&dyb, &w1, &cb).unwrap();
    let dxw = rms_norm_backward(&f32_of(&dyb), &w1, &cw).unwrap();
    let e = rel(&f32_of(&dxb), &dxw);
    assert!(e <= 2f32.powi(-8), "backward {e:e}");
}
