//! The decoder layer's wiring of the fused CUDA ops (issue 48, item 3), proven on the CPU: a step
//! with the fused paths forced (`rtune_ops::fused::forced`: the fused ops run their slice
//! references, the formulation `tests/kernels_emulated.rs` holds the kernels to) against the
//! same step on the unfused ops. The dispatch and the tensors each fused op takes and returns are
//! the code a GPU runs; only the kernel behind the op differs. Each fused op must run as often
//! as the layer has sites for it, so a wiring that falls back to the unfused ops fails.
//!
//! Tolerance: the references sum each row's squares in f64 where the CPU's norm sums in f32. In
//! f32 that moves a norm's output by ~1e-7 relative: measured 7e-7 of the largest gradient
//! (2026-12-06), bound 1e-5. In bf16 both sides round every output to bf16, and a rare element
//! whose f32 value sits at a rounding boundary rounds the other way (one bf16 ulp, 2⁻⁸ relative,
//! in under 1% of the norm outputs: `add_norm::tests`): measured bit-equal here, bound 1% of the
//! largest gradient and 1e-3 of the loss, what a few such elements could move.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{config, RandomWeights};
use rtune_lora::{Adapter, LoraSpec};
use rtune_model::config::ModelConfig;
use rtune_model::{Grads, Inputs, LoraCtx, Model, Quantize};
use rtune_ops::fused::{forced, without, Fused};

const LAYERS: usize = 2;

/// Gemma 2's layer: `1 + w` norms in f32 (the f32-weight form), sandwich norms, GeGLU.
fn gemma(mut cfg: ModelConfig) -> ModelConfig {
    cfg.arch = &rtune_model::family::GEMMA2;
    cfg.variant.plus_one_norms = true;
    cfg.variant.f32_norms = true;
    cfg.variant.sandwich_norms = true;
    cfg.variant.geglu = true;
    cfg
}

/// A random model (`RandomWeights` draws fresh values: built once, stepped on both paths) with
/// an all-linear adapter whose B is not zero.
fn setup(cfg: &ModelConfig, dtype: DType) -> (Model, Adapter, f64) {
    let dev = Device::Cpu;
    let mut model = Model::build_with(
        cfg.clone(),
        &RandomWeights { dtype },
        dtype,
        &dev,
        Quantize::None,
    )
    .unwrap();
    let spec = LoraSpec::new(4, 8.0, 0.0, false, &["all-linear".into()]).unwrap();
    let mut adapter = Adapter::init(spec.clone(), &model.lora_modules(&spec), 3, &dev).unwrap();
    for (i, p) in adapter.pairs.iter_mut().enumerate() {
        let v: Vec<f32> = (0..p.b.elem_count())
            .map(|j| (((i * 31 + j * 17) % 23) as f32 - 11.0) * 0.01)
            .collect();
        p.b = Tensor::from_vec(v, p.b.dims(), &dev).unwrap();
    }
    model.attach(&adapter);
    (model, adapter, spec.scaling())
}

/// One step's loss and its LoRA gradients, flattened.
fn step(model: &Model, adapter: &Adapter, scaling: f64, checkpoint: bool) -> (f64, Vec<Vec<f32>>) {
    let (b, t) = (2, 12);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 + 3) as u32 % 80).collect();
    let inputs = Inputs::new(ids.clone(), b, t);
    let targets: Vec<Option<u32>> = (0..b * t)
        .map(|i| ((i + 1) % t != 0).then(|| ids[i + 1]))
        .collect();
    let lc = LoraCtx {
        adapter,
        scaling,
        dropout: 0.0,
        seed: 11,
    };
    let mut grads = Grads::new(adapter.pairs.len());
    let loss = model
        .forward_backward(&inputs, &targets, &lc, 0.01, checkpoint, &mut grads)
        .unwrap();
    let flat = |g: &Option<Tensor>| -> Vec<f32> {
        g.as_ref()
            .map(|g| g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .unwrap_or_default()
    };
    let mut all: Vec<Vec<f32>> = grads.a.iter().map(flat).collect();
    all.extend(grads.b.iter().map(flat));
    (loss, all)
}

#[test]
fn forced_fused_add_norm_gives_the_unfused_layer_step() {
    for (name, cfg) in [("llama", config()), ("gemma2", gemma(config()))] {
        let mut cfg = cfg;
        cfg.num_layers = LAYERS;
        cfg.window_layers = vec![false; LAYERS];
        for dtype in [DType::F32, DType::BF16] {
            let (model, adapter, s) = setup(&cfg, dtype);
            for checkpoint in [false, true] {
                let case = format!("{name} {dtype:?} checkpoint {checkpoint}");
                let (loss, grads) = step(&model, &adapter, s, checkpoint);
                let ((floss, fgrads), runs) =
                    forced(&[Fused::AddNorm], || step(&model, &adapter, s, checkpoint));
                // Per layer: the add before the MLP's norm in the forward (and again in each
                // recompute: every layer but the last under checkpointing), the MLP norm's
                // backward, and the input norm's backward (not layer 0's: no input gradient).
                let recomputed = if checkpoint { LAYERS - 1 } else { 0 };
                let want = LAYERS + recomputed + 2 * LAYERS - 1;
                assert_eq!(runs, vec![want], "{case}: fused add+norm runs");
                let (tol_loss, tol_grad) = match dtype {
                    DType::F32 => (1e-6, 1e-5),
                    _ => (1e-3, 1e-2),
                };
                assert!(
                    (loss - floss).abs() <= tol_loss * loss.abs(),
                    "{case}: loss {loss} vs fused {floss}"
                );
                let scale = grads.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
                assert!(scale > 0.0, "{case}: all gradients zero");
                for (i, (a, b)) in grads.iter().zip(&fgrads).enumerate() {
                    assert_eq!(a.len(), b.len(), "{case}: gradient {i}");
                    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    eprintln!("{case}: gradient {i}: max diff {err:.2e} of {scale:.2e}");
                    assert!(
                        err <= tol_grad * scale,
                        "{case}: gradient {i}: max diff {err} of {scale}"
                    );
                }
            }
        }
    }
}

/// The LoRA branch in bf16 on cuBLAS (issue 48, item 2; `rtune_ops::lora::acc`): forced on the
/// CPU, the grouped q/k/v and gate/up path and the single o/down path run it (every product the
/// branch adds goes through `gemm_acc`, which refuses an operand layout candle's CUDA GEMM would:
/// the step passing proves the layouts), and the step stays within the f32 branch's: `xa` kept in
/// bf16 moves each LoRA contribution by up to 2⁻⁹ relative, as PEFT's bf16 autocast does;
/// measured 1.1% of the largest gradient (2026-12-06), bound 3%.
#[test]
fn forced_bf16_lora_branch_gives_the_f32_branch_step() {
    let mut cfg = config();
    cfg.num_layers = LAYERS;
    cfg.window_layers = vec![false; LAYERS];
    let (model, adapter, s) = setup(&cfg, DType::BF16);
    for checkpoint in [false, true] {
        let case = format!("bf16 checkpoint {checkpoint}");
        // The f32 branch, whichever the CPU would take (oneDNN in use: the bf16 one).
        let (loss, grads) = without(&[Fused::LoraBf16], || step(&model, &adapter, s, checkpoint));
        let ((hloss, hgrads), runs) =
            forced(&[Fused::LoraBf16], || step(&model, &adapter, s, checkpoint));
        assert!(runs[0] > 0, "{case}: the half branch never ran");
        assert!(
            (loss - hloss).abs() <= 1e-3 * loss.abs(),
            "{case}: loss {loss} vs half branch {hloss}"
        );
        let scale = grads.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in grads.iter().zip(&hgrads).enumerate() {
            assert_eq!(a.len(), b.len(), "{case}: gradient {i}");
            let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            eprintln!("{case}: gradient {i}: max diff {:.2e} of {scale:.2e}", err);
            assert!(
                err <= 3e-2 * scale,
                "{case}: gradient {i}: {err} of {scale}"
            );
        }
    }
}

/// A QLoRA model's grouped NF4 dequantization (issue 48, item 4; `rtune_model::group`'s `nf4.rs`): forced
/// on the CPU, each layer's q/k/v and gate/up weights are dequantized together into one of the two
/// reused buffers (the CPU reference fills them), served as the group's `(Σout, in)` block (one
/// GEMM), and the next group is prefetched into the other buffer. The step must equal the
/// per-weight step; from the second step on every request must find its group already there
/// (prefetched: no dequantization on demand), and that step must equal it too (a prefetch into
/// the wrong buffer, or over weights in use, changes the gradients).
///
/// Tolerance, against the per-weight step: the block's one GEMM sums each output over the same
/// 64 products as the per-weight GEMMs, in another order (another GEMM shape): f32 1e-5 of the
/// largest gradient (measured ~2e-7); bf16, where an output on a rounding boundary then rounds
/// one bf16 ulp (2⁻⁸) the other way and the step carries it on, 3e-2 (measured up to 7.3e-3,
/// 2026-12-06). A wrong or stale weight moves gradients by their own size. The grouped steps
/// among themselves (demand fills, then prefetched buffers) are compared bit for bit.
#[test]
fn forced_grouped_nf4_gives_the_per_weight_step_and_prefetches_every_group() {
    let mut cfg = config();
    cfg.num_layers = LAYERS;
    cfg.window_layers = vec![false; LAYERS];
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::BF16] {
        let mut model = Model::build_with(
            cfg.clone(),
            &RandomWeights { dtype },
            dtype,
            &dev,
            Quantize::linears(true),
        )
        .unwrap();
        let spec = LoraSpec::new(4, 8.0, 0.0, false, &["all-linear".into()]).unwrap();
        let mut adapter = Adapter::init(spec.clone(), &model.lora_modules(&spec), 3, &dev).unwrap();
        for (i, p) in adapter.pairs.iter_mut().enumerate() {
            let v: Vec<f32> = (0..p.b.elem_count())
                .map(|j| (((i * 29 + j * 13) % 19) as f32 - 9.0) * 0.01)
                .collect();
            p.b = Tensor::from_vec(v, p.b.dims(), &dev).unwrap();
        }
        model.attach(&adapter);
        let s = spec.scaling();
        for checkpoint in [false, true] {
            let case = format!("nf4 {dtype:?} checkpoint {checkpoint}");
            let (loss, grads) = step(&model, &adapter, s, checkpoint);
            // Per layer: q/k/v and gate/up in the forward (again in each recompute: every layer
            // but the last under checkpointing) and in the backward (not layer 0's q/k/v: no
            // input gradient, no dx).
            let recomputed = if checkpoint { LAYERS - 1 } else { 0 };
            let want = 2 * LAYERS + 2 * recomputed + 2 * LAYERS - 1;
            let fused = [Fused::Nf4Group, Fused::Nf4Prefetch];
            let mut steps = Vec::new();
            for n in 0..3 {
                let before = rtune_model::group::nf4_stats(&dev, dtype).unwrap_or_default();
                let (out, runs) = forced(&fused, || step(&model, &adapter, s, checkpoint));
                let after = rtune_model::group::nf4_stats(&dev, dtype).unwrap();
                let prefetched = after.prefetched - before.prefetched;
                assert_eq!(
                    runs,
                    vec![want, prefetched],
                    "{case}: step {n}: grouped runs"
                );
                assert_eq!(
                    after.hits + after.demand - before.hits - before.demand,
                    want
                );
                steps.push((out, (after.demand - before.demand, prefetched)));
            }
            let (demand, prefetched) = steps[2].1;
            assert_eq!(demand, 0, "{case}: the third step dequantized on demand");
            assert!(prefetched >= 2 * LAYERS, "{case}: {prefetched} prefetched");
            // The prefetched steps are the first step exactly (same GEMMs, same weights).
            let (first, _) = &steps[0];
            for (n, (later, _)) in steps.iter().enumerate().skip(1) {
                assert_eq!(
                    first.0.to_bits(),
                    later.0.to_bits(),
                    "{case}: step {n}: loss"
                );
                assert_eq!(first.1, later.1, "{case}: step {n}: gradients");
            }
            let (tol_loss, tol_grad) = match dtype {
                DType::F32 => (1e-6, 1e-5),
                _ => (1e-2, 3e-2),
            };
            let scale = grads.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.0, "{case}: all gradients zero");
            let (floss, fgrads) = first;
            assert!(
                (loss - floss).abs() <= tol_loss * loss.abs(),
                "{case}: loss {loss} vs grouped {floss}"
            );
            let mut worst = 0f32;
            for (i, (a, b)) in grads.iter().zip(fgrads).enumerate() {
                assert_eq!(a.len(), b.len(), "{case}: gradient {i}");
                let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                worst = worst.max(err);
                assert!(
                    err <= tol_grad * scale,
                    "{case}: gradient {i}: max diff {err} of {scale}"
                );
            }
            eprintln!(
                "{case}: largest gradient diff {:.2e} of the largest gradient",
                worst / scale
            );
        }
    }
}
