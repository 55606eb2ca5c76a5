//! How a train file's rows are split and repeated, for SFT examples and preference pairs alike:
//! the seeded per-file hold-out (`[data] valid_fraction`) and the file's weight (whole copies plus
//! a seeded sample of the fraction).

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The seed of train file `i`'s hold-out and weighting.
pub fn file_seed(seed: u64, i: usize) -> u64 {
    seed ^ (i as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407)
}

/// A seeded hold-out of `fraction` of `rows` (`(train, valid)`); at least one row stays for
/// training. Both parts keep file order (inspect shows the first rows as written).
pub fn hold_out<T>(rows: Vec<T>, fraction: f64, seed: u64) -> (Vec<T>, Vec<T>) {
    if fraction <= 0.0 || rows.is_empty() {
        return (rows, Vec::new());
    }
    let n_valid = ((rows.len() as f64 * fraction).round() as usize).min(rows.len() - 1);
    let mut idx: Vec<usize> = (0..rows.len()).collect();
    idx.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let mut held = vec![false; rows.len()];
    idx[..n_valid].iter().for_each(|&k| held[k] = true);
    let (v, t): (Vec<_>, Vec<_>) = rows.into_iter().zip(held).partition(|(_, h)| *h);
    (
        t.into_iter().map(|(r, _)| r).collect(),
        v.into_iter().map(|(r, _)| r).collect(),
    )
}

/// The most rows a run's weights may give an epoch: 16 times the rows of its files, or 2^20,
/// whichever is more. A weight repeats rows in memory (each copy is a row of its own, and a
/// preference run computes each copy's reference log-probabilities), so `weight = 1e7` on a
/// small file copied rows until the allocator aborted (issue 46). Weights are relative: a file
/// meant to be 10× as frequent as another needs weight 10 on it, not 10⁷; an epoch that large
/// is never what a run reaches anyway.
pub const WEIGHT_ROOM: usize = 16;
pub const WEIGHT_FLOOR: usize = 1 << 20;

/// Refuses weights that would repeat rows past the bound above, before any row is copied:
/// `files` holds each train file's path, its rows (after the hold-out) and its weight. The error
/// names the file and the key, with the figures.
pub fn check_weights(
    files: &[(&std::path::Path, usize, f64)],
) -> Result<(), rtune_data::DataError> {
    let rows: usize = files.iter().map(|f| f.1).sum();
    let cap = rows.saturating_mul(WEIGHT_ROOM).max(WEIGHT_FLOOR);
    // In f64: rows × weight may pass usize::MAX.
    let epoch: f64 = files.iter().map(|&(_, n, w)| n as f64 * w).sum();
    if epoch <= cap as f64 {
        return Ok(());
    }
    let &(path, n, weight) = files
        .iter()
        .max_by(|a, b| (a.1 as f64 * a.2).total_cmp(&(b.1 as f64 * b.2)))
        .expect("an epoch over the cap has a file");
    Err(rtune_data::DataError::File {
        path: path.to_path_buf(),
        message: format!(
            "[data] train weight {weight} repeats its {n} rows to {:.0} in memory, an epoch of \
             {epoch:.0} rows, over the {cap} allowed ({WEIGHT_ROOM} × the files' {rows} rows, at \
             least {WEIGHT_FLOOR}); weights are relative: scale them down together",
            n as f64 * weight
        ),
    })
}

/// `examples` repeated `weight` times: whole copies, plus a seeded sample for the fraction.
pub fn weighted<T: Clone>(examples: Vec<T>, weight: f64, seed: u64) -> Vec<T> {
    let whole = weight.floor() as usize;
    let frac = weight - whole as f64;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // The sampled fraction is cloned; the last whole copy takes the examples themselves.
    let sampled: Vec<T> = if frac > 0.0 {
        examples
            .iter()
            .filter(|_| rng.random::<f64>() < frac)
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    let mut out = Vec::with_capacity(examples.len() * whole + sampled.len());
    for _ in 1..whole {
        out.extend(examples.iter().cloned());
    }
    if whole > 0 {
        out.extend(examples);
    }
    out.extend(sampled);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtune_data::Example;

    fn ex(i: u32) -> Example {
        Example {
            input_ids: vec![1, i],
            labels: vec![1, i as i64],
        }
    }

    #[test]
    fn weights_repeat_whole_copies_and_sample_the_fraction() {
        let exs: Vec<Example> = (0..1000).map(ex).collect();
        assert_eq!(weighted(exs.clone(), 2.0, 1).len(), 2000);
        let half = weighted(exs.clone(), 0.5, 1);
        assert!((430..570).contains(&half.len()), "{}", half.len());
        assert_eq!(half, weighted(exs.clone(), 0.5, 1), "seeded");
        let w = weighted(exs, 1.25, 3);
        assert!((1200..1300).contains(&w.len()), "{}", w.len());
    }

    /// Issue 46: a weight of 1e7 copied rows until the allocator aborted; weights whose epoch
    /// passes 16 × the rows (at least 2^20) are refused before any copy, naming the file.
    #[test]
    fn absurd_weights_are_refused_before_copying() {
        let (a, b) = (
            std::path::Path::new("a.jsonl"),
            std::path::Path::new("b.jsonl"),
        );
        assert!(check_weights(&[(a, 6, 1e7)]).is_err());
        let e = check_weights(&[(a, 100, 1.0), (b, 6, 1e7)])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("b.jsonl: [data] train weight 10000000 "),
            "{e}"
        );
        assert!(
            e.contains("repeats its 6 rows to 60000000 in memory"),
            "{e}"
        );
        // A real mixture: a small file weighted up against a large one, and the floor.
        assert!(check_weights(&[(a, 1_000_000, 1.0), (b, 1000, 1000.0)]).is_ok());
        assert!(
            check_weights(&[(a, 6, 100_000.0)]).is_ok(),
            "600k rows: under 2^20"
        );
        assert!(check_weights(&[(a, 6, f64::MAX)]).is_err());
    }
}
