//! The kernel half of `rtune selftest` (feature `cuda`): the fused kernels against their CPU
//! references, NF4 dequantization against the CPU bit for bit, and NF4 bandwidth against the
//! card's copy bandwidth.

use candle_core::Device;
use half::bf16;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaStream;
use rtune_kernels::{nf4_dequant_cuda_into, DeviceAbsmax, Nf4Kernels, Nf4WeightCuda};

use crate::{Check, DiagError};

/// What the kernel half measured: its checks and the two bandwidths (GB/s, read + write).
#[derive(Default)]
pub struct Kernels {
    pub checks: Vec<Check>,
    pub nf4_dequant_gb_s: Option<f64>,
    pub copy_gb_s: Option<f64>,
}

fn kerr(op: &'static str) -> impl Fn(rtune_kernels::KernelError) -> DiagError {
    move |source| DiagError::Kernel { op, source }
}

fn derr(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> DiagError {
    move |source| DiagError::Driver { op, source }
}

fn qerr(op: &'static str) -> impl Fn(rtune_quant::QuantError) -> DiagError {
    move |source| DiagError::Quant { op, source }
}

/// Seconds per call of `f`, averaged over `iters` after one warm-up call.
fn time(
    s: &Arc<CudaStream>,
    iters: usize,
    mut f: impl FnMut() -> Result<(), DiagError>,
) -> Result<f64, DiagError> {
    f()?;
    s.synchronize().map_err(derr("synchronize"))?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    s.synchronize().map_err(derr("synchronize"))?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

pub fn kernels(dev: &Device) -> Result<Kernels, DiagError> {
    let mut report = Kernels::default();
    let Device::Cuda(cd) = dev else {
        return Ok(report);
    };
    let s = cd.cuda_stream();
    for (name, err, pass) in
        rtune_kernels::fused::self_test(&s).map_err(kerr("fused kernels self-test"))?
    {
        report
            .checks
            .push(Check::measured(format!("kernel {name}"), err, pass));
    }
    let k = Nf4Kernels::load(s.context()).map_err(kerr("load nf4 kernels"))?;
    // NF4 / FP4-shaped weights of a Llama-8B MLP projection, random normal values.
    let (rows, cols) = (4096usize, 14336usize);
    let x: Vec<f32> = {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        // Sums of uniforms: near-normal, with the long-ish tails that exercise every code.
        (0..rows * cols)
            .map(|_| 0.02 * (0..4).map(|_| rng.random_range(-1.0..1.0f32)).sum::<f32>())
            .collect()
    };
    for dq in [false, true] {
        let w = rtune_quant::quantize_nf4(&x, &[rows, cols], dq).map_err(qerr("quantize nf4"))?;
        let dw = Nf4WeightCuda::upload(&s, &w).map_err(kerr("upload nf4 weight"))?;
        let n = w.numel();
        let mut out = s.alloc_zeros::<bf16>(n).map_err(derr("alloc"))?;
        nf4_dequant_cuda_into(&k, &s, &dw, &mut out).map_err(kerr("nf4 dequant"))?;
        let got = s.clone_dtoh(&out).map_err(derr("copy to host"))?;
        let mut want = vec![bf16::ZERO; n];
        w.dequantize_into_bf16(&mut want)
            .map_err(qerr("dequantize nf4 on the cpu"))?;
        let mismatched = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let label = if dq { "nf4 double quant" } else { "nf4" };
        report.checks.push(Check::measured(
            format!("{label} dequant → bf16 {rows}x{cols}: bit-identical to the CPU"),
            mismatched as f64 / n as f64,
            mismatched == 0,
        ));
        if dq {
            let t = time(&s, 30, || {
                nf4_dequant_cuda_into(&k, &s, &dw, &mut out).map_err(kerr("nf4 dequant"))
            })?;
            let scales = match dw.absmax {
                DeviceAbsmax::Plain(_) => 4 * n / 64,
                DeviceAbsmax::Double { .. } => n / 64,
            };
            let moved = (n / 2 + scales + 2 * n) as f64;
            report.nf4_dequant_gb_s = Some(moved / t / 1e9);
        }
    }
    let bytes = 1usize << 30;
    let src = s.alloc_zeros::<u8>(bytes).map_err(derr("alloc"))?;
    let mut dst = s.alloc_zeros::<u8>(bytes).map_err(derr("alloc"))?;
    let t = time(&s, 20, || {
        s.memcpy_dtod(&src, &mut dst).map_err(derr("copy"))
    })?;
    let copy = 2.0 * bytes as f64 / t / 1e9;
    report.copy_gb_s = Some(copy);
    Ok(report)
}
