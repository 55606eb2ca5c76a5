//! `rtune selftest`'s check of the grouped NF4 kernel (`nf4_dequant_group_*`, issue 48 item 4) on
//! a GPU (feature `cuda`): a group dequantized by one launch into one buffer, at the offsets the
//! model's plan gives (`rtune_model::group::nf4_plan`), against each weight's per-tensor CPU
//! dequantization at its offset (`rtune_ops::nf4::group`'s reference), bit for bit, with the padding
//! between the weights left as it was. Two groups: Llama-3-8B's q/k/v (4096×4096, 1024×4096,
//! 1024×4096, double quant: the plan is tight, the buffer is the `(6144, 4096)` block), and four
//! small weights whose sizes are no multiple of 16 or 64 (padded apart) mixing plain and double
//! scales and an FP4 table. Expected: 0 differing elements (the kernel runs the per-tensor body,
//! one f32 product and one rounding per element, as the CPU).

use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use std::sync::Arc;

use rtune_backend::check::Rng;
use rtune_backend::{drv, KernelError, Result};
use rtune_model::group::{nf4_plan, Nf4GroupPlan as GroupPlan};
use rtune_ops::nf4::group;
use rtune_ops::nf4::{nf4_dequant_group_into, DequantOut, Nf4Kernels, Nf4WeightCuda};
use rtune_ops::nf4::{quantize_nf4, Nf4Weight, QuantType, FP4};

/// An element type the check runs in, with its CPU reference and a sentinel for the padding.
trait Out: DequantOut + PartialEq {
    const NAME: &'static str;
    const SENTINEL: Self;
    fn reference(ws: &[&Nf4Weight], p: &GroupPlan, out: &mut [Self]) -> rtune_ops::nf4::Result<()>;
}
impl Out for bf16 {
    const NAME: &'static str = "bf16";
    const SENTINEL: Self = bf16::from_bits(0x7fc1);
    fn reference(ws: &[&Nf4Weight], p: &GroupPlan, out: &mut [Self]) -> rtune_ops::nf4::Result<()> {
        group::dequantize_group_bf16(ws, &p.slots, out)
    }
}
impl Out for f16 {
    const NAME: &'static str = "f16";
    const SENTINEL: Self = f16::from_bits(0x7e01);
    fn reference(ws: &[&Nf4Weight], p: &GroupPlan, out: &mut [Self]) -> rtune_ops::nf4::Result<()> {
        group::dequantize_group_f16(ws, &p.slots, out)
    }
}

/// The fraction of the buffer's elements (weights and padding) that differ from the reference.
fn mismatch<T: Out>(
    k: &Nf4Kernels,
    s: &Arc<CudaStream>,
    ws: &[&Nf4Weight],
    dws: &[&Nf4WeightCuda],
) -> Result<f64> {
    let p = nf4_plan(ws, std::mem::size_of::<T>()).map_err(|e| KernelError::Unsupported {
        op: "nf4 grouped self-test",
        message: e.to_string(),
    })?;
    let mut want = vec![T::SENTINEL; p.total];
    T::reference(ws, &p, &mut want).map_err(|e| KernelError::Unsupported {
        op: "nf4 grouped self-test",
        message: e.to_string(),
    })?;
    let mut out: CudaSlice<T> = s
        .clone_htod(&vec![T::SENTINEL; p.total])
        .map_err(drv("nf4 grouped self-test: upload"))?;
    nf4_dequant_group_into(k, s, dws, ws, &p.slots, &mut out)?;
    let got = s
        .clone_dtoh(&out)
        .map_err(drv("nf4 grouped self-test: download"))?;
    let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    Ok(bad as f64 / p.total.max(1) as f64)
}

/// The two groups, each `(name, fraction differing, pass)`; bf16 for both, f16 for the small one.
pub fn self_test_seeded(s: &Arc<CudaStream>, seed: u64) -> Result<Vec<(String, f64, bool)>> {
    let k = Nf4Kernels::load(s.context())?;
    let mut rng = Rng::new(seed);
    let mut weight = |shape: [usize; 2], dq: bool| {
        let x: Vec<f32> = (0..shape[0] * shape[1])
            .map(|_| rng.normal() * 0.02)
            .collect();
        quantize_nf4(&x, &shape, dq).map_err(|e| KernelError::Unsupported {
            op: "nf4 grouped self-test: quantize",
            message: e.to_string(),
        })
    };
    let qkv = vec![
        weight([4096, 4096], true)?,
        weight([1024, 4096], true)?,
        weight([1024, 4096], true)?,
    ];
    let mut fp4 = weight([9, 37], true)?;
    fp4.quant_map = FP4;
    fp4.quant_type = QuantType::Fp4;
    let odd = vec![
        weight([21, 37], false)?,
        weight([3, 37], true)?,
        fp4,
        weight([40, 37], false)?,
    ];
    let mut out = Vec::new();
    for (label, ws, both) in [
        ("q/k/v 4096x4096+2x1024x4096 double quant", qkv, false),
        ("4 odd sizes, plain/double, nf4/fp4", odd, true),
    ] {
        let dws = ws
            .iter()
            .map(|w| Nf4WeightCuda::upload(s, w))
            .collect::<Result<Vec<_>>>()?;
        let (wr, dr): (Vec<&Nf4Weight>, Vec<&Nf4WeightCuda>) =
            (ws.iter().collect(), dws.iter().collect());
        let frac = mismatch::<bf16>(&k, s, &wr, &dr)?;
        let name = |t: &str| {
            format!("nf4 grouped dequant → {t} {label}: bit-identical to the per-tensor CPU, seed {seed}")
        };
        out.push((name(<bf16 as Out>::NAME), frac, frac == 0.0));
        if both {
            let frac = mismatch::<f16>(&k, s, &wr, &dr)?;
            out.push((name(<f16 as Out>::NAME), frac, frac == 0.0));
        }
    }
    Ok(out)
}
