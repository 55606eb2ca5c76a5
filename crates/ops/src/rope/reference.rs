//! Plain formulations of RoPE: on tensors (a chain of candle ops, differentiable by candle's
//! autograd: what `op.rs` and the backward are tested against) and on f32 slices with the CUDA
//! kernels' rounding to a [`Precision`] (what `check.rs` compares the kernels with).

use candle_core::{Result, Tensor, D};
use rtune_backend::Precision;

use super::halves;

/// [`apply`] as candle ops: the reference for the fused op (and differentiable by autograd).
/// Tables narrower than the head rotate its first part only: transformers' Phi-3
/// `cat([x_rot·cos + rotate_half(x_rot)·sin, x_pass])`.
pub fn apply_reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (dh, r) = (x.dim(D::Minus1)?, cos.dim(D::Minus1)?);
    let x_rot = x.narrow(D::Minus1, 0, r)?;
    let (x1, x2) = halves(&x_rot)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    let y = (x_rot.broadcast_mul(cos)? + rot.broadcast_mul(sin)?)?;
    if r == dh {
        return Ok(y);
    }
    Tensor::cat(&[&y, &x.narrow(D::Minus1, r, dh - r)?], D::Minus1)
}

/// Backward of [`apply_reference`]: the rotation's transpose, `dx = dy·cos + rotate_halfᵀ(dy·sin)`
/// with `rotate_halfᵀ([z1, z2]) = [z2, -z1]`.
/// Tables narrower than the head: the rotated part's transpose, the rest passed through.
pub fn apply_backward_reference(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (dh, r) = (dy.dim(D::Minus1)?, cos.dim(D::Minus1)?);
    if r < dh {
        let rot = apply_backward_reference(&dy.narrow(D::Minus1, 0, r)?, cos, sin)?;
        return Tensor::cat(&[&rot, &dy.narrow(D::Minus1, r, dh - r)?], D::Minus1);
    }
    let z = dy.broadcast_mul(sin)?;
    let (z1, z2) = halves(&z)?;
    let rot_t = Tensor::cat(&[&z2, &z1.neg()?], D::Minus1)?;
    dy.broadcast_mul(cos)? + rot_t
}

fn rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    (b, h, t, dh): (usize, usize, usize, usize),
    p: Precision,
    backward: bool,
) -> Vec<f32> {
    assert!(dh % 2 == 0, "head_dim {dh} is odd");
    assert_eq!(x.len(), b * h * t * dh);
    let mut y = x.to_vec();
    rotate_rows(&mut y, cos, sin, (h, t, dh), (b, dh), (p, p), backward);
    y
}

/// Rotates `x: (B, H, T, Dh)` in place with tables `(bc, 1, T, r)` (`bc` 1 or B; the first `r`
/// of each head rotate, the rest stay): each product and sum rounded to `pc` (the tables' type:
/// rope.rs's roundings for tables of x's type, none for f32 tables), the result to `p` (x's type).
fn rotate_rows(
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    (h, t, dh): (usize, usize, usize),
    (bc, r): (usize, usize),
    (pc, p): (Precision, Precision),
    backward: bool,
) {
    assert!(r % 2 == 0 && r <= dh, "rotary width {r} for head_dim {dh}");
    assert_eq!((cos.len(), sin.len()), (bc * t * r, bc * t * r));
    let half = r / 2;
    for (row, xr) in x.chunks_exact_mut(dh.max(1)).enumerate() {
        let (bi, ti) = (if bc == 1 { 0 } else { row / (h * t) }, row % t);
        let co = (bi * t + ti) * r;
        for c in 0..half {
            let (a1, a2) = (xr[c], xr[half + c]);
            let (c1, c2) = (cos[co + c], cos[co + half + c]);
            let (s1, s2) = (sin[co + c], sin[co + half + c]);
            let r = |v: f32| pc.round(v);
            let (o1, o2) = if backward {
                // dx = dy·cos + [z2, −z1], z = T(dy·sin)
                let (z1, z2) = (r(a1 * s1), r(a2 * s2));
                (r(a1 * c1) + z2, r(a2 * c2) - z1)
            } else {
                // y = x·cos + [−x2, x1]·sin
                (r(a1 * c1) + r(-a2 * s1), r(a2 * c2) + r(a1 * s2))
            };
            xr[c] = p.round(r(o1));
            xr[half + c] = p.round(r(o2));
        }
    }
}

/// RoPE on q and k in place (`kernels/rope_qk.cuh`): `q: (B, Hq, T, Dh)`, `k: (B, Hk, T, Dh)` of
/// precision `p`, tables `cos, sin: (bc, 1, T, r)` of precision `pc` (`bc` 1 or B, `r ≤ Dh`: the
/// first `r` of each head rotate — partial rotary — the rest stay). `pc = p` is [`rope_fwd`] /
/// [`rope_bwd`]'s numerics (each product rounded to `p`); `pc` f32 with a bf16/f16 `p` is
/// [`super::apply`]'s f32-table mode (rotated in f32, rounded once to `p`).
#[allow(clippy::too_many_arguments)]
pub fn rope_qk(
    q: &mut [f32],
    k: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    (b, hq, hk, t, dh): (usize, usize, usize, usize, usize),
    (bc, r): (usize, usize),
    (pc, p): (Precision, Precision),
    backward: bool,
) {
    assert_eq!((q.len(), k.len()), (b * hq * t * dh, b * hk * t * dh));
    rotate_rows(q, cos, sin, (hq, t, dh), (bc, r), (pc, p), backward);
    rotate_rows(k, cos, sin, (hk, t, dh), (bc, r), (pc, p), backward);
}

/// `y = T(T(x·cos) + T(rotate_half(x)·sin))`, `rotate_half([x1, x2]) = [−x2, x1]`: (b, h, t, dh).
pub fn rope_fwd(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    shape: (usize, usize, usize, usize),
    p: Precision,
) -> Vec<f32> {
    rope(x, cos, sin, shape, p, false)
}

/// `dx = T(T(dy·cos) + rotate_halfᵀ(T(dy·sin)))`, `rotate_halfᵀ([z1, z2]) = [z2, −z1]` (rope.rs
/// `apply_backward`): (b, h, t, dh).
pub fn rope_bwd(
    dy: &[f32],
    cos: &[f32],
    sin: &[f32],
    shape: (usize, usize, usize, usize),
    p: Precision,
) -> Vec<f32> {
    rope(dy, cos, sin, shape, p, true)
}

/// The cos/sin tables the kernels are checked on (`check.rs`, `tests/kernels_emulated.rs`):
/// `(b, 1, t, dh)`, Llama 3's base 500000 at a random start position per batch row, rounded to
/// `p` as the model's tables are.
pub fn check_tables(
    rng: &mut rtune_backend::check::Rng,
    (b, t, dh): (usize, usize, usize),
    p: Precision,
) -> (Vec<f32>, Vec<f32>) {
    let half = dh / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for _ in 0..b {
        let start = rng.below(8192);
        for ti in 0..t {
            for d in 0..dh {
                let f = 1.0 / 500000f32.powf((2 * (d % half)) as f32 / dh as f32);
                let a = (start + ti as u32) as f32 * f;
                cos.push(p.round(a.cos()));
                sin.push(p.round(a.sin()));
            }
        }
    }
    (cos, sin)
}
