//! Each hand-written backward against candle's autograd on the plain formulation of the same op.
//! Inputs are fresh random f32; tolerance 1e-5 relative to the largest gradient entry (f32 rounding
//! differs only in summation order).

use super::*;
use candle_core::{Device, Var};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn assert_close(got: &Tensor, want: &Tensor, what: &str) {
    let scale = want
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .max(1e-6);
    let err = (got - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(err / scale < 1e-5, "{what}: max err {err} vs scale {scale}");
}

#[test]
fn rms_norm_matches_autograd() {
    let x = Var::from_tensor(&randn(&[6, 8], 1)).unwrap();
    let w = randn(&[8], 2);
    let dy = randn(&[6, 8], 3);
    let r = (x.sqr().unwrap().mean_keepdim(1).unwrap() + 1e-5)
        .unwrap()
        .sqrt()
        .unwrap()
        .recip()
        .unwrap();
    let y = x.broadcast_mul(&r).unwrap().broadcast_mul(&w).unwrap();
    let grads = (y.clone() * &dy)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (y2, cache) = rms_norm(&x, &w, 1e-5).unwrap();
    assert_close(&y2, &y, "rms_norm forward");
    let dx = rms_norm_backward(&dy, &w, &cache).unwrap();
    assert_close(&dx, grads.get(&x).unwrap(), "rms_norm dx");
}

#[test]
fn swiglu_matches_autograd() {
    let g = Var::from_tensor(&(randn(&[5, 7], 4) * 4.0).unwrap()).unwrap();
    let u = Var::from_tensor(&randn(&[5, 7], 5)).unwrap();
    let dh = randn(&[5, 7], 6);
    let y = (g.silu().unwrap() * u.as_tensor()).unwrap();
    let grads = (y * &dh).unwrap().sum_all().unwrap().backward().unwrap();
    let (dg, du) = swiglu_backward(&dh, &g, &u).unwrap();
    assert_close(&dg, grads.get(&g).unwrap(), "swiglu dg");
    assert_close(&du, grads.get(&u).unwrap(), "swiglu du");
}

/// The plain attention: repeat_kv, rope via narrow/cat, softmax from exp/sum.
fn reference_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &AttnShape,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
) -> Tensor {
    let (b, t, h, hkv, dh) = (s.b, s.t, s.heads, s.kv_heads, s.head_dim);
    let g = h / hkv;
    let q = q.reshape((b, t, h, dh)).unwrap().transpose(1, 2).unwrap();
    let k = k.reshape((b, t, hkv, dh)).unwrap().transpose(1, 2).unwrap();
    let v = v.reshape((b, t, hkv, dh)).unwrap().transpose(1, 2).unwrap();
    let q = crate::rope::apply_reference(&q, cos, sin).unwrap();
    let k = crate::rope::apply_reference(&k, cos, sin).unwrap();
    let rep = |x: Tensor| {
        x.unsqueeze(2)
            .unwrap()
            .broadcast_as((b, hkv, g, t, dh))
            .unwrap()
            .reshape((b, h, t, dh))
            .unwrap()
    };
    let (k, v) = (rep(k), rep(v));
    let sc = (q
        .contiguous()
        .unwrap()
        .matmul(&k.t().unwrap().contiguous().unwrap())
        .unwrap()
        / (dh as f64).sqrt())
    .unwrap();
    let sc = sc.broadcast_add(&mask.squeeze(2).unwrap()).unwrap();
    let max = sc.max_keepdim(D::Minus1).unwrap().detach();
    let e = sc.broadcast_sub(&max).unwrap().exp().unwrap();
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
    let o = p.matmul(&v.contiguous().unwrap()).unwrap();
    o.transpose(1, 2).unwrap().reshape((b * t, h * dh)).unwrap()
}

#[test]
fn attention_matches_autograd() {
    let s = AttnShape {
        b: 2,
        t: 5,
        heads: 4,
        kv_heads: 2,
        head_dim: 6,
    };
    let n = s.b * s.t;
    let q = Var::from_tensor(&randn(&[n, 24], 7)).unwrap();
    let k = Var::from_tensor(&randn(&[n, 12], 8)).unwrap();
    let v = Var::from_tensor(&randn(&[n, 12], 9)).unwrap();
    let inv: Vec<f32> = vec![1.0, 0.1, 0.01];
    let pos: Vec<u32> = (0..n as u32).map(|i| i % 5 + 2).collect();
    let (cos, sin) = crate::rope::tables(&inv, &pos, s.b, s.t, DType::F32, &Device::Cpu).unwrap();
    let mask = causal_mask(s.t, Some(3), &Device::Cpu).unwrap();
    let d_out = randn(&[n, 24], 10);
    let want = reference_attention(&q, &k, &v, &s, &cos, &sin, &mask);
    let grads = (want.clone() * &d_out)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    // Both ways of getting the probabilities back in backward: kept, and recomputed from lse.
    for keep in [true, false] {
        let (got, cache) = attention_keeping(&q, &k, &v, &s, &cos, &sin, &mask, keep).unwrap();
        assert_eq!(cache.p.is_some(), keep);
        assert_close(&got, &want, "attention forward");
        let (dq, dk, dv) = attention_backward(&d_out, &cache, &s, &cos, &sin).unwrap();
        assert_close(&dq, grads.get(&q).unwrap(), "attention dq");
        assert_close(&dk, grads.get(&k).unwrap(), "attention dk");
        assert_close(&dv, grads.get(&v).unwrap(), "attention dv");
    }
}

#[test]
fn chunked_cross_entropy_matches_autograd() {
    let h = Var::from_tensor(&randn(&[7, 8], 11)).unwrap();
    let w = (randn(&[13, 8], 12) * 3.0).unwrap();
    let targets = [Some(3u32), None, Some(12), Some(0), None, Some(5), Some(5)];
    // Plain: full logits, log-softmax, pick, sum.
    let logits = h.matmul(&w.t().unwrap()).unwrap();
    let max = logits.max_keepdim(1).unwrap().detach();
    let z = logits.broadcast_sub(&max).unwrap();
    let lse = z.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
    let logp = z.broadcast_sub(&lse).unwrap();
    let mut total = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
    for (i, t) in targets.iter().enumerate() {
        if let Some(t) = t {
            total = (total - logp.get(i).unwrap().get(*t as usize).unwrap()).unwrap();
        }
    }
    let grads = (&total * 0.25).unwrap().backward().unwrap();
    for chunk in [1, 2, 3, 100] {
        let (loss, dh) = chunked_cross_entropy(&h, &w, &targets, 0.25, chunk).unwrap();
        let want = total.to_scalar::<f32>().unwrap() as f64;
        assert!(
            (loss - want).abs() / want < 1e-5,
            "chunk {chunk}: loss {loss} vs {want}"
        );
        assert_close(&dh, grads.get(&h).unwrap(), "cross-entropy dh");
    }
}

#[test]
fn rope_backward_is_the_transpose() {
    let x = Var::from_tensor(&randn(&[1, 2, 3, 8], 13)).unwrap();
    let inv = vec![1.0f32, 0.5, 0.25, 0.125];
    let (cos, sin) = crate::rope::tables(&inv, &[0, 5, 9], 1, 3, DType::F32, &Device::Cpu).unwrap();
    let dy = randn(&[1, 2, 3, 8], 14);
    let y = crate::rope::apply_reference(&x, &cos, &sin).unwrap();
    let grads = (y * &dy).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = crate::rope::apply_backward(&dy, &cos, &sin).unwrap();
    assert_close(&dx, grads.get(&x).unwrap(), "rope dx");
}
