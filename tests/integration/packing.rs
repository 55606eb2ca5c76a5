//! Packing: several samples in one row, each attending only to itself (block-diagonal causal mask,
//! positions restarting at 0), gives the same loss and LoRA gradients as running the samples one
//! by one. Tolerance 1e-5 relative (to the tensor's largest entry): the two runs differ only in
//! summation order (a packed row's GEMMs sum over more rows; masked keys add exact zeros).

use rtune_data::{Example, MicroBatch, IGNORE};
use rtune_model::{Grads, Inputs};

use crate::common::rel_err;
use crate::parity::{case, ctx, Case};

/// Cuts every golden row into samples at `cuts` (fractions of T) and returns them as examples.
fn samples(c: &Case, cuts: &[f64]) -> Vec<Example> {
    let (b, t) = (c.inputs.b, c.inputs.t);
    let mut out = Vec::new();
    for r in 0..b {
        let mut bounds: Vec<usize> = cuts.iter().map(|f| (f * t as f64) as usize).collect();
        bounds.insert(0, 0);
        bounds.push(t);
        for w in bounds.windows(2) {
            let (s, e) = (r * t + w[0], r * t + w[1]);
            let mut labels = vec![IGNORE];
            // The label of token i is the target of position i − 1 (the model shifts back).
            labels.extend(
                c.targets[s..e - 1]
                    .iter()
                    .map(|x| x.map_or(IGNORE, |v| v as i64)),
            );
            out.push(Example {
                input_ids: c.inputs.ids[s..e].to_vec(),
                labels,
            });
        }
    }
    out
}

fn run(c: &Case, mb: MicroBatch, checkpoint: bool, grads: &mut Grads) -> f64 {
    let inputs = Inputs {
        ids: mb.input_ids,
        positions: mb.positions,
        b: mb.b,
        t: mb.t,
        segments: mb.segments,
        lens: Some(mb.lens),
    };
    c.model
        .forward_backward(
            &inputs,
            &mb.targets,
            &ctx(&c.adapter),
            1.0,
            checkpoint,
            grads,
        )
        .unwrap()
}

fn check(model_dir: &str, golden: &str, cuts: &[f64]) {
    let c = case(model_dir, golden);
    let exs = samples(&c, cuts);
    let n = c.adapter.pairs.len();
    let mut one_by_one = Grads::new(n);
    let mut want = 0.0;
    for e in &exs {
        want += run(
            &c,
            MicroBatch::from_examples(&[e], 0),
            false,
            &mut one_by_one,
        );
    }
    // Two packed rows of unequal length (the shorter one padded).
    let refs: Vec<&Example> = exs.iter().collect();
    let split = refs.len() / 2 + 1;
    let rows = vec![refs[..split].to_vec(), refs[split..].to_vec()];
    for checkpoint in [false, true] {
        let mut packed = Grads::new(n);
        let got = run(&c, MicroBatch::packed(&rows, 0), checkpoint, &mut packed);
        let e = (got - want).abs() / want.abs();
        eprintln!("{golden}: packed loss {got} vs {want} (rel {e:e})");
        assert!(e <= 1e-5, "loss rel err {e:e}");
        let mut worst: f64 = 0.0;
        for (g, w) in packed
            .a
            .iter()
            .chain(&packed.b)
            .zip(one_by_one.a.iter().chain(&one_by_one.b))
        {
            let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
            worst = worst.max(rel_err(g, w));
        }
        eprintln!("{golden}: worst LoRA grad rel err {worst:e} (checkpoint {checkpoint})");
        assert!(worst <= 1e-5, "grad rel err {worst:e}");
    }
}

#[test]
fn packed_equals_one_by_one() {
    check(
        "fixtures/tiny-llama",
        "parity/golden_tiny.safetensors",
        &[0.3, 0.55],
    );
}

/// A sliding window (5) on every layer: the window and the sample boundaries both apply.
#[test]
fn packed_equals_one_by_one_with_sliding_window() {
    check(
        "fixtures/tiny-mistral",
        "parity/golden_tiny_mistral.safetensors",
        &[0.45],
    );
}

/// Qwen2: the window only on layer 1, and qkv biases.
#[test]
fn packed_equals_one_by_one_qwen2() {
    check(
        "fixtures/tiny-qwen2",
        "parity/golden_tiny_qwen2.safetensors",
        &[0.25, 0.6],
    );
}
