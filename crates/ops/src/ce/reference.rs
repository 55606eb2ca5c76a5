//! Plain formulations of the cross-entropy of a chunk: on tensors (a chain of candle ops, differentiable by candle's
//! autograd: what `op.rs` and the backward are tested against) and on f32 slices with the CUDA
//! kernels' rounding to a [`Precision`] (what `check.rs` compares the kernels with).

use candle_core::{DType, Result, Tensor, D};
use rtune_backend::Precision;

/// The cross-entropy of each row of `logits: (n, V)` against `targets: (n)` u32 as candle ops, in
/// f32: `(n, 2)` `[lse, lse − logit[target]]`. The reference for [`crate::ce::op::ce_fwd`].
pub fn cross_entropy_reference(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let z = logits.broadcast_sub(&max)?;
    let ls = z.exp()?.sum_keepdim(D::Minus1)?.log()?; // (n, 1), relative to max
    let picked = z.gather(&targets.unsqueeze(1)?, D::Minus1)?; // (n, 1)
    Tensor::cat(&[(&max + &ls)?, (ls - picked)?], 1)
}

/// `(softmax(logits) − onehot(targets))·scale` in the logits' dtype as candle ops: the reference
/// for [`crate::ce::op::ce_bwd`].
pub fn cross_entropy_grad_reference(
    logits: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (n, vocab) = logits.dims2()?;
    let dt = logits.dtype();
    let logits = logits.to_dtype(DType::F32)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let z = logits.broadcast_sub(&max)?;
    let ls = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let p = z.broadcast_sub(&ls)?.exp()?;
    let onehot = Tensor::arange(0u32, vocab as u32, logits.device())?
        .unsqueeze(0)?
        .broadcast_as((n, vocab))?
        .broadcast_eq(&targets.unsqueeze(1)?)?
        .to_dtype(DType::F32)?;
    ((p - onehot)? * scale)?.to_dtype(dt)
}

/// `(n, 2)` f32: `[lse, lse − logit[target]]` per row, `lse = max + ln(Σ exp(x − max))` in f64;
/// NaN loss for a target `>= v`.
pub fn ce_fwd(logits: &[f32], targets: &[u32], n: usize, v: usize) -> Vec<f32> {
    assert_eq!((logits.len(), targets.len()), (n * v, n));
    let mut out = Vec::with_capacity(2 * n);
    for (row, &tg) in logits.chunks_exact(v.max(1)).zip(targets).take(n) {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let s: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
        let lse = m + s.ln();
        let picked = row.get(tg as usize).map_or(f64::NAN, |&x| x as f64);
        out.push(lse as f32);
        out.push((lse - picked) as f32);
    }
    out
}

/// `dlogits = T((exp(x − lse) − [i = target])·scale)`: (n, v).
pub fn ce_bwd(
    logits: &[f32],
    targets: &[u32],
    lse: &[f32],
    scale: f32,
    n: usize,
    v: usize,
    p: Precision,
) -> Vec<f32> {
    assert_eq!((logits.len(), targets.len(), lse.len()), (n * v, n, n));
    let mut d = Vec::with_capacity(n * v);
    for (i, row) in logits.chunks_exact(v.max(1)).take(n).enumerate() {
        let l = lse[i] as f64;
        d.extend(row.iter().enumerate().map(|(j, &x)| {
            let onehot = if j == targets[i] as usize { 1.0 } else { 0.0 };
            p.round((((x as f64 - l).exp() - onehot) * scale as f64) as f32)
        }));
    }
    d
}

/// A soft-capped logit as `crate::softcap::softcap_logits` forms it on a tensor of precision `p`:
/// `z = T(T(tanh(T(x·inv)))·cap)` with `inv = f32(1/cap)` (candle's `x / cap` is `x·(1/cap)`),
/// each step rounded to `p`, `tanh` in f32.
pub fn cap_logit(x: f32, cap: f64, p: Precision) -> f32 {
    let inv = (1.0 / cap) as f32;
    let t = p.round(p.round(x * inv).tanh());
    p.round(t * cap as f32)
}

/// The soft-capped cross-entropy's forward (`ce_capped_fwd`): [`ce_fwd`] of the capped logits
/// [`cap_logit`]: `(n, 2)` f32 `[lse, lse − z[target]]`.
pub fn ce_capped_fwd(
    logits: &[f32],
    targets: &[u32],
    (n, v): (usize, usize),
    cap: f64,
    p: Precision,
) -> Vec<f32> {
    let z: Vec<f32> = logits.iter().map(|&x| cap_logit(x, cap, p)).collect();
    ce_fwd(&z, targets, n, v)
}

/// The soft-capped cross-entropy's backward (`ce_capped_bwd`): `dz` = [`ce_bwd`] of the capped
/// logits (a tensor of precision `p`), then `crate::softcap::softcap_logits_backward`'s
/// `T(dz·(1 − t²))` with `t = z·f32(1/cap)`: `(n, v)`.
#[allow(clippy::too_many_arguments)]
pub fn ce_capped_bwd(
    logits: &[f32],
    targets: &[u32],
    lse: &[f32],
    scale: f32,
    (n, v): (usize, usize),
    cap: f64,
    p: Precision,
) -> Vec<f32> {
    let inv = (1.0 / cap) as f32;
    let z: Vec<f32> = logits.iter().map(|&x| cap_logit(x, cap, p)).collect();
    let dz = ce_bwd(&z, targets, lse, scale, n, v, p);
    dz.iter()
        .zip(&z)
        .map(|(&d, &z)| {
            let t = z * inv;
            p.round(d * (1.0 - t * t))
        })
        .collect()
}

/// The inputs the cross-entropy kernels are checked on (`check.rs`, `tests/kernels_emulated.rs`):
/// `(logits, targets)` for `(n, v)`, logits ~ `std`·N(0, 1) rounded to `p`, one row in four given
/// a dominant logit (`top`) at its target (loss near 0, softmax near one-hot).
pub fn check_inputs(
    rng: &mut rtune_backend::check::Rng,
    (n, v): (usize, usize),
    (std, top): (f32, f32),
    p: Precision,
) -> (Vec<f32>, Vec<u32>) {
    let mut logits = rng.normals(n * v, std, p);
    let targets: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
    for (i, &tg) in targets.iter().enumerate().step_by(4) {
        logits[i * v + tg as usize] = p.round(top);
    }
    (logits, targets)
}
