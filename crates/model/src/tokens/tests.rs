//! The trainable-token paths against candle's autograd on PEFT's plain formulation: `W'` = `W`
//! with rows `ids` replaced (`W + index_add(ids, rows − W[ids])`, which has the same gradient
//! with respect to `rows` as PEFT's `index_copy`), embedding = `W'[input]`, logits = `h·W'ᵀ`.
//! f32; tolerance 1e-5 relative (the same products summed in another order).

use super::*;
use crate::test_util::randn;
use candle_core::{Device, Var, D};
use rtune_ops::{chunked_cross_entropy_loss_with, chunked_cross_entropy_with, HeadRows};

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    let m = b.abs().unwrap().max_all().unwrap();
    d.to_scalar::<f32>().unwrap() / m.to_scalar::<f32>().unwrap().max(1e-30)
}

/// `W'`: `w` with rows `ids` replaced by `rows`, as an autograd graph through `rows`.
fn replaced(w: &Tensor, ids: &Tensor, rows: &Tensor) -> Result<Tensor> {
    let old = w.index_select(ids, 0)?;
    w.index_add(ids, &(rows - old)?, 0)
}

#[test]
fn embedding_rows_and_gradient_match_autograd() -> Result<()> {
    let dev = Device::Cpu;
    let (v, d) = (11, 6);
    let w = randn(&[v, d], 1)?;
    let tokens = [3u32, 5, 0];
    let input = [3u32, 7, 5, 3, 9, 1, 2];
    let rows = Var::from_tensor(&randn(&[3, d], 2)?)?;
    let ids = Tensor::new(&tokens, &dev)?;
    let x_ref =
        replaced(&w, &ids, rows.as_tensor())?.index_select(&Tensor::new(&input, &dev)?, 0)?;
    let hits = hits(&input, &tokens, &dev)?.expect("3 and 5 occur");
    let x = embed(
        &w.index_select(&Tensor::new(&input, &dev)?, 0)?,
        &hits,
        &rows,
    )?;
    assert!(max_rel(&x, &x_ref) <= 1e-6, "{}", max_rel(&x, &x_ref));
    // The rows are copied, not computed: position 0 (id 3) is row 0 bit for bit, position 1 (id
    // 7) the embedding's.
    assert_eq!(x.get(0)?.to_vec1::<f32>()?, rows.get(0)?.to_vec1::<f32>()?);
    assert_eq!(x.get(1)?.to_vec1::<f32>()?, w.get(7)?.to_vec1::<f32>()?);
    let g = randn(&[input.len(), d], 3)?;
    let grads = (&x_ref * &g)?.sum_all()?.backward()?;
    let want = grads.get(&rows).expect("rows' gradient");
    let got = embed_backward(&g, &hits, 3)?;
    assert!(max_rel(&got, want) <= 1e-6, "{}", max_rel(&got, want));
    // Row 2 (id 0) is not an input: no gradient.
    let r2: Vec<f32> = got.get(2)?.to_vec1()?;
    assert!(r2.iter().all(|x| *x == 0.0));
    assert!(hits_none(&[4u32, 6], &tokens)?);
    Ok(())
}

fn hits_none(input: &[u32], tokens: &[u32]) -> Result<bool> {
    Ok(hits(input, tokens, &Device::Cpu)?.is_none())
}

/// The fused chunked cross-entropy with the tied lm_head's rows replaced: the loss, `dh` and the
/// rows' gradient against autograd on `h·W'ᵀ`, for chunks that split the rows unevenly.
#[test]
fn tied_head_cross_entropy_matches_autograd() -> Result<()> {
    let dev = Device::Cpu;
    let (n, v, d) = (9, 13, 5);
    let w = randn(&[v, d], 4)?;
    let tokens = [12u32, 0, 4];
    let rows = Var::from_tensor(&randn(&[3, d], 5)?)?;
    let h = Var::from_tensor(&randn(&[n, d], 6)?)?;
    let targets: Vec<Option<u32>> = (0..n)
        .map(|i| (i % 4 != 1).then_some(((i * 5) % v) as u32))
        .collect();
    let idx: Vec<u32> = (0..n as u32)
        .filter(|&i| targets[i as usize].is_some())
        .collect();
    let tgt: Vec<u32> = targets.iter().flatten().copied().collect();
    let ids = Tensor::new(&tokens, &dev)?;
    let wp = replaced(&w, &ids, rows.as_tensor())?;
    let logits = h
        .as_tensor()
        .index_select(&Tensor::new(idx.as_slice(), &dev)?, 0)?
        .matmul(&wp.t()?)?;
    let lse = logits.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = logits.gather(&Tensor::new(tgt.as_slice(), &dev)?.unsqueeze(1)?, D::Minus1)?;
    let loss_ref = (lse - picked)?.sum_all()?;
    let scale = 0.25;
    let grads = (&loss_ref * scale)?.backward()?;
    let want_loss = loss_ref.to_scalar::<f32>()? as f64;
    for chunk in [1, 4, 16] {
        let head = HeadRows::new(&tokens, &rows, DType::F32)?;
        let (loss, dh, drows) =
            chunked_cross_entropy_with(&h, &w, Some(&head), None, &targets, scale, chunk)?;
        assert!(
            (loss - want_loss).abs() / want_loss <= 1e-5,
            "{loss} vs {want_loss}"
        );
        let e = max_rel(&dh, grads.get(&h).expect("dh"));
        assert!(e <= 1e-5, "chunk {chunk}: dh {e}");
        let drows = drows.expect("rows' gradient");
        let e = max_rel(&drows, grads.get(&rows).expect("drows"));
        assert!(e <= 1e-5, "chunk {chunk}: drows {e}");
        let eval = chunked_cross_entropy_loss_with(&h, &w, Some(&head), None, &targets, chunk)?;
        assert_eq!(eval, loss);
    }
    Ok(())
}
