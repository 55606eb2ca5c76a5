//! Which engine served each matrix product, for `rtune bench`'s report: while a [`Guard`] from
//! [`start`] lives, the engines tally their products — oneDNN (with the implementation it chose,
//! and whether `B` was a packed frozen weight), the CBLAS, candle's gemm, and rtune's own kernels
//! that multiply (the LoRA up-projection, the tiled attention) — by engine and shape. Off, a
//! product costs one atomic load. Process-wide: any thread's products count, in every guard
//! alive at the time (each guard keeps its own tally).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Calls by (engine, `[batch, m, k, n]`).
type Tally = HashMap<(String, [usize; 4]), u64>;
/// Each live guard's id and tally.
static TALLIES: Mutex<Vec<(u64, Tally)>> = Mutex::new(Vec::new());
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn tallies() -> std::sync::MutexGuard<'static, Vec<(u64, Tally)>> {
    TALLIES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Products of one engine on one shape: `batch` products of `(m, k)·(k, n)` per call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub engine: String,
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub calls: u64,
}

impl Row {
    /// Floating-point operations of all its calls (`2·batch·m·k·n` each).
    pub fn flops(&self) -> f64 {
        2.0 * self.calls as f64 * (self.batch * self.m * self.k * self.n) as f64
    }
}

/// A tally of the products from now until the guard drops.
pub fn start() -> Guard {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    tallies().push((id, HashMap::new()));
    ACTIVE.fetch_add(1, Ordering::SeqCst);
    Guard(id)
}

/// Tallying is on while one lives.
pub struct Guard(u64);

impl Guard {
    /// Everything tallied since [`start`], largest flops first.
    pub fn rows(&self) -> Vec<Row> {
        let all = tallies();
        let mut rows: Vec<Row> = all
            .iter()
            .filter(|(id, _)| *id == self.0)
            .flat_map(|(_, t)| t)
            .map(|((engine, [batch, m, k, n]), &calls)| Row {
                engine: engine.clone(),
                batch: *batch,
                m: *m,
                k: *k,
                n: *n,
                calls,
            })
            .collect();
        rows.sort_by(|a, b| b.flops().total_cmp(&a.flops()));
        rows
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
        tallies().retain(|(id, _)| *id != self.0);
    }
}

/// Whether products are being tallied.
pub fn on() -> bool {
    ACTIVE.load(Ordering::Relaxed) > 0
}

/// Counts one call of `batch` products `(m, k)·(k, n)` served by `engine()` (called only when on).
pub fn record(engine: impl FnOnce() -> String, batch: usize, m: usize, k: usize, n: usize) {
    if !on() {
        return;
    }
    let key = (engine(), [batch, m, k, n]);
    for (_, t) in tallies().iter_mut() {
        *t.entry(key.clone()).or_default() += 1;
    }
}

/// `(batch, m, k, n)` of `a: (…, m, k)` times `b: (…, k, n)`.
pub fn dims(a: &[usize], b: &[usize]) -> (usize, usize, usize, usize) {
    let r = a.len();
    let n = b.last().copied().unwrap_or(1);
    if r < 2 {
        return (1, 1, a.first().copied().unwrap_or(1), n);
    }
    (a[..r - 2].iter().product(), a[r - 2], a[r - 1], n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off, nothing is kept; on, calls add up by engine and shape, and the flops are theirs; a
    /// guard started later sees only what came after it.
    #[test]
    fn tallies_calls_by_engine_and_shape_while_on() {
        record(|| "off".into(), 1, 2, 3, 4);
        let g = start();
        record(|| "early".into(), 1, 2, 3, 4);
        let later = start();
        assert!(later.rows().iter().all(|r| r.engine != "early"));
        drop(later);
        assert!(g.rows().iter().any(|r| r.engine == "early"));
        record(|| "a".into(), 1, 2, 3, 4);
        record(|| "a".into(), 1, 2, 3, 4);
        record(|| "b".into(), 5, 2, 3, 4);
        let rows = g.rows();
        assert!(rows.iter().all(|r| r.engine != "off"));
        let a = rows.iter().find(|r| r.engine == "a").expect("tallied");
        assert_eq!((a.calls, a.flops()), (2, 2.0 * 2.0 * 24.0));
        let b = rows.iter().find(|r| r.engine == "b").expect("tallied");
        assert_eq!((b.batch, b.calls, b.flops()), (5, 1, 2.0 * 5.0 * 24.0));
        assert!(rows.windows(2).all(|w| w[0].flops() >= w[1].flops()));
        assert_eq!(dims(&[7, 2, 3], &[7, 3, 4]), (7, 2, 3, 4));
    }
}
