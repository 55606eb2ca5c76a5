//! The preference objectives' arithmetic (DPO and its loss types, SimPO, ORPO; the formulas in
//! `rtune_config::objective`), as TRL 1.16 computes them, with their gradients by hand.
//!
//! Every objective is a function of each sequence's summed log-probability `π = Σ log p(target)`
//! over its completion (and its completion length, for the per-token averages), plus for SimPO
//! and ORPO the mean NLL of the chosen tokens. So the model's head hands over every position's
//! NLL ([`rtune_model::HeadLoss::PerToken`]), [`weigh`] forms the loss and `dloss/dnll` per
//! position (`−dloss/dπ` of the position's row, plus the NLL term's share), and the backward
//! runs once.
//!
//! A step's loss is the mean over its pairs (and the NLL term the mean over its chosen tokens),
//! whatever the micro-batches: each micro-batch is weighted by the step's totals ([`StepTotals`]),
//! as SFT weights by the step's target tokens, so accumulation equals one big batch.

use std::collections::BTreeMap;

use rtune_config::DpoLoss;
use rtune_data::PairBatch;

pub use super::kind::{Loss, PairLoss};

/// The whole step's counts that normalise each micro-batch's share.
#[derive(Debug, Clone, Copy)]
pub struct StepTotals {
    pub pairs: usize,
    /// Target tokens of the chosen rows (the NLL term's mean: completions; ORPO: prompts too).
    pub nll_tokens: usize,
}

/// What a micro-batch adds to the step's metrics (sums over its pairs; divided by the step's
/// pairs when reported).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PairSums {
    pub reward_chosen: f64,
    pub reward_rejected: f64,
    /// Pairs whose chosen reward is above the rejected one.
    pub correct: f64,
    pub logps_chosen: f64,
    pub logps_rejected: f64,
    /// The NLL term (SimPO, ORPO) before its weight: Σ chosen NLL / the step's chosen tokens.
    pub nll: f64,
    /// KTO: desirable and undesirable rows, and the sum of the micro-batches' KL estimates.
    pub desirable: f64,
    pub undesirable: f64,
    pub kl: f64,
    /// Micro-batches summed (KTO's `kl` is their mean).
    pub batches: f64,
}

impl PairSums {
    /// As numbers, for the ranks' all-reduce.
    pub fn to_array(&self) -> [f64; 10] {
        [
            self.reward_chosen,
            self.reward_rejected,
            self.correct,
            self.logps_chosen,
            self.logps_rejected,
            self.nll,
            self.desirable,
            self.undesirable,
            self.kl,
            self.batches,
        ]
    }

    pub fn from_array(a: [f64; 10]) -> Self {
        let [reward_chosen, reward_rejected, correct, logps_chosen, logps_rejected, nll, desirable, undesirable, kl, batches] =
            a;
        PairSums {
            reward_chosen,
            reward_rejected,
            correct,
            logps_chosen,
            logps_rejected,
            nll,
            desirable,
            undesirable,
            kl,
            batches,
        }
    }

    pub fn add(&mut self, o: &PairSums) {
        self.reward_chosen += o.reward_chosen;
        self.reward_rejected += o.reward_rejected;
        self.correct += o.correct;
        self.logps_chosen += o.logps_chosen;
        self.logps_rejected += o.logps_rejected;
        self.nll += o.nll;
        self.desirable += o.desirable;
        self.undesirable += o.undesirable;
        self.kl += o.kl;
        self.batches += o.batches;
    }
}

/// The loss of one pair and its derivatives: `(loss, dloss/dπc, dloss/dπr, reward c, reward r)`.
struct PairTerms {
    loss: f64,
    d_chosen: f64,
    d_rejected: f64,
    reward_chosen: f64,
    reward_rejected: f64,
}

fn log_sigmoid(x: f64) -> f64 {
    // log σ(x) = −log(1 + e^−x), stable on both sides.
    match x >= 0.0 {
        true => -(-x).exp().ln_1p(),
        false => x - x.exp().ln_1p(),
    }
}

fn sigmoid(x: f64) -> f64 {
    match x >= 0.0 {
        true => 1.0 / (1.0 + (-x).exp()),
        false => x.exp() / (1.0 + x.exp()),
    }
}

/// `−(1 − ls)·log σ(z) − ls·log σ(−z)` and its derivative in `z`.
fn smoothed_sigmoid_loss(z: f64, ls: f64) -> (f64, f64) {
    let loss = -(1.0 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z);
    let d = -(1.0 - ls) * sigmoid(-z) + ls * sigmoid(z);
    (loss, d)
}

/// `log(1 − e^x)` for `x < 0` (TRL's `log1mexp`), and its derivative `−e^x / (1 − e^x)`.
fn log1mexp(x: f64) -> (f64, f64) {
    let v = match x > -std::f64::consts::LN_2 {
        true => (-x.exp_m1()).ln(),
        false => (-x.exp()).ln_1p(),
    };
    (v, -1.0 / (-x).exp_m1())
}

/// One pair's terms. `lp`: the policy's summed log-probs `(chosen, rejected)`, `n`: completion
/// tokens, `reference`: the reference policy's summed log-probs (DPO).
fn pair_terms(
    obj: &PairLoss,
    lp: (f64, f64),
    n: (f64, f64),
    reference: Option<[f64; 2]>,
) -> PairTerms {
    let (pc, pr) = lp;
    match *obj {
        PairLoss::Dpo {
            beta,
            loss,
            label_smoothing: ls,
        } => {
            let [rc, rr] = reference.expect("DPO pairs carry their reference log-probs");
            let (lc, lr) = (pc - rc, pr - rr);
            let (loss, d_chosen, d_rejected) = match loss {
                DpoLoss::Sigmoid => {
                    let (l, d) = smoothed_sigmoid_loss(beta * (lc - lr), 0.0);
                    (l, beta * d, -beta * d)
                }
                DpoLoss::Robust => {
                    let z = beta * (lc - lr);
                    let l =
                        (-(1.0 - ls) * log_sigmoid(z) + ls * log_sigmoid(-z)) / (1.0 - 2.0 * ls);
                    let d = (-(1.0 - ls) * sigmoid(-z) - ls * sigmoid(z)) / (1.0 - 2.0 * ls);
                    (l, beta * d, -beta * d)
                }
                DpoLoss::Hinge => {
                    let m = 1.0 - beta * (lc - lr);
                    // torch's relu has gradient 0 at 0.
                    let d = if m > 0.0 { -beta } else { 0.0 };
                    (m.max(0.0), d, -d)
                }
                DpoLoss::Ipo => {
                    // Per-token averages of the log-ratios (TRL: completion tokens, at least 1).
                    let (nc, nr) = (n.0.max(1.0), n.1.max(1.0));
                    let e = lc / nc - lr / nr - 1.0 / (2.0 * beta);
                    (e * e, 2.0 * e / nc, -2.0 * e / nr)
                }
            };
            PairTerms {
                loss,
                d_chosen,
                d_rejected,
                reward_chosen: beta * lc,
                reward_rejected: beta * lr,
            }
        }
        PairLoss::Simpo {
            beta,
            gamma,
            label_smoothing,
            ..
        } => {
            // CPOTrainer: average log-probs, logits = π̄c − π̄r − γ/β, z = β·logits.
            let (ac, ar) = (pc / n.0, pr / n.1);
            let (loss, d) = smoothed_sigmoid_loss(beta * (ac - ar - gamma / beta), label_smoothing);
            PairTerms {
                loss,
                d_chosen: beta * d / n.0,
                d_rejected: -beta * d / n.1,
                reward_chosen: beta * ac,
                reward_rejected: beta * ar,
            }
        }
        PairLoss::Orpo { beta } => {
            // ORPOTrainer: loss = NLL − β·log σ(log_odds), log_odds = (π̄c − π̄r) −
            // (log(1 − e^π̄c) − log(1 − e^π̄r)).
            let (ac, ar) = (pc / n.0, pr / n.1);
            let ((mc, dmc), (mr, dmr)) = (log1mexp(ac), log1mexp(ar));
            let odds = (ac - ar) - (mc - mr);
            let d = -beta * sigmoid(-odds); // d(−β·log σ(odds))/d odds
            PairTerms {
                loss: -beta * log_sigmoid(odds),
                d_chosen: d * (1.0 - dmc) / n.0,
                d_rejected: d * (-1.0 + dmr) / n.1,
                reward_chosen: beta * ac,
                reward_rejected: beta * ar,
            }
        }
    }
}

/// The NLL term's weight: SimPO's `cpo_alpha`, ORPO's 1, none for DPO.
fn nll_weight(obj: &PairLoss) -> f64 {
    match *obj {
        PairLoss::Simpo { cpo_alpha, .. } => cpo_alpha,
        PairLoss::Orpo { .. } => 1.0,
        PairLoss::Dpo { .. } => 0.0,
    }
}

/// The micro-batch's share of the step's loss, `dloss/dnll` for every position, and its metric
/// sums. `nll`: every position's target NLL, as the model's head formed it.
pub fn weigh(
    loss: &Loss,
    batch: &PairBatch,
    nll: &[f32],
    totals: StepTotals,
) -> (f64, Vec<f32>, PairSums) {
    match *loss {
        Loss::Kto {
            beta,
            desirable_weight,
            undesirable_weight,
        } => weigh_kto(
            beta,
            (desirable_weight, undesirable_weight),
            batch,
            nll,
            totals,
        ),
        Loss::Pairs(ref obj) => weigh_pairs(obj, batch, nll, totals),
    }
}

/// [`weigh`] for a loss of pairs.
fn weigh_pairs(
    obj: &PairLoss,
    batch: &PairBatch,
    nll: &[f32],
    totals: StepTotals,
) -> (f64, Vec<f32>, PairSums) {
    let (b, t) = (batch.pairs(), batch.batch.t);
    let logps = batch.row_logps(nll);
    // Per-token averages divide by the completion's tokens: DPO's IPO as TRL's DPOTrainer (the
    // completion mask), SimPO and ORPO as CPO/ORPOTrainer's `get_batch_logps` (the tokens that
    // carry a log-prob: one fewer when the prompt is empty).
    let ntok = |row: usize| match obj {
        PairLoss::Dpo { .. } => batch.completion_tokens[row],
        _ => batch.completion[row * t..(row + 1) * t]
            .iter()
            .filter(|&&c| c)
            .count()
            .max(1),
    };
    let per_pair = 1.0 / totals.pairs.max(1) as f64;
    let per_token = 1.0 / totals.nll_tokens.max(1) as f64;
    let alpha = nll_weight(obj);
    let mut weights = vec![0f32; nll.len()];
    let (mut loss, mut sums) = (0.0, PairSums::default());
    for j in 0..b {
        let (c, r) = (j, b + j);
        let lp = (logps[c], logps[r]);
        let n = (ntok(c) as f64, ntok(r) as f64);
        let pt = pair_terms(obj, lp, n, batch.reference[j]);
        loss += pt.loss * per_pair;
        // π = −Σ nll over the row: dloss/dnll = −dloss/dπ on the row's target positions; the
        // NLL term adds α / (chosen tokens) on the chosen row's.
        // (row, weight of a completion target, weight of another target (ORPO's prompt)).
        let rows = [
            (
                c,
                -pt.d_chosen * per_pair + alpha * per_token,
                alpha * per_token,
            ),
            (r, -pt.d_rejected * per_pair, 0.0),
        ];
        let mut chosen_nll = 0.0;
        for (row, w, w_other) in rows {
            for k in row * t..(row + 1) * t {
                if batch.batch.targets[k].is_none() {
                    continue;
                }
                weights[k] = if batch.completion[k] { w } else { w_other } as f32;
                if row == c {
                    chosen_nll += nll[k] as f64 * per_token;
                }
            }
        }
        loss += alpha * chosen_nll;
        // TRL logs SimPO's and ORPO's per-token averages as their logps.
        let (lc, lr) = match obj {
            PairLoss::Dpo { .. } => lp,
            _ => (lp.0 / n.0, lp.1 / n.1),
        };
        sums.add(&PairSums {
            reward_chosen: pt.reward_chosen,
            reward_rejected: pt.reward_rejected,
            correct: f64::from(u8::from(pt.reward_chosen > pt.reward_rejected)),
            logps_chosen: lc,
            logps_rejected: lr,
            nll: chosen_nll,
            ..Default::default()
        });
    }
    (loss, weights, sums)
}

/// KTO (TRL's `KTOTrainer`, loss type `kto`): the batch's rows are the unpaired completions, then
/// their KL rows (each prompt with another row's completion). The KL estimate is the batch's mean
/// policy − reference log-ratio on the KL rows, clamped at 0 and a constant (TRL detaches it);
/// a desirable row's loss is `w_d·(1 − σ(β·(log-ratio − KL)))`, an undesirable one's
/// `w_u·(1 − σ(β·(KL − log-ratio)))`, the step's loss their mean over its rows.
fn weigh_kto(
    beta: f64,
    (w_d, w_u): (f64, f64),
    batch: &PairBatch,
    nll: &[f32],
    totals: StepTotals,
) -> (f64, Vec<f32>, PairSums) {
    let (b, t) = (batch.pairs(), batch.batch.t);
    let logps = batch.row_logps(nll);
    let reference =
        |j: usize| batch.reference[j].expect("KTO rows carry their reference log-probs");
    let kl =
        ((0..b).map(|j| logps[b + j] - reference(j)[1]).sum::<f64>() / b.max(1) as f64).max(0.0);
    let per_row = 1.0 / totals.pairs.max(1) as f64;
    let mut weights = vec![0f32; nll.len()];
    let (mut loss, mut sums) = (0.0, PairSums::default());
    sums.kl = kl;
    sums.batches = 1.0;
    for (j, &logp) in logps[..b].iter().enumerate() {
        let ratio = logp - reference(j)[0];
        let desirable = batch.labels[j].expect("KTO rows carry their label");
        // 1 − σ(z) with z = ±β(ratio − KL); d/dratio = ∓β·σ(z)·σ(−z).
        let (w, sign) = if desirable { (w_d, 1.0) } else { (w_u, -1.0) };
        let z = sign * beta * (ratio - kl);
        loss += w * (1.0 - sigmoid(z)) * per_row;
        let d_ratio = -w * sign * beta * sigmoid(z) * sigmoid(-z) * per_row;
        let row = j * t..(j + 1) * t;
        for (w, _) in weights[row.clone()]
            .iter_mut()
            .zip(&batch.completion[row])
            .filter(|(_, &c)| c)
        {
            *w = -d_ratio as f32; // π = −Σ nll
        }
        let reward = beta * ratio;
        let s = match desirable {
            true => PairSums {
                reward_chosen: reward,
                logps_chosen: logp,
                desirable: 1.0,
                ..Default::default()
            },
            false => PairSums {
                reward_rejected: reward,
                logps_rejected: logp,
                undesirable: 1.0,
                ..Default::default()
            },
        };
        sums.add(&s);
    }
    (loss, weights, sums)
}

/// A preference step's (or evaluation's) metrics under TRL's names, each key after `prefix`
/// (`""` for a step, `"eval_"` for an evaluation, as TRL logs them): `rewards/chosen`,
/// `rewards/rejected` (β·log-ratio to the reference; β·average log-prob for SimPO and ORPO),
/// `rewards/accuracies` (pairs whose chosen reward is higher), `rewards/margins`,
/// `logps/chosen`, `logps/rejected` (summed over the completion), and `nll_loss` (SimPO, ORPO),
/// each a mean over the `pairs`.
pub fn metrics(s: &PairSums, pairs: usize, obj: Loss, prefix: &str) -> BTreeMap<String, f64> {
    let n = pairs.max(1) as f64;
    let mut m = BTreeMap::new();
    let mut put = |k: &str, v: f64| m.insert(format!("{prefix}{k}"), v);
    if let Loss::Kto { .. } = obj {
        // TRL's KTO: rewards and logps averaged over the desirable and the undesirable rows
        // apart, the margin when both exist, the micro-batches' mean KL.
        let (d, u) = (s.desirable, s.undesirable);
        if d > 0.0 {
            put("rewards/chosen", s.reward_chosen / d);
            put("logps/chosen", s.logps_chosen / d);
        }
        if u > 0.0 {
            put("rewards/rejected", s.reward_rejected / u);
            put("logps/rejected", s.logps_rejected / u);
        }
        if d > 0.0 && u > 0.0 {
            put(
                "rewards/margins",
                s.reward_chosen / d - s.reward_rejected / u,
            );
        }
        put("kl", s.kl / s.batches.max(1.0));
        return m;
    }
    put("rewards/chosen", s.reward_chosen / n);
    put("rewards/rejected", s.reward_rejected / n);
    put("rewards/accuracies", s.correct / n);
    put("rewards/margins", (s.reward_chosen - s.reward_rejected) / n);
    put("logps/chosen", s.logps_chosen / n);
    put("logps/rejected", s.logps_rejected / n);
    if matches!(
        obj,
        Loss::Pairs(PairLoss::Simpo { .. } | PairLoss::Orpo { .. })
    ) {
        put("nll_loss", s.nll);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtune_data::Pair;

    fn batch() -> PairBatch {
        let p = |p: &[u32], c: &[u32], r: &[u32], reference| Pair {
            prompt: p.to_vec(),
            chosen: c.to_vec(),
            rejected: r.to_vec(),
            reference,
            reference_long: None,
            label: None,
        };
        let a = p(&[1, 2], &[3, 4, 5], &[6], Some([-4.0, -1.5]));
        let b = p(&[7], &[8], &[9, 10], Some([-2.0, -3.0]));
        PairBatch::new(&[&a, &b], 0, false)
    }

    /// Every objective's hand-written gradient against a central difference of its loss in
    /// each position's NLL (f64 arithmetic, f32 weights: 1e-4 relative).
    #[test]
    fn weights_are_the_loss_gradient() {
        let pb = batch();
        let nll: Vec<f32> = (0..pb.batch.targets.len())
            .map(|i| match pb.batch.targets[i] {
                Some(_) => 0.3 + 0.17 * (i % 5) as f32,
                None => 0.0,
            })
            .collect();
        let totals = StepTotals {
            pairs: 3,
            nll_tokens: 7,
        };
        let objectives = [
            PairLoss::Dpo {
                beta: 0.3,
                loss: DpoLoss::Sigmoid,
                label_smoothing: 0.0,
            },
            PairLoss::Dpo {
                beta: 0.3,
                loss: DpoLoss::Robust,
                label_smoothing: 0.2,
            },
            PairLoss::Dpo {
                beta: 0.3,
                loss: DpoLoss::Hinge,
                label_smoothing: 0.0,
            },
            PairLoss::Dpo {
                beta: 0.3,
                loss: DpoLoss::Ipo,
                label_smoothing: 0.0,
            },
            PairLoss::Simpo {
                beta: 2.0,
                gamma: 0.5,
                cpo_alpha: 0.7,
                label_smoothing: 0.05,
            },
            PairLoss::Orpo { beta: 0.25 },
        ];
        for obj in &objectives.map(Loss::Pairs) {
            let (_, w, _) = weigh(obj, &pb, &nll, totals);
            let mut checked = 0;
            for i in 0..nll.len() {
                if pb.batch.targets[i].is_none() {
                    assert_eq!(w[i], 0.0);
                    continue;
                }
                let h = 1e-3f32;
                let at = |d: f32| {
                    let mut x = nll.clone();
                    x[i] += d;
                    weigh(obj, &pb, &x, totals).0
                };
                let want = (at(h) - at(-h)) / (2.0 * h as f64);
                let err = (w[i] as f64 - want).abs() / want.abs().max(1e-3);
                assert!(err < 1e-3, "{obj:?} position {i}: {} vs {want}", w[i]);
                checked += 1;
            }
            assert_eq!(checked, 3 + 1 + 1 + 2, "every completion token weighed");
        }
    }

    /// DPO's sigmoid loss by its definition on one pair: −log σ(β·((πc − rc) − (πr − rr))).
    #[test]
    fn dpo_sigmoid_loss_is_its_formula() {
        let pb = batch();
        let nll = vec![0.5f32; pb.batch.targets.len()];
        let obj = Loss::Pairs(PairLoss::Dpo {
            beta: 0.1,
            loss: DpoLoss::Sigmoid,
            label_smoothing: 0.0,
        });
        let totals = StepTotals {
            pairs: 2,
            nll_tokens: 4,
        };
        let (loss, _, sums) = weigh(&obj, &pb, &nll, totals);
        let pair = |pc: f64, pr: f64, rc: f64, rr: f64| {
            let z: f64 = 0.1 * ((pc - rc) - (pr - rr));
            (1.0 + (-z).exp()).ln()
        };
        let want = (pair(-1.5, -0.5, -4.0, -1.5) + pair(-0.5, -1.0, -2.0, -3.0)) / 2.0;
        assert!((loss - want).abs() < 1e-12, "{loss} vs {want}");
        assert_eq!(sums.correct, 1.0); // pair 1: 0.25 vs 0.1; pair 2: 0.15 vs 0.2
    }

    /// KTO's hand-written gradient against a central difference on the completion rows (the KL
    /// rows carry none: TRL detaches the estimate), desirable and undesirable rows both, with the
    /// KL estimate above 0.
    #[test]
    fn kto_weights_are_the_loss_gradient() {
        let p = |c: &[u32], kl: &[u32], label, reference| Pair {
            prompt: vec![1, 2],
            chosen: c.to_vec(),
            rejected: kl.to_vec(),
            reference: Some(reference),
            reference_long: None,
            label: Some(label),
        };
        let rows = [
            p(&[3, 4], &[5], true, [-1.0, -2.5]),
            p(&[5], &[3, 4], false, [-0.2, -0.9]),
        ];
        let pb = PairBatch::new(&[&rows[0], &rows[1]], 0, false);
        let nll: Vec<f32> = (0..pb.batch.targets.len())
            .map(|i| 0.2 + 0.05 * (i % 7) as f32)
            .collect();
        let totals = StepTotals {
            pairs: 2,
            nll_tokens: 0,
        };
        let obj = Loss::Kto {
            beta: 0.7,
            desirable_weight: 1.3,
            undesirable_weight: 0.6,
        };
        let (_, w, sums) = weigh(&obj, &pb, &nll, totals);
        assert!(sums.kl > 0.0, "the test exercises a positive KL: {sums:?}");
        let t = pb.batch.t;
        for i in 0..nll.len() {
            if i >= 2 * t || pb.batch.targets[i].is_none() {
                assert_eq!(
                    w[i], 0.0,
                    "position {i}: KL rows and padding carry no gradient"
                );
                continue;
            }
            let at = |d: f32| {
                let mut x = nll.clone();
                x[i] += d;
                weigh(&obj, &pb, &x, totals).0
            };
            let want = (at(1e-3) - at(-1e-3)) / 2e-3;
            assert!(
                (w[i] as f64 - want).abs() <= 1e-4 * want.abs().max(1e-2),
                "{i}: {} vs {want}",
                w[i]
            );
        }
    }
}
