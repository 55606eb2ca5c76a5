//! The grouped mixture of experts against the plain one (every expert on every token, PEFT's
//! dense delta), forward in f32 and every gradient against candle's autograd on the plain one in
//! f64; the grouping itself; bad inputs refused with an error, not a panic.

use super::reference::*;
use super::*;
use crate::route::{route, Routing};
use candle_core::Var;
use rtune_ops::test_util::*;

mod nf4;

const T: usize = 13;
const H: usize = 8;
const E: usize = 6;
const I: usize = 5;
const K: usize = 2;
const R: usize = 3;

/// `T × K` expert ids never naming the last expert (so one expert has no rows, the path that
/// must give zero LoRA gradients), with softmax-top-k weights of random logits.
fn routing(seed: u64) -> (Vec<u32>, Vec<f32>) {
    let logits = flat(&randn(&[T, E], seed, 3.0));
    let masked: Vec<f32> = logits
        .chunks(E)
        .flat_map(|r| {
            let mut r = r.to_vec();
            r[E - 1] = -1e9;
            r
        })
        .collect();
    let r = route(&masked, E, K, Routing::SoftmaxTopK { normalize: true }).unwrap();
    (r.experts, r.weights)
}

struct Case {
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    /// `(a, b)` in PEFT's layouts, `b` nonzero so the delta is exercised.
    lgu: (Tensor, Tensor),
    ld: (Tensor, Tensor),
    dy: Tensor,
}

fn case(seed: u64) -> Case {
    Case {
        x: randn(&[T, H], seed, 1.0),
        gate_up: randn(&[E, 2 * I, H], seed + 1, 0.5),
        down: randn(&[E, H, I], seed + 2, 0.5),
        lgu: (
            randn(&[E * R, H], seed + 3, 0.5),
            randn(&[2 * I, R * E], seed + 4, 0.5),
        ),
        ld: (
            randn(&[E * R, I], seed + 5, 0.5),
            randn(&[H, R * E], seed + 6, 0.5),
        ),
        dy: randn(&[T, H], seed + 7, 1.0),
    }
}

const S_GU: f64 = 2.0;
const S_D: f64 = 0.5;

fn experts<'a>(c: &'a Case, lora: bool) -> Experts<'a> {
    let pair = |p: &'a (Tensor, Tensor), scale| ExpertLora {
        a: &p.0,
        b: &p.1,
        scale,
    };
    Experts {
        gate_up: (&c.gate_up).into(),
        down: (&c.down).into(),
        gate_up_bias: None,
        down_bias: None,
        act: ExpertAct::SwiGlu,
        lora_gate_up: lora.then(|| pair(&c.lgu, S_GU)),
        lora_down: lora.then(|| pair(&c.ld, S_D)),
        combine_f32: false,
    }
}

/// `max |got − want| / max |want|` against an f64 tensor.
fn rel64(got: &Tensor, want: &Tensor) -> f64 {
    let g = got.to_dtype(DType::F64).unwrap();
    let scale = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let err = (g - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    err / scale.max(1e-30)
}

#[test]
fn moe_forward_matches_every_expert_on_every_token() {
    for lora in [false, true] {
        let c = case(10);
        let (ids, w) = routing(11);
        let (y, cache) = moe_forward(&c.x, &ids, &w, K, &experts(&c, lora)).unwrap();
        let comb = combine_matrix(&ids, &w, K, E, DType::F32, &Device::Cpu).unwrap();
        let want = moe_reference(
            &c.x,
            &comb,
            &c.gate_up,
            &c.down,
            lora.then_some((&c.lgu.0, &c.lgu.1, S_GU)),
            lora.then_some((&c.ld.0, &c.ld.1, S_D)),
        )
        .unwrap();
        // f32 both, the same sums in another order (grouped rows, low-rank product against the
        // folded delta, zero-weighted experts added in the plain one): a few f32 ulps of the
        // largest output.
        let e = rel_err(&y, &want);
        eprintln!("moe forward (lora {lora}): relative error {e:.2e}");
        assert!(e < 2e-6, "moe forward (lora {lora}): {e:e}");
        // Grouped: T·k rows in all, none for the expert no token chose.
        assert_eq!(cache.groups.rows(), T * K);
        assert!(cache.groups.tokens[E - 1].is_empty());
    }
}

#[test]
fn moe_backward_matches_autograd_f64() {
    let c = case(20);
    let (ids, w) = routing(21);
    let (_, cache) = moe_forward(&c.x, &ids, &w, K, &experts(&c, true)).unwrap();
    let g = moe_backward(&c.dy, &w, &experts(&c, true), &cache).unwrap();

    let f64v = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
    let x = f64v(&c.x);
    let comb = f64v(&combine_matrix(&ids, &w, K, E, DType::F32, &Device::Cpu).unwrap());
    let (agu, bgu, ad, bd) = (f64v(&c.lgu.0), f64v(&c.lgu.1), f64v(&c.ld.0), f64v(&c.ld.1));
    let y = moe_reference(
        &x,
        &comb,
        &c.gate_up.to_dtype(DType::F64).unwrap(),
        &c.down.to_dtype(DType::F64).unwrap(),
        Some((&agu, &bgu, S_GU)),
        Some((&ad, &bd, S_D)),
    )
    .unwrap();
    let dy = c.dy.to_dtype(DType::F64).unwrap();
    let grads = (y * dy).unwrap().sum_all().unwrap().backward().unwrap();
    let want = |v: &Var| grads.get(v).unwrap().clone();

    // f32 against f64: products of depth ≤ H + I + R accumulated in f32 (seen: ≤ 4e-7); 2e-6
    // of the largest gradient leaves room for that and fails on any wrong index, layout or scale.
    let tol = 2e-6;
    let check = |what: &str, got: &Tensor, want: &Tensor| {
        let e = rel64(got, want);
        eprintln!("moe {what}: relative error {e:.2e}");
        assert!(e < tol, "moe {what}: {e:e}");
    };
    check("dx", &g.dx, &want(&x));
    let (dagu, dbgu) = g.gate_up.as_ref().expect("gate_up adapted");
    let (dad, dbd) = g.down.as_ref().expect("down adapted");
    check("d lora_A gate_up", dagu, &want(&agu));
    check("d lora_B gate_up", dbgu, &want(&bgu));
    check("d lora_A down", dad, &want(&ad));
    check("d lora_B down", dbd, &want(&bd));
    // ∂L/∂w of slot (t, j) is the combine matrix's gradient at (t, expert).
    let dc = want(&comb).to_dtype(DType::F32).unwrap();
    let dc = flat(&dc);
    let dw_want: Vec<f32> = ids
        .iter()
        .enumerate()
        .map(|(s, &x)| dc[(s / K) * E + x as usize])
        .collect();
    let dw_t = Tensor::new(g.dweights.as_slice(), &Device::Cpu).unwrap();
    let dw_want = Tensor::new(dw_want.as_slice(), &Device::Cpu).unwrap();
    check("d weights", &dw_t, &dw_want.to_dtype(DType::F64).unwrap());
    // The expert no token chose: zero LoRA gradients, and its rows of lora_A exactly zero.
    let rows = flat(&dagu.narrow(0, (E - 1) * R, R).unwrap());
    assert!(rows.iter().all(|v| *v == 0.0));
}

/// gpt-oss's experts: interleaved gate/up with the clamped SwiGLU, biases on both projections,
/// LoRA on both stacks. A limit of 0.6 against gate/up outputs of spread ~1 clamps a good share of
/// both halves (above for the gate, both sides for up), so the masks of the backward matter.
#[test]
fn gpt_oss_experts_match_autograd_f64() {
    const ACT: ExpertAct = ExpertAct::Clamped {
        alpha: 1.702,
        limit: 0.6,
    };
    let c = case(50);
    let (bgu, bd) = (randn(&[E, 2 * I], 58, 0.5), randn(&[E, H], 59, 0.5));
    let (ids, w) = routing(51);
    let ex = Experts {
        gate_up_bias: Some(&bgu),
        down_bias: Some(&bd),
        act: ACT,
        ..experts(&c, true)
    };
    let (y, cache) = moe_forward(&c.x, &ids, &w, K, &ex).unwrap();
    let g = moe_backward(&c.dy, &w, &ex, &cache).unwrap();

    let f64v = |t: &Tensor| Var::from_tensor(&t.to_dtype(DType::F64).unwrap()).unwrap();
    let x = f64v(&c.x);
    let comb = f64v(&combine_matrix(&ids, &w, K, E, DType::F32, &Device::Cpu).unwrap());
    let (agu, blgu, ad, bld) = (f64v(&c.lgu.0), f64v(&c.lgu.1), f64v(&c.ld.0), f64v(&c.ld.1));
    let f64t = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let (gate_up, down, bgu64, bd64) = (f64t(&c.gate_up), f64t(&c.down), f64t(&bgu), f64t(&bd));
    let reference = |act| {
        let rex = RefExperts {
            gate_up: &gate_up,
            down: &down,
            biases: Some((&bgu64, &bd64)),
            act,
        };
        moe_reference_with(
            &x,
            &comb,
            &rex,
            Some((&agu, &blgu, S_GU)),
            Some((&ad, &bld, S_D)),
        )
        .unwrap()
    };
    let want = reference(ACT);
    // The clamp is live: without it (limit 1e9) the output moves by far more than the tolerance.
    let unclamped = reference(ExpertAct::Clamped {
        alpha: 1.702,
        limit: 1e9,
    });
    assert!(rel64(&unclamped, &want) > 1e-2, "the limit clamps nothing");
    // Forward: f32 against f64 (seen ≤ 1e-6 on the SwiGLU case's rule); 2e-6 as there.
    let e = rel64(&y, &want);
    eprintln!("gpt-oss moe forward: relative error {e:.2e}");
    assert!(e < 2e-6, "gpt-oss moe forward: {e:e}");
    let dy = c.dy.to_dtype(DType::F64).unwrap();
    let grads = (want * dy).unwrap().sum_all().unwrap().backward().unwrap();
    let wanted = |v: &Var| grads.get(v).unwrap().clone();
    let check = |what: &str, got: &Tensor, want: &Tensor| {
        let e = rel64(got, want);
        eprintln!("gpt-oss moe {what}: relative error {e:.2e}");
        assert!(e < 2e-6, "gpt-oss moe {what}: {e:e}");
    };
    check("dx", &g.dx, &wanted(&x));
    let (dagu, dbgu) = g.gate_up.as_ref().expect("gate_up adapted");
    let (dad, dbd) = g.down.as_ref().expect("down adapted");
    check("d lora_A gate_up", dagu, &wanted(&agu));
    check("d lora_B gate_up", dbgu, &wanted(&blgu));
    check("d lora_A down", dad, &wanted(&ad));
    check("d lora_B down", dbd, &wanted(&bld));
    let dc = flat(&wanted(&comb).to_dtype(DType::F32).unwrap());
    let dw_want: Vec<f32> = ids
        .iter()
        .enumerate()
        .map(|(s, &x)| dc[(s / K) * E + x as usize])
        .collect();
    let dw_t = Tensor::new(g.dweights.as_slice(), &Device::Cpu).unwrap();
    let dw_want = Tensor::new(dw_want.as_slice(), &Device::Cpu).unwrap();
    check("d weights", &dw_t, &dw_want.to_dtype(DType::F64).unwrap());
}

#[test]
fn moe_without_lora_has_no_lora_grads() {
    let c = case(30);
    let (ids, w) = routing(31);
    let (_, cache) = moe_forward(&c.x, &ids, &w, K, &experts(&c, false)).unwrap();
    let g = moe_backward(&c.dy, &w, &experts(&c, false), &cache).unwrap();
    assert!(g.gate_up.is_none() && g.down.is_none());
    assert_eq!(g.dx.dims(), &[T, H]);
}

#[test]
fn groups_list_each_experts_tokens() {
    // Tokens 0..3, top-2: (1, 0), (2, 1), (0, 2).
    let g = Groups::new(&[1, 0, 2, 1, 0, 2], 2, 4).unwrap();
    assert_eq!(g.tokens, vec![vec![0, 2], vec![0, 1], vec![1, 2], vec![]]);
    assert_eq!(g.slots, vec![vec![1, 4], vec![0, 3], vec![2, 5], vec![]]);
    assert_eq!(g.rows(), 6);
}

#[test]
fn moe_refuses_bad_inputs() {
    let c = case(40);
    let (ids, w) = routing(41);
    let ex = experts(&c, true);
    // An expert id out of range.
    let mut bad = ids.clone();
    bad[3] = E as u32;
    let err = moe_forward(&c.x, &bad, &w, K, &ex).unwrap_err();
    assert!(err.to_string().contains("expert id 6 at slot 3"), "{err}");
    // Too few ids for the tokens.
    let err = moe_forward(&c.x, &ids[..4], &w[..4], K, &ex).unwrap_err();
    assert!(err.to_string().contains("for 13 tokens"), "{err}");
    // A down stack of the wrong width.
    let down = randn(&[E, H, I + 1], 1, 1.0);
    let ex2 = Experts {
        down: (&down).into(),
        ..ex
    };
    let err = moe_forward(&c.x, &ids, &w, K, &ex2).unwrap_err();
    assert!(err.to_string().contains("do not fit x"), "{err}");
    // lora_B of the wrong rank.
    let b = randn(&[2 * I, R * E + 1], 1, 1.0);
    let ex3 = Experts {
        lora_gate_up: Some(ExpertLora {
            a: &c.lgu.0,
            b: &b,
            scale: 1.0,
        }),
        ..ex
    };
    let err = moe_forward(&c.x, &ids, &w, K, &ex3).unwrap_err();
    assert!(err.to_string().contains("LoRA on gate_up_proj"), "{err}");
    // A bias of the wrong shape.
    let bias = randn(&[E, H + 1], 1, 1.0);
    let ex4 = Experts {
        down_bias: Some(&bias),
        ..ex
    };
    let err = moe_forward(&c.x, &ids, &w, K, &ex4).unwrap_err();
    assert!(err.to_string().contains("down_proj_bias"), "{err}");
}

/// The fast CPU path ([`grouped`]) against the per-expert path on the same fresh inputs, forward
/// and backward: SwiGLU without and with LoRA, and gpt-oss's clamped SwiGLU with biases and LoRA.
/// Both f32, the same sums in another order (other GEMM blockings, the bias added inside the
/// product's pass): a few ulps; 2e-6 of each output's largest element, as the reference tests,
/// fails on any wrong row, expert, layout or scale (O(1)).
#[test]
fn grouped_path_matches_the_per_expert_path() {
    let clamped = ExpertAct::Clamped {
        alpha: 1.702,
        limit: 0.6,
    };
    for (n, (lora, act, biases)) in [
        (false, ExpertAct::SwiGlu, false),
        (true, ExpertAct::SwiGlu, false),
        (true, clamped, true),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 70 + 10 * n as u64;
        let c = case(seed);
        let (bgu, bd) = (
            randn(&[E, 2 * I], seed + 8, 0.5),
            randn(&[E, H], seed + 9, 0.5),
        );
        let (ids, w) = routing(seed + 1);
        let ex = Experts {
            gate_up_bias: biases.then_some(&bgu),
            down_bias: biases.then_some(&bd),
            act,
            ..experts(&c, lora)
        };
        assert!(grouped::applies(&c.x, &ex));
        let groups = Groups::new(&ids, K, E).unwrap();
        let (y_ref, slow) = per_expert_forward(&c.x, &groups, &w, &ex).unwrap();
        let want = per_expert_backward(&c.dy, &w, &ex, &groups, &slow).unwrap();
        // The same stacks held in panels (`panels`: what an f32 CPU model holds on AVX2 CPUs
        // without AVX-512; the portable loops elsewhere).
        let pack = |t: &Tensor| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            panels::PanelStack::pack(&v, t.dims3().unwrap()).unwrap()
        };
        let (pgu, pd) = (pack(&c.gate_up), pack(&c.down));
        let ex_panels = Experts {
            gate_up: Stack::Panels(&pgu),
            down: Stack::Panels(&pd),
            ..ex
        };
        // Both engines: the CBLAS one only where a CBLAS loads (rtune's own path).
        for (engine, held) in [
            (grouped::Engine::Gemm, "dense"),
            (grouped::Engine::Blas, "dense"),
            (grouped::Engine::Gemm, "panels"),
            (grouped::Engine::Blas, "panels"),
        ] {
            if engine == grouped::Engine::Blas && rtune_backend::blas::init().is_none() {
                eprintln!("no CBLAS found (install libopenblas0): the Blas engine not compared");
                continue;
            }
            let ex = if held == "panels" { ex_panels } else { ex };
            let (y, fast) = grouped::forward(engine, &c.x, &groups, &w, &ex).unwrap();
            let case = format!("{engine:?}, {held}, lora {lora}, {act:?}, biases {biases}");
            let check = |what: &str, got: &Tensor, want: &Tensor| {
                let e = rel_err(got, want);
                eprintln!("grouped vs per-expert {what} ({case}): {e:.2e}");
                assert!(e < 2e-6, "grouped vs per-expert {what} ({case}): {e:e}");
            };
            check("y", &y, &y_ref);
            let (dx, dw, ggu, gdn) = grouped::backward(engine, &c.dy, &w, &ex, &fast, K).unwrap();
            check("dx", &dx, &want.dx);
            let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
            check("d weights", &t(&dw), &t(&want.dweights));
            assert_eq!(ggu.is_some(), lora);
            assert_eq!(gdn.is_some(), lora);
            for (name, got, want) in [("gate_up", ggu, &want.gate_up), ("down", gdn, &want.down)] {
                if let (Some((da, db)), Some((wa, wb))) = (got, want) {
                    check(&format!("d lora_A {name}"), &da, wa);
                    check(&format!("d lora_B {name}"), &db, wb);
                }
            }
        }
    }
}

/// How a model holds a stack ([`StackWeights::new`]): f32 on the CPU in panels exactly where
/// [`panels::fast`] says so (rewritten in place, the values as loaded), another dtype as is, NF4
/// when asked.
#[test]
fn stacks_are_held_in_panels_where_the_cpu_reads_them_so() {
    let c = case(90);
    let want = c.gate_up.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let held = StackWeights::new(c.gate_up.clone(), None).unwrap();
    assert_eq!(
        matches!(held, StackWeights::Panels(_)),
        panels::fast(),
        "f32 stack: {held:?}"
    );
    let back = held.dense(&Device::Cpu).unwrap().unwrap();
    assert_eq!(back.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
    assert_eq!(back.dims(), c.gate_up.dims());
    let bf16 = c.gate_up.to_dtype(DType::BF16).unwrap();
    assert!(matches!(
        StackWeights::new(bf16, None).unwrap(),
        StackWeights::Dense(_)
    ));
    assert!(matches!(
        StackWeights::new(c.gate_up.clone(), Some(false)).unwrap(),
        StackWeights::Nf4(_)
    ));
}

/// Timing, not a check (`cargo test --release -p rtune-experts moe_timing -- --ignored
/// --nocapture`): forward + backward with LoRA r 16 on both stacks, the fast CPU path against
/// the per-expert path, on benches/moe_vs_peft.sh's layer (Qwen3-30B-A3B's scaled down: 128
/// experts, top-8, H 512, I 192) over 2048 tokens.
#[test]
#[ignore]
fn moe_timing() {
    use std::time::Instant;
    let (t, h, e, i, k, r) = (2048, 512, 128, 192, 8, 16);
    let x = randn(&[t, h], 1, 1.0);
    let gate_up = randn(&[e, 2 * i, h], 2, 0.05);
    let down = randn(&[e, h, i], 3, 0.05);
    let (ag, bg) = (randn(&[e * r, h], 4, 0.05), randn(&[2 * i, r * e], 5, 0.05));
    let (ad, bd) = (randn(&[e * r, i], 6, 0.05), randn(&[h, r * e], 7, 0.05));
    let logits = flat(&randn(&[t, e], 8, 3.0));
    let routed = route(&logits, e, k, Routing::SoftmaxTopK { normalize: true }).unwrap();
    let ex = Experts {
        gate_up: (&gate_up).into(),
        down: (&down).into(),
        gate_up_bias: None,
        down_bias: None,
        act: ExpertAct::SwiGlu,
        lora_gate_up: Some(ExpertLora {
            a: &ag,
            b: &bg,
            scale: 2.0,
        }),
        lora_down: Some(ExpertLora {
            a: &ad,
            b: &bd,
            scale: 2.0,
        }),
        combine_f32: false,
    };
    let dy = randn(&[t, h], 9, 1.0);
    let groups = Groups::new(&routed.experts, k, e).unwrap();
    let w = &routed.weights;
    rtune_backend::blas::init();
    let engine = grouped::Engine::detect();
    let fast = || {
        let (_, c) = grouped::forward(engine, &x, &groups, w, &ex).unwrap();
        grouped::backward(engine, &dy, w, &ex, &c, k).unwrap();
    };
    let gemm = grouped::Engine::Gemm;
    let fast_gemm = || {
        let (_, c) = grouped::forward(gemm, &x, &groups, w, &ex).unwrap();
        grouped::backward(gemm, &dy, w, &ex, &c, k).unwrap();
    };
    let slow = || {
        let (_, c) = per_expert_forward(&x, &groups, w, &ex).unwrap();
        per_expert_backward(&dy, w, &ex, &groups, &c).unwrap();
    };
    // Frozen products only: forward 3·H·I a row, backward 3·H·I (the input gradients).
    let flops = (t * k) as f64 * 2.0 * 3.0 * (h * i) as f64 * 2.0;
    // This process's CPU seconds (utime + stime, /proc/self/stat, 100 Hz ticks): on a loaded
    // machine the wall clock measures the neighbours too; GFLOP per CPU second does less so.
    let cpu = || -> f64 {
        let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let f: Vec<&str> = s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (tick(11) + tick(12)) / 100.0
    };
    let time = |f: &dyn Fn()| {
        f();
        let n = 3;
        let (t0, c0) = (Instant::now(), cpu());
        (0..n).for_each(|_| f());
        let n = n as f64;
        (t0.elapsed().as_secs_f64() / n, (cpu() - c0) / n)
    };
    // The dense path's GEMM on as many FLOPs, x·Wᵀ for all T·k rows at once (forward gate_up,
    // then down, then their input gradients), and each expert's own rows through it (serial
    // over the experts, OpenBLAS threading each product).
    let xs = randn(&[t * k, h], 10, 1.0);
    let ms = randn(&[t * k, i], 11, 1.0);
    let (gu0, dn0) = (gate_up.get(0).unwrap(), down.get(0).unwrap());
    let dense = || {
        let mm = rtune_backend::blas::matmul;
        let gu = mm(&xs, &gu0.t().unwrap()).unwrap();
        mm(&ms, &dn0.t().unwrap()).unwrap();
        mm(&gu, &gu0).unwrap();
        mm(&xs, &dn0).unwrap();
    };
    let per_rows: Vec<(Tensor, Tensor)> = groups
        .tokens
        .iter()
        .scan(0, |o, toks| {
            let n = toks.len();
            *o += n;
            Some((
                xs.narrow(0, *o - n, n).unwrap(),
                ms.narrow(0, *o - n, n).unwrap(),
            ))
        })
        .collect();
    let blas_experts = || {
        let mm = rtune_backend::blas::matmul;
        for (e, (x, m)) in per_rows.iter().enumerate() {
            if x.dim(0).unwrap() == 0 {
                continue;
            }
            let (gu, dn) = (gate_up.get(e).unwrap(), down.get(e).unwrap());
            let g = mm(x, &gu.t().unwrap()).unwrap();
            mm(m, &dn.t().unwrap()).unwrap();
            mm(&g, &gu).unwrap();
            mm(x, &dn).unwrap();
        }
    };
    for (name, f) in [
        ("dense OpenBLAS", &dense as &dyn Fn()),
        ("OpenBLAS per expert", &blas_experts),
    ] {
        let (wall, cpu_s) = time(f);
        eprintln!(
            "{name} (frozen products only): {:.1} ms, {:.1} GFLOP/s; {:.1} GFLOP per CPU second",
            wall * 1e3,
            flops / wall / 1e9,
            flops / cpu_s.max(1e-9) / 1e9
        );
    }
    // RTUNE_MOE_TIMING=grouped or per-expert times that path alone (for a profile).
    let only = std::env::var("RTUNE_MOE_TIMING").unwrap_or_default();
    for _ in 0..2 {
        for (name, f) in [
            ("grouped", &fast as &dyn Fn()),
            ("grouped-gemm", &fast_gemm),
            ("per-expert", &slow),
        ] {
            if !only.is_empty() && only != name {
                continue;
            }
            let (wall, cpu_s) = time(f);
            eprintln!(
                "moe fwd+bwd {name}: {:.1} ms, {:.1} GFLOP/s of the routed frozen products; \
                 {:.1} GFLOP per CPU second",
                wall * 1e3,
                flops / wall / 1e9,
                flops / cpu_s.max(1e-9) / 1e9
            );
        }
    }
}

/// In bf16 each adapted expert multiplies by its folded weight `bf16(W_e + s·B_e·A_e)`, as PEFT's
/// `ParamWrapper` does: the output and `dx` are bit-equal to the unadapted experts on stacks folded
/// beforehand (the same products in the same dtype); the LoRA gradients are the f32 path's on the
/// same bf16 values within bf16's rounding (2e-2 of each tensor's largest: the bf16 products round
/// their outputs, 8 bits, over sums of up to 13 rows; seen 3.7e-3 to 1.1e-2). With `combine_f32`
/// the routing weights scale in f32 and a token's outputs sum in f32, rounded once (Mixtral).
#[test]
fn bf16_experts_fold_each_update_into_the_weight() {
    let c = case(91);
    let (ids, w) = routing(92);
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let c16 = Case {
        x: bf(&c.x),
        gate_up: bf(&c.gate_up),
        down: bf(&c.down),
        lgu: (bf(&c.lgu.0), bf(&c.lgu.1)),
        ld: (bf(&c.ld.0), bf(&c.ld.1)),
        dy: bf(&c.dy),
    };
    let ex = experts(&c16, true);
    let (y, cache) = moe_forward(&c16.x, &ids, &w, K, &ex).unwrap();
    assert!(matches!(cache.kept, Kept::PerExpert(_)));
    let g = moe_backward(&c16.dy, &w, &ex, &cache).unwrap();
    // The stacks folded per expert in f32 and rounded once, then no LoRA.
    let fold = |stack: &Tensor, (a, b): &(Tensor, Tensor), s: f64| {
        let per: Vec<Tensor> = (0..E)
            .map(|e| {
                let (ae, be) = expert_factors(&ExpertLora { a, b, scale: s }, e, E).unwrap();
                folded(&stack.get(e).unwrap(), &ae, &be, s).unwrap()
            })
            .collect();
        Tensor::stack(&per, 0).unwrap()
    };
    let (gu_f, dn_f) = (
        fold(&c16.gate_up, &c16.lgu, S_GU),
        fold(&c16.down, &c16.ld, S_D),
    );
    let plain = Experts {
        gate_up: (&gu_f).into(),
        down: (&dn_f).into(),
        ..experts(&c16, false)
    };
    let (y_ref, cache_ref) = moe_forward(&c16.x, &ids, &w, K, &plain).unwrap();
    let g_ref = moe_backward(&c16.dy, &w, &plain, &cache_ref).unwrap();
    // bf16 to f32 is exact: equal f32 bits are equal bf16 bits.
    let bits = |t: &Tensor| -> Vec<u32> {
        let v: Vec<f32> = t
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    };
    assert_eq!(bits(&y), bits(&y_ref), "forward");
    assert_eq!(bits(&g.dx), bits(&g_ref.dx), "dx");
    // The same bf16 values in f32 (the low-rank products formed apart, f32 throughout).
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let c32 = Case {
        x: f(&c16.x),
        gate_up: f(&c16.gate_up),
        down: f(&c16.down),
        lgu: (f(&c16.lgu.0), f(&c16.lgu.1)),
        ld: (f(&c16.ld.0), f(&c16.ld.1)),
        dy: f(&c16.dy),
    };
    let ex32 = experts(&c32, true);
    let (_, cache32) = moe_forward(&c32.x, &ids, &w, K, &ex32).unwrap();
    let g32 = moe_backward(&c32.dy, &w, &ex32, &cache32).unwrap();
    for (name, got, want) in [
        (
            "gate_up A",
            &g.gate_up.as_ref().unwrap().0,
            &g32.gate_up.as_ref().unwrap().0,
        ),
        (
            "gate_up B",
            &g.gate_up.as_ref().unwrap().1,
            &g32.gate_up.as_ref().unwrap().1,
        ),
        (
            "down A",
            &g.down.as_ref().unwrap().0,
            &g32.down.as_ref().unwrap().0,
        ),
        (
            "down B",
            &g.down.as_ref().unwrap().1,
            &g32.down.as_ref().unwrap().1,
        ),
    ] {
        let e = rel64(&f(got), &want.to_dtype(DType::F64).unwrap());
        eprintln!("bf16 vs f32 LoRA gradient {name}: {e:e}");
        assert!(e <= 2e-2, "{name}: {e:e}");
    }
    // combine_f32: each token's outputs weighted and summed in f32, one rounding.
    let mixtral = Experts {
        combine_f32: true,
        ..plain
    };
    let (ym, _) = moe_forward(&c16.x, &ids, &w, K, &mixtral).unwrap();
    let groups = Groups::new(&ids, K, E).unwrap();
    let mut want = vec![0f32; T * H];
    for e in 0..E {
        for (&tok, &slot) in groups.tokens[e].iter().zip(&groups.slots[e]) {
            let xe = c16.x.get(tok as usize).unwrap().unsqueeze(0).unwrap();
            let gu = xe.matmul(&gu_f.get(e).unwrap().t().unwrap()).unwrap();
            let m = act::act_forward(&gu, ExpertAct::SwiGlu).unwrap();
            let d = m.matmul(&dn_f.get(e).unwrap().t().unwrap()).unwrap();
            let d: Vec<f32> = f(&d).flatten_all().unwrap().to_vec1().unwrap();
            for (j, v) in d.iter().enumerate() {
                want[tok as usize * H + j] += v * w[slot];
            }
        }
    }
    let want = Tensor::from_vec(want, (T, H), &Device::Cpu).unwrap();
    assert_eq!(bits(&ym), bits(&bf(&want)), "combine_f32");
    assert_ne!(bits(&ym), bits(&y_ref), "combine_f32 changed nothing");
}

/// The per-expert path in bf16 on `moe_timing`'s shape (E 128, top-8, 2048 tokens), forward and
/// backward, unadapted and with both stacks adapted (folded): best of 3 each, printed
/// (`cargo test --offline -p rtune-experts moe_timing_bf16 -- --ignored --nocapture`).
#[test]
#[ignore]
fn moe_timing_bf16() {
    use std::time::Instant;
    let (t, h, e, i, k, r) = (2048, 512, 128, 192, 8, 16);
    let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
    let x = bf(randn(&[t, h], 1, 1.0));
    let gate_up = bf(randn(&[e, 2 * i, h], 2, 0.05));
    let down = bf(randn(&[e, h, i], 3, 0.05));
    let (ag, bg) = (
        bf(randn(&[e * r, h], 4, 0.05)),
        bf(randn(&[2 * i, r * e], 5, 0.05)),
    );
    let (ad, bd) = (
        bf(randn(&[e * r, i], 6, 0.05)),
        bf(randn(&[h, r * e], 7, 0.05)),
    );
    let logits = flat(&randn(&[t, e], 8, 3.0));
    let routed = route(&logits, e, k, Routing::SoftmaxTopK { normalize: true }).unwrap();
    let dy = bf(randn(&[t, h], 9, 1.0));
    let w = &routed.weights;
    for lora in [false, true] {
        let ex = Experts {
            gate_up: (&gate_up).into(),
            down: (&down).into(),
            gate_up_bias: None,
            down_bias: None,
            act: ExpertAct::SwiGlu,
            lora_gate_up: lora.then_some(ExpertLora {
                a: &ag,
                b: &bg,
                scale: 2.0,
            }),
            lora_down: lora.then_some(ExpertLora {
                a: &ad,
                b: &bd,
                scale: 2.0,
            }),
            combine_f32: false,
        };
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            let (_, c) = moe_forward(&x, &routed.experts, w, k, &ex).unwrap();
            moe_backward(&dy, w, &ex, &c).unwrap();
            best = best.min(t0.elapsed().as_secs_f64());
        }
        eprintln!("bf16 per-expert lora {lora}: {:.1} ms", best * 1e3);
    }
}

/// gpt-oss's clamp at its bounds (issue 45's bf16 gradient gap): torch 2.15's scalar clamp passes
/// no gradient at `limit` itself (gate) nor at `±limit` (up), only strictly inside; in bf16 values
/// land on the limit exactly and the closed range put the gate_up `lora_B` gradient 0.36 off
/// PEFT's. Pairs `(g, u)`: g at the limit, u at +limit, u at −limit, g past it, u past −limit, both
/// inside; `dout = 0.5`. Want torch's, f32 and bf16 (bit for bit: the backward rounds where
/// torch's does):
/// ```python
/// gu = torch.tensor([[1.0, 0.5, 0.5, 1.0, 0.5, -1.0, 1.5, 0.25, 0.25, -1.5, 0.75, 0.125]],
///                   dtype=dt, requires_grad=True)
/// gate, up = gu[..., ::2].clamp(min=None, max=1.0), gu[..., 1::2].clamp(min=-1.0, max=1.0)
/// o = (up + 1) * (gate * torch.sigmoid(gate * 1.702)); o.backward(torch.full_like(o, 0.5))
/// ```
#[test]
fn clamp_passes_no_gradient_at_the_limit_as_torch() {
    let act = ExpertAct::Clamped {
        alpha: 1.702,
        limit: 1.0,
    };
    let gu = [
        1.0f32, 0.5, 0.5, 1.0, 0.5, -1.0, 1.5, 0.25, 0.25, -1.5, 0.75, 0.125,
    ];
    let f32_want = [
        0.0f32, 0.42289788, 0.8792219, 0.0, 0.0, 0.0, 0.0, 0.42289788, 0.0, 0.0, 0.56225896,
        0.293195,
    ];
    let bf16_want = [
        0.0f32, 0.42382812, 0.87890625, 0.0, 0.0, 0.0, 0.0, 0.42382812, 0.0, 0.0, 0.5625,
        0.29296875,
    ];
    for (dt, want) in [(DType::F32, f32_want), (DType::BF16, bf16_want)] {
        let gu = Tensor::new(&gu, &Device::Cpu)
            .unwrap()
            .reshape((1, 12))
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let dm = Tensor::full(0.5f32, (1, 6), &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let got = flat(
            &act::act_backward(&dm, &gu, act)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        );
        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
            // f32: torch's sums in another order, an ulp or two; bf16: the same bits.
            let tol = if dt == DType::F32 { 1e-6 } else { 0.0 };
            assert!((g - w).abs() <= tol, "{dt:?} entry {j}: {g} vs torch {w}");
        }
    }
}

/// The routing weights' gradient in bf16 as torch's `mul` backward forms it (`weighted_out =
/// proj_out * sample_weights_g` in transformers' experts): each `dy·d` rounded to bf16, the row
/// summed in f32 and rounded. Want torch's (bit for bit), which neither the f32 sum nor its
/// rounding gives here (0.09248, −0.03030 in f32); Mixtral's f32 weights keep the f32 sum:
/// ```python
/// g = torch.Generator().manual_seed(3)  # the first of its draws where both alternatives differ
/// d = torch.randn(2, 8, generator=g).bfloat16(); dy = (torch.randn(2, 8, generator=g) * 0.01).bfloat16()
/// w = torch.tensor([[0.5], [0.25]], dtype=torch.bfloat16, requires_grad=True)
/// (d * w).backward(dy); w.grad
/// ```
#[test]
fn weight_grads_round_as_torch_in_bf16() {
    let d = [
        -0.1259765625f64,
        0.310546875,
        2.46875,
        -1.0859375,
        1.65625,
        -0.9765625,
        -0.51171875,
        -0.703125,
        -1.015625,
        -1.1875,
        0.462890625,
        0.48046875,
        0.1904296875,
        -0.03759765625,
        -0.0712890625,
        -1.1484375,
    ];
    let dy = [
        -0.0079345703125f64,
        0.01055908203125,
        0.012939453125,
        0.0016021728515625,
        0.01177978515625,
        -0.0284423828125,
        -0.00390625,
        -0.01239013671875,
        -0.00408935546875,
        -0.0003509521484375,
        -0.00531005859375,
        0.0007781982421875,
        -0.0115966796875,
        -0.0030670166015625,
        -0.003997802734375,
        0.0269775390625,
    ];
    // bf16 values, exact in f64 and f32 (written in f64: clippy counts their digits).
    let t = |v: &[f64], dt| {
        Tensor::new(v, &Device::Cpu)
            .unwrap()
            .reshape((2, 8))
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    };
    let (d16, dy16) = (t(&d, DType::BF16), t(&dy, DType::BF16));
    let want = [0.0927734375f64, -0.0303955078125].map(|v| v as f32);
    assert_eq!(weight_grads(&dy16, &d16, true).unwrap(), want);
    // Unrounded (f32 weights, or f32 compute): the f32 sum.
    for got in [
        weight_grads(&dy16, &d16, false).unwrap(),
        weight_grads(&t(&dy, DType::F32), &t(&d, DType::F32), true).unwrap(),
    ] {
        for (g, w) in got.iter().zip([0.09247982f32, -0.030304126]) {
            assert!((g - w).abs() <= 1e-7, "{g} vs the f32 sum {w}");
        }
    }
}
