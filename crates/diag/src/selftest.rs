//! `rtune selftest --device cuda:N`: everything the CUDA path computes, checked against the CPU on
//! fresh random inputs, in one call (what `benches/gpu/run.sh` runs first on a GPU machine):
//!
//! 1. every fused kernel against its plain-Rust reference, on aligned, odd and offset shapes
//!    (`rtune_ops::selftest::self_test_seeded`), one check per op pair, shape and type;
//! 2. NF4 / NF4 double-quant dequantization on the GPU against the CPU's, bit for bit, on the
//!    Llama-8B MLP shape and an odd element count, and its bandwidth against the card's
//!    device-to-device copy;
//! 3. (CUDA) NCCL as data-parallel training uses it: a world of one rank, a known buffer
//!    all-reduced in place on the second stream, which must come back bit for bit;
//! 4. whole training steps (forward + backward, checkpointing on and off) of a small random Llama
//!    on the device against the same step on the CPU: loss and every LoRA gradient, in f32, bf16
//!    and bf16 with an NF4 base.
//!
//! Step 3 is device-generic: `--device cpu` (and a CPU-only build) runs it CPU against CPU, which
//! tests the harness itself where there is no GPU.
//!
//! Every check runs through [`Runner::attempt`]: an error or a panic inside one becomes that
//! check's FAIL with its text and the next check still runs; the caller is told after each check
//! (`rtune selftest` prints its line and rewrites the JSON report then). One seed, printed and
//! recorded, draws every random input; given again (`--seed`) it reproduces the run's inputs.
//! Test hook: [`INJECT_ENV`] (`RTUNE_SELFTEST_INJECT_FAIL=<text>`) makes every check whose name
//! contains `<text>` fail with an injected error before it runs (tests/integration/diag.rs).

pub(crate) mod runner;

use candle_core::{DType, Device, Tensor};

use rtune_lora::{Adapter, LoraPair, LoraSpec};
use rtune_model::{Grads, Inputs, LoraCtx, Model, ModelError, Quantize};

use crate::weights::{Draw, RandomWeights};
use crate::{Check, DiagError};
pub use runner::{Report, Runner, INJECT_ENV};

fn cerr(op: &str) -> impl FnOnce(candle_core::Error) -> DiagError + '_ {
    move |e| ModelError::candle(op, e).into()
}

/// The small Llama of the parity checks: GQA, two layers, odd-ish sizes.
fn parity_config() -> rtune_model::ModelConfig {
    let o = crate::bench::BenchOptions {
        hidden: 256,
        layers: 2,
        heads: 8,
        kv_heads: 2,
        intermediate: 704,
        vocab: 1000,
        ..Default::default()
    };
    crate::bench::model_config(&o)
}

/// One forward + backward on `dev`: the summed loss and the LoRA gradients (f32, on the CPU).
fn step(
    dev: &Device,
    seed: u64,
    dtype: DType,
    quantize: Quantize,
    checkpoint: bool,
    offload: bool,
) -> Result<(f64, Vec<Tensor>), DiagError> {
    let (b, t) = (2usize, 96usize);
    let cfg = parity_config();
    let vocab = cfg.vocab_size as u64;
    let src = RandomWeights::new(dev, dtype, quantize, Draw::Seeded(seed));
    let mut model = Model::build_with(cfg, &src, dtype, dev, quantize)?;
    model.offload_checkpoints = offload;
    let spec = LoraSpec::new(8, 16.0, 0.0, false, &["all-linear".to_string()])?;
    // B is zero at init, which would leave every A gradient zero: give B values too.
    let init = Adapter::init(spec.clone(), &model.lora_modules(&spec), seed, &Device::Cpu)?;
    let mut pairs = Vec::with_capacity(init.pairs.len());
    for (i, p) in init.pairs.iter().enumerate() {
        let n = p.b.elem_count();
        let bv = Tensor::from_vec(
            RandomWeights::seeded_values(seed, &format!("lora_b.{i}"), n),
            p.b.shape(),
            &Device::Cpu,
        )
        .map_err(cerr("lora b"))?;
        pairs.push(LoraPair {
            a: p.a.to_device(dev).map_err(cerr("lora a"))?,
            b: bv.to_device(dev).map_err(cerr("lora b"))?,
            m: None,
        });
    }
    let adapter = Adapter {
        pairs,
        ..init.clone()
    };
    model.attach(&adapter);
    let ids: Vec<u32> = (0..(b * t) as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) % vocab) as u32)
        .collect();
    let targets: Vec<Option<u32>> = (0..b * t)
        .map(|i| ((i + 1) % t != 0).then(|| ids[i + 1]))
        .collect();
    let mut grads = Grads::new(adapter.pairs.len());
    let lc = LoraCtx {
        adapter: &adapter,
        scaling: spec.scaling(),
        dropout: 0.0,
        seed: 0,
    };
    let loss = model.forward_backward(
        &Inputs::new(ids, b, t),
        &targets,
        &lc,
        1.0,
        checkpoint,
        &mut grads,
    )?;
    let mut out = Vec::new();
    for g in grads.a.into_iter().chain(grads.b).flatten() {
        out.push(g.to_device(&Device::Cpu).map_err(cerr("grad to cpu"))?);
    }
    Ok((loss, out))
}

/// `‖x − y‖ / ‖y‖` over all of them (one number per step: single elements near zero would make a
/// max of element-wise ratios meaningless).
fn rel_err(x: &[Tensor], y: &[Tensor]) -> Result<f64, DiagError> {
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in x.iter().zip(y) {
        let (a, b) = (
            a.to_dtype(DType::F64).map_err(cerr("rel err"))?,
            b.to_dtype(DType::F64).map_err(cerr("rel err"))?,
        );
        let d = (&a - &b).and_then(|d| d.sqr()?.sum_all()?.to_scalar::<f64>());
        num += d.map_err(cerr("rel err"))?;
        den += b
            .sqr()
            .and_then(|s| s.sum_all()?.to_scalar::<f64>())
            .map_err(cerr("rel err"))?;
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}

/// Training-step parity of `dev` against the CPU, in f32, bf16 and bf16 over NF4, with and
/// without checkpointing (and, in 16 bits, with the checkpoints offloaded to host memory): one
/// check each, through `runner`.
/// Tolerances: f32 1e-4 (cuBLAS and the fused kernels sum in other orders than the CPU: ~1e-6 per
/// op, grown through two layers and the loss); bf16 3e-2 (activations are rounded to 8 bits of
/// mantissa, 4e-3 each, at places that differ between the two backends).
pub fn step_parity(dev: &Device, runner: &mut Runner) {
    let seed = runner.report.seed;
    let nf4 = Quantize::Nf4 { double_quant: true };
    let cases = [
        ("f32", DType::F32, Quantize::None, 1e-4),
        ("bf16", DType::BF16, Quantize::None, 3e-2),
        ("bf16 + nf4-dq", DType::BF16, nf4, 3e-2),
    ];
    for (label, dtype, q, tol) in cases {
        // (checkpointing, offloading the kept inputs to host memory)
        for (ckpt, offload) in [(false, false), (true, false), (true, true)] {
            if offload && dtype == DType::F32 {
                continue;
            }
            let ck = match (ckpt, offload) {
                (true, true) => ", checkpoints offloaded",
                (true, false) => ", checkpointing",
                _ => "",
            };
            let name = format!("train step {label}{ck}: loss and LoRA grads vs CPU");
            runner.attempt(&name.clone(), || {
                let (l_ref, g_ref) = step(&Device::Cpu, seed, dtype, q, ckpt, false)?;
                let (l_dev, g_dev) = step(dev, seed, dtype, q, ckpt, offload)?;
                let loss_err = (l_dev - l_ref).abs() / l_ref.abs().max(f64::MIN_POSITIVE);
                let err = loss_err.max(rel_err(&g_dev, &g_ref)?);
                Ok(vec![Check::measured(
                    name,
                    err,
                    err <= tol && !g_dev.is_empty(),
                )])
            });
        }
    }
}

/// A seed from the clock (nanoseconds since the epoch), for a run not given one.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Runs every check on `device` (`cuda:N`; `cpu`: the parity loop CPU against CPU, the harness
/// only) under `seed`, telling `on_check` after each; checks named in `inject` fail (see
/// [`INJECT_ENV`]). Errors only when the device cannot be opened: every check's own error is its
/// FAIL in the report.
pub fn run(
    device: &str,
    seed: u64,
    inject: Option<String>,
    on_check: &mut dyn FnMut(&Check, &Report),
) -> Result<Report, DiagError> {
    let d = rtune_config::parse_device(device).map_err(|_| DiagError::BadOption {
        command: "selftest",
        option: "--device",
        value: device.to_string(),
        expected: "cpu, cuda, cuda:N",
    })?;
    let dev = rtune_train::device(d)?;
    let mut runner = Runner::new(device, seed, inject, on_check);
    #[cfg(feature = "cuda")]
    crate::selftest_cuda::kernels(&dev, &mut runner);
    #[cfg(feature = "cuda")]
    crate::selftest_cuda::nccl(&dev, &mut runner);
    step_parity(&dev, &mut runner);
    #[cfg(feature = "cuda")]
    if dev.is_cuda() {
        crate::selftest_cuda::deferred(&dev, &mut runner, "the training steps");
    }
    Ok(runner.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_against_itself_is_exact_and_grads_are_nonzero() -> Result<(), DiagError> {
        let (l1, g1) = step(&Device::Cpu, 7, DType::F32, Quantize::None, false, false)?;
        let (l2, g2) = step(&Device::Cpu, 7, DType::F32, Quantize::None, true, false)?;
        assert!(l1.is_finite() && l1 > 0.0);
        assert_eq!(g1.len(), 2 * 7 * 2, "A and B for 7 modules × 2 layers");
        // Checkpointing recomputes the same ops: equal to f32 rounding.
        assert!((l1 - l2).abs() <= 1e-9 * l1 && rel_err(&g2, &g1)? < 1e-6);
        for g in &g1 {
            let norm = g
                .sqr()
                .and_then(|s| s.sum_all()?.to_scalar::<f32>())
                .map_err(cerr("norm"))?;
            assert!(
                norm > 0.0,
                "a zero LoRA gradient: the check would be vacuous"
            );
        }
        Ok(())
    }

    /// The whole parity loop, CPU against CPU: every case runs, equal computations pass, and
    /// the caller is told after each check with the report so far.
    #[test]
    fn step_parity_runs_every_case() {
        let mut seen = Vec::new();
        let mut on_check = |c: &Check, r: &Report| seen.push((c.name.clone(), r.checks.len()));
        let mut runner = Runner::new("cpu", 3, None, &mut on_check);
        step_parity(&Device::Cpu, &mut runner);
        let r = runner.finish();
        assert_eq!(r.checks.len(), 2 + 3 + 3);
        for c in &r.checks {
            assert!(c.pass && c.max_rel_err == Some(0.0), "{c:?}");
        }
        assert_eq!(
            seen.iter().map(|s| s.1).collect::<Vec<_>>(),
            (1..=8).collect::<Vec<_>>()
        );
    }

    /// The seed reaches the inputs: another seed, another loss.
    #[test]
    fn the_seed_draws_the_inputs() -> Result<(), DiagError> {
        let (a, _) = step(&Device::Cpu, 1, DType::F32, Quantize::None, false, false)?;
        let (b, _) = step(&Device::Cpu, 1, DType::F32, Quantize::None, false, false)?;
        let (c, _) = step(&Device::Cpu, 2, DType::F32, Quantize::None, false, false)?;
        assert!(a == b && a != c, "{a} {b} {c}");
        Ok(())
    }

    #[test]
    fn rel_err_sees_a_wrong_gradient() -> Result<(), DiagError> {
        let (_, g) = step(&Device::Cpu, 7, DType::F32, Quantize::None, false, false)?;
        let mut bad = g.clone();
        bad[3] = (&bad[3] * 1.01).map_err(cerr("scale"))?;
        assert!(rel_err(&bad, &g)? > 1e-4);
        Ok(())
    }
}
