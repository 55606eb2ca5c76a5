//! The CUDA NF4 dequantize kernels against rtune-quant's CPU dequantization, on fresh random weights
//! (the seed is printed): plain and double quant, f32/f16/bf16 outputs, sizes that end mid-thread,
//! mid-block and on an odd element. Tolerance: none — both sides compute the same f32 products
//! (double-quant scales with separate multiply and add roundings) and round to 16 bits to nearest even.
//! Skips, saying so, where there is no CUDA driver or GPU; compiled only with `--features cuda`.
#![cfg(feature = "kernels")]

use cudarc::driver::{CudaContext, CudaStream};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rtune_ops::nf4::{nf4_dequant_cuda, DequantOut, Nf4Kernels, Nf4WeightCuda};
use rtune_ops::nf4::{quantize_nf4, Nf4Weight};
use std::sync::Arc;

fn gpu() -> Option<Arc<CudaContext>> {
    // With dynamic loading cudarc panics when libcuda is absent (silenced here); an error means no
    // usable device.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let ctx = std::panic::catch_unwind(|| CudaContext::new(0));
    std::panic::set_hook(hook);
    match ctx {
        Ok(Ok(ctx)) => Some(ctx),
        Ok(Err(e)) => {
            eprintln!("SKIPPED nf4 CUDA test: no usable GPU ({e})");
            None
        }
        Err(_) => {
            eprintln!("SKIPPED nf4 CUDA test: no CUDA driver library (libcuda) on this machine");
            None
        }
    }
}

fn check<T: DequantOut + PartialEq + std::fmt::Debug>(
    k: &Nf4Kernels,
    stream: &Arc<CudaStream>,
    w: &Nf4Weight,
    dw: &Nf4WeightCuda,
    cpu: &[T],
    what: &str,
) {
    let out = nf4_dequant_cuda::<T>(k, stream, dw).unwrap();
    let got = stream.clone_dtoh(&out).unwrap();
    assert_eq!(got.len(), cpu.len());
    if let Some(i) = (0..got.len()).find(|&i| got[i] != cpu[i]) {
        panic!(
            "{what} {}: element {i} of {:?}: gpu {:?}, cpu {:?}",
            T::SUFFIX,
            w.shape,
            got[i],
            cpu[i]
        );
    }
}

#[test]
fn cuda_dequant_equals_cpu_dequant() {
    let Some(ctx) = gpu() else { return };
    let stream = ctx.default_stream();
    let k = Nf4Kernels::load(&ctx).unwrap();
    let seed: u64 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("nf4 CUDA test seed {seed}");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let shapes: [&[usize]; 8] = [
        &[1],
        &[15],
        &[17],
        &[3, 43],
        &[64, 64],
        &[96, 160],
        &[1001, 37],
        &[4096, 1024],
    ];
    for shape in shapes {
        let n: usize = shape.iter().product();
        // Gaussian-ish with per-row scale and a few outliers, like real weights.
        let x: Vec<f32> = (0..n)
            .map(|i| {
                let g: f32 = (0..4).map(|_| rng.random::<f32>() - 0.5).sum();
                let out = if rng.random::<f32>() < 0.001 {
                    20.0
                } else {
                    1.0
                };
                g * out * (1.0 + (i % 7) as f32) * 0.01
            })
            .collect();
        for dq in [false, true] {
            let what = if dq { "double" } else { "plain" };
            let w = quantize_nf4(&x, shape, dq).unwrap();
            let dw = Nf4WeightCuda::upload(&stream, &w).unwrap();
            let f = w.dequantize_f32();
            check(&k, &stream, &w, &dw, &f, what);
            let mut b = vec![bf16::ZERO; n];
            w.dequantize_into_bf16(&mut b).unwrap();
            check(&k, &stream, &w, &dw, &b, what);
            let mut h = vec![f16::ZERO; n];
            w.dequantize_into_f16(&mut h).unwrap();
            check(&k, &stream, &w, &dw, &h, what);
        }
    }
    eprintln!(
        "nf4 CUDA kernels equal the CPU reference on {} shapes",
        shapes.len()
    );
}
