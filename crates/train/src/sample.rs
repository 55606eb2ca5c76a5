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
}
