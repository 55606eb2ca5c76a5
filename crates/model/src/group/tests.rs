//! The group path ([`super::forward`], [`super::backward`]) against each member computed on its
//! own, and [`super::fuse`]'s row views.

use super::*;
use crate::test_util::randn;
use rtune_lora::{Adapter, LoraPair, LoraSpec};

/// q/k/v-like members (outputs 48, 16, 16 of input 40; one with a bias) and their adapter.
fn setup() -> Result<(Vec<Linear>, Adapter)> {
    let outs = [48usize, 16, 16];
    let mut lins = Vec::new();
    let mut pairs = Vec::new();
    for (i, &o) in outs.iter().enumerate() {
        lins.push(Linear {
            name: format!("m{i}"),
            w: Frozen::Dense(randn(&[o, 40], 10 + i as u64)?),
            bias: (i == 1).then(|| randn(&[o], 20)).transpose()?,
            lora: Some(i),
            dora_norm: Default::default(),
        });
        pairs.push(LoraPair {
            a: randn(&[4, 40], 30 + i as u64)?,
            b: randn(&[o, 4], 40 + i as u64)?,
            m: None,
        });
    }
    let spec = LoraSpec::new(4, 8.0, 0.0, false, &["all-linear".to_string()])
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let adapter = Adapter {
        spec,
        names: (0..3).map(|i| format!("m{i}")).collect(),
        pairs,
        tokens: None,
    };
    Ok((lins, adapter))
}

fn max_rel(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(d / b.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-30))
}

/// The group path (fused block, stacked LoRA) against each member on its own, with and without
/// dropout and with and without dx. Tolerance 1e-5 relative: the same products summed in another
/// order (one GEMM over the concatenation instead of several), ~1e-7 per sum of 40 terms.
#[test]
fn group_equals_members_one_by_one() -> Result<()> {
    for dropout in [0.0, 0.25] {
        for fused in [false, true] {
            for need_dx in [true, false] {
                let (mut lins, adapter) = setup()?;
                let block = if fused {
                    let mut refs: Vec<&mut Linear> = lins.iter_mut().collect();
                    fuse(&mut refs)?
                } else {
                    None
                };
                assert_eq!(block.is_some(), fused);
                let ctx = LoraCtx {
                    adapter: &adapter,
                    scaling: 2.0,
                    dropout,
                    seed: 5,
                };
                let x = randn(&[24, 40], 1)?;
                let salts = [0u64, 1, 2];
                let members: Vec<&Linear> = lins.iter().collect();
                let got = forward(&members, block.as_ref(), &x, Some(&ctx), &salts)?;
                let want: Vec<(Tensor, LinearCache)> = members
                    .iter()
                    .zip(salts)
                    .map(|(m, s)| m.forward(&x, Some(&ctx), s))
                    .collect::<Result<_>>()?;
                for ((g, _), (w, _)) in got.iter().zip(&want) {
                    assert!(max_rel(g, w)? < 1e-5, "forward {dropout} {fused}");
                }
                let dys: Vec<Tensor> = [48usize, 16, 16]
                    .iter()
                    .enumerate()
                    .map(|(i, &o)| randn(&[24, o], 50 + i as u64))
                    .collect::<Result<_>>()?;
                let caches: Vec<&LinearCache> = got.iter().map(|(_, c)| c).collect();
                let mut g_grads = Grads::new(3);
                let dx = backward(
                    &members,
                    block.as_ref(),
                    &dys,
                    &x,
                    &caches,
                    Some(&ctx),
                    &mut g_grads,
                    need_dx,
                )?;
                let mut w_grads = Grads::new(3);
                let mut wdx: Option<Tensor> = None;
                for ((m, dy), (_, c)) in members.iter().zip(&dys).zip(&want) {
                    if let Some(d) = m.backward(dy, &x, c, Some(&ctx), &mut w_grads, need_dx)? {
                        wdx = Some(match wdx {
                            Some(a) => (a + d)?,
                            None => d,
                        });
                    }
                }
                assert_eq!(dx.is_some(), need_dx);
                if let (Some(a), Some(b)) = (&dx, &wdx) {
                    assert!(max_rel(a, b)? < 1e-5, "dx {dropout} {fused}");
                }
                for i in 0..3 {
                    let (ga, wa) = (g_grads.a[i].as_ref(), w_grads.a[i].as_ref());
                    let (gb, wb) = (g_grads.b[i].as_ref(), w_grads.b[i].as_ref());
                    assert!(max_rel(ga.unwrap(), wa.unwrap())? < 1e-5, "dA {i}");
                    assert!(max_rel(gb.unwrap(), wb.unwrap())? < 1e-5, "dB {i}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn fuse_leaves_row_views_of_one_block() -> Result<()> {
    let (mut lins, _) = setup()?;
    let before: Vec<Tensor> = lins
        .iter()
        .map(|l| l.w.dense().map(|w| w.into_owned()))
        .collect::<Result<_>>()?;
    let mut refs: Vec<&mut Linear> = lins.iter_mut().collect();
    let block = fuse(&mut refs)?.expect("dense members fuse");
    assert_eq!(block.dims(), &[80, 40]);
    for (l, b) in lins.iter().zip(&before) {
        let w = l.w.dense()?;
        assert_eq!(max_rel(&w, b)?, 0.0);
        assert!(w.is_contiguous());
    }
    Ok(())
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.iter().map(|x| x.to_bits()).collect())
}

/// With dropout the group path (masks made together, batched GEMMs, one masked-sum pass) equals
/// each member's own LoRA branch bit for bit — outputs, dA, dB and dx — in f32 and in bf16 (the
/// frozen part in the compute dtype, dx rounded after each member's term as the member path
/// does): the same GEMM per member and the same masks. Unfused weights, so that the frozen
/// GEMMs are the members' own too.
#[test]
fn group_with_dropout_equals_members_bit_for_bit() -> Result<()> {
    for dtype in [DType::F32, DType::BF16] {
        let (mut lins, adapter) = setup()?;
        for l in lins.iter_mut() {
            l.w = Frozen::Dense(l.w.dense()?.to_dtype(dtype)?);
            l.bias = l.bias.as_ref().map(|b| b.to_dtype(dtype)).transpose()?;
        }
        let ctx = LoraCtx {
            adapter: &adapter,
            scaling: 2.0,
            dropout: 0.25,
            seed: 11,
        };
        let x = randn(&[24, 40], 2)?.to_dtype(dtype)?;
        let salts = [7u64, 8, 9];
        let members: Vec<&Linear> = lins.iter().collect();
        assert!(stacked_lora(&members, Some(&ctx)).is_some());
        let got = forward(&members, None, &x, Some(&ctx), &salts)?;
        let want: Vec<(Tensor, LinearCache)> = members
            .iter()
            .zip(salts)
            .map(|(m, s)| m.forward(&x, Some(&ctx), s))
            .collect::<Result<_>>()?;
        for ((g, _), (w, _)) in got.iter().zip(&want) {
            assert_eq!(bits(g)?, bits(w)?, "forward {dtype:?}");
        }
        let dys: Vec<Tensor> = [48usize, 16, 16]
            .iter()
            .enumerate()
            .map(|(i, &o)| randn(&[24, o], 60 + i as u64)?.to_dtype(dtype))
            .collect::<Result<_>>()?;
        let caches: Vec<&LinearCache> = got.iter().map(|(_, c)| c).collect();
        let mut g_grads = Grads::new(3);
        let dx = backward(
            &members,
            None,
            &dys,
            &x,
            &caches,
            Some(&ctx),
            &mut g_grads,
            true,
        )?
        .expect("need_dx");
        // The member path of the same sum: the frozen dx, then each member's LoRA term.
        let mut w_grads = Grads::new(3);
        let mut wdx: Option<Tensor> = None;
        for (m, dy) in members.iter().zip(&dys) {
            let d = mm(dy, &*m.w.dense()?)?;
            wdx = Some(match wdx {
                Some(a) => (a + d)?,
                None => d,
            });
        }
        let mut wdx = wdx.expect("three members");
        for ((m, dy), (_, c)) in members.iter().zip(&dys).zip(&want) {
            wdx = m
                .lora_backward(dy, &x, c, Some(&ctx), &mut w_grads, Some(wdx))?
                .expect("need_dx");
        }
        assert_eq!(bits(&dx)?, bits(&wdx)?, "dx {dtype:?}");
        for i in 0..3 {
            let (ga, wa) = (g_grads.a[i].as_ref(), w_grads.a[i].as_ref());
            let (gb, wb) = (g_grads.b[i].as_ref(), w_grads.b[i].as_ref());
            assert_eq!(bits(ga.unwrap())?, bits(wa.unwrap())?, "dA {i} {dtype:?}");
            assert_eq!(bits(gb.unwrap())?, bits(wb.unwrap())?, "dB {i} {dtype:?}");
        }
    }
    Ok(())
}

/// Members of different ranks cannot share the batched `(G, N, r)` GEMM: with dropout the group
/// leaves their LoRA branches to each member (without dropout the stacked GEMM takes any ranks).
#[test]
fn dropout_with_mixed_ranks_is_not_stacked() -> Result<()> {
    let (lins, mut adapter) = setup()?;
    adapter.pairs[1] = LoraPair {
        a: randn(&[2, 40], 70)?,
        b: randn(&[16, 2], 71)?,
        m: None,
    };
    let members: Vec<&Linear> = lins.iter().collect();
    let ctx = |dropout| LoraCtx {
        adapter: &adapter,
        scaling: 2.0,
        dropout,
        seed: 1,
    };
    assert!(stacked_lora(&members, Some(&ctx(0.1))).is_none());
    assert!(stacked_lora(&members, Some(&ctx(0.0))).is_some());
    Ok(())
}
