//! Attention masks: causal, with a sliding window, and per packed segment ([`AttnMask`]: what the
//! materialized and the tiled paths read).

use candle_core::{Result, Tensor};

/// Which keys each query of a batch sees: one run `starts[r, i] ..= i` per query `i` of row `r`
/// (causal; Mistral's sliding window `i − j < w`; packed rows: the query's own sample only). The
/// tiled path reads `starts` alone; the plain path's dense additive mask is built from the same
/// description on first use ([`AttnMask::dense`]: exactly [`causal_mask`] / [`segment_mask`]).
#[derive(Debug, Clone)]
pub struct AttnMask {
    /// `(B or 1, T)` u32: the first key each query sees.
    pub starts: Tensor,
    segments: Option<std::sync::Arc<[u32]>>,
    b: usize,
    t: usize,
    window: Option<usize>,
    /// Keys before the queries ([`AttnMask::after`]): query `i` sits at key slot `past + i`.
    past: usize,
    /// [`AttnMask::after`]'s starts on the host, `(B, T)` row-major: its dense mask is built
    /// from them.
    after: Option<std::sync::Arc<[u32]>>,
    dense: std::sync::Arc<std::sync::OnceLock<Tensor>>,
}

impl AttnMask {
    /// The mask of a `(b, t)` batch: one sample a row (`segments: None`, `starts: (1, T)`) or
    /// packed rows (`segments[row·T + i]`, contiguous runs of equal ids, `starts: (B, T)`), with
    /// an optional sliding `window`.
    pub fn new(
        segments: Option<&[u32]>,
        b: usize,
        t: usize,
        window: Option<usize>,
        dev: &candle_core::Device,
    ) -> Result<AttnMask> {
        let w = window.unwrap_or(usize::MAX).max(1);
        let starts: Vec<u32> = match segments {
            None => (0..t).map(|i| i.saturating_sub(w - 1) as u32).collect(),
            Some(seg) => {
                if seg.len() != b * t {
                    candle_core::bail!(
                        "AttnMask: {} segment ids for a ({b}, {t}) batch",
                        seg.len()
                    );
                }
                let mut v = Vec::with_capacity(b * t);
                for row in seg.chunks(t.max(1)) {
                    let mut first = 0;
                    for i in 0..row.len() {
                        if i > 0 && row[i] != row[i - 1] {
                            first = i;
                        }
                        v.push(first.max(i.saturating_sub(w - 1)) as u32);
                    }
                }
                v
            }
        };
        let rows = if segments.is_some() { b } else { 1 };
        Ok(AttnMask {
            starts: Tensor::from_vec(starts, (rows, t), dev)?,
            segments: segments.map(std::sync::Arc::from),
            b,
            t,
            window,
            past: 0,
            after: None,
            dense: Default::default(),
        })
    }

    /// The mask of `t` new queries a row after `past` cached keys (decoding with a key/value
    /// cache): query `i` of row `r` is key slot `past + i` and sees the keys
    /// `max(first[r], past + i + 1 − window) ..= past + i`. Slots before `first[r]` are the row's
    /// left padding: no query of the row sees them, and a padding query (`past + i < first[r]`)
    /// sees itself only, so no softmax row is empty. `starts: (B, T)`; the dense mask
    /// `(B, 1, 1, T, past + T)`. With `past = 0` and every `first` 0 it is [`AttnMask::new`]'s
    /// causal (windowed) mask.
    pub fn after(
        past: usize,
        first: &[usize],
        t: usize,
        window: Option<usize>,
        dev: &candle_core::Device,
    ) -> Result<AttnMask> {
        let w = window.unwrap_or(usize::MAX).max(1);
        let starts: Vec<u32> = first
            .iter()
            .flat_map(|&f| {
                (past..past + t).map(move |q| f.max((q + 1).saturating_sub(w)).min(q) as u32)
            })
            .collect();
        let b = first.len();
        Ok(AttnMask {
            starts: Tensor::from_vec(starts.clone(), (b, t), dev)?,
            segments: None,
            b,
            t,
            window,
            past,
            after: Some(starts.into()),
            dense: Default::default(),
        })
    }

    /// The mask as one causal band for every row (cuDNN's diagonal band,
    /// [`crate::attention::cudnn::Band`]): one sample a row ([`AttnMask::new`] without
    /// segments), its window as given (`starts[i] = max(0, i + 1 − w)`); `None` for packed rows
    /// and for keys after a cache, whose runs differ by row.
    pub fn band(&self) -> Option<crate::attention::cudnn::Band> {
        (self.segments.is_none() && self.after.is_none()).then_some(crate::attention::cudnn::Band {
            window: self.window.map(|w| w.max(1)),
        })
    }

    /// Keys before the queries: 0 but for [`AttnMask::after`].
    pub fn past(&self) -> usize {
        self.past
    }

    /// The additive f32 mask of the plain path, `(B or 1, 1, 1, T, past + T)` (built once).
    pub fn dense(&self) -> Result<Tensor> {
        if let Some(m) = self.dense.get() {
            return Ok(m.clone());
        }
        let dev = self.starts.device();
        let m = match (&self.after, &self.segments) {
            (Some(starts), _) => starts_mask(starts, self.b, self.t, self.past, dev)?,
            (None, Some(seg)) => segment_mask(seg, self.b, self.t, self.window, dev)?,
            (None, None) => causal_mask(self.t, self.window, dev)?,
        };
        Ok(self.dense.get_or_init(|| m).clone())
    }
}

/// Additive causal mask `(1, 1, 1, T, T)`, f32: 0 where key `j ≤ i` (and `i − j < window`), −∞ elsewhere.
pub fn causal_mask(t: usize, window: Option<usize>, dev: &candle_core::Device) -> Result<Tensor> {
    causal_mask_from(t, 0, window, dev)
}

/// [`causal_mask`] for `n` queries at positions `start..start + n` over keys `0..start + n`:
/// `(1, 1, 1, n, start + n)` (decoding with a key/value cache).
pub fn causal_mask_from(
    n: usize,
    start: usize,
    window: Option<usize>,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    let w = window.unwrap_or(usize::MAX);
    let total = start + n;
    let m: Vec<f32> = (0..n)
        .flat_map(|i| {
            let q = start + i;
            (0..total).map(move |j| {
                if j <= q && q - j < w {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(m, (1, 1, 1, n, total), dev)
}

/// The additive mask `(B, 1, 1, T, past + T)`, f32, of query `i` of row `r` seeing the keys
/// `starts[r·T + i] ..= past + i` ([`AttnMask::after`]).
fn starts_mask(
    starts: &[u32],
    b: usize,
    t: usize,
    past: usize,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    let total = past + t;
    let mut m = vec![f32::NEG_INFINITY; b * t * total];
    for (k, (row, &s)) in m.chunks_mut(total).zip(starts).enumerate() {
        let q = past + k % t;
        row[s as usize..=q].fill(0.0);
    }
    Tensor::from_vec(m, (b, 1, 1, t, total), dev)
}

/// Block-diagonal causal mask of packed rows `(B, 1, 1, T, T)`, f32: key `j` is visible to query `i`
/// of the same row only when both belong to the same sample (`segments[row·T + i]`), `j ≤ i` and
/// `i − j < window`. Every query sees at least itself, so no softmax row is empty.
pub fn segment_mask(
    segments: &[u32],
    b: usize,
    t: usize,
    window: Option<usize>,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    if segments.len() != b * t {
        candle_core::bail!(
            "segment_mask: {} segment ids for a ({b}, {t}) batch",
            segments.len()
        );
    }
    let w = window.unwrap_or(usize::MAX);
    let mut m = vec![f32::NEG_INFINITY; b * t * t];
    for r in 0..b {
        let seg = &segments[r * t..(r + 1) * t];
        for i in 0..t {
            let row = &mut m[(r * t + i) * t..(r * t + i + 1) * t];
            // Segments are contiguous, so the visible keys of query i are one run ending at i.
            let mut j = i;
            loop {
                row[j] = 0.0;
                if j == 0 || seg[j - 1] != seg[i] || i - (j - 1) >= w {
                    break;
                }
                j -= 1;
            }
        }
    }
    Tensor::from_vec(m, (b, 1, 1, t, t), dev)
}
