//! The references against textbook formulas in f64 and against each other: backward = finite
//! differences of forward, RoPE's backward = its forward's transpose, and the comparison's rules.

use super::*;

const F32: Precision = Precision::F32;

/// Central difference of `f` at `x` along coordinate `i`, in f64.
fn fd(f: &dyn Fn(&[f64]) -> f64, x: &[f64], i: usize) -> f64 {
    let h = 1e-6 * x[i].abs().max(1.0);
    let (mut a, mut b) = (x.to_vec(), x.to_vec());
    a[i] += h;
    b[i] -= h;
    (f(&a) - f(&b)) / (2.0 * h)
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn assert_close(got: f32, want: f64, rtol: f64, what: &str) {
    let tol = rtol * want.abs().max(1.0);
    assert!(
        (got as f64 - want).abs() <= tol,
        "{what}: got {got}, want {want}"
    );
}

#[test]
fn precision_rounds_to_nearest_even_and_knows_its_ulp() {
    let b = Precision::Bf16;
    assert_eq!(b.round(1.0 + 2f32.powi(-8)), 1.0); // tie, to even
    assert_eq!(b.round(1.0 + 3.0 * 2f32.powi(-8)), 1.0 + 2f32.powi(-6)); // tie, to even (up)
    assert_eq!(b.ulp(1.0), 2f32.powi(-7));
    assert_eq!(b.ulp(-3.0), 2f32.powi(-6));
    assert_eq!(Precision::F16.ulp(1.0), 2f32.powi(-10));
    assert_eq!(Precision::F16.ulp(0.0), 2f32.powi(-24));
    assert_eq!(Precision::F16.round(65519.0), 65504.0);
    assert_eq!(F32.ulp(1.0), f32::EPSILON);
    assert_eq!(F32.ulp(0.0), 2f32.powi(-149));
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

#[test]
fn swiglu_bwd_is_the_gradient_of_fwd() {
    let mut rng = Rng::new(3);
    let n = 50;
    let g = rng.normals(n, 4.0, F32);
    let u = rng.normals(n, 1.0, F32);
    let dh = rng.normals(n, 1.0, F32);
    let h = swiglu_fwd(&g, &u, F32);
    let out = swiglu_bwd(&dh, &g, &u, F32);
    for i in 0..n {
        let gi = g[i] as f64;
        let silu = gi / (1.0 + (-gi).exp());
        assert_close(h[i], silu * u[i] as f64, 1e-6, "swiglu_fwd");
        let f = |x: &[f64]| dh[i] as f64 * x[0] / (1.0 + (-x[0]).exp()) * x[1];
        let at = [gi, u[i] as f64];
        assert_close(out[i], fd(&f, &at, 0), 1e-5, "swiglu_bwd dg");
        assert_close(out[n + i], fd(&f, &at, 1), 1e-5, "swiglu_bwd du");
    }
}

/// cos/sin tables `(b, 1, t, dh)` of real rotations (angle `pos·f`, frequencies repeated over the
/// two halves, as rope.rs builds them).
fn tables(rng: &mut Rng, b: usize, t: usize, dh: usize) -> (Vec<f32>, Vec<f32>) {
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
    let (cos, sin) = tables(&mut rng, b, t, dh);
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

#[test]
fn ce_fwd_is_log_sum_exp_and_ce_bwd_its_gradient() {
    let mut rng = Rng::new(5);
    let (n, v) = (3, 11);
    let logits = rng.normals(n * v, 3.0, F32);
    let targets: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
    let out = ce_fwd(&logits, &targets, n, v);
    let lse: Vec<f32> = (0..n).map(|i| out[2 * i]).collect();
    let scale = 0.25f32;
    let d = ce_bwd(&logits, &targets, &lse, scale, n, v, F32);
    let lf = f64s(&logits);
    for i in 0..n {
        let row = &lf[i * v..(i + 1) * v];
        let naive = row.iter().map(|x| x.exp()).sum::<f64>().ln();
        assert_close(out[2 * i], naive, 1e-6, "lse");
        assert_close(
            out[2 * i + 1],
            naive - row[targets[i] as usize],
            1e-6,
            "nll",
        );
        assert!(
            d[i * v..(i + 1) * v]
                .iter()
                .map(|&x| x as f64)
                .sum::<f64>()
                .abs()
                < 1e-6
        );
    }
    // scale · Σ nll, differentiated by each logit
    let loss = |x: &[f64]| -> f64 {
        (0..n)
            .map(|i| {
                let row = &x[i * v..(i + 1) * v];
                row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[targets[i] as usize]
            })
            .sum::<f64>()
            * scale as f64
    };
    for (j, &g) in d.iter().enumerate() {
        assert_close(g, fd(&loss, &lf, j), 1e-5, "ce_bwd");
    }
    // Out-of-range target: NaN loss, lse still right, no one-hot.
    let bad = ce_fwd(&logits[..v], &[v as u32], 1, v);
    assert!(bad[1].is_nan() && bad[0] == out[0]);
}

#[test]
fn attn_softmax_is_a_masked_softmax_and_bwd_its_gradient() {
    let mut rng = Rng::new(7);
    // 2 heads of 3 query rows over 5 keys; mask row 1 fully masked, row 2 masks key 4.
    let (tq, tk, scale) = (3, 5, 0.5f32);
    let mut mask = vec![0f32; tq * tk];
    mask[tk..2 * tk].fill(f32::NEG_INFINITY);
    mask[2 * tk + 4] = f32::NEG_INFINITY;
    let raw = rng.normals(2 * tq * tk, 3.0, F32);
    let dp = rng.normals(2 * tq * tk, 1.0, F32);
    let p = attn_softmax_fwd(&raw, &mask, tk, scale, F32);
    let ds = attn_softmax_bwd(&p, &dp, tk, scale, F32);
    for r in 0..2 * tq {
        let (row, m) = (r * tk, (r % tq) * tk);
        if r % tq == 1 {
            assert!(p[row..row + tk].iter().all(|v| v.is_nan()), "row {r}");
            assert!(ds[row..row + tk].iter().all(|v| v.is_nan()), "row {r}");
            continue;
        }
        // L(raw) = Σ dp·softmax(raw·scale + mask), in f64
        let loss = |x: &[f64]| -> f64 {
            let s: Vec<f64> = (0..tk)
                .map(|j| x[j] * scale as f64 + mask[m + j] as f64)
                .collect();
            let e: Vec<f64> = s.iter().map(|v| v.exp()).collect();
            let sum: f64 = e.iter().sum();
            (0..tk).map(|j| dp[row + j] as f64 * e[j] / sum).sum()
        };
        let x = f64s(&raw[row..row + tk]);
        let e: Vec<f64> = (0..tk)
            .map(|j| (x[j] * scale as f64 + mask[m + j] as f64).exp())
            .collect();
        let sum: f64 = e.iter().sum();
        for j in 0..tk {
            assert_close(p[row + j], e[j] / sum, 1e-6, "attn_softmax_fwd");
            assert_close(ds[row + j], fd(&loss, &x, j), 1e-5, "attn_softmax_bwd");
        }
        assert_eq!(p[row + 4] == 0.0, r % tq == 2);
    }
    // bf16: the scaled scores round to bf16 (scale too); the outputs of bwd are bf16 values.
    let b = Precision::Bf16;
    let rb: Vec<f32> = raw.iter().map(|&v| b.round(v)).collect();
    let pb = attn_softmax_fwd(&rb, &mask[..tk], tk, 0.3, b);
    let s: Vec<f32> = rb[..tk]
        .iter()
        .map(|&v| b.round(v * b.round(0.3)))
        .collect();
    let top = s.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let sum: f64 = s.iter().map(|&v| ((v - top) as f64).exp()).sum();
    assert_eq!(pb[0], (((s[0] - top) as f64).exp() / sum) as f32);
    let dpb: Vec<f32> = dp.iter().map(|&v| b.round(v)).collect();
    let dsb = attn_softmax_bwd(&pb, &dpb, tk, 0.3, b);
    assert!(dsb.iter().all(|&v| b.round(v) == v));
}

#[test]
fn compare_applies_the_tolerance() {
    let tol = Tolerance {
        ulps: 2.0,
        rtol: 0.0,
        atol: 0.0,
    };
    let b = Precision::Bf16;
    let want = [1.0, -2.0, f32::NAN, 0.0];
    let two_ulps = [1.0 + 2.0 * b.ulp(1.0), -2.0, f32::NAN, 0.0];
    let c = compare(&two_ulps, &want, b, tol);
    assert!(c.pass, "{c:?}");
    assert!((c.max_rel_err - 2.0 * 2f64.powi(-7)).abs() < 1e-12);
    let three_ulps = [1.0 + 3.0 * b.ulp(1.0), -2.0, f32::NAN, 0.0];
    let c = compare(&three_ulps, &want, b, tol);
    assert!(!c.pass && c.worst == 0, "{c:?}");
    let nan = [1.0, f32::NAN, f32::NAN, 0.0];
    let c = compare(&nan, &want, b, tol);
    assert!(
        !c.pass && c.worst == 1 && c.max_rel_err.is_infinite(),
        "{c:?}"
    );
    let c = compare(&[1.0, -2.0, 0.5, 0.0], &want, b, tol);
    assert!(!c.pass && c.worst == 2, "{c:?}");
    // atol: a fraction of the largest |want|
    let loose = Tolerance {
        ulps: 0.0,
        rtol: 0.0,
        atol: 1e-3,
    };
    assert!(!compare(&[1.0, 0.0019], &[1.0, 0.0], F32, loose).pass);
    assert!(compare(&[1.0, 0.0009], &[1.0, 0.0], F32, loose).pass);
}

#[test]
fn rng_is_deterministic_and_roughly_normal() {
    let (mut a, mut b) = (Rng::new(7), Rng::new(7));
    let x: Vec<f32> = (0..20000).map(|_| a.normal()).collect();
    assert!(x
        .iter()
        .zip((0..20000).map(|_| b.normal()))
        .all(|(p, q)| *p == q));
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / x.len() as f64;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / x.len() as f64;
    assert!(
        mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
        "{mean} {var}"
    );
    assert!((0..1000).all(|_| a.below(7) < 7));
}
