//! Gradient checkpointing's recompute (`Layer::recompute`) gives the gradients of a step that keeps
//! every activation, bit for bit, while computing less: no down-projection product and no
//! attention for a recomputed layer on the tiled path (its output and log-sum-exp are kept from
//! the forward). Checked over the plain and tiled attention paths (12 and 70 tokens: 70 is not a
//! tile multiple), dropout, DoRA, packed rows, a sliding window, f32 and bf16.
//!
//! Tolerance: none. The recompute runs the same ops on the same inputs in the same order (and on
//! the tiled path reuses the forward's own attention output), so any difference is a bug.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{config, RandomWeights};
use rtune_backend::blas::{self, layout_audit};
use rtune_lora::{Adapter, LoraSpec};
use rtune_model::{Grads, Inputs, LoraCtx, Model, Quantize};

const LAYERS: usize = 3;

#[derive(Debug, Clone, Copy)]
struct Case {
    dtype: DType,
    t: usize,
    dropout: f64,
    dora: bool,
    packed: bool,
    window: Option<usize>,
}

/// A step's loss and every gradient's bits, and the products it computed.
struct Step {
    loss: u64,
    grads: Vec<Vec<u32>>,
    calls: Vec<layout_audit::Call>,
}

fn bits(t: &Option<Tensor>) -> Vec<u32> {
    t.as_ref()
        .map(|t| {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        })
        .unwrap_or_default()
}

/// The same step on the same random model without and with checkpointing.
fn steps(case: Case, audit: &layout_audit::Guard) -> [Step; 2] {
    let dev = Device::Cpu;
    let mut cfg = config();
    cfg.num_layers = LAYERS;
    cfg.sliding_window = case.window;
    cfg.window_layers = vec![case.window.is_some(); LAYERS];
    let source = RandomWeights { dtype: case.dtype };
    let mut model = Model::build_with(cfg, &source, case.dtype, &dev, Quantize::None).unwrap();
    let spec = LoraSpec::new(4, 8.0, case.dropout, false, &["all-linear".into()])
        .unwrap()
        .with_dora(case.dora);
    let mut adapter = Adapter::init(spec.clone(), &model.lora_modules(&spec), 3, &dev).unwrap();
    for p in &mut adapter.pairs {
        p.b = Tensor::randn(0f32, 0.1, p.b.dims(), &dev).unwrap();
        // DoRA: a magnitude per output row (any positive values do).
        if case.dora {
            let out = p.b.dims()[0];
            p.m = Some((Tensor::rand(0f32, 1.0, out, &dev).unwrap() + 0.5).unwrap());
        }
    }
    model.attach(&adapter);
    let (b, t) = (2, case.t);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 + 3) as u32 % 80).collect();
    let mut inputs = Inputs::new(ids.clone(), b, t);
    if case.packed {
        // Three samples in each row: t/3, t/3 and the rest.
        let seg: Vec<u32> = (0..b * t).map(|i| ((i % t) * 3 / t) as u32).collect();
        inputs.positions = (0..b * t)
            .map(|i| {
                let j = i % t;
                (j - (seg[i] as usize * t).div_ceil(3)) as u32
            })
            .collect();
        inputs.segments = Some(seg);
    }
    let targets: Vec<Option<u32>> = (0..b * t)
        .map(|i| ((i + 1) % t != 0).then(|| ids[i + 1]))
        .collect();
    let lc = LoraCtx {
        adapter: &adapter,
        scaling: spec.scaling(),
        dropout: case.dropout,
        seed: 11,
    };
    [false, true].map(|checkpoint| {
        let mut grads = Grads::new(adapter.pairs.len());
        audit.take_calls();
        let loss = model
            .forward_backward(&inputs, &targets, &lc, 0.01, checkpoint, &mut grads)
            .unwrap();
        let calls = audit.take_calls();
        let mut all: Vec<Vec<u32>> = grads.a.iter().map(bits).collect();
        all.extend(grads.b.iter().map(bits));
        all.extend(grads.m.iter().map(bits));
        Step {
            loss: loss.to_bits(),
            grads: all,
            calls,
        }
    })
}

/// The products of a step: how many down projections `(N, I)·(I, D)` and tiled attention forwards.
fn counts(s: &Step, n: usize) -> (usize, usize) {
    let c = config();
    let (i, d) = (c.intermediate_size, c.hidden_size);
    let down = s
        .calls
        .iter()
        .filter(|c| c.op == "matmul" && c.lhs == [n, i] && c.rhs == [i, d])
        .count();
    let flash = s.calls.iter().filter(|c| c.op == "flash_attn").count();
    (down, flash)
}

#[test]
fn recomputed_layers_give_the_same_gradients_with_less_compute() {
    blas::init();
    let audit = layout_audit::start();
    let mut cases = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for t in [12, 70] {
            for dropout in [0.0, 0.1] {
                for dora in [false, true] {
                    cases.push(Case {
                        dtype,
                        t,
                        dropout,
                        dora,
                        packed: false,
                        window: None,
                    });
                }
            }
        }
    }
    for (packed, window) in [(true, None), (false, Some(5)), (true, Some(9))] {
        cases.push(Case {
            dtype: DType::F32,
            t: 70,
            dropout: 0.1,
            dora: false,
            packed,
            window,
        });
    }
    for case in cases {
        let [full, ckpt] = steps(case, &audit);
        assert_eq!(full.loss, ckpt.loss, "{case:?}: loss");
        assert!(full.grads.iter().any(|g| !g.is_empty()), "{case:?}");
        for (i, (a, b)) in full.grads.iter().zip(&ckpt.grads).enumerate() {
            assert!(a == b, "{case:?}: gradient {i} differs with checkpointing");
        }
        // Without checkpointing: one down product and (tiled) one attention per layer. With it,
        // the L − 1 recomputed layers add none; a DoRA pair's cache needs its frozen output, so
        // there the recompute runs the down projection's forward again (DoRA with dropout also
        // multiplies the dropped input by W, as PEFT does). On the plain path attention is no
        // tiled call at all.
        let n = 2 * case.t;
        let tiled = case.t >= 64;
        let (down_full, flash) = counts(&full, n);
        assert_eq!(flash, if tiled { LAYERS } else { 0 }, "{case:?}");
        let (down, flash) = counts(&ckpt, n);
        if case.dora {
            assert!(down > down_full, "{case:?}: DoRA's down forward recomputed");
        } else {
            assert_eq!(down_full, LAYERS, "{case:?}: down products");
            assert_eq!(down, LAYERS, "{case:?}: down products recomputed");
        }
        assert_eq!(
            flash,
            if tiled { LAYERS } else { 0 },
            "{case:?}: attention recomputed"
        );
    }
}
