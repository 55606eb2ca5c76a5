//! SwiGLU: the fused op against its plain reference (f32 and bf16), the backward against candle's
//! autograd, and the slice reference against textbook formulas in f64.

use super::reference::*;
use super::*;
use crate::test_util::*;
use candle_core::Var;
use rtune_backend::check::Rng;

#[test]
fn swiglu_matches_plain() {
    // 13·1377 = 17901 elements: two rayon tasks, the second partial.
    for (i, shape) in [[3, 7], [13, 1377]].iter().enumerate() {
        let s = 10 * i as u64;
        // Gates out to ±12 so σ saturates on both sides.
        let g = randn(shape, s + 4, 12.0);
        let u = randn(shape, s + 5, 2.0);
        let dh = randn(shape, s + 6, 1.0);
        let h = crate::swiglu::swiglu(&g, &u).unwrap();
        assert_f32(
            &h,
            &crate::swiglu::swiglu_reference(&g, &u).unwrap(),
            "swiglu f32",
        );
        let (dg, du) = crate::swiglu::swiglu_backward(&dh, &g, &u).unwrap();
        let (wg, wu) = crate::swiglu::swiglu_backward_reference(&dh, &g, &u).unwrap();
        assert_f32(&dg, &wg, "swiglu dg f32");
        assert_f32(&du, &wu, "swiglu du f32");
        assert!(dg.is_contiguous() && du.is_contiguous());

        let (g, u, dh) = (bf16(&g), bf16(&u), bf16(&dh));
        let h = crate::swiglu::swiglu(&g, &u).unwrap();
        assert_bf16(
            &h,
            &crate::swiglu::swiglu_reference(&g, &u).unwrap(),
            "swiglu bf16",
        );
        let (dg, du) = crate::swiglu::swiglu_backward(&dh, &g, &u).unwrap();
        let (wg, wu) = crate::swiglu::swiglu_backward_reference(&dh, &g, &u).unwrap();
        assert_bf16(&dg, &wg, "swiglu dg bf16");
        assert_bf16(&du, &wu, "swiglu du bf16");
    }
}

#[test]
fn swiglu_matches_autograd() {
    let g = Var::from_tensor(&(randn(&[5, 7], 4, 1.0) * 4.0).unwrap()).unwrap();
    let u = Var::from_tensor(&randn(&[5, 7], 5, 1.0)).unwrap();
    let dh = randn(&[5, 7], 6, 1.0);
    let y = (g.silu().unwrap() * u.as_tensor()).unwrap();
    let grads = (y * &dh).unwrap().sum_all().unwrap().backward().unwrap();
    let (dg, du) = swiglu_backward(&dh, &g, &u).unwrap();
    assert_close_t(&dg, grads.get(&g).unwrap(), "swiglu dg");
    assert_close_t(&du, grads.get(&u).unwrap(), "swiglu du");
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
