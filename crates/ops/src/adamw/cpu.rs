//! The CPU optimizer, beside the kernels it is the reference of: AdamW with exactly
//! `torch.optim.AdamW` semantics (torch's single-tensor path) on flat host vectors, and the global
//! gradient norm with `torch.nn.utils.clip_grad_norm_`'s coefficient. Every CPU run trains with
//! these (`rtune_train::optim::LoraOptimizer`); the kernels' loop-for-loop reference in `mod.rs`
//! equals [`AdamW::update`] bit for bit (`rtune_train`'s `optim/reference_tests.rs`).

use rayon::prelude::*;
use rtune_backend::cpu::{dispatch, Kernel};

/// Elements of a tensor one rayon job updates.
const UPDATE_BLOCK: usize = 1 << 14;

/// Optimizer state for a flat list of parameters (f32, host).
#[derive(Debug, Clone)]
pub struct AdamW {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub step: u64,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

impl AdamW {
    pub fn new(sizes: &[usize], betas: (f64, f64), eps: f64, weight_decay: f64) -> Self {
        Self {
            betas,
            eps,
            weight_decay,
            step: 0,
            m: sizes.iter().map(|&n| vec![0.0; n]).collect(),
            v: sizes.iter().map(|&n| vec![0.0; n]).collect(),
        }
    }

    /// One update of every parameter in place. `params[i]` and `grads[i]` have `sizes[i]` elements.
    pub fn update(&mut self, params: &mut [Vec<f32>], grads: &[Vec<f32>], lr: f64) {
        self.update_grouped(params, grads, lr, &[]);
    }

    /// [`update`](Self::update) with torch's parameter groups: tensor `i` trains at
    /// `lr · lr_scale[i]` (missing entries: 1, as one group). A scale of 1 gives the same bits as
    /// one group (`lr · 1.0 = lr`).
    pub fn update_grouped(
        &mut self,
        params: &mut [Vec<f32>],
        grads: &[Vec<f32>],
        lr: f64,
        lr_scale: &[f64],
    ) {
        self.step += 1;
        let (b1, b2) = self.betas;
        let t = self.step as i32;
        let bc1 = 1.0 - b1.powi(t);
        let bc2_sqrt = (1.0 - b2.powi(t)).sqrt();
        let (w1, b2f, w2) = ((1.0 - b1) as f32, b2 as f32, (1.0 - b2) as f32);
        let (eps, bc2_sqrt) = (self.eps as f32, bc2_sqrt as f32);
        for (k, (((p, g), m), v)) in params
            .iter_mut()
            .zip(grads)
            .zip(&mut self.m)
            .zip(&mut self.v)
            .enumerate()
        {
            let lr = lr * lr_scale.get(k).copied().unwrap_or(1.0);
            let step_size = (lr / bc1) as f32;
            let decay = (self.weight_decay != 0.0).then_some((1.0 - lr * self.weight_decay) as f32);
            assert!(
                g.len() == p.len() && m.len() == p.len() && v.len() == p.len(),
                "AdamW: tensor {k} has {} values, {} gradients, {} and {} moments",
                p.len(),
                g.len(),
                m.len(),
                v.len()
            );
            // Element by element, so any split gives the same bits: blocks over rayon's threads
            // (the update otherwise runs on one thread while the others wait), each compiled for
            // the widest instruction set (`sqrt` and `/` are exact in every width; no FMA).
            let k = Update {
                g,
                decay,
                w1,
                b2f,
                w2,
                bc2_sqrt,
                eps,
                step_size,
            };
            p.par_chunks_mut(UPDATE_BLOCK)
                .zip(m.par_chunks_mut(UPDATE_BLOCK))
                .zip(v.par_chunks_mut(UPDATE_BLOCK))
                .enumerate()
                .for_each(|(i, ((p, m), v))| dispatch(&k, i * UPDATE_BLOCK, (p, m, v)));
        }
    }
}

/// One tensor's AdamW update on a block of its elements from `r0` on: `(p, m, v)` in place from
/// `g[r0..]` (the loop of torch's single-tensor path, element by element).
struct Update<'a> {
    g: &'a [f32],
    decay: Option<f32>,
    w1: f32,
    b2f: f32,
    w2: f32,
    bc2_sqrt: f32,
    eps: f32,
    step_size: f32,
}

impl Kernel for Update<'_> {
    type Out<'o> = (&'o mut [f32], &'o mut [f32], &'o mut [f32]);

    #[inline(always)]
    fn run(&self, r0: usize, (p, m, v): Self::Out<'_>) {
        let g = &self.g[r0..r0 + p.len()];
        if let Some(decay) = self.decay {
            p.iter_mut().for_each(|p| *p *= decay);
        }
        for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            *m += self.w1 * (g - *m);
            *v = *v * self.b2f + self.w2 * g * g;
            let denom = v.sqrt() / self.bc2_sqrt + self.eps;
            *p -= self.step_size * *m / denom;
        }
    }
}

/// Elements of one partial sum of squares in [`clip_factor`].
const NORM_BLOCK: usize = 1 << 14;

/// `Σ x²` in f64 over 8 running sums (one chain of dependent adds is latency-bound), added in a
/// fixed order.
fn sum_sq(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v) * f64::from(v);
        }
    }
    let tail: f64 = it
        .remainder()
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// The global L2 norm of all gradients (in f64), and the factor `clip_grad_norm_` scales them by.
/// Each gradient's blocks of NORM_BLOCK (16 384) elements are summed over rayon's threads and the
/// blocks' sums added in order: the same bits on any number of threads (a single sequential sum
/// ran on one thread for ~5 ms a step on a 6.6 M-value adapter, the other core idle).
pub fn clip_factor(grads: &[Vec<f32>], max_norm: f64) -> (f64, f64) {
    let blocks: Vec<f64> = grads
        .par_iter()
        .flat_map(|g| g.par_chunks(NORM_BLOCK).map(sum_sq))
        .collect();
    let norm = blocks.iter().sum::<f64>().sqrt();
    if max_norm <= 0.0 {
        return (norm, 1.0);
    }
    let coef = max_norm / (norm + 1e-6);
    (norm, coef.min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// torch 2.x, the lines that produced the expected values:
    /// ```python
    /// p = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    /// opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    /// for g in ([0.5, -1.0, 2.0], [0.1, 0.2, -0.3]):
    ///     p.grad = torch.tensor(g); opt.step()
    /// print(p.tolist())  # [0.8177969455718994, -1.8449994325637817, 0.34388071298599243]
    /// ```
    /// Recomputed here by hand from the update rule: step 1 moves each weight by −lr·sign(g) after
    /// decay; step 2 by −lr·m̂/√v̂.
    #[test]
    fn adamw_two_steps_by_hand() {
        let mut p = vec![vec![1.0f32, -2.0, 0.5]];
        let mut opt = AdamW::new(&[3], (0.9, 0.999), 1e-8, 0.01);
        opt.update(&mut p, &[vec![0.5, -1.0, 2.0]], 0.1);
        // step 1: p·(1 − 0.001) − 0.1·g/|g| (up to eps)
        let want1 = [1.0 * 0.999 - 0.1, -2.0 * 0.999 + 0.1, 0.5 * 0.999 - 0.1];
        for (a, b) in p[0].iter().zip(want1) {
            assert!((a - b as f32).abs() < 1e-6, "{a} vs {b}");
        }
        opt.update(&mut p, &[vec![0.1, 0.2, -0.3]], 0.1);
        let g1 = [0.5f64, -1.0, 2.0];
        let g2 = [0.1f64, 0.2, -0.3];
        for i in 0..3 {
            let m = 0.9 * 0.1 * g1[i] + 0.1 * g2[i];
            let v = 0.999 * 0.001 * g1[i] * g1[i] + 0.001 * g2[i] * g2[i];
            let mhat = m / (1.0 - 0.9f64.powi(2));
            let vhat = v / (1.0 - 0.999f64.powi(2));
            let want = want1[i] * 0.999 - 0.1 * mhat / (vhat.sqrt() + 1e-8);
            assert!(
                (p[0][i] as f64 - want).abs() < 1e-5,
                "{i}: {} vs {want}",
                p[0][i]
            );
        }
        let torch = [0.817_796_95f32, -1.844_999_4, 0.343_880_7];
        for (a, b) in p[0].iter().zip(torch) {
            // f32 arithmetic in a different order than torch's kernels: a few ulp.
            assert!((a - b).abs() < 1e-6, "{a} vs torch {b}");
        }
    }

    /// The update compiled for AVX-512, AVX2 and the baseline gives the same bits as a plain
    /// element-by-element loop (the update rule written out once more here), with and without
    /// decay, on tensors that end mid-block: exact, as every width rounds each operation alike.
    #[test]
    fn every_instruction_set_updates_alike() {
        use rtune_backend::cpu::ISA_CAP;
        use std::sync::atomic::Ordering;
        let n = [UPDATE_BLOCK + 37, 5];
        let vals = |seed: u32, k: usize| -> Vec<f32> {
            (0..k)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / 4e9 - 0.5)
                .collect()
        };
        let grads: Vec<Vec<f32>> = n.iter().map(|&k| vals(7, k)).collect();
        for wd in [0.0, 0.1] {
            let run = |cap: u8| {
                ISA_CAP.store(cap, Ordering::Relaxed);
                let mut p: Vec<Vec<f32>> = n.iter().map(|&k| vals(3, k)).collect();
                let mut opt = AdamW::new(&n, (0.9, 0.999), 1e-8, wd);
                opt.update(&mut p, &grads, 1e-3);
                opt.update_grouped(&mut p, &grads, 1e-3, &[0.5]);
                ISA_CAP.store(2, Ordering::Relaxed);
                p
            };
            // The reference: the same two updates, one element at a time.
            let mut want: Vec<Vec<f32>> = n.iter().map(|&k| vals(3, k)).collect();
            let mut mv: Vec<(Vec<f32>, Vec<f32>)> =
                n.iter().map(|&k| (vec![0.0; k], vec![0.0; k])).collect();
            for (step, scale) in [(1, [1.0, 1.0]), (2, [0.5, 1.0])] {
                let bc1 = 1.0 - 0.9f64.powi(step);
                let bc2_sqrt = ((1.0 - 0.999f64.powi(step)).sqrt()) as f32;
                for (t, (p, (m, v))) in want.iter_mut().zip(&mut mv).enumerate() {
                    let lr = 1e-3 * scale[t];
                    let step_size = (lr / bc1) as f32;
                    for i in 0..p.len() {
                        if wd != 0.0 {
                            p[i] *= (1.0 - lr * wd) as f32;
                        }
                        let g = grads[t][i];
                        m[i] += (1.0 - 0.9f64) as f32 * (g - m[i]);
                        v[i] = v[i] * 0.999f64 as f32 + (1.0 - 0.999f64) as f32 * g * g;
                        let denom = v[i].sqrt() / bc2_sqrt + 1e-8f64 as f32;
                        p[i] -= step_size * m[i] / denom;
                    }
                }
            }
            let bits =
                |p: &[Vec<f32>]| -> Vec<u32> { p.iter().flatten().map(|x| x.to_bits()).collect() };
            for cap in [2, 1, 0] {
                assert!(
                    bits(&run(cap)) == bits(&want),
                    "weight decay {wd}, ISA cap {cap}"
                );
            }
        }
    }

    /// The norm over blocks equals a sequential f64 sum within 1e-12 relative (the order of the
    /// f64 adds: a sequential sum of n = 5·10⁴ squares is off by up to n·ε ≈ 5.6e-12 of the
    /// total; seen 4.3e-14), and is the same bits on 1 and on 3 threads: 3 gradients of odd
    /// sizes, one spanning several blocks, one empty.
    #[test]
    fn the_norm_is_the_same_on_any_thread_count() {
        let sizes = [3 * NORM_BLOCK + 11, 0, 777];
        let grads: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                (0..n)
                    .map(|i| ((i * 7919 + k * 104729) % 2003) as f32 * 1e-3 - 1.0)
                    .collect()
            })
            .collect();
        let seq: f64 = grads
            .iter()
            .flatten()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt();
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| clip_factor(&grads, 1.0))
        };
        let (one, three) = (on(1), on(3));
        assert_eq!(one.0.to_bits(), three.0.to_bits());
        assert_eq!(one.1.to_bits(), three.1.to_bits());
        assert!((one.0 - seq).abs() / seq < 1e-12, "{} vs {seq}", one.0);
        assert!(one.1 < 1.0, "the norm {} is above 1: clipped", one.0);
    }

    #[test]
    fn clipping_as_torch() {
        let g = vec![vec![3.0f32, 0.0], vec![4.0]];
        let (n, c) = clip_factor(&g, 1.0);
        assert!((n - 5.0).abs() < 1e-12);
        assert!((c - 1.0 / (5.0 + 1e-6)).abs() < 1e-12);
        assert_eq!(clip_factor(&g, 10.0).1, 1.0);
        assert_eq!(clip_factor(&g, 0.0).1, 1.0);
    }
}
