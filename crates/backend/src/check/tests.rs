//! The references against textbook formulas in f64 and against each other: backward = finite
//! differences of forward, RoPE's backward = its forward's transpose, and the comparison's rules.

use super::*;

const F32: Precision = Precision::F32;

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
