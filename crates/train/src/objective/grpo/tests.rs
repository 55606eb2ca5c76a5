//! The hand-written loss and gradient against TRL's formulation restated as candle ops in f64
//! (autograd gives the reference gradient), and the advantages against values worked by hand.

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

const B: usize = 4;
const T: usize = 7;

struct Data {
    logp: Vec<f32>,
    old: Vec<f32>,
    reference: Vec<f32>,
    adv: Vec<f32>,
    mask: Vec<f32>,
}

fn data(seed: u64) -> Data {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut normal = || {
        // Box–Muller: enough for test inputs.
        let (u, v): (f32, f32) = (rng.random_range(1e-6..1.0), rng.random_range(0.0..1.0));
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    };
    let logp: Vec<f32> = (0..B * T).map(|_| -0.2 - normal().abs() * 1.5).collect();
    // Ratios spread past ±ε so every clip branch is taken.
    let old = logp.iter().map(|l| l + 0.3 * normal()).collect();
    let reference = logp.iter().map(|l| l + 0.5 * normal()).collect();
    let adv = (0..B).map(|_| normal()).collect();
    // Rows of 7, 5, 1 and 3 completion tokens.
    let lens = [7, 5, 1, 3];
    let mask = (0..B * T)
        .map(|i| f32::from(u8::from(i % T < lens[i / T])))
        .collect();
    Data {
        logp,
        old,
        reference,
        adv,
        mask,
    }
}

fn norm() -> Normalizer {
    Normalizer {
        grad_accum: 2,
        max_completion_length: 9,
        num_items_in_batch: 40.0,
        num_processes: 1,
        steps_per_generation: 2,
    }
}

/// TRL's `_compute_loss` as candle ops in f64: the loss, and ∂loss/∂logp by autograd.
fn reference(cfg: &PolicyConfig, d: &Data, on_policy: bool) -> (f64, Vec<f64>) {
    let dev = Device::Cpu;
    let t64 = |v: &[f32], shape: (usize, usize)| {
        Tensor::from_iter(v.iter().map(|x| *x as f64), &dev)
            .unwrap()
            .reshape(shape)
            .unwrap()
    };
    let logp = Var::from_tensor(&t64(&d.logp, (B, T))).unwrap();
    let lp = logp.as_tensor();
    let old = if on_policy {
        lp.detach()
    } else {
        t64(&d.old, (B, T))
    };
    let mask = t64(&d.mask, (B, T));
    let adv = t64(&d.adv, (B, 1));
    let msum = mask.sum_keepdim(1).unwrap().clamp(1.0, f64::MAX).unwrap();
    let log_ratio = (lp - &old).unwrap();
    let liw = match cfg.level {
        Level::Token => log_ratio,
        Level::Sequence => ((log_ratio * &mask).unwrap().sum_keepdim(1).unwrap() / &msum).unwrap(),
    };
    let coef_1 = liw.exp().unwrap();
    let bcast = |x: &Tensor| x.broadcast_as((B, T)).unwrap();
    let mut ptl = match cfg.loss_type {
        LossType::Cispo => {
            let cl = coef_1.minimum(cfg.epsilon_high as f64).unwrap().detach();
            bcast(&cl.broadcast_mul(&adv).unwrap().neg().unwrap())
                .mul(lp)
                .unwrap()
        }
        LossType::Sapo => {
            let temps: Vec<f32> = d
                .adv
                .iter()
                .map(|a| {
                    if *a > 0.0 {
                        cfg.sapo_temperature_pos
                    } else {
                        cfg.sapo_temperature_neg
                    }
                })
                .collect();
            let tau = t64(&temps, (B, 1));
            let z = (coef_1
                .broadcast_sub(&Tensor::new(1f64, &dev).unwrap())
                .unwrap())
            .broadcast_mul(&tau)
            .unwrap();
            let sig = ((z.neg().unwrap().exp().unwrap() + 1.0).unwrap())
                .recip()
                .unwrap();
            let soft = ((sig * 4.0).unwrap().broadcast_div(&tau)).unwrap();
            bcast(&soft.broadcast_mul(&adv).unwrap().neg().unwrap())
        }
        _ => {
            let lo = 1.0 - cfg.epsilon_low as f64;
            let hi = 1.0 + cfg.epsilon_high as f64;
            let coef_2 = coef_1.maximum(lo).unwrap().minimum(hi).unwrap();
            let c1 = match cfg.delta {
                Some(delta) => coef_1.minimum(delta as f64).unwrap(),
                None => coef_1.clone(),
            };
            let t1 = c1.broadcast_mul(&adv).unwrap();
            let t2 = coef_2.broadcast_mul(&adv).unwrap();
            bcast(&t1.minimum(&t2).unwrap().neg().unwrap())
        }
    };
    if cfg.beta != 0.0 {
        let x = (t64(&d.reference, (B, T)) - lp).unwrap();
        let mut kl = ((x.exp().unwrap() - &x).unwrap() - 1.0).unwrap();
        if cfg.bias_correction_kl {
            kl = kl.broadcast_mul(&coef_1).unwrap();
        }
        ptl = (ptl + (kl * cfg.beta as f64).unwrap()).unwrap();
    }
    let masked = (ptl * &mask).unwrap();
    let n = norm();
    let accum = n.grad_accum as f64;
    let loss = match cfg.loss_type {
        LossType::Grpo | LossType::Sapo => ((masked.sum_keepdim(1).unwrap() / &msum)
            .unwrap()
            .mean_all()
            .unwrap()
            / accum)
            .unwrap(),
        LossType::Bnpo => {
            let m = mask.sum_all().unwrap().to_scalar::<f64>().unwrap().max(1.0);
            (masked.sum_all().unwrap() / (m * accum)).unwrap()
        }
        LossType::DrGrpo => {
            (masked.sum_all().unwrap() / ((B * n.max_completion_length) as f64 * accum)).unwrap()
        }
        LossType::Dapo | LossType::Cispo => {
            let normalizer = (n.num_items_in_batch as f64).max(1.0) / n.num_processes as f64
                * accum
                / n.steps_per_generation as f64;
            (masked.sum_all().unwrap() / normalizer).unwrap()
        }
    };
    let grads = loss.backward().unwrap();
    let g = grads
        .get(lp)
        .map(|g| g.flatten_all().unwrap().to_vec1::<f64>().unwrap())
        .unwrap_or_else(|| vec![0.0; B * T]);
    (loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap(), g)
}

/// Every loss type, at both levels, on and off policy, with and without the KL (bias-corrected
/// or not) and δ: the loss within 1e-5 relative and each gradient entry within 1e-5 of the largest
/// (f32 sums of ~20 terms against f64: a few ulps).
#[test]
fn policy_loss_and_gradient_match_trl_formulation() {
    let types = [
        LossType::Grpo,
        LossType::Bnpo,
        LossType::DrGrpo,
        LossType::Dapo,
        LossType::Cispo,
        LossType::Sapo,
    ];
    let mut cases = 0;
    for (k, loss_type) in types.into_iter().enumerate() {
        for level in [Level::Token, Level::Sequence] {
            for (beta, bias) in [(0.0, true), (0.04, true), (0.04, false)] {
                for on_policy in [true, false] {
                    for delta in [None, Some(1.1)] {
                        let cfg = PolicyConfig {
                            loss_type,
                            level,
                            epsilon_low: 0.2,
                            epsilon_high: if loss_type == LossType::Cispo {
                                1.2
                            } else {
                                0.28
                            },
                            delta,
                            beta,
                            bias_correction_kl: bias,
                            ..PolicyConfig::default()
                        };
                        let d = data(k as u64 * 7 + cases % 5);
                        let rows = Rows {
                            t: T,
                            logp: &d.logp,
                            old: (!on_policy).then_some(&d.old[..]),
                            reference: (beta != 0.0).then_some(&d.reference[..]),
                            advantages: &d.adv,
                            mask: &d.mask,
                        };
                        let got = policy_loss(&cfg, rows, &norm());
                        let (want, grad) = reference(&cfg, &d, on_policy);
                        let what = format!("{cfg:?} on_policy {on_policy}");
                        let rel = (got.loss as f64 - want).abs() / want.abs().max(1e-6);
                        assert!(rel <= 1e-5, "{what}: loss {} vs {want}", got.loss);
                        let scale = grad.iter().fold(0f64, |m, g| m.max(g.abs()));
                        assert!(scale > 0.0, "{what}: no gradient");
                        for (i, (a, b)) in got.dlogp.iter().zip(&grad).enumerate() {
                            assert!(
                                (*a as f64 - b).abs() <= 1e-5 * scale,
                                "{what}: dlogp[{i}] {a} vs {b}"
                            );
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 6 * 2 * 3 * 2 * 2);
}

/// A ratio exactly on a clamp's bound: torch 2.15's scalar clamp passes no gradient there, and
/// torch.minimum splits the gradient evenly between its two equal terms. Torch's ∂loss/∂coef_1
/// (ε_low 0.2, ε_high 0.28, δ 1.1, each f32), worked with `-torch.min(c1·A, clamp(c1)·A)`:
/// ∓0.5 at each bound for A = ±1 (exact: halves of 1).
#[test]
fn a_ratio_on_a_clamp_bound_gets_torchs_gradient() {
    let cfg = |delta| PolicyConfig {
        loss_type: LossType::Dapo,
        epsilon_low: 0.2,
        epsilon_high: 0.28,
        delta,
        ..PolicyConfig::default()
    };
    let (lo, hi) = (1.0 - 0.2f32, 1.0 + 0.28f32);
    for (what, cfg, c1) in [
        ("1 + ε_high", cfg(None), hi),
        ("1 − ε_low", cfg(None), lo),
        ("δ", cfg(Some(1.1)), 1.1f32),
    ] {
        for a in [1.0f32, -1.0] {
            let (v, dv) = super::loss::ratio_term(&cfg, c1, a, 0.0);
            assert_eq!(v, -c1 * a, "{what}, A {a}: loss term");
            assert_eq!(dv, -0.5 * a, "{what}, A {a}: ∂/∂coef_1");
        }
    }
}

/// The clip indicators TRL logs, on ratios set by hand: token level counts masked tokens.
#[test]
fn clip_stats_count_as_trl_logs_them() {
    let cfg = PolicyConfig {
        loss_type: LossType::Grpo,
        ..PolicyConfig::default()
    };
    // Row 0 (A > 0): ratios 1.5 (high-clipped), 1.0, 0.5 (low, but A > 0: not counted), padding.
    // Row 1 (A < 0): ratios 0.5 (low-clipped), 1.5 (not counted), padding, padding.
    let old = [0.0f32; 8];
    let logp: Vec<f32> = [1.5f32, 1.0, 0.5, 1.0, 0.5, 1.5, 1.0, 1.0]
        .iter()
        .map(|r| r.ln())
        .collect();
    let mask = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0];
    let step = policy_loss(
        &cfg,
        Rows {
            t: 4,
            logp: &logp,
            old: Some(&old),
            reference: None,
            advantages: &[1.0, -1.0],
            mask: &mask,
        },
        &norm(),
    );
    let s = step.stats;
    assert_eq!(
        (s.low, s.high, s.region, s.count, s.tokens),
        (1.0, 1.0, 2.0, 5.0, 5.0)
    );
    assert_eq!(s.row_low, [0.0, 0.5]);
    assert_eq!(s.row_high, [1.0 / 3.0, 0.0]);
    assert_eq!(s.kl_sum, None);
}

#[test]
fn advantages_follow_trl() {
    let nan = f32::NAN;
    // One function; group 0: 1, 2, 3 and an unscorable completion; group 1: all equal.
    let rewards: Vec<Vec<f32>> = [1.0, 2.0, 3.0, nan, 5.0, 5.0, 5.0, 5.0]
        .iter()
        .map(|r| vec![*r])
        .collect();
    let a = advantages(
        &rewards,
        &[1.0],
        4,
        ScaleRewards::Group,
        Aggregation::SumThenNormalize,
    );
    // Group 0: mean 2, std 1 (Bessel over three values); the unscorable one gets 0.
    let s = 1.0 + 1e-4;
    assert_eq!(
        a.advantages,
        [-1.0 / s, 0.0, 1.0 / s, 0.0, 0.0, 0.0, 0.0, 0.0]
    );
    assert_eq!(
        a.std_zero,
        [false, false, false, false, true, true, true, true]
    );
    let a = advantages(
        &rewards,
        &[1.0],
        4,
        ScaleRewards::None,
        Aggregation::SumThenNormalize,
    );
    assert_eq!(a.advantages, [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    // Batch: the std over all seven scored rewards.
    let a = advantages(
        &rewards,
        &[1.0],
        4,
        ScaleRewards::Batch,
        Aggregation::SumThenNormalize,
    );
    let scored = [1.0f32, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0];
    let std = advantages::nanstd(&scored);
    // Σ(r − 26/7)² = 122/7 over 6: √(122/42).
    assert!((std - (122.0f32 / 42.0).sqrt()).abs() < 1e-6, "{std}");
    assert_eq!(a.advantages[0], -1.0 / (std + 1e-4));
    assert_eq!(a.advantages[4], 0.0);
    // A group with one scored completion: its std is NaN, so its advantage is 0.
    let lone: Vec<Vec<f32>> = [2.0, nan].iter().map(|r| vec![*r]).collect();
    let a = advantages(
        &lone,
        &[1.0],
        2,
        ScaleRewards::Group,
        Aggregation::SumThenNormalize,
    );
    assert_eq!(a.advantages, [0.0, 0.0]);
    assert_eq!(a.std_zero, [false, false]);
    // Two functions, weighted; a NaN from one adds nothing (nansum).
    let two = vec![vec![1.0, nan], vec![0.0, 2.0]];
    let a = advantages(
        &two,
        &[1.0, 0.5],
        2,
        ScaleRewards::None,
        Aggregation::SumThenNormalize,
    );
    assert_eq!(a.advantages, [0.0, 0.0]);
    // normalize_then_sum: per function within the group, then over the batch.
    let nts = vec![vec![0.0, 1.0], vec![1.0, 0.0]];
    let a = advantages(
        &nts,
        &[1.0, 1.0],
        2,
        ScaleRewards::Group,
        Aggregation::NormalizeThenSum,
    );
    // Each function's z-scores are ∓1/√2·… and cancel: every total is 0, and so the advantages.
    assert_eq!(a.advantages, [0.0, 0.0]);
}

/// The generation batch's training order (TRL's `shuffle_sequence_dict`): a permutation, the
/// same from the same RNG state, and uniform: 24 000 shuffles of 4 rows give each of the 24
/// orders 1000 times in expectation (σ ≈ 31); a biased shuffle (a swap with any row, not only
/// the rows before it: some orders 1.5× as often as others) falls outside 800..1200.
#[test]
fn the_training_order_is_a_seeded_uniform_permutation() {
    use super::rollout::{shuffled, Rng};
    let mut rng = Rng(7);
    let (mut r1, mut r2) = (rng, rng);
    let a = shuffled(16, &mut r1);
    assert_eq!(a, shuffled(16, &mut r2), "a function of the RNG state");
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..16).collect::<Vec<_>>());
    assert_ne!(a, sorted, "shuffled");
    assert!(shuffled(0, &mut rng).is_empty());
    assert_eq!(shuffled(1, &mut rng), vec![0]);
    let mut counts = std::collections::HashMap::new();
    for _ in 0..24_000 {
        *counts.entry(shuffled(4, &mut rng)).or_insert(0u32) += 1;
    }
    assert_eq!(counts.len(), 24);
    assert!(
        counts.values().all(|&n| (800..1200).contains(&n)),
        "{counts:?}"
    );
}
