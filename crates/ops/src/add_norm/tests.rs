//! The slice reference of the fused residual add + RMSNorm (what `kernels/add_norm.cuh` is checked
//! against, emulated and on a GPU) against the two ops the layer runs on tensors: `crate::add`
//! then `crate::rms_norm` / `crate::rms_norm_plus_one`, and `crate::add(dres, norm backward)`.

use candle_core::{DType, Device, Tensor};
use rtune_backend::check::{compare, tolerance, Op, Rng};
use rtune_backend::Precision;

use super::reference::{add_rms_norm_bwd, add_rms_norm_fwd, check_inputs, Weight};
use crate::test_util::flat;

/// f32, bf16 and f16 with both weights, a dim past several vector widths with a tail: `h` equal
/// bit for bit (one rounded add on both sides); `y` and `dh` within the kernels' tolerance (the
/// reference sums rows in f64, candle in f32: 2 ulps of the type, 1e-5 relative for f32), and in
/// bf16/f16 bit-equal in all but 1% of the elements.
#[test]
fn reference_equals_the_add_then_norm_ops() {
    let (rows, dim, eps) = (6, 203, 1e-6f32);
    let dev = Device::Cpu;
    for (dt, p) in [
        (DType::F32, Precision::F32),
        (DType::BF16, Precision::Bf16),
        (DType::F16, Precision::F16),
    ] {
        for weight in [Weight::Typed, Weight::F32] {
            let case = format!("{dt:?} {weight:?}");
            let mut rng = Rng::new(7);
            let (x, res, w, dy, dres) = check_inputs(&mut rng, (rows, dim), p, weight);
            let t = |v: &[f32], dt| {
                Tensor::from_vec(v.to_vec(), (rows, dim), &dev)
                    .and_then(|t| t.to_dtype(dt))
                    .unwrap()
            };
            let wdt = if weight == Weight::F32 {
                DType::F32
            } else {
                dt
            };
            let wt = Tensor::from_vec(w.clone(), dim, &dev)
                .and_then(|t| t.to_dtype(wdt))
                .unwrap();
            let h = crate::add(&t(&x, dt), &t(&res, dt)).unwrap();
            let (y, cache) = match weight {
                Weight::Typed => crate::rms_norm(&h, &wt, eps as f64),
                Weight::F32 => crate::rms_norm_plus_one(&h, &wt, eps as f64),
            }
            .unwrap();
            let dn = match weight {
                Weight::Typed => crate::rms_norm_backward(&t(&dy, dt), &wt, &cache),
                Weight::F32 => crate::rms_norm_plus_one_backward(&t(&dy, dt), &wt, &cache),
            }
            .unwrap();
            let dh = crate::add(&t(&dres, dt), &dn).unwrap();

            let (want_h, want_y) = add_rms_norm_fwd(&x, &res, &w, (rows, dim), eps, p, weight);
            let want_dh = add_rms_norm_bwd(&dy, &want_h, &w, &dres, (rows, dim), eps, p, weight);
            assert_eq!(flat(&h), want_h, "{case}: h");
            for (what, got, want, op) in [
                ("y", &y, &want_y, "add_rms_norm_fwd"),
                ("dh", &dh, &want_dh, "add_rms_norm_bwd"),
            ] {
                let got = flat(got);
                let c = compare(&got, want, p, tolerance(Op::typed(op), p));
                assert!(c.pass, "{case}: {what}: {c:?}");
                // The 2-ulp tolerance would also pass a reference with one rounding too many or
                // too few (Llama's `T(h·r)` for the f32 weight): in bf16/f16 the two sides must
                // also be bit-equal but for the few elements where `r` (f32 sums in another
                // order) tips a rounding.
                let differ = got
                    .iter()
                    .zip(want)
                    .filter(|(a, b)| a.to_bits() != b.to_bits());
                let differ = differ.count();
                eprintln!("{case}: {what}: {differ} of {} elements differ", got.len());
                if p != Precision::F32 {
                    assert!(100 * differ <= got.len(), "{case}: {what}: {differ} differ");
                }
            }
        }
    }
}
