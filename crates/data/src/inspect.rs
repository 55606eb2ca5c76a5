//! `rtune data inspect`: the first formatted samples exactly as training sees them, with the
//! trained tokens told apart from the masked ones, and the length distribution of the whole set —
//! the check to make on a few examples before a long run (template, BOS/EOS, loss mask).
//! Loading the run's data as training does is `rtune_train::objective::load_for`; this file
//! only looks at examples already loaded.

use serde::Serialize;

use crate::{Example, Tokenizer, IGNORE};

/// A run of consecutive tokens that are all trained or all masked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Span {
    pub text: String,
    pub trained: bool,
    pub tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// The whole sample decoded, special tokens included.
    pub text: String,
    pub input_ids: Vec<u32>,
    /// `-100` where no loss is taken (aligned with `input_ids`, as transformers' `labels`).
    pub labels: Vec<i64>,
    #[serde(skip)]
    pub spans: Vec<Span>,
    #[serde(skip)]
    pub trained_tokens: usize,
}

/// Histogram of example lengths: `(lower, upper, count)` bins of equal width up to `max`.
pub fn histogram(lengths: &[usize], max: usize, bins: usize) -> Vec<(usize, usize, usize)> {
    let width = max.div_ceil(bins).max(1);
    let mut out: Vec<(usize, usize, usize)> = (0..bins)
        .map(|i| (i * width + 1, ((i + 1) * width).min(max), 0))
        .collect();
    for &l in lengths {
        let i = (l.saturating_sub(1) / width).min(bins - 1);
        out[i].2 += 1;
    }
    out
}

/// Whether token `i` of `e` carries a loss (the first token never does: nothing predicts it).
fn trained(e: &Example, i: usize) -> bool {
    i > 0 && e.labels[i] != IGNORE
}

/// `e` decoded with `tok` (token ids printed as a list without one), split where the mask changes.
pub fn sample(e: &Example, tok: Option<&Tokenizer>) -> crate::Result<Sample> {
    let decode = |ids: &[u32]| -> crate::Result<String> {
        Ok(match tok {
            Some(t) => t.decode(ids, false)?,
            None => format!("{ids:?}"),
        })
    };
    let mut spans: Vec<Span> = Vec::new();
    let mut start = 0;
    for i in 1..=e.input_ids.len() {
        if i == e.input_ids.len() || trained(e, i) != trained(e, start) {
            spans.push(Span {
                text: decode(&e.input_ids[start..i])?,
                trained: trained(e, start),
                tokens: i - start,
            });
            start = i;
        }
    }
    Ok(Sample {
        text: decode(&e.input_ids)?,
        input_ids: e.input_ids.clone(),
        labels: e.labels.clone(),
        trained_tokens: (0..e.input_ids.len()).filter(|&i| trained(e, i)).count(),
        spans,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_split_where_the_mask_changes() {
        let e = Example {
            input_ids: vec![1, 2, 3, 4, 5],
            labels: vec![IGNORE, IGNORE, 3, 4, IGNORE],
        };
        let s = sample(&e, None).unwrap();
        let got: Vec<(bool, usize)> = s.spans.iter().map(|s| (s.trained, s.tokens)).collect();
        assert_eq!(got, vec![(false, 2), (true, 2), (false, 1)]);
        assert_eq!(s.trained_tokens, 2);
        // The first token is never trained, whatever its label.
        let e = Example {
            input_ids: vec![1, 2],
            labels: vec![1, 2],
        };
        assert_eq!(sample(&e, None).unwrap().trained_tokens, 1);
    }

    #[test]
    fn histogram_bins_cover_every_length() {
        let h = histogram(&[1, 2, 50, 100, 100, 120], 100, 4);
        assert_eq!(h[0], (1, 25, 2));
        assert_eq!(h[1].2, 1);
        assert_eq!(h[3], (76, 100, 3), "over-long lengths land in the last bin");
        assert_eq!(h.iter().map(|b| b.2).sum::<usize>(), 6);
    }
}
