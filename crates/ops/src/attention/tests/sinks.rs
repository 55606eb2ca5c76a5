//! Attention sinks ([`crate::attention::sinks`]) on both paths against a plain f64 formulation
//! differentiated by candle's autograd: transformers' `eager_attention_forward` for gpt-oss
//! (scores, mask, the sink logit concatenated as one more column, softmax, the column dropped).
//! GQA 4/2 with a sliding window of 5 over 19 tokens and packed rows; sinks of ±2 so their share of
//! the mass is large (a forward or backward that ignores them misses by far more than the tolerance).
//! RoPE tables are the identity here (the rotation is the same op with or without sinks, tested in
//! `tests.rs`). Tolerance 1e-5 of the largest element: f32 against f64, as the paths' own rule.

use super::{randn, rel_err};
use crate::attention::sinks::{apply_sinks, attend_sinked, sink_grad};
use crate::{AttnMask, AttnPath, AttnShape};
use candle_core::{DType, Device, Tensor, Var, D};

const B: usize = 2;
const T: usize = 19;
const H: usize = 4;
const HKV: usize = 2;
const DH: usize = 8;

/// `(o, dq, dk, dv, dsinks)` of the f64 formulation; `q: (B, H, T, Dh)`, `k, v: (B, Hkv, T, Dh)`.
fn reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: &Tensor,
    mask: &Tensor,
    d_out: &Tensor,
    scale: f64,
) -> [Tensor; 5] {
    let f64v = |x: &Tensor| Var::from_tensor(&x.to_dtype(DType::F64).unwrap()).unwrap();
    let (q, k, v, sk) = (f64v(q), f64v(k), f64v(v), f64v(sinks));
    let g = H / HKV;
    // repeat_kv: query head h reads kv head h / G.
    let rep = |x: &Tensor| {
        x.unsqueeze(2)
            .unwrap()
            .broadcast_as((B, HKV, g, T, DH))
            .unwrap()
            .reshape((B, H, T, DH))
            .unwrap()
    };
    let (kr, vr) = (rep(k.as_tensor()), rep(v.as_tensor()));
    let mask = mask
        .to_dtype(DType::F64)
        .unwrap()
        .reshape(((), 1, T, T))
        .unwrap();
    let scores = (q.as_tensor().matmul(&kr.t().unwrap()).unwrap() * scale)
        .unwrap()
        .broadcast_add(&mask)
        .unwrap();
    let sink_col = sk
        .as_tensor()
        .reshape((1, H, 1, 1))
        .unwrap()
        .broadcast_as((B, H, T, 1))
        .unwrap();
    let all = Tensor::cat(&[&scores, &sink_col], 3).unwrap();
    let max = all.max_keepdim(D::Minus1).unwrap().detach();
    let e = all.broadcast_sub(&max).unwrap().exp().unwrap();
    let p = e
        .broadcast_div(&e.sum_keepdim(D::Minus1).unwrap())
        .unwrap()
        .narrow(3, 0, T)
        .unwrap();
    let o = p.matmul(&vr).unwrap(); // (B, H, T, Dh)
    let d_out = d_out.to_dtype(DType::F64).unwrap();
    let loss = (&o * &d_out).unwrap().sum_all().unwrap();
    let gr = loss.backward().unwrap();
    let grad = |x: &Var| gr.get(x.as_tensor()).unwrap().clone();
    [o, grad(&q), grad(&k), grad(&v), grad(&sk)]
}

/// `(B, T, X·Dh)` laid out as `(N, X·Dh)` -> `(B, X, T, Dh)`.
fn heads(x: &Tensor, x_heads: usize) -> Tensor {
    x.reshape((B, T, x_heads, DH))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
}

#[test]
fn sinks_match_the_f64_formulation_on_both_paths() {
    let n = B * T;
    let q = randn(&[n, H * DH], 80, 1.5);
    let k = randn(&[n, HKV * DH], 81, 1.5);
    let v = randn(&[n, HKV * DH], 82, 1.0);
    let d_out = randn(&[n, H * DH], 83, 1.0);
    let sinks = Tensor::new(&[2.0f32, -2.0, 0.5, 1.5], &Device::Cpu).unwrap();
    // Identity RoPE: inverse frequencies 0.
    let pos: Vec<u32> = (0..n as u32).collect();
    let (cos, sin) =
        crate::rope::tables(&[0.0; DH / 2], &pos, B, T, DType::F32, &Device::Cpu).unwrap();
    // Row 0 one sample, row 1 two packed samples of 7 and 12.
    let segs: Vec<u32> = (0..T)
        .map(|_| 0)
        .chain((0..T).map(|i| u32::from(i >= 7)))
        .collect();
    let mask = AttnMask::new(Some(&segs), B, T, Some(5), &Device::Cpu).unwrap();
    let s = AttnShape::new(B, T, H, HKV, DH);
    let want = reference(
        &heads(&q, H),
        &heads(&k, HKV),
        &heads(&v, HKV),
        &sinks,
        &mask.dense().unwrap(),
        &heads(&d_out, H),
        s.scale,
    );
    // The reference in the op's layouts: o, dq (N, H·Dh); dk, dv (N, Hkv·Dh); dsinks (H,).
    let flat = |x: &Tensor| {
        let hs = x.dim(1).unwrap();
        x.transpose(1, 2).unwrap().reshape((n, hs * DH)).unwrap()
    };
    let want = [
        flat(&want[0]),
        flat(&want[1]),
        flat(&want[2]),
        flat(&want[3]),
        want[4].clone(),
    ];
    let no_sinks = crate::attend(&q, &k, &v, &s, &cos, &sin, &mask, AttnPath::Plain)
        .unwrap()
        .0;
    let moved = rel_err(&no_sinks, &want[0].to_dtype(DType::F32).unwrap());
    assert!(moved > 1e-2, "the sinks move the output by only {moved:e}");
    // `joined`: the sinks in the softmax ([`attend_sinked`]; the plain path's probabilities
    // dropped after the forward for `keep = false`, so the backward recomputes them).
    for (path, keep, joined) in [
        (AttnPath::Plain, true, false),
        (AttnPath::Plain, false, false),
        (AttnPath::Tiled, false, false),
        (AttnPath::Plain, true, true),
        (AttnPath::Plain, false, true),
        (AttnPath::Tiled, false, true),
    ] {
        let (o, c) = match (path, keep, joined) {
            (_, _, true) => {
                let (o, mut c) =
                    attend_sinked(&q, &k, &v, &s, &cos, &sin, &mask, path, &sinks).unwrap();
                if path == AttnPath::Plain {
                    assert!(c.p.is_some(), "small rows keep their probabilities");
                    if !keep {
                        c.p = None;
                    }
                }
                (o, c)
            }
            (AttnPath::Plain, keep, _) => {
                let dense = mask.dense().unwrap();
                let (o, c) =
                    crate::attention_keeping(&q, &k, &v, &s, &cos, &sin, &dense, keep).unwrap();
                apply_sinks(&o, c, &s, &sinks).unwrap()
            }
            _ => {
                let (o, c) = crate::attend(&q, &k, &v, &s, &cos, &sin, &mask, path).unwrap();
                apply_sinks(&o, c, &s, &sinks).unwrap()
            }
        };
        let ds = sink_grad(&d_out, &o, &c, &s).unwrap();
        let (dq, dk, dv) = crate::attention_backward(&d_out, &c, &s, &cos, &sin).unwrap();
        for (name, (got, w)) in ["o", "dq", "dk", "dv", "dsinks"]
            .iter()
            .zip([o, dq, dk, dv, ds].iter().zip(&want))
        {
            let e = rel_err(got, &w.to_dtype(DType::F32).unwrap());
            eprintln!("{path:?} keep={keep} joined={joined} {name}: relative error {e:.2e}");
            assert!(
                e <= 1e-5,
                "{path:?} keep={keep} joined={joined} {name}: {e:e} > 1e-5"
            );
        }
    }
}

#[test]
fn sinks_refuse_bad_inputs() {
    let n = B * T;
    let q = randn(&[n, H * DH], 84, 1.0);
    let k = randn(&[n, HKV * DH], 85, 1.0);
    let pos: Vec<u32> = (0..n as u32).collect();
    let (cos, sin) =
        crate::rope::tables(&[0.0; DH / 2], &pos, B, T, DType::F32, &Device::Cpu).unwrap();
    let mask = AttnMask::new(None, B, T, None, &Device::Cpu).unwrap();
    let s = AttnShape::new(B, T, H, HKV, DH);
    let (o, c) = crate::attend(&q, &k, &k, &s, &cos, &sin, &mask, AttnPath::Plain).unwrap();
    let short = Tensor::zeros(H - 1, DType::F32, &Device::Cpu).unwrap();
    let e = apply_sinks(&o, c.clone(), &s, &short).unwrap_err();
    assert!(e.to_string().contains("one logit a query head"), "{e}");
    let e = sink_grad(&o, &o, &c, &s).unwrap_err();
    assert!(e.to_string().contains("no sinks"), "{e}");
    let mut capped = s.clone();
    capped.softcap = Some(30.0);
    let sinks = Tensor::zeros(H, DType::F32, &Device::Cpu).unwrap();
    let e = apply_sinks(&o, c, &capped, &sinks).unwrap_err();
    assert!(e.to_string().contains("soft-capped"), "{e}");
}
