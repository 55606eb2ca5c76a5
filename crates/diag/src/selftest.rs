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
//! 4. whole training steps (forward + backward, checkpointing on and off) of small random models
//!    on the device against the same step on the CPU: loss and every LoRA gradient. A Llama in
//!    f32, bf16 and bf16 with an NF4 base; then one model per family that adds ops to its layer
//!    (`families.rs`: Qwen3, Gemma 2, Gemma 3, Phi-3, Phi-4-mini), in f32 and bf16 with
//!    checkpointing, Phi-3 over NF4 too, Gemma 2 and 3 in f16 under a backing-off loss scale.
//!
//! 5. (CUDA) the LoRA branch in bf16 (issue 48, item 2): one bf16 Llama step counts the casts its
//!    LoRA code runs ([`lora_casts`]): 0 per layer, where the f32 branch casts each adapted
//!    module's input and output gradient.
//!
//! Step 4 is device-generic: `--device cpu` (and a CPU-only build) runs it CPU against CPU, which
//! tests the harness itself where there is no GPU.
//!
//! Every check runs through [`Runner::attempt`]: an error or a panic inside one becomes that
//! check's FAIL with its text and the next check still runs; the caller is told after each check
//! (`rtune selftest` prints its line and rewrites the JSON report then). One seed, printed and
//! recorded, draws every random input; given again (`--seed`) it reproduces the run's inputs.
//! Test hook: [`INJECT_ENV`] (`RTUNE_SELFTEST_INJECT_FAIL=<text>`) makes every check whose name
//! contains `<text>` fail with an injected error before it runs (tests/integration/diag.rs).

pub(crate) mod families;
pub(crate) mod runner;

use candle_core::{DType, Device, Tensor};

use rtune_lora::{Adapter, LoraPair, LoraSpec};
use rtune_model::{Grads, Inputs, LoraCtx, Model, ModelConfig, ModelError, Quantize};
use rtune_train::optim::LossScaler;

use crate::weights::{Draw, RandomWeights};
use crate::{Check, DiagError};
use families::Family;
pub use runner::{Report, Runner, INJECT_ENV};

fn cerr(op: &str) -> impl FnOnce(candle_core::Error) -> DiagError + '_ {
    move |e| ModelError::candle(op, e).into()
}

/// The loss scale an f16 step starts from: `[train] loss_scale_init`'s default (torch's
/// `GradScaler`'s). On these models and rows the first passes overflow in f16, as Gemma's do, and
/// the scaler must back off to a scale whose gradients are finite: each f16 check exercises it on
/// both devices (the check's line gives the scale each ended at).
const F16_LOSS_SCALE: f64 = 65536.0;

/// What one [`step`] gives: the summed loss, the LoRA gradients (f32, on the CPU; unscaled), and
/// the loss scale the backward ran at (1 but in f16).
struct Stepped {
    loss: f64,
    grads: Vec<Tensor>,
    loss_scale: f64,
}

/// One forward + backward of `cfg`'s random model on `dev`. In f16 the backward runs on the loss
/// scaled as the trainer scales it ([`LossScaler`], from [`F16_LOSS_SCALE`]): a pass whose loss or
/// gradients overflow is run again at the backed-off scale.
fn step(
    dev: &Device,
    seed: u64,
    cfg: &ModelConfig,
    dtype: DType,
    quantize: Quantize,
    checkpoint: bool,
    offload: bool,
) -> Result<Stepped, DiagError> {
    let (b, t) = (2usize, 96usize);
    let vocab = cfg.vocab_size as u64;
    let src = RandomWeights::new(dev, dtype, quantize, Draw::Seeded(seed))
        .norm_offsets(cfg.variant.plus_one_norms);
    let mut model = Model::build_with(cfg.clone(), &src, dtype, dev, quantize)?;
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
    let lc = LoraCtx {
        adapter: &adapter,
        scaling: spec.scaling(),
        dropout: 0.0,
        seed: 0,
    };
    let mut scaler = (dtype == DType::F16).then(|| LossScaler::new(F16_LOSS_SCALE, usize::MAX));
    loop {
        let scale = scaler.as_ref().map_or(1.0, |s| s.scale);
        let mut grads = Grads::new(adapter.pairs.len());
        let inputs = Inputs::new(ids.clone(), b, t);
        let loss = model.forward_backward(&inputs, &targets, &lc, scale, checkpoint, &mut grads)?;
        let mut out = Vec::new();
        for g in grads.a.into_iter().chain(grads.b).flatten() {
            let g = g.to_device(&Device::Cpu).map_err(cerr("grad to cpu"))?;
            out.push((g / scale).map_err(cerr("unscale"))?);
        }
        match &mut scaler {
            // Overflowed: back off as the trainer does, down to no scaling at all.
            Some(s) if s.scale > 1.0 && !(loss.is_finite() && all_finite(&out)?) => s.update(true),
            _ => {
                return Ok(Stepped {
                    loss,
                    grads: out,
                    loss_scale: scale,
                })
            }
        }
    }
}

/// Whether every element of `ts` is finite.
fn all_finite(ts: &[Tensor]) -> Result<bool, DiagError> {
    for t in ts {
        let v: Vec<f32> = t
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all()?.to_vec1())
            .map_err(cerr("finite"))?;
        if !v.iter().all(|x| x.is_finite()) {
            return Ok(false);
        }
    }
    Ok(true)
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

/// f32's tolerance: cuBLAS and the fused kernels sum in other orders than the CPU, ~1e-6 per op,
/// grown through two layers and the loss.
const TOL_F32: f64 = 1e-4;
/// bf16's: activations are rounded to 8 bits of mantissa, 4e-3 each, at places that differ
/// between the two backends.
const TOL_BF16: f64 = 3e-2;
/// f16's: 11 bits of mantissa round 8× finer than bf16's (4.9e-4 each), a third of bf16's bound
/// leaving room for the scaled backward (values near f16's top, where the loss scale puts them).
const TOL_F16: f64 = 1e-2;

/// One training-step parity check: a family's model in a dtype over a base, with or without
/// checkpointing (and offloading the checkpoints to host memory).
struct Case {
    family: Family,
    /// The dtype and base in the check's name (`bf16 + nf4-dq`).
    label: &'static str,
    dtype: DType,
    quantize: Quantize,
    checkpoint: bool,
    offload: bool,
    tol: f64,
}

impl Case {
    /// `train step [family ]label[, checkpointing]: loss and LoRA grads vs CPU` (the Llama's
    /// checks keep the names they had before the other families came).
    fn name(&self) -> String {
        let ck = match (self.checkpoint, self.offload) {
            (true, true) => ", checkpoints offloaded",
            (true, false) => ", checkpointing",
            _ => "",
        };
        let family = match self.family {
            Family::Llama => String::new(),
            f => format!("{} ", f.name()),
        };
        format!(
            "train step {family}{}{ck}: loss and LoRA grads vs CPU",
            self.label
        )
    }
}

/// Every parity check, in order. The Llama: f32, bf16 and bf16 over NF4, each without and with
/// checkpointing, and in 16 bits with the checkpoints offloaded. Each other family: f32, and bf16
/// with checkpointing (the recomputed forward of its own ops); Phi-3 adds bf16 over NF4 (its fused
/// weights quantized); Gemma 2 and 3 add f16 (the scaled backward through their soft-caps and
/// √hidden embeddings; Gemma 3's with checkpointing).
fn cases() -> Vec<Case> {
    let nf4 = Quantize::linears(true);
    let case = |family, label, dtype, quantize, checkpoint, offload, tol| Case {
        family,
        label,
        dtype,
        quantize,
        checkpoint,
        offload,
        tol,
    };
    let mut out = Vec::new();
    let llama = [
        ("f32", DType::F32, Quantize::None, TOL_F32),
        ("bf16", DType::BF16, Quantize::None, TOL_BF16),
        ("bf16 + nf4-dq", DType::BF16, nf4, TOL_BF16),
    ];
    for (label, dtype, q, tol) in llama {
        for (ckpt, offload) in [(false, false), (true, false), (true, true)] {
            if !(offload && dtype == DType::F32) {
                out.push(case(Family::Llama, label, dtype, q, ckpt, offload, tol));
            }
        }
    }
    let (none, bf16, f16) = (Quantize::None, DType::BF16, DType::F16);
    for f in Family::ALL.into_iter().skip(1) {
        out.push(case(f, "f32", DType::F32, none, false, false, TOL_F32));
        out.push(case(f, "bf16", bf16, none, true, false, TOL_BF16));
        match f {
            Family::Phi3 => out.push(case(f, "bf16 + nf4-dq", bf16, nf4, true, false, TOL_BF16)),
            Family::Gemma2 => out.push(case(f, "f16", f16, none, false, false, TOL_F16)),
            Family::Gemma3 => out.push(case(f, "f16", f16, none, true, false, TOL_F16)),
            _ => {}
        }
    }
    out
}

/// Training-step parity of `dev` against the CPU: a Llama in f32, bf16 and bf16 over NF4 (without
/// and with checkpointing, in 16 bits with the checkpoints offloaded too), and a small model of
/// each other family (Qwen3, Gemma 2 and 3, Phi-3, Phi-4-mini) in f32 and in bf16 with
/// checkpointing, Phi-3 over NF4, Gemma 2 and 3 in f16 under the loss scaler: one check each,
/// through `runner`. A check's figure is the larger of the loss's relative error and the
/// gradients' (`‖x − y‖ / ‖y‖` over all of them); tolerances: f32 1e-4, bf16 3e-2, f16 1e-2 (their
/// reasons beside `TOL_F32`, `TOL_BF16`, `TOL_F16`).
pub fn step_parity(dev: &Device, runner: &mut Runner) {
    let seed = runner.report.seed;
    for c in cases() {
        let name = c.name();
        runner.attempt(&name.clone(), || {
            let cfg = c.family.config()?;
            let (dt, q, ck) = (c.dtype, c.quantize, c.checkpoint);
            let cpu = step(&Device::Cpu, seed, &cfg, dt, q, ck, false)?;
            let on_dev = step(dev, seed, &cfg, dt, q, ck, c.offload)?;
            let loss_err = (on_dev.loss - cpu.loss).abs() / cpu.loss.abs().max(f64::MIN_POSITIVE);
            let err = loss_err.max(rel_err(&on_dev.grads, &cpu.grads)?);
            let pass = err <= c.tol && !on_dev.grads.is_empty();
            let mut check = Check::measured(name, err, pass);
            if dt == DType::F16 {
                check.detail += &format!(
                    ", loss scale {} (CPU {})",
                    on_dev.loss_scale, cpu.loss_scale
                );
            }
            Ok(vec![check])
        });
    }
}

/// The name of [`lora_casts`]' check.
pub const LORA_CASTS: &str = "lora bf16 branch: casts per layer (expected 0)";

/// One bf16 Llama step on `dev` (`step`'s, no checkpointing) with the LoRA code's casts counted
/// ([`rtune_backend::cast::counting`]): passes with none. On CUDA the LoRA branch runs in bf16 on
/// cuBLAS (`rtune_model`'s `half_branch`) and casts no activation; with `RTUNE_UNFUSED=lora_bf16`
/// (or on the CPU) it casts each adapted module's input and output gradient to f32, and fails.
pub fn lora_casts(dev: &Device, seed: u64) -> Result<Check, DiagError> {
    let cfg = Family::Llama.config()?;
    let counting = rtune_backend::cast::counting::start();
    step(dev, seed, &cfg, DType::BF16, Quantize::None, false, false)?;
    let casts = counting.casts();
    let layers = cfg.num_layers.max(1);
    let detail = format!(
        "{casts} casts in a {layers}-layer step ({:.1} per layer; the adapter's weights are cast \
         to bf16 at each use with to_dtype, not counted)",
        casts as f64 / layers as f64
    );
    Ok(Check::new(LORA_CASTS, casts == 0, detail))
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
    if dev.is_cuda() {
        runner.attempt(LORA_CASTS, || Ok(vec![lora_casts(&dev, seed)?]));
    }
    #[cfg(feature = "cuda")]
    if dev.is_cuda() {
        crate::selftest_cuda::deferred(&dev, &mut runner, "the training steps");
    }
    Ok(runner.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama() -> ModelConfig {
        Family::Llama.config().expect("the Llama's config")
    }

    fn sq_norm(g: &Tensor) -> Result<f32, DiagError> {
        g.sqr()
            .and_then(|s| s.sum_all()?.to_scalar::<f32>())
            .map_err(cerr("norm"))
    }

    /// [`step`] on the CPU under seed 7, on a full-precision base.
    fn cpu_step(
        cfg: &ModelConfig,
        dtype: DType,
        checkpoint: bool,
    ) -> Result<(f64, Vec<Tensor>), DiagError> {
        let s = step(
            &Device::Cpu,
            7,
            cfg,
            dtype,
            Quantize::None,
            checkpoint,
            false,
        )?;
        Ok((s.loss, s.grads))
    }

    /// The check is not vacuous: the f32 branch (the CPU's) casts, and fails; the bf16 branch,
    /// forced on the CPU as CUDA takes it, casts nothing, and passes.
    #[test]
    fn lora_cast_check_fails_the_f32_branch_and_passes_the_bf16_one() -> Result<(), DiagError> {
        let fused = [rtune_ops::fused::Fused::LoraBf16];
        // The f32 branch, whichever the CPU would take (oneDNN in use: the bf16 one).
        let f32_branch = rtune_ops::fused::without(&fused, || lora_casts(&Device::Cpu, 5))?;
        assert!(!f32_branch.pass, "{f32_branch:?}");
        let (half, runs) = rtune_ops::fused::forced(&fused, || lora_casts(&Device::Cpu, 5));
        let half = half?;
        assert!(runs[0] > 0 && half.pass, "{half:?}");
        Ok(())
    }

    #[test]
    fn cpu_against_itself_is_exact_and_grads_are_nonzero() -> Result<(), DiagError> {
        let cfg = llama();
        let (l1, g1) = cpu_step(&cfg, DType::F32, false)?;
        let (l2, g2) = cpu_step(&cfg, DType::F32, true)?;
        assert!(l1.is_finite() && l1 > 0.0);
        assert_eq!(g1.len(), 2 * 7 * 2, "A and B for 7 modules × 2 layers");
        // Checkpointing recomputes the same ops: equal to f32 rounding.
        assert!((l1 - l2).abs() <= 1e-9 * l1 && rel_err(&g2, &g1)? < 1e-6);
        for g in &g1 {
            assert!(
                sq_norm(g)? > 0.0,
                "a zero LoRA gradient: the check would be vacuous"
            );
        }
        Ok(())
    }

    /// Every family's check is non-vacuous: its step gives a finite loss and a non-zero gradient
    /// for every LoRA tensor (A and B of each adapted module, fused ones for Phi), checkpointing
    /// recomputes it exactly, and no two families give the same loss (each config really builds
    /// another model).
    #[test]
    fn every_family_steps_with_nonzero_grads_and_its_own_loss() -> Result<(), DiagError> {
        let mut losses: Vec<(Family, f64)> = Vec::new();
        for f in Family::ALL {
            let cfg = f.config()?;
            let (l, g) = cpu_step(&cfg, DType::F32, false)?;
            let (lc, gc) = cpu_step(&cfg, DType::F32, true)?;
            assert!(l.is_finite() && l > 0.0, "{f:?}: loss {l}");
            let modules = cfg.arch.linear_modules.len();
            assert_eq!(g.len(), 2 * modules * cfg.num_layers, "{f:?}");
            for (k, t) in g.iter().enumerate() {
                assert!(sq_norm(t)? > 0.0, "{f:?}: LoRA gradient {k} is zero");
            }
            assert!(
                (l - lc).abs() <= 1e-9 * l && rel_err(&gc, &g)? < 1e-6,
                "{f:?}: checkpointing changed the step"
            );
            for (other, lo) in &losses {
                assert!(
                    (l - lo).abs() > 1e-6 * l,
                    "{f:?} and {other:?} give the same loss {l}"
                );
            }
            losses.push((f, l));
        }
        Ok(())
    }

    /// The features the families' checks are there for act on the selftest's rows: removing
    /// Gemma 2's attention soft-cap, its final soft-cap or its window each changes the step (its
    /// loss or its gradients) by more than 1%.
    #[test]
    fn gemma2s_soft_caps_and_window_act() -> Result<(), DiagError> {
        let cfg = Family::Gemma2.config()?;
        let (base, g0) = cpu_step(&cfg, DType::F32, false)?;
        let mut no_attn_cap = cfg.clone();
        no_attn_cap.variant.attn_softcap = None;
        let mut no_final_cap = cfg.clone();
        no_final_cap.variant.final_softcap = None;
        let mut no_window = cfg.clone();
        no_window.window_layers = vec![false; cfg.num_layers];
        for (what, c) in [
            ("attention soft-cap", no_attn_cap),
            ("final soft-cap", no_final_cap),
            ("window", no_window),
        ] {
            let (l, g) = cpu_step(&c, DType::F32, false)?;
            let change = ((l - base).abs() / base).max(rel_err(&g, &g0)?);
            eprintln!("{what}: loss {base} → {l}, change {change:.2e}");
            assert!(change > 1e-2, "the {what} does not act: {change:.2e}");
        }
        Ok(())
    }

    /// The 16-bit steps against f32 on the CPU, within the parity tolerances: the f16 steps'
    /// loss scaler copes (the first scale overflows, the backed-off one gives finite unscaled
    /// gradients near f32's), and each 16-bit tolerance holds even against f32 (the device's
    /// step is compared with the CPU's in the same dtype, which rounds at mostly the same places).
    #[test]
    fn sixteen_bit_steps_stay_near_f32() -> Result<(), DiagError> {
        for f in Family::ALL {
            let cfg = f.config()?;
            let (l32, g32) = cpu_step(&cfg, DType::F32, false)?;
            let mut dtypes = vec![(DType::BF16, TOL_BF16)];
            if matches!(f, Family::Gemma2 | Family::Gemma3) {
                dtypes.push((DType::F16, TOL_F16));
            }
            for (dtype, tol) in dtypes {
                let Stepped {
                    loss: l,
                    grads: g,
                    loss_scale,
                } = step(&Device::Cpu, 7, &cfg, dtype, Quantize::None, false, false)?;
                // f16: the first scale overflowed and the scaler backed off to a finite one.
                let backed_off = (1.0..F16_LOSS_SCALE).contains(&loss_scale);
                assert!(
                    dtype != DType::F16 || backed_off,
                    "{f:?}: scale {loss_scale}"
                );
                let err = ((l - l32).abs() / l32).max(rel_err(&g, &g32)?);
                eprintln!("{f:?} {dtype:?}: {err:.2e} vs f32");
                assert!(all_finite(&g)? && err.is_finite(), "{f:?} {dtype:?}");
                assert!(err <= tol, "{f:?} {dtype:?}: {err:.2e} from f32");
            }
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
        // Llama 2 + 3 + 3; Qwen3, Phi-4: 2; Gemma 2 and 3, Phi-3: 3.
        assert_eq!(r.checks.len(), 8 + 2 * 2 + 3 * 3);
        for c in &r.checks {
            assert!(c.pass && c.max_rel_err == Some(0.0), "{c:?}");
        }
        assert_eq!(
            seen.iter().map(|s| s.1).collect::<Vec<_>>(),
            (1..=21).collect::<Vec<_>>()
        );
        let names: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
        assert!(names.contains(&"train step f32: loss and LoRA grads vs CPU"));
        assert!(
            names.contains(&"train step gemma2 bf16, checkpointing: loss and LoRA grads vs CPU")
        );
        assert!(names.contains(&"train step gemma3 f16, checkpointing: loss and LoRA grads vs CPU"));
    }

    /// The seed reaches the inputs: another seed, another loss.
    #[test]
    fn the_seed_draws_the_inputs() -> Result<(), DiagError> {
        let cfg = llama();
        let loss = |seed| -> Result<f64, DiagError> {
            let (dt, q) = (DType::F32, Quantize::None);
            Ok(step(&Device::Cpu, seed, &cfg, dt, q, false, false)?.loss)
        };
        let (a, b, c) = (loss(1)?, loss(1)?, loss(2)?);
        assert!(a == b && a != c, "{a} {b} {c}");
        Ok(())
    }

    #[test]
    fn rel_err_sees_a_wrong_gradient() -> Result<(), DiagError> {
        let (_, g) = cpu_step(&llama(), DType::F32, false)?;
        let mut bad = g.clone();
        bad[3] = (&bad[3] * 1.01).map_err(cerr("scale"))?;
        assert!(rel_err(&bad, &g)? > 1e-4);
        Ok(())
    }
}
