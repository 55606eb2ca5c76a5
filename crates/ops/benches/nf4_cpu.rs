//! CPU NF4 dequantisation throughput, in GB/s of output written.
//!
//!     cargo bench -p rtune-ops --bench nf4_cpu [-- --quick]
//!
//! For each weight shape (Llama-3-8B's attention 4096×4096 and MLP 4096×14336), plain and double
//! quant, f32 and bf16 output: the median of several runs into a reused buffer (the steady state of
//! dequantising layer after layer), once on one thread and once on all of rayon's threads, plus a
//! `to_tensor` run that includes allocating the output.

use candle_core::{DType, Device};
use half::bf16;
use rand::{Rng, SeedableRng};
use rtune_ops::nf4::{quantize_nf4, Nf4Weight};
use std::time::Instant;

fn median_secs(runs: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up: page faults, caches
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn report(label: &str, bytes: usize, secs: f64) {
    println!(
        "{label:<44} {:>8.2} GB/s  ({:.2} ms)",
        bytes as f64 / secs / 1e9,
        secs * 1e3
    );
}

fn bench_weight(w: &Nf4Weight, runs: usize, pools: &[(String, rayon::ThreadPool)]) {
    let n = w.numel();
    let kind = if w.absmax.is_double() { "dq" } else { "plain" };
    let shape = format!("{}x{} {kind}", w.shape[0], w.shape[1]);
    let mut f32_out = vec![0f32; n];
    let mut bf16_out = vec![bf16::ZERO; n];
    for (threads, pool) in pools {
        let s = pool.install(|| median_secs(runs, || w.dequantize_into_f32(&mut f32_out).unwrap()));
        report(&format!("{shape} f32  into buffer, {threads}"), 4 * n, s);
        let s =
            pool.install(|| median_secs(runs, || w.dequantize_into_bf16(&mut bf16_out).unwrap()));
        report(&format!("{shape} bf16 into buffer, {threads}"), 2 * n, s);
    }
    let (threads, pool) = pools.last().unwrap();
    let s = pool.install(|| {
        median_secs(runs, || {
            w.to_tensor(DType::BF16, &Device::Cpu).unwrap();
        })
    });
    report(
        &format!("{shape} bf16 to_tensor (alloc), {threads}"),
        2 * n,
        s,
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let runs = if quick { 3 } else { 9 };
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pools: Vec<(String, rayon::ThreadPool)> = [1, all]
        .into_iter()
        .map(|t| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap();
            (format!("{t} thread(s)"), pool)
        })
        .collect();
    println!("nf4 CPU dequant bench: median of {runs} runs, {all} hardware threads");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    for (rows, cols) in [(4096usize, 4096usize), (4096, 14336)] {
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random::<f32>() - 0.5)
            .collect();
        for dq in [false, true] {
            let w = quantize_nf4(&values, &[rows, cols], dq).unwrap();
            bench_weight(&w, runs, &pools);
        }
    }
}
