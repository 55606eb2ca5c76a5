//! Advantages from a generation batch's rewards, as TRL 1.16's `_generate_and_score_completions`
//! forms them in f32: completions come in groups of `num_generations` (one prompt's), consecutive;
//! a completion no reward function scored is NaN, left out of every mean and std, and gets
//! advantage 0. TRL's `nanstd` applies Bessel's correction (NaN for fewer than two values) and
//! the scale divides by `std + 1e-4`.

pub use rtune_config::ScaleRewards;

/// TRL's `multi_objective_aggregation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aggregation {
    /// Weighted sum of the functions' rewards, then normalised (TRL's default).
    SumThenNormalize,
    /// Each function normalised within its group, then the weighted sum normalised over the batch.
    NormalizeThenSum,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Advantages {
    /// One per completion.
    pub advantages: Vec<f32>,
    /// Per completion, whether the std its advantage was scaled by is (close to) zero:
    /// `frac_reward_zero_std` is their mean.
    pub std_zero: Vec<bool>,
}

/// The advantages of `n` completions from `rewards[i][f]` (function `f`'s reward for completion
/// `i`, NaN where it gave none) and the functions' `weights`.
pub fn advantages(
    rewards: &[Vec<f32>],
    weights: &[f32],
    num_generations: usize,
    scale: ScaleRewards,
    aggregation: Aggregation,
) -> Advantages {
    let n = rewards.len();
    assert!(
        num_generations > 0 && n.is_multiple_of(num_generations),
        "grpo advantages: {n} completions are not whole groups of {num_generations}"
    );
    let unscorable: Vec<bool> = rewards
        .iter()
        .map(|r| r.iter().all(|v| v.is_nan()))
        .collect();
    let weighted = |per: &dyn Fn(usize, usize) -> f32| -> Vec<f32> {
        (0..n)
            .map(|i| {
                if unscorable[i] {
                    return f32::NAN;
                }
                // nansum: a NaN term adds nothing.
                (0..weights.len())
                    .map(|f| per(i, f) * weights[f])
                    .filter(|v| !v.is_nan())
                    .sum()
            })
            .collect()
    };
    let (adv, std): (Vec<f32>, Vec<f32>) = match aggregation {
        Aggregation::SumThenNormalize => {
            let total = weighted(&|i, f| rewards[i][f]);
            let groups: Vec<&[f32]> = total.chunks(num_generations).collect();
            let mean: Vec<f32> = groups.iter().map(|g| nanmean(g)).collect();
            let std: Vec<f32> = match scale {
                ScaleRewards::Group | ScaleRewards::None => (0..n)
                    .map(|i| {
                        if num_generations > 1 {
                            nanstd(groups[i / num_generations])
                        } else {
                            0.0
                        }
                    })
                    .collect(),
                ScaleRewards::Batch => {
                    let s = if n > 1 { nanstd(&total) } else { 0.0 };
                    vec![s; n]
                }
            };
            let adv = (0..n)
                .map(|i| {
                    let a = total[i] - mean[i / num_generations];
                    if scale == ScaleRewards::None {
                        a
                    } else {
                        a / (std[i] + 1e-4)
                    }
                })
                .collect();
            (adv, std)
        }
        Aggregation::NormalizeThenSum => {
            let funcs = weights.len();
            // Per function, per group: (mean, std).
            let stats: Vec<Vec<(f32, f32)>> = (0..funcs)
                .map(|f| {
                    let column: Vec<f32> = rewards.iter().map(|r| r[f]).collect();
                    column
                        .chunks(num_generations)
                        .map(|g| {
                            let s = if num_generations > 1 { nanstd(g) } else { 0.0 };
                            (nanmean(g), s)
                        })
                        .collect()
                })
                .collect();
            let total = weighted(&|i, f| {
                let (m, s) = stats[f][i / num_generations];
                (rewards[i][f] - m) / (s + 1e-4)
            });
            let s = if n > 1 { nanstd(&total) } else { 0.0 };
            let mean = nanmean(&total);
            let adv = total.iter().map(|r| (r - mean) / (s + 1e-4)).collect();
            (adv, vec![s; n])
        }
    };
    Advantages {
        // torch.nan_to_num(advantages, nan=0.0).
        advantages: adv
            .into_iter()
            .map(|a| if a.is_nan() { 0.0 } else { a })
            .collect(),
        // torch.isclose(std, 0): |std| ≤ 1e-8 (NaN is never close).
        std_zero: std.iter().map(|s| s.abs() <= 1e-8).collect(),
    }
}

/// torch.nanmean: the mean of the values that are not NaN (NaN when there are none).
pub fn nanmean(x: &[f32]) -> f32 {
    let (sum, count) = x
        .iter()
        .filter(|v| !v.is_nan())
        .fold((0f32, 0usize), |(s, c), v| (s + v, c + 1));
    if count == 0 {
        f32::NAN
    } else {
        sum / count as f32
    }
}

/// TRL's `nanstd`: the std of the values that are not NaN with Bessel's correction; NaN for fewer
/// than two.
pub fn nanstd(x: &[f32]) -> f32 {
    let mean = nanmean(x);
    let sq: Vec<f32> = x.iter().map(|v| (v - mean) * (v - mean)).collect();
    let var = nanmean(&sq);
    let count = x.iter().filter(|v| !v.is_nan()).count();
    if count > 1 {
        (var * (count as f32 / (count as f32 - 1.0))).sqrt()
    } else {
        f32::NAN
    }
}
