//! GPU NF4 dequantisation throughput against the card's own device-to-device copy bandwidth.
//!
//!     cargo bench -p rtune-ops --features kernels        # on a machine with a GPU
//!
//! Bytes moved = packed codes + scales read + output written; the copy moves 2 × its size (read +
//! write). Goal (issue 4): dequant ≥ 85% of copy bandwidth. Prints SKIPPED without a GPU.

use cudarc::driver::{CudaContext, CudaStream};
use half::{bf16, f16};
use rtune_ops::nf4::quantize_nf4;
use rtune_ops::nf4::{nf4_dequant_cuda_into, DequantOut, Nf4Kernels, Nf4WeightCuda};
use std::sync::Arc;
use std::time::Instant;

const ITERS: usize = 50;

fn secs_per_iter(stream: &Arc<CudaStream>, mut f: impl FnMut()) -> f64 {
    f();
    stream.synchronize().unwrap();
    let t = Instant::now();
    for _ in 0..ITERS {
        f();
    }
    stream.synchronize().unwrap();
    t.elapsed().as_secs_f64() / ITERS as f64
}

fn run<T: DequantOut>(k: &Nf4Kernels, s: &Arc<CudaStream>, w: &Nf4WeightCuda, copy_bw: f64) {
    let n = w.numel();
    let mut out = s.alloc_zeros::<T>(n).unwrap();
    let t = secs_per_iter(s, || nf4_dequant_cuda_into(k, s, w, &mut out).unwrap());
    let read = n / 2
        + n / 64
            * if matches!(w.absmax, rtune_ops::nf4::DeviceAbsmax::Plain(_)) {
                4
            } else {
                1
            };
    let moved = (read + n * std::mem::size_of::<T>()) as f64;
    println!(
        "  {:>4}: {:7.1} GB/s of output, {:7.1} GB/s moved = {:5.1}% of copy ({:.3} ms)",
        T::SUFFIX,
        (n * std::mem::size_of::<T>()) as f64 / t / 1e9,
        moved / t / 1e9,
        100.0 * moved / t / copy_bw,
        t * 1e3
    );
}

fn main() {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {})); // cudarc panics when libcuda is absent
    let ctx = std::panic::catch_unwind(|| CudaContext::new(0));
    std::panic::set_hook(hook);
    let ctx = match ctx {
        Ok(Ok(c)) => c,
        _ => {
            println!("SKIPPED: no CUDA driver or GPU");
            return;
        }
    };
    let s = ctx.default_stream();
    let k = Nf4Kernels::load(&ctx).unwrap();
    let bytes = 1usize << 30;
    let src = s.alloc_zeros::<u8>(bytes).unwrap();
    let mut dst = s.alloc_zeros::<u8>(bytes).unwrap();
    let t = secs_per_iter(&s, || s.memcpy_dtod(&src, &mut dst).unwrap());
    let copy_bw = 2.0 * bytes as f64 / t;
    println!(
        "device copy: {:.1} GB/s (read + write of 1 GiB)",
        copy_bw / 1e9
    );
    for (rows, cols) in [(4096usize, 4096usize), (4096, 14336), (8192, 28672)] {
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as f32) * 0.618_034).sin())
            .collect();
        for dq in [false, true] {
            let w = quantize_nf4(&x, &[rows, cols], dq).unwrap();
            let dw = Nf4WeightCuda::upload(&s, &w).unwrap();
            println!(
                "{rows}x{cols} {}",
                if dq { "double quant" } else { "plain" }
            );
            run::<f32>(&k, &s, &dw, copy_bw);
            run::<f16>(&k, &s, &dw, copy_bw);
            run::<bf16>(&k, &s, &dw, copy_bw);
        }
    }
}
