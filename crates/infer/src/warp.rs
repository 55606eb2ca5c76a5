//! The next-token distribution as transformers 5.24's `generate` shapes it when sampling, for GRPO's
//! rollouts (issue 44) and `rtune generate`: the repetition penalty over every token the row holds
//! (prompt included), then temperature, top-k, top-p and min-p, in that order
//! (`GenerationMixin._get_logits_processor`), each removed token set to −∞ (`filter_value`). f32 as
//! torch computes them; ties at a cut are kept as torch keeps them (top-k keeps every token equal to
//! the k-th; top-p and min-p always keep the most likely token).

/// The sampling settings (transformers' `GenerationConfig` names; the defaults turn each off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Warpers {
    /// Logits divided by it (1: unchanged). Must be > 0: greedy decoding is `top_k = 1`.
    pub temperature: f32,
    /// Keep the `top_k` largest (0: off).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass passes `top_p` (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (None: off).
    pub min_p: Option<f32>,
    /// Divide a seen token's positive logit by it, multiply a negative one (1: off).
    pub repetition_penalty: f32,
}

impl Default for Warpers {
    fn default() -> Self {
        Warpers {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: None,
            repetition_penalty: 1.0,
        }
    }
}

impl Warpers {
    /// Shapes one row's logits in place; `seen` is every token of the row so far (prompt and
    /// completion), repeats allowed.
    pub fn apply(&self, logits: &mut [f32], seen: &[u32]) {
        if self.repetition_penalty != 1.0 {
            let mut done = vec![false; logits.len()];
            for &t in seen {
                // transformers clamps ids past the head's vocabulary to a padding column it drops.
                let Some(l) = logits.get_mut(t as usize) else {
                    continue;
                };
                if std::mem::replace(&mut done[t as usize], true) {
                    continue;
                }
                *l = if *l < 0.0 {
                    *l * self.repetition_penalty
                } else {
                    *l / self.repetition_penalty
                };
            }
        }
        if self.temperature != 1.0 {
            logits.iter_mut().for_each(|l| *l /= self.temperature);
        }
        if self.top_k != 0 {
            top_k(logits, self.top_k);
        }
        if self.top_p < 1.0 {
            top_p(logits, self.top_p);
        }
        if let Some(p) = self.min_p {
            min_p(logits, p);
        }
    }
}

/// `TopKLogitsWarper`: remove every logit below the k-th largest (ties with it stay).
fn top_k(logits: &mut [f32], k: usize) {
    let k = k.min(logits.len());
    let mut sorted = logits.to_vec();
    sorted.sort_unstable_by(|a, b| b.total_cmp(a));
    let kth = sorted[k - 1];
    logits
        .iter_mut()
        .filter(|l| **l < kth)
        .for_each(|l| *l = f32::NEG_INFINITY);
}

/// The softmax of `x` in f32 (max subtracted, as torch).
fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let e: Vec<f32> = x.iter().map(|v| (v - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

/// `TopPLogitsWarper`: sort ascending, remove the prefix whose cumulative probability is at most
/// `1 − p`; the most likely token always stays.
fn top_p(logits: &mut [f32], p: f32) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // torch.sort (ascending) is stable on CPU for these sizes; ties keep index order.
    order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
    let sorted: Vec<f32> = order.iter().map(|&i| logits[i]).collect();
    let probs = softmax(&sorted);
    let mut cum = 0f32;
    let last = order.len() - 1;
    for (rank, (&i, q)) in order.iter().zip(&probs).enumerate() {
        cum += q;
        if rank < last && cum <= 1.0 - p {
            logits[i] = f32::NEG_INFINITY;
        }
    }
}

/// `MinPLogitsWarper`: remove tokens whose probability is below `p` times the largest; the most
/// likely token always stays.
fn min_p(logits: &mut [f32], p: f32) {
    let probs = softmax(logits);
    let (top, top_prob) =
        probs
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bp), (i, &q)| {
                if q > bp {
                    (i, q)
                } else {
                    (bi, bp)
                }
            });
    let threshold = p * top_prob;
    for (i, q) in probs.iter().enumerate() {
        if *q < threshold && i != top {
            logits[i] = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    /// transformers' processors on seeded logits (`tests/parity/golden_warpers.safetensors`, made by
    /// `tests/parity/make_warpers_golden.py`): for each setting, the logits after processing.
    /// The kept token sets must be equal exactly; the kept logits within 1 ulp-ish (1e-6
    /// relative: transformers divides by the temperature in f32 as here, and the penalty too).
    #[test]
    fn warpers_keep_what_transformers_keeps() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/parity/golden_warpers.safetensors"
        );
        let bytes = std::fs::read(path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let f32s = |k: &str| -> Vec<f32> {
            st.tensor(k)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let i64s = |k: &str| -> Vec<u32> {
            st.tensor(k)
                .unwrap()
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect()
        };
        let shape = st.tensor("logits").unwrap().shape().to_vec();
        let (rows, vocab) = (shape[0], shape[1]);
        let logits = f32s("logits");
        let seen = i64s("seen");
        let seen_len = seen.len() / rows;
        let settings = f32s("settings");
        let cases = settings.len() / 5;
        let mut kept_total = 0;
        for c in 0..cases {
            let s = &settings[c * 5..c * 5 + 5];
            let w = Warpers {
                temperature: s[0],
                top_k: s[1] as usize,
                top_p: s[2],
                min_p: (s[3] > 0.0).then_some(s[3]),
                repetition_penalty: s[4],
            };
            let want = f32s(&format!("out.{c}"));
            for r in 0..rows {
                let mut row = logits[r * vocab..(r + 1) * vocab].to_vec();
                w.apply(&mut row, &seen[r * seen_len..(r + 1) * seen_len]);
                let want = &want[r * vocab..(r + 1) * vocab];
                for (v, (a, b)) in row.iter().zip(want).enumerate() {
                    let same_cut = a.is_finite() == b.is_finite();
                    assert!(same_cut, "case {c} {w:?} row {r} token {v}: {a} vs {b}");
                    if b.is_finite() {
                        kept_total += 1;
                        assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
                    }
                }
            }
        }
        assert!(kept_total > 0);
    }

    #[test]
    fn ties_at_the_cut_stay() {
        let mut l = vec![1.0, 3.0, 3.0, 2.0];
        top_k(&mut l, 2);
        assert_eq!(l, [f32::NEG_INFINITY, 3.0, 3.0, f32::NEG_INFINITY]);
        let mut l = vec![0.0, 10.0];
        top_p(&mut l, 0.01);
        assert_eq!(l, [f32::NEG_INFINITY, 10.0], "the top token stays");
        let mut l = vec![0.0, 0.0];
        min_p(&mut l, 1.0);
        assert_eq!(
            l,
            [0.0, 0.0],
            "equal probabilities are not below each other"
        );
    }
}
