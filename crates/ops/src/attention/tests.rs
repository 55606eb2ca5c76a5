//! Attention: both paths against the plain one and candle's autograd (f32, bf16, autocast), the
//! softmax's slice reference against textbook formulas.

use super::mask::*;
use super::reference::*;
use super::*;
use crate::test_util::*;
use candle_core::{DType, Device, Tensor, Var, D};
use rtune_backend::check::Rng;
use rtune_backend::Precision;

mod cudnn;
mod flash_ref;
mod sinks;

#[test]
fn attention_softmax_matches_plain() {
    // (1, 2, 3·37, 37): rows with a 5-element tail; (1, 1, 2·130, 130): many rayon tasks. A
    // causal mask with a window, so rows hold −∞; scale 1/√6 is not exact in bf16 (kept f32 and
    // the product rounded once, as torch does).
    for (i, &(hkv, g, t)) in [(2, 3, 37), (1, 2, 130)].iter().enumerate() {
        let s = 10 * i as u64;
        let raw = randn(&[1, hkv, g * t, t], s + 50, 6.0);
        let dp = randn(&[1, hkv, g * t, t], s + 51, 1.0);
        let mask = crate::causal_mask(t, Some(t / 2 + 1), &Device::Cpu).unwrap();
        let scale = 1.0 / 6f64.sqrt();
        for (raw, dp) in [(raw.clone(), dp.clone()), (bf16(&raw), bf16(&dp))] {
            let dt = raw.dtype();
            let p = crate::attention::softmax::attn_softmax(&raw, &mask, scale).unwrap();
            let want = crate::attention::attention_probs_reference(&raw, &mask, scale).unwrap();
            // Probabilities are f32 whatever the scores' dtype; bf16 scores scale identically.
            assert_f32(&p, &want, &format!("attn_softmax {dt:?}"));
            let ds = crate::attention::softmax::attn_softmax_bwd(&want, &dp, scale).unwrap();
            let want = crate::attention::attention_grad_reference(&want, &dp, scale).unwrap();
            match dt {
                DType::F32 => assert_f32(&ds, &want, "attn_softmax_bwd f32"),
                _ => assert_bf16(&ds, &want, "attn_softmax_bwd bf16"),
            }
        }
    }
}

/// One shape of [`tiled_attention_matches_plain`]: `(b, t, heads, kv_heads, head_dim)`, a sliding
/// window, packed rows (sample lengths of each row).
struct AttnCase {
    dims: (usize, usize, usize, usize, usize),
    window: Option<usize>,
    packed: Option<Vec<Vec<usize>>>,
    /// Gemma 2's soft cap of the scaled scores.
    softcap: Option<f64>,
    what: &'static str,
}

/// `(out, dq, dk, dv)` of the model's attention ([`crate::attend`]) on `path`, inputs of dtype `dt`
/// (rounded through bf16 first when `via_bf16`).
fn attend_on(c: &AttnCase, dt: DType, path: crate::AttnPath, via_bf16: bool) -> [Tensor; 4] {
    let (b, t, h, hkv, dh) = c.dims;
    let mut s = crate::AttnShape::new(b, t, h, hkv, dh);
    s.softcap = c.softcap;
    let n = b * t;
    let cast = |x: Tensor| {
        let x = if via_bf16 { bf16(&x) } else { x };
        x.to_dtype(dt).unwrap()
    };
    let q = cast(randn(&[n, h * dh], 70, 1.5));
    let k = cast(randn(&[n, hkv * dh], 71, 1.5));
    let v = cast(randn(&[n, hkv * dh], 72, 1.0));
    let d_out = cast(randn(&[n, h * dh], 73, 1.0));
    let (cos, sin) = rand_tables(b, t, dh);
    let (cos, sin) = (cast(cos), cast(sin));
    let segs: Option<Vec<u32>> = c.packed.as_ref().map(|rows| {
        rows.iter()
            .flat_map(|lens| {
                assert_eq!(lens.iter().sum::<usize>(), t);
                lens.iter()
                    .enumerate()
                    .flat_map(|(i, &l)| std::iter::repeat_n(i as u32, l))
            })
            .collect()
    });
    let mask = crate::AttnMask::new(segs.as_deref(), b, t, c.window, &Device::Cpu).unwrap();
    let (o, cache) = crate::attend(&q, &k, &v, &s, &cos, &sin, &mask, path).unwrap();
    let (dq, dk, dv) = crate::attention_backward(&d_out, &cache, &s, &cos, &sin).unwrap();
    [o, dq, dk, dv]
}

/// Names of the four tensors [`attend_on`] returns.
const ATTN_OUTPUTS: [&str; 4] = ["out", "dq", "dk", "dv"];

/// The f32 rule for a tiled attention against the plain path: both compute in f32; the tiled one
/// sums scores in another order, rescales by e^(m_old − m_new) and takes P = e^(s − lse) in the
/// backward, D = rowsum(dO∘O) for Σ dP∘P: a few f32 ulps of each term, far under 1e-5 of the
/// largest element.
fn assert_attention_f32(c: &AttnCase, got: &[Tensor; 4], plain: &[Tensor; 4]) {
    const TOL: f32 = 1e-5;
    for (name, (g, w)) in ATTN_OUTPUTS.iter().zip(got.iter().zip(plain)) {
        let e = rel_err(g, w);
        eprintln!("{} {name}: relative error {e:.2e}", c.what);
        assert!(
            e <= TOL,
            "{} {name}: relative error {e:e} > {TOL:e}",
            c.what
        );
    }
}

/// The bf16 rule: `got` (bf16 inputs, f32 accumulation) against `truth` (the plain path in f32 on
/// the same bf16-rounded inputs). The plain bf16 path rounds P to bf16 before P·V and dP, dS
/// between its products: a few bf16 roundings (2^-8 relative each) of terms as large as the
/// result. `got` is held to the plain bf16 path's own error against the truth plus one rounding of
/// the largest element (2^-8: its rotated q/k are bf16 as the plain path's are, its output is
/// rounded once), and to 2% overall.
fn assert_attention_bf16(
    c: &AttnCase,
    got: &[Tensor; 4],
    plain: &[Tensor; 4],
    truth: &[Tensor; 4],
) {
    const TOL: f32 = 2e-2;
    const ONE_ROUNDING: f32 = 1.0 / 256.0;
    for (i, name) in ATTN_OUTPUTS.iter().enumerate() {
        assert_eq!(got[i].dtype(), DType::BF16);
        let e = rel_err(&got[i], &truth[i]);
        let e_plain = rel_err(&plain[i], &truth[i]);
        eprintln!(
            "{} {name}: relative error {e:.2e} (plain bf16: {e_plain:.2e})",
            c.what
        );
        assert!(
            e <= TOL && e <= e_plain + ONE_ROUNDING,
            "{} {name}: relative error {e:e} (plain bf16 {e_plain:e})",
            c.what
        );
    }
}

#[test]
fn tiled_attention_matches_plain() {
    // Odd T everywhere (not a multiple of the 64-query/64-key tiles), several tiles per head.
    let cases = [
        AttnCase {
            dims: (2, 77, 8, 2, 16),
            window: None,
            packed: None,
            softcap: None,
            what: "causal GQA 8/2",
        },
        AttnCase {
            dims: (1, 130, 4, 1, 24),
            window: None,
            packed: None,
            softcap: None,
            what: "causal MQA",
        },
        AttnCase {
            dims: (2, 12, 4, 2, 8),
            window: Some(5),
            packed: None,
            softcap: None,
            what: "sliding window 5 over 12",
        },
        AttnCase {
            dims: (2, 141, 4, 2, 16),
            window: Some(50),
            packed: None,
            softcap: None,
            what: "sliding window 50 over 141",
        },
        AttnCase {
            dims: (2, 99, 4, 2, 16),
            window: None,
            packed: Some(vec![vec![30, 50, 19], vec![1, 70, 28]]),
            softcap: None,
            what: "packed rows of 3 samples",
        },
        AttnCase {
            dims: (2, 99, 4, 1, 16),
            window: Some(20),
            packed: Some(vec![vec![10, 60, 29], vec![65, 33, 1]]),
            softcap: None,
            what: "packed rows of 3 samples, window 20, MQA",
        },
        // Gemma 2: soft-capped scores (cap 1.5 bends most of these), alone and with a window.
        AttnCase {
            dims: (2, 141, 4, 2, 16),
            window: None,
            packed: None,
            softcap: Some(1.5),
            what: "soft cap 1.5, GQA 4/2",
        },
        AttnCase {
            dims: (2, 99, 4, 2, 16),
            window: Some(20),
            packed: Some(vec![vec![10, 60, 29], vec![65, 33, 1]]),
            softcap: Some(1.5),
            what: "soft cap 1.5, packed, window 20",
        },
    ];
    for c in &cases {
        let plain = attend_on(c, DType::F32, crate::AttnPath::Plain, false);
        let tiled = attend_on(c, DType::F32, crate::AttnPath::Tiled, false);
        assert_attention_f32(c, &tiled, &plain);
    }
}

#[test]
fn tiled_attention_bf16_matches_plain_within_its_rounding() {
    // bf16 inputs (and rotary tables, and the rotated q/k), f32 accumulation on the tiled path;
    // the rule is assert_attention_bf16's.
    for c in [
        AttnCase {
            dims: (2, 77, 8, 2, 16),
            window: None,
            packed: None,
            softcap: None,
            what: "bf16 causal GQA 8/2",
        },
        AttnCase {
            dims: (2, 99, 4, 1, 16),
            window: Some(20),
            packed: Some(vec![vec![10, 60, 29], vec![65, 33, 1]]),
            softcap: None,
            what: "bf16 packed, window, MQA",
        },
        AttnCase {
            dims: (2, 141, 4, 2, 16),
            window: Some(50),
            packed: None,
            softcap: Some(1.5),
            what: "bf16 soft cap 1.5, window 50",
        },
    ] {
        let truth = attend_on(&c, DType::F32, crate::AttnPath::Plain, true);
        let plain = attend_on(&c, DType::BF16, crate::AttnPath::Plain, false);
        let tiled = attend_on(&c, DType::BF16, crate::AttnPath::Tiled, false);
        assert_attention_bf16(&c, &tiled, &plain, &truth);
    }
}

/// Under bf16 autocast the tiled attention's tile products take bf16-rounded operands, as every
/// other product of an autocast step (regression: it computed in f32, so f32 noise in `q, k, v, dO`
/// — oneDNN vs the fallback's summation order — reached the gradients instead of vanishing in the
/// rounding). Checked as what rounding means: f32 inputs give the same bits as the same inputs
/// rounded to bf16 first (tolerance 0: rounding is idempotent, the kernel's sums run in a fixed
/// order). Without autocast the two differ (the f32 kernel reads the unrounded values), so the
/// check is not vacuous. Three key tiles (T = 150), GQA 4/2.
#[test]
fn tiled_attention_under_autocast_rounds_its_operands_to_bf16() {
    let (b, h, hkv, t, dh) = (2, 4, 2, 150, 16);
    let q = randn(&[b, h, t, dh], 80, 1.5);
    let k = randn(&[b, hkv, t, dh], 81, 1.5);
    let v = randn(&[b, hkv, t, dh], 82, 1.0);
    let d_o = randn(&[b, t, h, dh], 83, 1.0);
    let starts = Tensor::zeros((1, t), DType::U32, &Device::Cpu).unwrap();
    let r = |x: &Tensor| bf16(x).to_dtype(DType::F32).unwrap();
    let (qr, kr, vr, d_or) = (r(&q), r(&k), r(&v), r(&d_o));
    let run = |[q, k, v, d_o]: [&Tensor; 4]| -> [Tensor; 5] {
        let (o, lse) = crate::attention::tiled::flash_attn(q, k, v, &starts, 0.25, None).unwrap();
        let (dq, dk, dv) =
            crate::attention::tiled::flash_attn_bwd(q, k, v, &o, &lse, d_o, &starts, 0.25, None)
                .unwrap();
        [o, lse, dq, dk, dv]
    };
    let names = ["o", "lse", "dq", "dk", "dv"];
    {
        let _autocast = rtune_backend::blas::autocast::scope(true);
        let raw = run([&q, &k, &v, &d_o]);
        let rounded = run([&qr, &kr, &vr, &d_or]);
        for (name, (a, b)) in names.iter().zip(raw.iter().zip(&rounded)) {
            assert_eq!(a.dtype(), DType::F32, "{name}");
            let e = rel_err(a, b);
            assert!(
                e == 0.0,
                "autocast {name}: f32 vs bf16-rounded inputs differ by {e:e}"
            );
        }
    }
    let raw = run([&q, &k, &v, &d_o]);
    let rounded = run([&qr, &kr, &vr, &d_or]);
    for (name, (a, b)) in names.iter().zip(raw.iter().zip(&rounded)) {
        let e = rel_err(a, b);
        eprintln!("f32 {name}: unrounded vs rounded inputs {e:.2e}");
        assert!(
            e > 1e-4,
            "f32 {name}: rounding the inputs changes nothing ({e:e})"
        );
    }
}

/// Under autocast the tile products take bf16 operands, `P` and `dS` included: one tile (T = 40,
/// causal) against the formulas in plain ops with `Q, K, V, dO` rounded and `S = Q·Kᵀ·scale`.
/// Forward: `o = bf16(e^(S − m))·V / Σ e^(S − m)` (the unnormalised `P` rounded, as torch's CPU
/// flash kernel; the row sum unrounded). Backward, with `P = e^(S − L)` from the forward's
/// log-sum-exp, `D = rowsum(dO ∘ O)`, `dS = P ∘ (dO·Vᵀ − D)·scale`: `dQ = bf16(dS)·K`,
/// `dK = bf16(dS)ᵀ·Q`, `dV = bf16(P)ᵀ·dO`. Tolerance 1e-5: f32 summation order and the kernel's
/// own `exp` (an entry that lands on the other side of a bf16 boundary would move a result by
/// ~1e-3; none does here). The same formulas on unrounded `P` and `dS` are > 1e-4 away (checked):
/// without `P`'s rounding `o` is 7.8e-4 off, `dV` 1.3e-3; without `dS`'s `dQ` 2.3e-3.
#[test]
fn tiled_attention_under_autocast_rounds_p_and_ds() -> Result<()> {
    let (t, dh, scale) = (40, 16, 0.25);
    let q = randn(&[1, 1, t, dh], 93, 1.5);
    let k = randn(&[1, 1, t, dh], 94, 1.5);
    let v = randn(&[1, 1, t, dh], 95, 1.0);
    let d_o = randn(&[1, t, 1, dh], 96, 1.0);
    let starts = Tensor::zeros((1, t), DType::U32, &Device::Cpu)?;
    let (o, lse, got) = {
        let _autocast = rtune_backend::blas::autocast::scope(true);
        let (o, lse) = crate::attention::tiled::flash_attn(&q, &k, &v, &starts, scale, None)?;
        let g = crate::attention::tiled::flash_attn_bwd(
            &q, &k, &v, &o, &lse, &d_o, &starts, scale, None,
        )?;
        (o, lse, g)
    };
    let r = |x: &Tensor| bf16(x).to_dtype(DType::F32);
    let (qr, kr, vr) = (r(&q)?, r(&k)?, r(&v)?);
    let dor = r(&d_o)?.transpose(1, 2)?.contiguous()?; // (1, 1, T, Dh)
    let o = o.transpose(1, 2)?.contiguous()?;
    let lse = lse.reshape((1, 1, t, 1))?;
    let mask = crate::causal_mask(t, None, &Device::Cpu)?.reshape((1, 1, t, t))?;
    let s = (qr.matmul(&kr.t()?)? * scale)?.broadcast_add(&mask)?;
    let e = s.broadcast_sub(&s.max_keepdim(3)?)?.exp()?;
    let l = e.sum_keepdim(3)?;
    let fwd = |e: &Tensor| e.matmul(&vr)?.broadcast_div(&l);
    let err = rel_err(&o, &fwd(&r(&e)?)?);
    assert!(err < 1e-5, "o vs its formula on bf16 operands: {err:e}");
    let err = rel_err(&o, &fwd(&e)?);
    assert!(err > 1e-4, "o: the rounding of P is visible: {err:e}");
    let p = s.broadcast_sub(&lse)?.exp()?;
    let dd = (&dor * &o)?.sum_keepdim(3)?;
    let ds = (p.clone() * dor.matmul(&vr.t()?)?.broadcast_sub(&dd)?)?.affine(scale, 0.0)?;
    let formulas = |p: &Tensor, ds: &Tensor| -> Result<[Tensor; 3]> {
        Ok([ds.matmul(&kr)?, ds.t()?.matmul(&qr)?, p.t()?.matmul(&dor)?])
    };
    let want = formulas(&r(&p)?, &r(&ds)?)?;
    let unrounded = formulas(&p, &ds)?;
    for (name, (g, (w, u))) in ["dq", "dk", "dv"].iter().zip(
        [&got.0, &got.1, &got.2]
            .into_iter()
            .zip(want.iter().zip(&unrounded)),
    ) {
        let e = rel_err(g, w);
        assert!(e < 1e-5, "{name} vs its formula on bf16 operands: {e:e}");
        let eu = rel_err(g, u);
        assert!(eu > 1e-4, "{name}: the rounding of P/dS is visible: {eu:e}");
    }
    Ok(())
}

#[test]
fn tiled_attention_bad_inputs_are_errors() {
    let q = randn(&[1, 4, 10, 8], 1, 1.0);
    let k = randn(&[1, 2, 10, 8], 2, 1.0);
    let starts = Tensor::new(&[[0u32, 0, 0, 0, 0, 0, 0, 0, 9, 9]], &Device::Cpu).unwrap();
    let e = crate::attention::tiled::flash_attn(&q, &k, &k, &starts, 0.3, None).unwrap_err();
    assert!(format!("{e}").contains("query 8 starts at key 9"), "{e}");
    let k3 = randn(&[1, 3, 10, 8], 2, 1.0);
    let e = crate::attention::tiled::flash_attn(&q, &k3, &k3, &starts, 0.3, None).unwrap_err();
    assert!(format!("{e}").contains("Hkv dividing H"), "{e}");
    let short = Tensor::new(&[[0u32, 1, 2]], &Device::Cpu).unwrap();
    let e = crate::attention::tiled::flash_attn(&q, &k, &k, &short, 0.3, None).unwrap_err();
    assert!(format!("{e}").contains("`starts`"), "{e}");
}

/// The plain attention: repeat_kv, rope via narrow/cat, scores times `s.scale` (soft-capped as
/// transformers' Gemma 2 does: `tanh(s/cap)·cap`), softmax from exp/sum.
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
        * s.scale)
        .unwrap();
    let sc = match s.softcap {
        Some(cap) => ((sc / cap).unwrap().tanh().unwrap() * cap).unwrap(),
        None => sc,
    };
    let sc = sc.broadcast_add(&mask.squeeze(2).unwrap()).unwrap();
    let max = sc.max_keepdim(D::Minus1).unwrap().detach();
    let e = sc.broadcast_sub(&max).unwrap().exp().unwrap();
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
    let o = p.matmul(&v.contiguous().unwrap()).unwrap();
    o.transpose(1, 2).unwrap().reshape((b * t, h * dh)).unwrap()
}

#[test]
fn attention_matches_autograd() {
    attention_matches_autograd_for(AttnShape::new(2, 5, 4, 2, 6));
}

/// Gemma's attention: scores scaled by `1/√query_pre_attn_scalar` (not `1/√head_dim`) and
/// soft-capped at 1.5, small enough that the cap bends most scores (Gemma 2 ships 50 on larger
/// logits); the plain path, kept and recomputed probabilities.
#[test]
fn softcapped_attention_matches_autograd() {
    let mut s = AttnShape::new(2, 5, 4, 2, 6);
    s.scale = 1.0 / 20f64.sqrt();
    s.softcap = Some(1.5);
    attention_matches_autograd_for(s);
    // The tiled path caps in its kernels: `tiled_attention_matches_plain`'s soft-capped cases.
}

/// The model's attention (both ways of getting the probabilities in backward) against candle's
/// autograd of [`reference_attention`], f32, window 3.
fn attention_matches_autograd_for(s: AttnShape) {
    let n = s.b * s.t;
    let q = Var::from_tensor(&randn(&[n, 24], 7, 1.0)).unwrap();
    let k = Var::from_tensor(&randn(&[n, 12], 8, 1.0)).unwrap();
    let v = Var::from_tensor(&randn(&[n, 12], 9, 1.0)).unwrap();
    let inv: Vec<f32> = vec![1.0, 0.1, 0.01];
    let pos: Vec<u32> = (0..n as u32).map(|i| i % 5 + 2).collect();
    let (cos, sin) = crate::rope::tables(&inv, &pos, s.b, s.t, DType::F32, &Device::Cpu).unwrap();
    let mask = causal_mask(s.t, Some(3), &Device::Cpu).unwrap();
    let d_out = randn(&[n, 24], 10, 1.0);
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
        assert_close_t(&got, &want, "attention forward");
        let (dq, dk, dv) = attention_backward(&d_out, &cache, &s, &cos, &sin).unwrap();
        assert_close_t(&dq, grads.get(&q).unwrap(), "attention dq");
        assert_close_t(&dk, grads.get(&k).unwrap(), "attention dk");
        assert_close_t(&dv, grads.get(&v).unwrap(), "attention dv");
    }
}

#[test]
fn attn_softmax_is_a_masked_softmax_and_bwd_its_gradient() {
    let mut rng = Rng::new(7);
    // 2 heads of 3 query rows over 5 keys; mask row 1 fully masked, row 2 masks key 4.
    let (tq, tk, scale) = (3, 5, 0.5f32);
    let mut mask = vec![0f32; tq * tk];
    mask[tk..2 * tk].fill(f32::NEG_INFINITY);
    mask[2 * tk + 4] = f32::NEG_INFINITY;
    let raw = rng.normals(2 * tq * tk, 3.0, F32);
    let dp = rng.normals(2 * tq * tk, 1.0, F32);
    let p = attn_softmax_fwd(&raw, &mask, tk, scale, F32);
    let ds = attn_softmax_bwd(&p, &dp, tk, scale, F32);
    for r in 0..2 * tq {
        let (row, m) = (r * tk, (r % tq) * tk);
        if r % tq == 1 {
            assert!(p[row..row + tk].iter().all(|v| v.is_nan()), "row {r}");
            assert!(ds[row..row + tk].iter().all(|v| v.is_nan()), "row {r}");
            continue;
        }
        // L(raw) = Σ dp·softmax(raw·scale + mask), in f64
        let loss = |x: &[f64]| -> f64 {
            let s: Vec<f64> = (0..tk)
                .map(|j| x[j] * scale as f64 + mask[m + j] as f64)
                .collect();
            let e: Vec<f64> = s.iter().map(|v| v.exp()).collect();
            let sum: f64 = e.iter().sum();
            (0..tk).map(|j| dp[row + j] as f64 * e[j] / sum).sum()
        };
        let x = f64s(&raw[row..row + tk]);
        let e: Vec<f64> = (0..tk)
            .map(|j| (x[j] * scale as f64 + mask[m + j] as f64).exp())
            .collect();
        let sum: f64 = e.iter().sum();
        for j in 0..tk {
            assert_close(p[row + j], e[j] / sum, 1e-6, "attn_softmax_fwd");
            assert_close(ds[row + j], fd(&loss, &x, j), 1e-5, "attn_softmax_bwd");
        }
        assert_eq!(p[row + 4] == 0.0, r % tq == 2);
    }
    // bf16: the scaled scores round to bf16 once (the scale stays f32, as torch's scalar: 0.3 is
    // not a bf16 value); the outputs of bwd are bf16 values.
    let b = Precision::Bf16;
    let rb: Vec<f32> = raw.iter().map(|&v| b.round(v)).collect();
    let pb = attn_softmax_fwd(&rb, &mask[..tk], tk, 0.3, b);
    let s: Vec<f32> = rb[..tk].iter().map(|&v| b.round(v * 0.3)).collect();
    let top = s.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let sum: f64 = s.iter().map(|&v| ((v - top) as f64).exp()).sum();
    assert_eq!(pb[0], (((s[0] - top) as f64).exp() / sum) as f32);
    let dpb: Vec<f32> = dp.iter().map(|&v| b.round(v)).collect();
    let dsb = attn_softmax_bwd(&pb, &dpb, tk, 0.3, b);
    assert!(dsb.iter().all(|&v| b.round(v) == v));
}

/// The tiled attention's score products of bf16 inputs on oneDNN (per-thread streams,
/// `rtune_backend::onednn::tile`) against the same attention with them on the gemm crate
/// (`RTUNE_UNFUSED=onednn_attn`'s path, [`crate::fused::without`]), forward and backward, on
/// several key tiles (T = 150, 200), GQA, packed rows with a window, and a soft cap. Both sum
/// the same bf16 products in f32, in another order: the scores differ by f32 rounding (≈ Dh·2⁻²⁴
/// of |S|), which reaches the attention's bf16 outputs only where a value lies at a rounding
/// boundary (1 ulp there). So `out` and `dv` are within 2 bf16 ulps ([`BF16_ULPS`]; of the
/// value, floored at 1/256 of the largest: `bf16_ulps`) of the gemm crate's. `dq` and `dk` sum,
/// over key or query rows, products of bf16 `dS`, and a `dS` row sums to zero: where one `dS`
/// value flips at a boundary, a small entry of the sum moves by an ulp of the terms, not of the
/// entry (then RoPE's backward sums two such values). They are held within 2 bf16 ulps of
/// their tensor's largest entry (`ulps_of_largest`). Measured: on a 2-core AVX-512-BF16 EPYC
/// (no AMX) every output was within 2 ulps of its value; on a 2-core AMX Xeon (oneDNN's AMX
/// kernels) `dk` of the packed MQA case was 4 ulps off a small entry's value (2⁻¹³ at
/// |dk| < 1/128 of the largest) and 0.125 ulps of the largest. Where oneDNN is in use the tally
/// shows the oneDNN engine served (else both runs are the gemm crate's and agree bitwise).
#[test]
fn tiled_attention_bf16_on_onednn_matches_the_gemm_crate() {
    use crate::fused::{without, Fused};
    let tally = rtune_backend::served::start();
    for c in [
        AttnCase {
            dims: (2, 150, 8, 2, 64),
            window: None,
            packed: None,
            softcap: None,
            what: "bf16 causal GQA 8/2, Dh 64",
        },
        AttnCase {
            dims: (1, 200, 4, 1, 128),
            window: Some(70),
            packed: Some(vec![vec![90, 110]]),
            softcap: None,
            what: "bf16 packed, window 70, MQA, Dh 128",
        },
        AttnCase {
            dims: (1, 141, 4, 2, 32),
            window: None,
            packed: None,
            softcap: Some(1.5),
            what: "bf16 soft cap 1.5, Dh 32",
        },
    ] {
        let dnn = attend_on(&c, DType::BF16, crate::AttnPath::Tiled, false);
        let own = without(&[Fused::OnednnAttn], || {
            attend_on(&c, DType::BF16, crate::AttnPath::Tiled, false)
        });
        for (name, (g, w)) in ATTN_OUTPUTS.iter().zip(dnn.iter().zip(&own)) {
            let (u, ul) = (bf16_ulps(g, w), ulps_of_largest(g, w));
            eprintln!(
                "{} {name}: {u:.2} bf16 ulps of the value, {ul:.2} of the largest",
                c.what
            );
            let (u, of) = match *name {
                "dq" | "dk" => (ul, "the largest"),
                _ => (u, "the value"),
            };
            assert!(
                u <= BF16_ULPS,
                "{} {name}: {u} bf16 ulps of {of} > {BF16_ULPS}",
                c.what
            );
            if rtune_backend::onednn::get().is_err() {
                assert_eq!(bits(g), bits(w), "{} {name}", c.what);
            }
        }
    }
    if rtune_backend::onednn::get().is_ok() {
        let rows = tally.rows();
        assert!(
            rows.iter().any(|r| r.engine.contains("oneDNN bf16 tiles")),
            "{rows:?}"
        );
    }
}

/// Timing, not a check (`cargo test --release -p rtune-ops --lib onednn_attention_timing --
/// --ignored --nocapture`): the tiled attention forward + backward on bf16 inputs, score products
/// on oneDNN vs on the gemm crate, alternating rounds.
#[test]
#[ignore]
fn onednn_attention_timing() -> candle_core::Result<()> {
    use crate::fused::{without, Fused};
    use std::time::Instant;
    let dev = Device::Cpu;
    for &(t, h, dh) in &[
        (512usize, 9usize, 64usize),
        (512, 32, 64),
        (512, 16, 128),
        (2048, 9, 64),
        (2048, 16, 128),
    ] {
        let r = |s: u64, n: usize| bf16(&randn(&[1, n, t, dh], s, 1.0));
        let (q, k, v) = (r(1, h), r(2, h), r(3, h));
        let d_o = bf16(&randn(&[1, t, h, dh], 4, 1.0));
        let starts =
            Tensor::new((0..t as u32).map(|_| 0u32).collect::<Vec<_>>(), &dev)?.reshape((1, t))?;
        let scale = 1.0 / (dh as f64).sqrt();
        let step = || -> candle_core::Result<f64> {
            let t0 = Instant::now();
            let (o, lse) = super::tiled::flash_attn(&q, &k, &v, &starts, scale, None)?;
            super::tiled::flash_attn_bwd(&q, &k, &v, &o, &lse, &d_o, &starts, scale, None)?;
            Ok(t0.elapsed().as_secs_f64())
        };
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            a.push(step()?);
            b.push(without(&[Fused::OnednnAttn], step)?);
        }
        let med = |x: &mut Vec<f64>| {
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        let (ma, mb) = (med(&mut a), med(&mut b));
        println!(
            "T {t} H {h} Dh {dh}: oneDNN {:.1} ms, gemm crate {:.1} ms, speed-up {:.2}x (rounds {a:.3?} vs {b:.3?})",
            ma * 1e3,
            mb * 1e3,
            mb / ma
        );
    }
    Ok(())
}
