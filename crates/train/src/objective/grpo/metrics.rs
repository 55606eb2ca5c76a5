//! GRPO's metrics under TRL 1.16's names: those of the generation batch (`reward`,
//! `reward_std`, `rewards/<name>/mean|std`, `frac_reward_zero_std`, `completions/...`) and those
//! the policy loss adds up over the step's micro-batches (`kl`, `entropy`, `clip_ratio/...`,
//! `cispo_clip_ratio`), as TRL's `global_masked_mean` forms them: over every rank's tokens. TRL
//! logs the mean of each micro-batch's value; rtune the step's pooled one (the same at
//! `grad_accum = 1`, which the replay parity runs).

use std::collections::BTreeMap;

use super::advantages::{nanmean, nanstd};
use super::rollout::Row;
use super::{PolicyConfig, Stats};
use crate::objective::Sums;
use rtune_config::LossType;

/// What the step's micro-batches add up over the ranks: sums, except the last two, a min and a
/// max ([`Sums::MAX_TAIL`]: the min travels negated).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoSums {
    pub kl_sum: f64,
    /// Σ over masked completion tokens of the policy's entropy at temperature T.
    pub entropy_sum: f64,
    pub tokens: f64,
    pub low: f64,
    pub high: f64,
    pub region: f64,
    pub count: f64,
    pub low_min: f64,
    pub high_max: f64,
}

impl Default for GrpoSums {
    fn default() -> Self {
        GrpoSums {
            kl_sum: 0.0,
            entropy_sum: 0.0,
            tokens: 0.0,
            low: 0.0,
            high: 0.0,
            region: 0.0,
            count: 0.0,
            low_min: f64::INFINITY,
            high_max: f64::NEG_INFINITY,
        }
    }
}

impl Sums for GrpoSums {
    const MAX_TAIL: usize = 2;
    fn to_vec(&self) -> Vec<f64> {
        vec![
            self.kl_sum,
            self.entropy_sum,
            self.tokens,
            self.low,
            self.high,
            self.region,
            self.count,
            -self.low_min,
            self.high_max,
        ]
    }
    fn from_slice(v: &[f64]) -> Self {
        let at = |i: usize| v.get(i).copied().unwrap_or(f64::NAN);
        GrpoSums {
            kl_sum: at(0),
            entropy_sum: at(1),
            tokens: at(2),
            low: at(3),
            high: at(4),
            region: at(5),
            count: at(6),
            low_min: -at(7),
            high_max: at(8),
        }
    }
}

impl GrpoSums {
    /// Adds one micro-batch's [`Stats`].
    pub fn add(&mut self, s: &Stats) {
        self.kl_sum += f64::from(s.kl_sum.unwrap_or(0.0));
        self.tokens += f64::from(s.tokens);
        self.low += f64::from(s.low);
        self.high += f64::from(s.high);
        self.region += f64::from(s.region);
        self.count += f64::from(s.count);
        // nanmin / nanmax: an all-masked row's NaN ratio counts for nothing.
        for &l in s.row_low.iter().filter(|v| !v.is_nan()) {
            self.low_min = self.low_min.min(f64::from(l));
        }
        for &h in s.row_high.iter().filter(|v| !v.is_nan()) {
            self.high_max = self.high_max.max(f64::from(h));
        }
    }

    /// The loss's metrics under TRL's names.
    pub fn metrics(&self, p: &PolicyConfig) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        if p.beta != 0.0 {
            m.insert("kl".into(), self.kl_sum / self.tokens.max(1.0));
        }
        m.insert("entropy".into(), self.entropy_sum / self.tokens.max(1.0));
        let mean = |x: f64| x / self.count.max(1.0);
        if p.loss_type.is_clipped() {
            m.insert("clip_ratio/low_mean".into(), mean(self.low));
            m.insert("clip_ratio/high_mean".into(), mean(self.high));
            m.insert("clip_ratio/region_mean".into(), mean(self.region));
            if self.low_min.is_finite() {
                m.insert("clip_ratio/low_min".into(), self.low_min);
            }
            if self.high_max.is_finite() {
                m.insert("clip_ratio/high_max".into(), self.high_max);
            }
        } else if p.loss_type == LossType::Cispo {
            m.insert("cispo_clip_ratio".into(), mean(self.low));
        }
        m
    }
}

/// The generation batch's metrics (`rows` in generation order, groups of `group`).
pub fn generation(rows: &[Row], names: &[String], group: usize) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    if rows.is_empty() || group == 0 {
        return m;
    }
    let total: Vec<f32> = rows.iter().map(|r| r.reward.unwrap_or(f32::NAN)).collect();
    let groups: Vec<&[f32]> = total.chunks(group).collect();
    let means: Vec<f32> = groups.iter().map(|g| nanmean(g)).collect();
    let stds: Vec<f32> = groups.iter().map(|g| nanstd(g)).collect();
    let avg = |x: &[f32]| x.iter().map(|v| f64::from(*v)).sum::<f64>() / x.len() as f64;
    m.insert("reward".into(), avg(&means));
    m.insert("reward_std".into(), avg(&stds));
    let zero = rows.iter().filter(|r| r.std_zero).count();
    m.insert(
        "frac_reward_zero_std".into(),
        zero as f64 / rows.len() as f64,
    );
    for (f, name) in names.iter().enumerate() {
        let col: Vec<f32> = (rows.iter())
            .map(|r| {
                r.rewards
                    .get(f)
                    .copied()
                    .flatten()
                    .map_or(f32::NAN, |v| v as f32)
            })
            .collect();
        m.insert(format!("rewards/{name}/mean"), f64::from(nanmean(&col)));
        m.insert(format!("rewards/{name}/std"), f64::from(nanstd(&col)));
    }
    let lens: Vec<f64> = rows.iter().map(|r| r.completion.len() as f64).collect();
    let stats = |p: &str, x: &[f64], m: &mut BTreeMap<String, f64>| {
        let (mean, min, max) = match x.is_empty() {
            true => (0.0, 0.0, 0.0),
            false => (
                x.iter().sum::<f64>() / x.len() as f64,
                x.iter().copied().fold(f64::INFINITY, f64::min),
                x.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            ),
        };
        m.insert(format!("completions/mean_{p}length"), mean);
        m.insert(format!("completions/min_{p}length"), min);
        m.insert(format!("completions/max_{p}length"), max);
    };
    stats("", &lens, &mut m);
    let terminated: Vec<f64> = (rows.iter().zip(&lens))
        .filter(|(r, _)| !r.truncated)
        .map(|(_, l)| *l)
        .collect();
    stats("terminated_", &terminated, &mut m);
    let clipped = rows.iter().filter(|r| r.truncated).count();
    m.insert(
        "completions/clipped_ratio".into(),
        clipped as f64 / rows.len() as f64,
    );
    m
}
