//! The multi-tensor optimizer of `kernels/adamw.cu`: the gradients' global L2 norm, the clipping
//! coefficient of `torch.nn.utils.clip_grad_norm_` (`coef = min(1, max_norm/(norm + 1e-6))`) and
//! the AdamW update of `torch.optim.AdamW` (f32 moments and master weights, bias corrections,
//! decoupled weight decay) over every tensor of a step at once.
//!
//! This file is the CPU reference of the kernels, written loop for loop as the kernels run them:
//! the tensors are cut into [`CHUNK`]-element chunks ([`chunk_table`]); [`multi_tensor_sq_norm`]
//! sums each chunk's squares in [`THREADS`] f64 lanes (lane `t` takes elements `t, t + THREADS,
//! …`), folds the lanes by the same tree as the kernel's shared memory, then folds the chunk
//! partials the same way; [`clip_coef`] is the final kernel's scalar code; [`multi_tensor_adamw`]
//! is the per-element update. Every step is an IEEE-rounded f32/f64 operation in the kernels'
//! order (the kernels use `__fmul_rn`, `__dadd_rn`, … to forbid FMA contraction), so the kernels
//! equal this reference bit for bit; [`AdamWScalars`] computes the step's scalars in f64 and
//! rounds them to f32 exactly as [`AdamW::update`] (`cpu.rs`, the CPU optimizer) does, so the update
//! equals it bit for bit, and the norm differs from its sequential f64 sum only in the
//! order of the f64 additions.
//!
//! With the `cuda` feature, `cuda` holds the launchers ([`AdamWKernels`]) and `check` compares them
//! with this reference ([`check::self_test`], for `rtune selftest`).

#[cfg(feature = "kernels")]
pub mod check;
mod cpu;
pub use cpu::{clip_factor, AdamW};
#[cfg(feature = "kernels")]
mod cuda;
#[cfg(feature = "kernels")]
pub use cuda::{mt_adamw, mt_sq_norm, AdamWKernels};

/// Elements of a tensor one block handles (`MT_CHUNK` in adamw.cu).
pub const CHUNK: usize = 2048;
/// Threads of a block (`MT_THREADS` in adamw.cu): the lanes of a chunk's sum.
pub const THREADS: usize = 256;

/// The chunk table of tensors of `sizes` elements: `(tensor, start)` per chunk, flattened
/// (`[t0, s0, t1, s1, …]`), every tensor's chunks in order; an empty tensor has none.
pub fn chunk_table(sizes: &[usize]) -> Vec<u64> {
    let mut t = Vec::new();
    for (k, &n) in sizes.iter().enumerate() {
        for start in (0..n).step_by(CHUNK) {
            t.extend([k as u64, start as u64]);
        }
    }
    t
}

/// Each tensor's first element in the flat master/m/v buffers (prefix sums of `sizes`), and the
/// total.
pub fn offsets(sizes: &[usize]) -> (Vec<usize>, usize) {
    let mut off = Vec::with_capacity(sizes.len());
    let mut total = 0;
    for &n in sizes {
        off.push(total);
        total += n;
    }
    (off, total)
}

/// Folds `lane` (THREADS entries) as the kernels' shared-memory tree: for `s = THREADS/2, …, 1`,
/// `lane[t] += lane[t + s]` for `t < s`; returns `lane[0]`.
fn tree(lane: &mut [f64; THREADS]) -> f64 {
    let mut s = THREADS / 2;
    while s > 0 {
        for t in 0..s {
            lane[t] += lane[t + s];
        }
        s /= 2;
    }
    lane[0]
}

/// The f32 gradient element the kernels read: `g[i]`, or 0 for a missing gradient.
fn grad(g: Option<&[f32]>, i: usize) -> f32 {
    g.map_or(0.0, |g| g[i])
}

/// `mt_sq_norm_partial`: one f64 partial sum of `(g·unscale)²` per chunk of [`chunk_table`].
/// `grads[k]` (None: zeros) has `sizes[k]` elements.
pub fn sq_norm_partials(grads: &[Option<&[f32]>], sizes: &[usize], unscale: f32) -> Vec<f64> {
    let chunks = chunk_table(sizes);
    chunks
        .chunks_exact(2)
        .map(|c| {
            let (k, start) = (c[0] as usize, c[1] as usize);
            let end = (start + CHUNK).min(sizes[k]);
            let mut lane = [0f64; THREADS];
            for (t, acc) in lane.iter_mut().enumerate() {
                let mut i = start + t;
                while i < end {
                    let x = (grad(grads[k], i) * unscale) as f64;
                    *acc += x * x;
                    i += THREADS;
                }
            }
            tree(&mut lane)
        })
        .collect()
}

/// `mt_norm_finalize`'s sum: lane `t` adds partials `t, t + THREADS, …` in order, then the tree.
pub fn sum_partials(partials: &[f64]) -> f64 {
    let mut lane = [0f64; THREADS];
    for (t, acc) in lane.iter_mut().enumerate() {
        for p in partials.iter().skip(t).step_by(THREADS) {
            *acc += p;
        }
    }
    tree(&mut lane)
}

/// The sum of `(g·unscale)²` over every element of every tensor, in the kernels' order.
pub fn multi_tensor_sq_norm(grads: &[Option<&[f32]>], sizes: &[usize], unscale: f32) -> f64 {
    sum_partials(&sq_norm_partials(grads, sizes, unscale))
}

/// `mt_norm_finalize`'s scalars: `(norm, coef)`, `norm = sqrt(sq)`, `coef = min(1, max_norm /
/// (norm + 1e-6))` (1 when `max_norm <= 0`: clipping off), as `clip_grad_norm_`.
pub fn clip_coef(sq: f64, max_norm: f64) -> (f64, f64) {
    let norm = sq.sqrt();
    if max_norm <= 0.0 {
        return (norm, 1.0);
    }
    (norm, (max_norm / (norm + 1e-6)).min(1.0))
}

/// One AdamW step's f32 scalars, computed in f64 and rounded as `rtune_train`'s CPU `AdamW`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// `f32(1 / loss scale)`: the gradients are multiplied by it first.
    pub unscale: f32,
    /// `1 − β1`.
    pub w1: f32,
    /// `β2`.
    pub b2: f32,
    /// `1 − β2`.
    pub w2: f32,
    pub eps: f32,
    /// `sqrt(1 − β2ᵗ)`.
    pub bc2_sqrt: f32,
    /// `lr / (1 − β1ᵗ)`.
    pub step_size: f32,
    /// `1 − lr·weight_decay` (exactly 1 without weight decay: multiplying by it changes nothing).
    pub decay: f32,
}

impl AdamWScalars {
    /// The scalars of update number `step` (1-based: the first update is step 1).
    pub fn new(
        step: u64,
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        unscale: f64,
    ) -> Self {
        let (b1, b2) = betas;
        let t = step as i32;
        let bc1 = 1.0 - b1.powi(t);
        let bc2_sqrt = (1.0 - b2.powi(t)).sqrt();
        AdamWScalars {
            unscale: unscale as f32,
            w1: (1.0 - b1) as f32,
            b2: b2 as f32,
            w2: (1.0 - b2) as f32,
            eps: eps as f32,
            bc2_sqrt: bc2_sqrt as f32,
            step_size: (lr / bc1) as f32,
            decay: (1.0 - lr * weight_decay) as f32,
        }
    }
}

/// `mt_adamw`: updates the flat `master`, `m`, `v` (tensor `k` at [`offsets`]`[k]`, `sizes[k]`
/// elements) with the gradients `grads` (None: zeros) clipped by `coef`, and returns the new
/// weights per tensor (what the kernel writes to each tensor's out pointer). Does nothing and
/// returns None when `norm` is not finite (a skipped step).
// `i` indexes the gradient and the out tensor at `i`, the state at `off[k] + i`, as the kernel does.
#[allow(clippy::needless_range_loop)]
pub fn multi_tensor_adamw(
    state: (&mut [f32], &mut [f32], &mut [f32]),
    grads: &[Option<&[f32]>],
    sizes: &[usize],
    (norm, coef): (f64, f64),
    s: &AdamWScalars,
) -> Option<Vec<Vec<f32>>> {
    if !norm.is_finite() {
        return None;
    }
    let (master, m, v) = state;
    let (off, _) = offsets(sizes);
    let c = coef as f32;
    let mut out: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    let chunks = chunk_table(sizes);
    for ch in chunks.chunks_exact(2) {
        let (k, start) = (ch[0] as usize, ch[1] as usize);
        for i in start..(start + CHUNK).min(sizes[k]) {
            let j = off[k] + i;
            let g = grad(grads[k], i) * s.unscale * c;
            let mut p = master[j] * s.decay;
            m[j] += s.w1 * (g - m[j]);
            v[j] = v[j] * s.b2 + s.w2 * g * g;
            let denom = v[j].sqrt() / s.bc2_sqrt + s.eps;
            p -= s.step_size * m[j] / denom;
            master[j] = p;
            out[k][i] = p;
        }
    }
    Some(out)
}

/// The steps the kernels are checked on (`check.rs` for `rtune selftest`, and
/// `tests/kernels_emulated.rs` on the CPU): `(name, gradient scale, unscale, clip as a fraction of
/// the norm (0: off), an infinite gradient)`.
pub const CHECK_STEPS: [(&str, f32, f64, f64, bool); 4] = [
    ("clipped", 1.0, 1.0, 0.25, false),
    ("loss-scaled", 1024.0, 1.0 / 1024.0, 0.5, false),
    ("unclipped", 1.0, 1.0, 0.0, false),
    ("inf-skipped", 1.0, 1.0, 0.25, true),
];

/// One checked step as the reference takes it: its gradients (tensor 1 given as none: zeros),
/// the norm cap handed to the kernels, the reference's `(norm, coef)` and scalars, and the weights
/// it wrote per tensor (`None`: a skipped step).
pub struct CheckStep {
    pub grads: Vec<Vec<f32>>,
    pub unscale: f32,
    pub max_norm: f64,
    pub norm: f64,
    pub coef: f64,
    pub scalars: AdamWScalars,
    pub written: Option<Vec<Vec<f32>>>,
}

impl CheckStep {
    /// The gradients as the kernels' table gives them: tensor 1 none.
    pub fn host(&self) -> Vec<Option<&[f32]>> {
        self.grads
            .iter()
            .enumerate()
            .map(|(k, g)| (k != 1).then_some(g.as_slice()))
            .collect()
    }
}

/// Draws [`CHECK_STEPS`]`[i]`'s gradients for `sizes` from `rng` and applies the reference's step
/// `step + 1` (AdamW with lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01) to `state`
/// (master, m, v); `step` advances unless the step was skipped.
pub fn check_step(
    rng: &mut rtune_backend::check::Rng,
    sizes: &[usize],
    i: usize,
    step: &mut u64,
    state: (&mut [f32], &mut [f32], &mut [f32]),
) -> CheckStep {
    let (_, scale, unscale, clip, poison) = CHECK_STEPS[i];
    let mut grads: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| rng.normals(n, 0.01 * scale, rtune_backend::Precision::F32))
        .collect();
    if poison {
        if let Some(g) = grads.iter_mut().find(|g| g.len() > 5) {
            g[5] = f32::INFINITY;
        }
    }
    let mut c = CheckStep {
        grads,
        unscale: unscale as f32,
        max_norm: 0.0,
        norm: 0.0,
        coef: 0.0,
        scalars: AdamWScalars::new(*step + 1, 1e-3, (0.9, 0.999), 1e-8, 0.01, unscale),
        written: None,
    };
    let host = c.host();
    let sq = multi_tensor_sq_norm(&host, sizes, unscale as f32);
    let max_norm = if clip > 0.0 && sq.is_finite() {
        clip * sq.sqrt()
    } else {
        clip
    };
    let (norm, coef) = clip_coef(sq, max_norm);
    let written = multi_tensor_adamw(state, &host, sizes, (norm, coef), &c.scalars);
    if written.is_some() {
        *step += 1;
    }
    (c.max_norm, c.norm, c.coef, c.written) = (max_norm, norm, coef, written);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_element_once() {
        let sizes = [0, 1, CHUNK, CHUNK + 1, 3 * CHUNK - 1];
        let t = chunk_table(&sizes);
        let mut seen: Vec<Vec<bool>> = sizes.iter().map(|&n| vec![false; n]).collect();
        for c in t.chunks_exact(2) {
            let (k, s) = (c[0] as usize, c[1] as usize);
            for (i, x) in seen[k].iter_mut().enumerate().take(s + CHUNK).skip(s) {
                assert!(!*x, "tensor {k} element {i} twice");
                *x = true;
            }
        }
        assert!(seen.iter().flatten().all(|&b| b));
        assert_eq!(t.len() / 2, 1 + 1 + 2 + 3);
        assert_eq!(
            offsets(&sizes),
            (vec![0, 0, 1, 1 + CHUNK, 2 + 2 * CHUNK], 5 * CHUNK + 1)
        );
    }

    /// The chunked, laned sum equals the plain sum of squares to f64 rounding (1e-14 relative:
    /// ~10⁴ additions of positive terms reordered), and a missing gradient counts as zeros.
    #[test]
    fn sq_norm_is_the_sum_of_squares() {
        let sizes = [5000usize, 0, 7, 2049];
        let data: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
                    .collect()
            })
            .collect();
        let grads: Vec<Option<&[f32]>> = vec![Some(&data[0]), Some(&data[1]), None, Some(&data[3])];
        let got = multi_tensor_sq_norm(&grads, &sizes, 0.5);
        let want: f64 = [0usize, 3]
            .iter()
            .flat_map(|&k| data[k].iter())
            .map(|&x| ((x * 0.5) as f64).powi(2))
            .sum();
        assert!((got - want).abs() <= 1e-14 * want, "{got} vs {want}");
        let (n, c) = clip_coef(got, 1.0);
        assert_eq!(n, got.sqrt());
        assert_eq!(c, (1.0 / (n + 1e-6)).min(1.0));
        assert_eq!(clip_coef(got, 0.0).1, 1.0);
    }

    #[test]
    fn skipped_when_the_norm_is_not_finite() {
        let (mut p, mut m, mut v) = (vec![1.0f32; 3], vec![0.0f32; 3], vec![0.0f32; 3]);
        let s = AdamWScalars::new(1, 0.1, (0.9, 0.999), 1e-8, 0.0, 1.0);
        let g = [1.0f32, 2.0, 3.0];
        let r = multi_tensor_adamw(
            (&mut p, &mut m, &mut v),
            &[Some(&g)],
            &[3],
            (f64::NAN, 1.0),
            &s,
        );
        assert!(r.is_none());
        assert_eq!((p, m, v), (vec![1.0; 3], vec![0.0; 3], vec![0.0; 3]));
    }
}
