//! GRPO's policy loss on per-token log-probabilities, forward and hand-written backward, as TRL
//! 1.16's `GRPOTrainer._compute_loss` forms it (f32, as torch computes it on the CPU):
//!
//! - the importance ratio `coef_1 = exp(logp − old)` per token, or per sequence (GSPO:
//!   `exp(Σ_t (logp − old)·m / max(Σ_t m, 1))`, broadcast over the row's tokens);
//! - the per-token loss by `loss_type`: `grpo`/`bnpo`/`dr_grpo`/`dapo`:
//!   `−min(min(coef_1, δ)·A, clamp(coef_1, 1 − ε_low, 1 + ε_high)·A)` (δ only when set);
//!   `cispo`: `−min(coef_1, ε_high)·A·logp` with the clamped ratio held constant; `sapo`:
//!   `−σ(τ(coef_1 − 1))·4/τ·A`, τ by the sign of A;
//! - plus `β·KL` when β > 0, `KL = e^(ref − logp) − (ref − logp) − 1` per token (times `coef_1`
//!   with `use_bias_correction_kl`, TRL's default);
//! - summed over the completion mask and normalised by `loss_type` ([`Normalizer`]).
//!
//! The gradient with respect to `logp` is what the head's backward takes (its chain to the logits
//! is the cross-entropy's). `old` is a constant (`None`: the on-policy case, `old = logp` held
//! constant, so every ratio is exactly 1 and only its gradient moves); so is `ref`.

use super::{Level, LossType, PolicyConfig};

/// Everything the loss reads for one micro-batch of `b` completions padded to `t` tokens (`b × t`
/// row-major, except `advantages`: one per completion).
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub t: usize,
    /// `log p(token)` under the policy being trained.
    pub logp: &'a [f32],
    /// Under the policy that sampled the completions (`num_iterations > 1`), or `None`.
    pub old: Option<&'a [f32]>,
    /// Under the reference model (`beta > 0`).
    pub reference: Option<&'a [f32]>,
    pub advantages: &'a [f32],
    /// 1 on completion tokens that count, 0 on padding (and after EOS; and on truncated
    /// completions' tokens with `mask_truncated_completions`).
    pub mask: &'a [f32],
}

/// What the sum over tokens is divided by, by `loss_type` (TRL's names).
#[derive(Debug, Clone, Copy)]
pub struct Normalizer {
    /// Micro-batches accumulated into one optimizer step.
    pub grad_accum: usize,
    /// `dr_grpo`: its constant denominator is `b · max_completion_length`.
    pub max_completion_length: usize,
    /// `dapo` / `cispo`: completion tokens in the whole generation batch, over every process.
    pub num_items_in_batch: f32,
    pub num_processes: usize,
    pub steps_per_generation: usize,
}

/// The loss of one micro-batch, its gradient, and what TRL logs from it.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The micro-batch's loss, already divided for accumulation (what its backward starts from).
    pub loss: f32,
    /// `∂loss/∂logp`, `b × t` (0 where the mask is 0).
    pub dlogp: Vec<f32>,
    /// Sums and counts over masked tokens (or over sequences at `Level::Sequence`) for TRL's
    /// `global_masked_mean`: `kl` (β > 0), `clip_ratio/{low,high,region}_mean` (clipped loss
    /// types), `cispo_clip_ratio`.
    pub stats: Stats,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Σ KL over masked tokens, when β > 0.
    pub kl_sum: Option<f32>,
    /// Masked tokens (the denominator of `kl` and of token-level clip ratios).
    pub tokens: f32,
    /// Σ of each clip indicator over masked tokens (token level) or sequences (sequence level);
    /// `cispo`: `low` holds its `cispo_clip_ratio`, the others stay 0.
    pub low: f32,
    pub high: f32,
    pub region: f32,
    /// The clip indicators' denominator: `tokens`, or the number of sequences.
    pub count: f32,
    /// Per completion, the masked mean of the low and high clip indicators (TRL gathers these for
    /// `clip_ratio/low_min` and `clip_ratio/high_max`).
    pub row_low: Vec<f32>,
    pub row_high: Vec<f32>,
}

/// The loss and its gradient with respect to `rows.logp`.
pub fn policy_loss(cfg: &PolicyConfig, rows: Rows, norm: &Normalizer) -> Step {
    let t = rows.t;
    let b = rows.advantages.len();
    assert_eq!(rows.logp.len(), b * t, "grpo loss: logp is not b × t");
    assert_eq!(rows.mask.len(), b * t, "grpo loss: mask is not b × t");
    if cfg.beta != 0.0 {
        assert!(
            rows.reference.is_some(),
            "grpo loss: β > 0 needs reference log-probs"
        );
    }
    let old = |i: usize| rows.old.map_or(rows.logp[i], |o| o[i]);
    // Each token's weight in the sum (its mask included): how `loss_type` normalises.
    let w: Vec<f32> = token_weights(cfg.loss_type, rows.mask, t, norm)
        .iter()
        .zip(rows.mask)
        .map(|(w, m)| w * m)
        .collect();
    let mut stats = Stats {
        kl_sum: (cfg.beta != 0.0).then_some(0.0),
        row_low: vec![0.0; b],
        row_high: vec![0.0; b],
        ..Stats::default()
    };
    let mut loss = 0f32;
    let mut dlogp = vec![0f32; b * t];
    for r in 0..b {
        let a = rows.advantages[r];
        let row = r * t..(r + 1) * t;
        let m_sum: f32 = rows.mask[row.clone()].iter().sum();
        let m_clamp = m_sum.max(1.0);
        // Sequence level (GSPO): one ratio for the row, a function of every logp in it:
        // ∂coef_1/∂logp_s = coef_1 · m_s / max(Σm, 1).
        let seq = (cfg.level == Level::Sequence).then(|| {
            let s: f32 = row
                .clone()
                .map(|i| (rows.logp[i] - old(i)) * rows.mask[i])
                .sum();
            (s / m_clamp).exp()
        });
        // Σ_t w_t · ∂l_t/∂coef_1 over the row (sequence level): spread over its logps below.
        let mut row_dcoef = 0f32;
        let (mut low, mut high, mut region) = (0f32, 0f32, 0f32);
        for i in row.clone() {
            let m = rows.mask[i];
            let c1 = seq.unwrap_or_else(|| (rows.logp[i] - old(i)).exp());
            let (mut v, dv) = ratio_term(cfg, c1, a, rows.logp[i]);
            // ∂v/∂logp_i directly: through the token's own ratio (token level), or through logp
            // itself (cispo, the ratio held constant); at sequence level through coef_1, pooled.
            let mut d = match (cfg.loss_type, seq) {
                (LossType::Cispo, _) => dv,
                (_, None) => dv * c1,
                (_, Some(_)) => {
                    row_dcoef += w[i] * dv;
                    0.0
                }
            };
            if cfg.beta != 0.0 {
                let x = rows.reference.expect("checked above")[i] - rows.logp[i];
                let e = x.exp();
                let kl = e - x - 1.0;
                // ∂KL/∂logp = 1 − e^(ref − logp).
                let dkl = 1.0 - e;
                if cfg.bias_correction_kl {
                    // KL · coef_1: the ratio's own derivative too.
                    v += cfg.beta * kl * c1;
                    d += cfg.beta * dkl * c1;
                    match seq {
                        None => d += cfg.beta * kl * c1,
                        Some(_) => row_dcoef += w[i] * cfg.beta * kl,
                    }
                    *stats.kl_sum.as_mut().expect("β > 0") += kl * c1 * m;
                } else {
                    v += cfg.beta * kl;
                    d += cfg.beta * dkl;
                    *stats.kl_sum.as_mut().expect("β > 0") += kl * m;
                }
            }
            loss += w[i] * v;
            dlogp[i] = w[i] * d;
            let (lo, hi) = clipped(cfg, c1, a);
            low += lo * m;
            high += hi * m;
            region += f32::from(u8::from(lo + hi > 0.0)) * m;
        }
        if let Some(c1) = seq {
            for i in row {
                dlogp[i] += row_dcoef * c1 * rows.mask[i] / m_clamp;
            }
            // One indicator per sequence (TRL's (B, 1) ratios).
            let (lo, hi) = clipped(cfg, c1, a);
            stats.low += lo;
            stats.high += hi;
            stats.region += f32::from(u8::from(lo + hi > 0.0));
            stats.count += 1.0;
            stats.row_low[r] = lo;
            stats.row_high[r] = hi;
        } else {
            stats.low += low;
            stats.high += high;
            stats.region += region;
            stats.count += m_sum;
            // TRL's masked_seq_mean divides by Σm unclamped (NaN for an all-masked row).
            stats.row_low[r] = low / m_sum;
            stats.row_high[r] = high / m_sum;
        }
        stats.tokens += m_sum;
    }
    Step { loss, dlogp, stats }
}

/// TRL's clip indicators at ratio `c1`, advantage `a`: (low, high) for the clipped loss types;
/// `cispo`'s one indicator as low; none for `sapo`.
fn clipped(cfg: &PolicyConfig, c1: f32, a: f32) -> (f32, f32) {
    let one = |b: bool| f32::from(u8::from(b));
    match cfg.loss_type {
        LossType::Cispo => (one(c1 > cfg.epsilon_high && a > 0.0), 0.0),
        LossType::Sapo => (0.0, 0.0),
        _ => (
            one(c1 < 1.0 - cfg.epsilon_low && a < 0.0),
            one(c1 > 1.0 + cfg.epsilon_high && a > 0.0),
        ),
    }
}

/// The ratio part of the per-token loss at ratio `c1` and advantage `a`: its value and its
/// derivative with respect to `c1` (for `cispo`: with respect to `logp`, the ratio held).
pub(super) fn ratio_term(cfg: &PolicyConfig, c1: f32, a: f32, logp: f32) -> (f32, f32) {
    match cfg.loss_type {
        LossType::Cispo => {
            let cl = c1.min(cfg.epsilon_high);
            (-cl * a * logp, -cl * a)
        }
        LossType::Sapo => {
            let tau = if a > 0.0 {
                cfg.sapo_temperature_pos
            } else {
                cfg.sapo_temperature_neg
            };
            let s = 1.0 / (1.0 + (-(tau * (c1 - 1.0))).exp());
            // d/dc1 [σ(τ(c1 − 1))·4/τ] = 4·σ(1 − σ).
            (-s * 4.0 / tau * a, -4.0 * s * (1.0 - s) * a)
        }
        _ => {
            // term1 = min(c1, δ)·A (δ when set), term2 = clamp(c1, 1 − ε_low, 1 + ε_high)·A;
            // loss = −min(term1, term2). torch 2.15's clamp by a scalar passes the gradient
            // only strictly inside its bounds (none at a bound itself); torch.minimum splits
            // it evenly on a tie.
            let (c1d, d1) = match cfg.delta {
                Some(delta) if c1 >= delta => (delta, 0.0),
                _ => (c1, 1.0),
            };
            let (lo, hi) = (1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high);
            let c2 = c1.clamp(lo, hi);
            let d2 = if lo < c1 && c1 < hi { 1.0 } else { 0.0 };
            let (t1, t2) = (c1d * a, c2 * a);
            let dmin = if t1 < t2 {
                d1 * a
            } else if t2 < t1 {
                d2 * a
            } else {
                0.5 * (d1 + d2) * a
            };
            (-t1.min(t2), -dmin)
        }
    }
}

/// Each token's weight in the loss (before its mask): how `loss_type` normalises.
fn token_weights(loss_type: LossType, mask: &[f32], t: usize, n: &Normalizer) -> Vec<f32> {
    let b = mask.len() / t;
    let accum = n.grad_accum as f32;
    let total: f32 = mask.iter().sum();
    match loss_type {
        // mean over rows of each row's masked mean.
        LossType::Grpo | LossType::Sapo => mask
            .chunks(t)
            .flat_map(|row| {
                let s = row.iter().sum::<f32>().max(1.0);
                std::iter::repeat_n(1.0 / s / b as f32 / accum, t)
            })
            .collect(),
        LossType::Bnpo => vec![1.0 / total.max(1.0) / accum; mask.len()],
        LossType::DrGrpo => vec![1.0 / (b * n.max_completion_length) as f32 / accum; mask.len()],
        LossType::Dapo | LossType::Cispo => {
            let normalizer = n.num_items_in_batch.max(1.0) / n.num_processes as f32 * accum
                / n.steps_per_generation as f32;
            vec![1.0 / normalizer; mask.len()]
        }
    }
}
