//! [`super`]'s factorisations against their definitions and against torch.

use super::*;
use crate::test_util::max_abs_diff;

fn rng() -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(5)
}

/// A seeded `(out, in)` matrix with entries in [-1, 1).
fn matrix(out: usize, inp: usize, seed: u64) -> Vec<f32> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..out * inp)
        .map(|_| r.random_range(-1.0f32..1.0))
        .collect()
}

/// `s·B·A` as f64, `(out, in)` row-major.
fn product(d: &Decomposed, out: usize, inp: usize, r: usize, s: f64) -> Vec<f64> {
    let mut p = vec![0.0; out * inp];
    for i in 0..out {
        for j in 0..inp {
            p[i * inp + j] = s
                * (0..r)
                    .map(|k| d.b[i * r + k] as f64 * d.a[k * inp + j] as f64)
                    .sum::<f64>();
        }
    }
    p
}

#[test]
fn names_parse_and_print() {
    for s in ["default", "gaussian", "pissa", "pissa_niter_4", "olora"] {
        assert_eq!(s.parse::<Init>().unwrap().to_string(), s);
    }
    assert_eq!("true".parse::<Init>(), Ok(Init::Default));
    for bad in ["pisa", "pissa_niter_", "pissa_niter_x", "loftq", ""] {
        assert!(bad.parse::<Init>().is_err(), "{bad}");
    }
    assert!(Init::Olora.mutates_base() && !Init::Gaussian.mutates_base());
}

/// PiSSA: W = residual + s·B·A (f32 rounding: 1e-5), s·B·A is the best rank-r approximation
/// (Eckart–Young: ‖W − s·B·A‖²_F = Σ_{i>r} σ_i², to 1e-6 relative), and A, B carry √(S/s) each
/// (so ‖A‖_F = ‖B‖_F).
#[test]
fn pissa_is_the_top_r_svd() {
    let (out, inp, r, s) = (12, 9, 3, 2.0);
    let w = matrix(out, inp, 1);
    let d = decompose(
        Init::Pissa { niter: None },
        "w",
        &w,
        (out, inp),
        r,
        s,
        &mut rng(),
    )
    .unwrap();
    let p = product(&d, out, inp, r, s);
    for k in 0..out * inp {
        assert!((d.residual[k] as f64 + p[k] - w[k] as f64).abs() < 1e-5);
    }
    let m =
        DMatrix::<f64>::from_row_slice(out, inp, &w.iter().map(|&x| x as f64).collect::<Vec<_>>());
    let sv = m.svd(false, false).singular_values;
    let mut sv: Vec<f64> = sv.iter().copied().collect();
    sv.sort_by(|a, b| b.total_cmp(a));
    let tail: f64 = sv[r..].iter().map(|x| x * x).sum();
    let err: f64 = (0..out * inp).map(|k| (w[k] as f64 - p[k]).powi(2)).sum();
    assert!((err - tail).abs() / tail < 1e-6, "{err} vs {tail}");
    let fro = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
    assert!((fro(&d.a) - fro(&d.b)).abs() < 1e-5 * fro(&d.a));
    // Σ σ_i / s over the top r = ‖A‖²_F.
    let want: f64 = sv[..r].iter().sum::<f64>() / s;
    assert!((fro(&d.a) - want).abs() < 1e-5 * want);
}

/// `pissa_niter_N` on a matrix with a gap after σ_r (σ_{r+1}/σ_r = 0.01) finds the exact top-r
/// product, whatever the random draw (error ~ (0.01)^(2N+1)): tall and wide shapes.
#[test]
fn randomized_svd_finds_a_separated_subspace() {
    for (out, inp) in [(14, 10), (8, 15)] {
        let r = 3;
        let base = DMatrix::<f64>::from_row_slice(
            out,
            inp,
            &matrix(out, inp, 2)
                .iter()
                .map(|&x| x as f64)
                .collect::<Vec<_>>(),
        );
        let svd = base.svd(true, true);
        let (u, vt) = (svd.u.unwrap(), svd.v_t.unwrap());
        let k = out.min(inp);
        let sig: Vec<f64> = (0..k)
            .map(|i| {
                if i < r {
                    10.0 - i as f64
                } else {
                    0.07 / (1 + i) as f64
                }
            })
            .collect();
        let gapped = &u * DMatrix::from_diagonal(&nalgebra::DVector::from_vec(sig)) * &vt;
        let w: Vec<f32> = row_major(&gapped).iter().map(|&x| x as f32).collect();
        let exact = decompose(
            Init::Pissa { niter: None },
            "w",
            &w,
            (out, inp),
            r,
            1.5,
            &mut rng(),
        )
        .unwrap();
        let approx = decompose(
            Init::Pissa { niter: Some(4) },
            "w",
            &w,
            (out, inp),
            r,
            1.5,
            &mut rng(),
        )
        .unwrap();
        let (pe, pa) = (
            product(&exact, out, inp, r, 1.5),
            product(&approx, out, inp, r, 1.5),
        );
        for k in 0..out * inp {
            assert!(
                (pe[k] - pa[k]).abs() < 1e-5,
                "{out}x{inp} [{k}]: {} vs {}",
                pe[k],
                pa[k]
            );
        }
    }
}

/// OLoRA's QR equals torch.linalg.qr (LAPACK) including its signs, tall and wide:
/// ```python
/// W = torch.tensor([[1.,-2.,3.,0.5],[4.,5.,-6.,1.],[-7.,8.,9.,2.]])
/// Q, R = torch.linalg.qr(W)      # and torch.linalg.qr(W.t())
/// ```
/// f32 LAPACK vs f64 here: 1e-5.
#[test]
fn olora_qr_matches_torch() {
    let w: Vec<f32> = vec![1., -2., 3., 0.5, 4., 5., -6., 1., -7., 8., 9., 2.];
    let m = DMatrix::<f64>::from_row_slice(3, 4, &w.iter().map(|&x| x as f64).collect::<Vec<_>>());
    let (q, r) = householder_qr(&m, 3);
    let tq = [
        [
            -0.12309145927429199,
            0.16888225078582764,
            0.9779197573661804,
        ],
        [
            -0.49236592650413513,
            -0.8659713268280029,
            0.0875747799873352,
        ],
        [0.8616403937339783, -0.4707146883010864, 0.1897457242012024],
    ];
    let tr = [
        [
            -8.124038696289062,
            4.677476406097412,
            10.339685440063477,
            1.169369101524353,
        ],
        [
            0.0,
            -8.43333911895752,
            1.4660422801971436,
            -1.7229597568511963,
        ],
        [0.0, 0.0, 4.116021633148193, 0.9560260772705078],
    ];
    for i in 0..3 {
        for j in 0..3 {
            assert!((q[(i, j)] - tq[i][j]).abs() < 1e-5, "Q[{i},{j}]");
        }
        for j in 0..4 {
            assert!((r[(i, j)] - tr[i][j]).abs() < 1e-5, "R[{i},{j}]");
        }
    }
    let (q, r) = householder_qr(&m.transpose(), 2);
    let tq = [
        [-0.26490652561187744, -0.9017486572265625],
        [0.5298129916191101, -0.27164486050605774],
        [-0.7947194576263428, 0.16802763938903809],
        [-0.13245324790477753, -0.29124802350997925],
    ];
    let tr = [
        [-3.7749171257019043, 6.225301742553711, -1.3245320320129395],
        [0.0, -6.264631271362305, 5.068835258483887],
    ];
    for i in 0..4 {
        for j in 0..2 {
            assert!((q[(i, j)] - tq[i][j]).abs() < 1e-5, "Qt[{i},{j}]");
        }
    }
    for i in 0..2 {
        for j in 0..3 {
            assert!((r[(i, j)] - tr[i][j]).abs() < 1e-5, "Rt[{i},{j}]");
        }
    }
    // Through decompose: B = Q[:, :r], A = R[:r], residual = W − s·B·A.
    let d = decompose(Init::Olora, "w", &w, (3, 4), 2, 2.0, &mut rng()).unwrap();
    assert!((d.b[0] as f64 - tq_first()).abs() < 1e-5);
    let p = product(&d, 3, 4, 2, 2.0);
    for k in 0..12 {
        assert!((d.residual[k] as f64 + p[k] - w[k] as f64).abs() < 1e-5);
    }
}

fn tq_first() -> f64 {
    -0.12309145927429199
}

#[test]
fn rank_above_the_layer_is_refused() {
    let w = matrix(4, 6, 3);
    let e = decompose(Init::Olora, "model.x", &w, (4, 6), 5, 1.0, &mut rng())
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.x") && e.contains("r = 5"), "{e}");
}

/// PEFT's gaussian init: A ~ N(0, 1/r²) (std within 5% over 4096 draws), B = 0.
#[test]
fn gaussian_has_std_one_over_r() {
    let spec = LoraSpec::new(4, 8.0, 0.0, false, &["q_proj".into()]).unwrap();
    let m = ModuleShape {
        name: "q".into(),
        in_features: 1024,
        out_features: 8,
        experts: 1,
    };
    let ad = gaussian(spec, &[m], 7, &Device::Cpu).unwrap();
    let a: Vec<f32> = ad.pairs[0].a.flatten_all().unwrap().to_vec1().unwrap();
    let n = a.len() as f64;
    let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
    let std = (a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!((std - 0.25).abs() < 0.0125, "{std}");
    assert!(mean.abs() < 0.02, "{mean}");
    let b: Vec<f32> = ad.pairs[0].b.flatten_all().unwrap().to_vec1().unwrap();
    assert!(b.iter().all(|&x| x == 0.0));
}

/// The converted adapter adds exactly s·(B·A − B₀·A₀) with the original scaling.
#[test]
fn conversion_is_the_difference_at_the_same_scaling() {
    for rslora in [false, true] {
        let spec = LoraSpec::new(2, 4.0, 0.0, rslora, &["q_proj".into()]).unwrap();
        let dev = Device::Cpu;
        let t = |seed, r, c| Tensor::from_vec(matrix(r, c, seed), (r, c), &dev).unwrap();
        let ad = Adapter {
            spec: spec.clone(),
            names: vec!["q".into()],
            pairs: vec![LoraPair {
                a: t(1, 2, 5),
                b: t(2, 3, 2),
                m: None,
            }],
            tokens: None,
        };
        let init = vec![LoraPair {
            a: t(3, 2, 5),
            b: t(4, 3, 2),
            m: None,
        }];
        let c = converted(&ad, &init).unwrap();
        assert_eq!(c.spec.r, 4);
        assert!((c.spec.scaling() - spec.scaling()).abs() < 1e-12);
        let got = (c.pairs[0].b.matmul(&c.pairs[0].a).unwrap() * c.spec.scaling()).unwrap();
        let want = ((ad.pairs[0].b.matmul(&ad.pairs[0].a).unwrap()
            - init[0].b.matmul(&init[0].a).unwrap())
        .unwrap()
            * spec.scaling())
        .unwrap();
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-5, "{d}");
    }
}
