//! DoRA's hand-written backward against finite differences of its forward, and the group path
//! against each member on its own.

use super::*;
use crate::group;
use crate::linear::{Frozen, LinearCache};
use crate::test_util::randn;
use candle_core::Device;
use rtune_lora::{Adapter, LoraSpec};

/// q/k/v-like members (outputs 12, 6, 6 of input 10; one with a bias), DoRA pairs with m ≠ n.
fn setup() -> Result<(Vec<Linear>, Adapter)> {
    let outs = [12usize, 6, 6];
    let mut lins = Vec::new();
    let mut pairs = Vec::new();
    for (i, &o) in outs.iter().enumerate() {
        lins.push(Linear {
            name: format!("m{i}"),
            w: Frozen::Dense(randn(&[o, 10], 10 + i as u64)?),
            bias: (i == 1).then(|| randn(&[o], 20)).transpose()?,
            lora: Some(i),
            dora_norm: Default::default(),
        });
        pairs.push(LoraPair {
            a: randn(&[3, 10], 30 + i as u64)?,
            b: randn(&[o, 3], 40 + i as u64)?,
            m: Some((randn(&[o], 60 + i as u64)? + 2.0)?),
        });
    }
    let spec = LoraSpec::new(3, 6.0, 0.0, false, &["all-linear".to_string()])
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?
        .with_dora(true);
    let adapter = Adapter {
        spec,
        names: (0..3).map(|i| format!("m{i}")).collect(),
        pairs,
        tokens: None,
    };
    Ok((lins, adapter))
}

fn to64(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `L = Σ y ⊙ g` for a fixed `g`, the forward in f64-friendly f32: the objective whose gradients
/// the backward must give. The norm is detached, so the finite difference of m, A, B must hold
/// `n` fixed: the cache keeps it (same A, B tensor ids) — we perturb copies and pass the original
/// norm explicitly through a fresh layer whose cache is primed.
fn objective(lin: &Linear, ad: &Adapter, x: &Tensor, g: &Tensor, dropout: f64) -> Result<f64> {
    let ctx = LoraCtx {
        adapter: ad,
        scaling: ad.spec.scaling(),
        dropout,
        seed: 9,
    };
    let (y, _) = lin.forward(x, Some(&ctx), 3)?;
    (y * g)?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()
}

/// dm, dA, dB, dx of one DoRA layer against central differences, with and without dropout. The
/// detached norm is held at its unperturbed value by the cache: `lin` is primed once, and the
/// perturbed adapters reuse the same A and B tensors wherever they are not the perturbed one, so
/// for dA/dB the test compares against the gradient *with* `n` fixed by computing `n` once and
/// patching it in. Tolerance 2e-2 relative to the gradient's largest entry: f32 forward, step 1e-2.
#[test]
fn backward_matches_finite_differences() -> Result<()> {
    for dropout in [0.0, 0.3] {
        let (lins, ad) = setup()?;
        let lin = &lins[1]; // with bias
        let x = randn(&[5, 10], 1)?;
        let g = randn(&[5, 6], 2)?;
        let ctx = LoraCtx {
            adapter: &ad,
            scaling: ad.spec.scaling(),
            dropout,
            seed: 9,
        };
        let (_, cache) = lin.forward(&x, Some(&ctx), 3)?;
        let mut grads = Grads::new(3);
        let dx = lin
            .backward(&g, &x, &cache, Some(&ctx), &mut grads, true)?
            .unwrap();
        let n0 = lin
            .dora_norm
            .get(|| lin.w.dense(), &ad.pairs[1], ad.spec.scaling())?;
        let h = 1e-2f32;
        // A perturbed copy of one tensor of pair 1; the norm stays n0 (detached).
        let fd = |which: usize, i: usize| -> Result<f64> {
            let mut f = [0f64; 2];
            for (s, sign) in [1f32, -1.0].into_iter().enumerate() {
                let mut ad2 = ad.clone();
                let p = &mut ad2.pairs[1];
                let t = match which {
                    0 => &mut p.a,
                    1 => &mut p.b,
                    _ => p.m.as_mut().unwrap(),
                };
                let mut v: Vec<f32> = t.flatten_all()?.to_vec1()?;
                v[i] += sign * h;
                *t = Tensor::from_vec(v, t.shape(), &Device::Cpu)?;
                let l2 = Linear {
                    dora_norm: NormCache::default(),
                    ..lin.clone()
                };
                *l2.dora_norm.0.lock().unwrap() =
                    Some((p.a.id(), p.b.id(), ad2.spec.scaling().to_bits(), n0.clone()));
                f[s] = objective(&l2, &ad2, &x, &g, dropout)?;
            }
            Ok((f[0] - f[1]) / (2.0 * h as f64))
        };
        for (which, got) in [
            (0, grads.a[1].as_ref().unwrap()),
            (1, grads.b[1].as_ref().unwrap()),
            (2, grads.m[1].as_ref().unwrap()),
        ] {
            let got = to64(got);
            let scale = got.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (i, g) in got.iter().enumerate() {
                let want = fd(which, i)?;
                assert!(
                    (g - want).abs() <= 2e-2 * scale,
                    "dropout {dropout} tensor {which}[{i}]: {g} vs {want}"
                );
            }
        }
        // dx: perturb x.
        let dxv = to64(&dx);
        let scale = dxv.iter().fold(0f64, |m, v| m.max(v.abs()));
        let xv: Vec<f32> = x.flatten_all()?.to_vec1()?;
        for i in (0..xv.len()).step_by(7) {
            let mut f = [0f64; 2];
            for (s, sign) in [1f32, -1.0].into_iter().enumerate() {
                let mut v = xv.clone();
                v[i] += sign * h;
                let x2 = Tensor::from_vec(v, x.shape(), &Device::Cpu)?;
                f[s] = objective(lin, &ad, &x2, &g, dropout)?;
            }
            let want = (f[0] - f[1]) / (2.0 * h as f64);
            assert!(
                (dxv[i] - want).abs() <= 2e-2 * scale,
                "dropout {dropout} dx[{i}]: {} vs {want}",
                dxv[i]
            );
        }
    }
    Ok(())
}

/// The norm is computed once for the same A and B, again after either is replaced.
#[test]
fn norm_is_cached_until_a_or_b_changes() -> Result<()> {
    let (lins, mut ad) = setup()?;
    let lin = &lins[0];
    let w = lin.w.dense()?.into_owned();
    let n1 = lin
        .dora_norm
        .get(|| Ok(std::borrow::Cow::Borrowed(&w)), &ad.pairs[0], 2.0)?;
    let n2 = lin
        .dora_norm
        .get(|| Ok(std::borrow::Cow::Borrowed(&w)), &ad.pairs[0], 2.0)?;
    assert_eq!(n1.id(), n2.id(), "recomputed for the same A, B");
    ad.pairs[0].b = (&ad.pairs[0].b * 2.0)?;
    let n3 = lin
        .dora_norm
        .get(|| Ok(std::borrow::Cow::Borrowed(&w)), &ad.pairs[0], 2.0)?;
    assert_ne!(n1.id(), n3.id());
    let want = weight_norm(&w, &ad.pairs[0].a, &ad.pairs[0].b, 2.0)?;
    assert_eq!(to64(&n3), to64(&want));
    Ok(())
}

/// DoRA members through the group path (fused block, stacked LoRA without dropout) equal each
/// member on its own. Tolerance 1e-5 relative: the same sums in another order.
#[test]
fn group_equals_members_one_by_one() -> Result<()> {
    for dropout in [0.0, 0.25] {
        let (mut lins, ad) = setup()?;
        let block = {
            let mut refs: Vec<&mut Linear> = lins.iter_mut().collect();
            group::fuse(&mut refs)?
        };
        let ctx = LoraCtx {
            adapter: &ad,
            scaling: ad.spec.scaling(),
            dropout,
            seed: 5,
        };
        let x = randn(&[7, 10], 1)?;
        let salts = [0u64, 1, 2];
        let members: Vec<&Linear> = lins.iter().collect();
        let got = group::forward(&members, block.as_ref(), &x, Some(&ctx), &salts)?;
        let want: Vec<(Tensor, LinearCache)> = members
            .iter()
            .zip(salts)
            .map(|(m, s)| m.forward(&x, Some(&ctx), s))
            .collect::<Result<_>>()?;
        let rel = |a: &Tensor, b: &Tensor| -> Result<f32> {
            let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            Ok(d / b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30))
        };
        for ((g, _), (w, _)) in got.iter().zip(&want) {
            assert!(rel(g, w)? < 1e-5, "forward {dropout}");
        }
        let dys: Vec<Tensor> = [12usize, 6, 6]
            .iter()
            .enumerate()
            .map(|(i, &o)| randn(&[7, o], 50 + i as u64))
            .collect::<Result<_>>()?;
        let caches: Vec<&LinearCache> = got.iter().map(|(_, c)| c).collect();
        let mut gg = Grads::new(3);
        let dx = group::backward(
            &members,
            block.as_ref(),
            &dys,
            &x,
            &caches,
            Some(&ctx),
            &mut gg,
            true,
        )?
        .unwrap();
        let mut wg = Grads::new(3);
        let mut wdx: Option<Tensor> = None;
        for ((m, dy), (_, c)) in members.iter().zip(&dys).zip(&want) {
            let d = m.backward(dy, &x, c, Some(&ctx), &mut wg, true)?.unwrap();
            wdx = Some(match wdx {
                Some(a) => (a + d)?,
                None => d,
            });
        }
        assert!(rel(&dx, &wdx.unwrap())? < 1e-5, "dx {dropout}");
        for i in 0..3 {
            for (a, b) in [
                (&gg.a[i], &wg.a[i]),
                (&gg.b[i], &wg.b[i]),
                (&gg.m[i], &wg.m[i]),
            ] {
                assert!(
                    rel(a.as_ref().unwrap(), b.as_ref().unwrap())? < 1e-5,
                    "{dropout} {i}"
                );
            }
        }
    }
    Ok(())
}
