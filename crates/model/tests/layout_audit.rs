//! Every matmul operand of a training step passes candle's CUDA GEMM layout rule, proven on the CPU.
//!
//! candle 0.11.1's CUDA matmul (`gemm_config`) refuses an operand whose last two dims are neither
//! packed row-major nor column-major (e.g. a column view `t.narrow(1, c, r)` of a wider tensor),
//! while the CPU paths accept any strides: a layout bug there shows on the first GPU step only.
//! This test runs full training steps on a tiny random model on the CPU with
//! [`rtune_backend::blas::layout_audit`] on, over every path that shapes the operands — grouped
//! (q/k/v, gate/up) with all members adapted and with a subset, dense and NF4 frozen weights,
//! gradient checkpointing on and off, LoRA dropout on and off, packed and unpacked rows, f32 and
//! bf16 — plus an evaluation pass and an inference forward, and asserts that no operand reaching
//! [`rtune_backend::blas::matmul`] fails the rule ([`rtune_backend::blas::cuda_gemm_ok`]).

mod common;

use candle_core::{DType, Device, Tensor};
use common::{config, RandomWeights};
use rtune_backend::blas::{self, layout_audit};
use rtune_lora::{Adapter, LoraSpec};
use rtune_model::{Grads, Inputs, LoraCtx, Model, Quantize};

#[derive(Debug, Clone, Copy)]
struct Case {
    dtype: DType,
    nf4: bool,
    all_linear: bool,
    checkpoint: bool,
    dropout: f64,
    packed: bool,
}

/// One training step (forward + backward), one evaluation pass and one inference forward.
fn run(case: Case) -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let quantize = if case.nf4 {
        Quantize::linears(false)
    } else {
        Quantize::None
    };
    let source = RandomWeights { dtype: case.dtype };
    let mut model = Model::build_with(config(), &source, case.dtype, &dev, quantize)?;
    let targets: Vec<String> = if case.all_linear {
        vec!["all-linear".into()]
    } else {
        // q alone of q/k/v, up alone of gate/up: groups with some members adapted.
        ["q_proj", "v_proj", "up_proj", "down_proj"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let spec = LoraSpec::new(4, 8.0, case.dropout, false, &targets)?;
    let mut adapter = Adapter::init(spec.clone(), &model.lora_modules(&spec), 3, &dev)?;
    // B = 0 at init would leave every LoRA product zero; any values do for layouts.
    for p in &mut adapter.pairs {
        p.b = Tensor::randn(0f32, 0.1, p.b.dims(), &dev)?;
    }
    model.attach(&adapter);
    let (b, t) = (2, 12);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 + 3) as u32 % 80).collect();
    let mut inputs = Inputs::new(ids.clone(), b, t);
    if case.packed {
        // Row 0 holds three samples (5, 4, 3 tokens), row 1 two (8, 4).
        let seg: Vec<u32> = [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
            .into_iter()
            .chain([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
            .collect();
        inputs.positions = (0..b * t)
            .map(|i| {
                let (r, j) = (i / t, i % t);
                let start = (0..=j)
                    .rev()
                    .take_while(|&k| seg[r * t + k] == seg[i])
                    .last()
                    .unwrap();
                (j - start) as u32
            })
            .collect();
        inputs.segments = Some(seg);
    }
    let targets: Vec<Option<u32>> = (0..b * t)
        .map(|i| ((i + 1) % t != 0).then(|| ids[i + 1]))
        .collect();
    let n = targets.iter().filter(|x| x.is_some()).count() as f64;
    let lc = LoraCtx {
        adapter: &adapter,
        scaling: spec.scaling(),
        dropout: case.dropout,
        seed: 11,
    };
    let mut grads = Grads::new(adapter.pairs.len());
    let loss =
        model.forward_backward(&inputs, &targets, &lc, 1.0 / n, case.checkpoint, &mut grads)?;
    assert!(loss.is_finite(), "{case:?}: loss {loss}");
    for (i, (a, bb)) in grads.a.iter().zip(&grads.b).enumerate() {
        assert!(
            a.is_some() && bb.is_some(),
            "{case:?}: no gradient for module {i}"
        );
    }
    let eval = model.eval_loss(&inputs, &targets, Some(&lc))?;
    assert!(eval.is_finite());
    model.forward(&inputs, Some(&lc), false)?;
    Ok(())
}

/// Every combination of the paths above, f32; the QLoRA and dense combinations again in bf16.
#[test]
fn training_steps_pass_candles_cuda_gemm_rule() -> Result<(), Box<dyn std::error::Error>> {
    blas::init();
    let audit = layout_audit::start();
    // The audit itself: a column view is refused and recorded.
    let x = Tensor::zeros((6, 8), DType::F32, &Device::Cpu)?;
    blas::matmul(
        &x.narrow(1, 2, 3)?,
        &Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?,
    )?;
    assert_eq!(
        audit.violations().len(),
        1,
        "the audit records a column view"
    );
    drop(audit);

    let audit = layout_audit::start();
    let mut cases = Vec::new();
    for nf4 in [false, true] {
        for all_linear in [true, false] {
            for checkpoint in [false, true] {
                for dropout in [0.0, 0.1] {
                    for packed in [false, true] {
                        cases.push(Case {
                            dtype: DType::F32,
                            nf4,
                            all_linear,
                            checkpoint,
                            dropout,
                            packed,
                        });
                    }
                }
            }
        }
    }
    for nf4 in [false, true] {
        for dropout in [0.0, 0.1] {
            cases.push(Case {
                dtype: DType::BF16,
                nf4,
                all_linear: true,
                checkpoint: true,
                dropout,
                packed: true,
            });
        }
    }
    let mut failed = Vec::new();
    for case in cases {
        run(case)?;
        let v = audit.take();
        if !v.is_empty() {
            let mut sites: Vec<String> = v.iter().map(|x| x.to_string()).collect();
            sites.sort();
            sites.dedup();
            failed.push(format!(
                "{case:?}: {} matmuls\n    {}",
                v.len(),
                sites.join("\n    ")
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "matmul operands candle's CUDA GEMM refuses:\n{}",
        failed.join("\n")
    );
    Ok(())
}
