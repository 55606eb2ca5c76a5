//! Mixture-of-experts routing (issue 45), forward and hand-written backward, as transformers 5.24's
//! routers compute it on each token's router logits (`n` tokens × `e` experts, f32):
//! - [`Routing::SoftmaxTopK`]: softmax over the experts, the `k` largest probabilities, divided by
//!   their sum when `normalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral always);
//! - [`Routing::TopKSoftmax`]: the `k` largest logits, softmax over them (gpt-oss; its router's
//!   bias is in the logits already).
//!
//! The experts are chosen in descending order (torch's `topk`, sorted), equal scores kept and
//! ordered as torch's CPU kernel leaves them (`route/topk.rs`); the choice is piecewise
//! constant, so the backward flows through the chosen weights only. The router weight is frozen;
//! the gradient with respect to the logits is what the router's input gradient needs.
//!
//! [`aux_loss`] is transformers' `load_balancing_loss_func` over every layer's logits (what
//! `output_router_logits` adds, times `router_aux_loss_coef`), with its gradient.
//!
//! In a 16-bit model (the logits' `dtype`) torch gives the logits two gradients, each rounded to
//! that dtype by its own path, and sums them in it: the routing path's ([`route_backward`]:
//! the f32 softmax's backward rounded by the cast back to the logits' dtype; gpt-oss's softmax
//! in the dtype itself, its saved output rounded) and the load-balancing loss's ([`aux_loss`]:
//! transformers' softmax of the 16-bit logits in the dtype, so rounded probabilities, its
//! backward on them with the incoming gradient rounded). The caller adds the two and rounds the
//! sum. Summed in f32 and rounded once instead, 312 to 374 of 512 entries a layer of
//! `golden_route`'s bf16 logits' gradients differ from torch's (`route/tests.rs`); so rounded,
//! gpt-oss's are bit-equal, Qwen3-MoE's and Mixtral's but for 0 to 8 entries of f32 noise (a
//! softmax backward that cancels, on probabilities whose `exp` differs from torch's in the last
//! bit).

use candle_core::{bail, DType, Result};
use rayon::prelude::*;

#[cfg(test)]
mod tests;
mod topk;

use topk::TopK;

/// How a family turns router logits into expert weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    SoftmaxTopK { normalize: bool },
    TopKSoftmax,
}

/// The experts each token goes to and their weights, with what the backward needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub k: usize,
    /// `n × k` expert indices, each token's in descending order of its score.
    pub experts: Vec<u32>,
    /// `n × k` weights, paired with `experts`.
    pub weights: Vec<f32>,
    /// `SoftmaxTopK`: the `n × e` softmax (the backward's Jacobian); empty otherwise.
    probs: Vec<f32>,
    /// `SoftmaxTopK` with `normalize`: each token's sum of its chosen probabilities.
    sums: Vec<f32>,
}

/// Softmax of one row in f32 (max subtracted), as torch's.
fn softmax_into(x: &[f32], out: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    let mut sum = 0f32;
    for (o, v) in out.iter_mut().zip(x) {
        *o = (v - max).exp();
        sum += *o;
    }
    out.iter_mut().for_each(|o| *o /= sum);
}

/// [`TopK::of`] into a new vector.
#[cfg(test)]
fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    TopK::default().of(x, k).to_vec()
}

/// `x` rounded to `dtype` (nearest even) and back to f32; f32 (or any other dtype) as is.
fn round(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Routes `n` tokens from their `n × e` router logits to `k` experts each. Errors: `k` not in
/// `1..=e`, or logits that are not `n × e`.
pub fn route(logits: &[f32], e: usize, k: usize, routing: Routing) -> Result<Routed> {
    if k == 0 || k > e {
        bail!("route: top-{k} of {e} experts (k must be in 1..={e})");
    }
    if !logits.len().is_multiple_of(e) {
        bail!(
            "route: router logits of {} values are not n × {e} experts",
            logits.len()
        );
    }
    let n = logits.len() / e;
    let mut r = Routed {
        k,
        experts: vec![0; n * k],
        weights: vec![0f32; n * k],
        probs: Vec::new(),
        sums: Vec::new(),
    };
    // Each token's row alone, over rayon's threads (the same values in any order).
    let rows = logits
        .par_chunks(e)
        .zip(r.experts.par_chunks_mut(k))
        .zip(r.weights.par_chunks_mut(k));
    match routing {
        Routing::SoftmaxTopK { normalize } => {
            r.probs = vec![0f32; n * e];
            // Each token's sum of its chosen probabilities; kept with `normalize` only.
            let mut sums = vec![0f32; n];
            rows.zip(r.probs.par_chunks_mut(e))
                .zip(sums.par_chunks_mut(1))
                .for_each_init(TopK::default, |tk, ((((row, ex), w), p), s)| {
                    softmax_into(row, p);
                    let top = tk.of(p, k);
                    let sum: f32 = top.iter().map(|&j| p[j]).sum();
                    for ((x, w), &j) in ex.iter_mut().zip(w.iter_mut()).zip(top.iter()) {
                        *x = j as u32;
                        *w = if normalize { p[j] / sum } else { p[j] };
                    }
                    s[0] = sum;
                });
            if normalize {
                r.sums = sums;
            }
        }
        Routing::TopKSoftmax => rows.for_each_init(TopK::default, |tk, ((row, ex), w)| {
            let top = tk.of(row, k);
            let vals: Vec<f32> = top.iter().map(|&j| row[j]).collect();
            softmax_into(&vals, w);
            ex.iter_mut()
                .zip(top.iter())
                .for_each(|(x, &j)| *x = j as u32);
        }),
    }
    Ok(r)
}

/// `∂L/∂logits` (`n × e`) from `∂L/∂weights` (`n × k`, paired with `routed.experts`), for logits
/// computed in `dtype`: in a 16-bit dtype rounded to it as torch's routing path gives it
/// (`SoftmaxTopK`: the f32 softmax's backward, rounded by the cast of the logits to f32;
/// `TopKSoftmax`: the softmax in the dtype, its backward on its rounded output). Errors:
/// `dweights` not `n × k`.
pub fn route_backward(
    routed: &Routed,
    dweights: &[f32],
    e: usize,
    routing: Routing,
    dtype: DType,
) -> Result<Vec<f32>> {
    let k = routed.k;
    let n = routed.experts.len() / k;
    if dweights.len() != n * k {
        bail!(
            "route backward: dweights of {} values are not n × k = {n} × {k}",
            dweights.len()
        );
    }
    let mut dlogits = vec![0f32; n * e];
    for t in 0..n {
        let ex = &routed.experts[t * k..(t + 1) * k];
        let w = &routed.weights[t * k..(t + 1) * k];
        let g = &dweights[t * k..(t + 1) * k];
        let dl = &mut dlogits[t * e..(t + 1) * e];
        match routing {
            Routing::SoftmaxTopK { normalize } => {
                // ∂L/∂p on the chosen experts: w_j = p_j / S gives g_j / S − Σ_m g_m w_m / S, in
                // torch's order (the division's two backward terms, the second summed over k).
                let mut dp = vec![0f32; e];
                if normalize {
                    let s = routed.sums[t];
                    let gw: f32 = g.iter().zip(w).map(|(a, b)| -(a * (b / s))).sum();
                    for (j, &x) in ex.iter().enumerate() {
                        dp[x as usize] = g[j] / s + gw;
                    }
                } else {
                    for (j, &x) in ex.iter().enumerate() {
                        dp[x as usize] = g[j];
                    }
                }
                let p = &routed.probs[t * e..(t + 1) * e];
                softmax_backward(p, &dp, dl);
            }
            Routing::TopKSoftmax => {
                let w: Vec<f32> = w.iter().map(|&v| round(v, dtype)).collect();
                let gw: f32 = g.iter().zip(&w).map(|(a, b)| a * b).sum();
                for (j, &x) in ex.iter().enumerate() {
                    dl[x as usize] = w[j] * (g[j] - gw);
                }
            }
        }
    }
    dlogits.iter_mut().for_each(|v| *v = round(*v, dtype));
    Ok(dlogits)
}

/// `∂L/∂x` of `p = softmax(x)` from `∂L/∂p`: `p ⊙ (dp − Σ p·dp)`.
fn softmax_backward(p: &[f32], dp: &[f32], dx: &mut [f32]) {
    let dot: f32 = p.iter().zip(dp).map(|(a, b)| a * b).sum();
    for ((o, pi), di) in dx.iter_mut().zip(p).zip(dp) {
        *o = pi * (di - dot);
    }
}

/// transformers' `load_balancing_loss_func` over `layers` (each `n × e` router logits of the same
/// `n` tokens, computed in `dtype`), top-`k` counts; `mask` (`n`, 1 = a real token) leaves
/// padding out. Returns the loss (before `router_aux_loss_coef`) and the gradient of
/// `scale · loss` (`scale`: the coefficient times the loss's weight in the step) with respect to
/// each layer's logits: `E · Σ_e (count_e / N) · (Σ_t p_te / N)`, `N` the masked tokens over all
/// layers; the counts are piecewise constant, so the gradient flows through the probabilities
/// only. In a 16-bit `dtype` the probabilities are rounded to it (transformers' softmax of the
/// 16-bit logits), the counts are their top-`k`, and the gradient is torch's: `∂/∂p` rounded to
/// the dtype, the softmax's backward on the rounded probabilities rounded (see the module doc).
pub fn aux_loss(
    layers: &[&[f32]],
    e: usize,
    k: usize,
    mask: Option<&[f32]>,
    scale: f32,
    dtype: DType,
) -> (f32, Vec<Vec<f32>>) {
    let n = layers.first().map_or(0, |l| l.len() / e);
    let ones = vec![1f32; n];
    let mask = mask.unwrap_or(&ones);
    let mut counts = vec![0f32; e];
    let mut prob_sum = vec![0f32; e];
    let mut total = 0f32;
    let mut probs: Vec<Vec<f32>> = Vec::with_capacity(layers.len());
    // Rows over rayon's threads in blocks of a fixed size, each block's sums in row order and the
    // blocks' in block order: the same bits on any number of threads.
    const BLOCK: usize = 256;
    for logits in layers {
        let mut p = vec![0f32; n * e];
        let partial: Vec<(Vec<f32>, Vec<f32>)> = logits
            .par_chunks(BLOCK * e)
            .zip(p.par_chunks_mut(BLOCK * e))
            .zip(mask.par_chunks(BLOCK))
            .map(|((rows, pb), mb)| {
                let (mut c, mut s, mut tk) = (vec![0f32; e], vec![0f32; e], TopK::default());
                for ((row, pr), &m) in rows.chunks(e).zip(pb.chunks_mut(e)).zip(mb) {
                    softmax_into(row, pr);
                    pr.iter_mut().for_each(|v| *v = round(*v, dtype));
                    for &j in tk.of(pr, k) {
                        c[j] += m;
                    }
                    s.iter_mut().zip(pr.iter()).for_each(|(s, v)| *s += v * m);
                }
                (c, s)
            })
            .collect();
        for (c, s) in &partial {
            counts.iter_mut().zip(c).for_each(|(a, b)| *a += b);
            prob_sum.iter_mut().zip(s).for_each(|(a, b)| *a += b);
        }
        total += mask.iter().sum::<f32>();
        probs.push(p);
    }
    let tokens_per_expert: Vec<f32> = counts.iter().map(|c| c / total).collect();
    let loss = e as f32
        * tokens_per_expert
            .iter()
            .zip(&prob_sum)
            .map(|(a, b)| a * (b / total))
            .sum::<f32>();
    // ∂(scale · loss)/∂p_te = scale · E · tokens_per_expert_e / N · mask_t, in torch's order, then
    // rounded as the backward of transformers' `.float()` of the 16-bit probabilities.
    let de: Vec<f32> = (tokens_per_expert.iter())
        .map(|c| scale * e as f32 * c / total)
        .collect();
    let grads = probs
        .iter()
        .map(|p| {
            let mut d = vec![0f32; n * e];
            // Each token's row alone, over rayon's threads.
            d.par_chunks_mut(e)
                .zip(p.par_chunks(e))
                .zip(mask.par_iter())
                .for_each_init(
                    || vec![0f32; e],
                    |dp, ((row, pr), &m)| {
                        dp.iter_mut()
                            .zip(&de)
                            .for_each(|(o, v)| *o = round(v * m, dtype));
                        softmax_backward(pr, dp, row);
                        row.iter_mut().for_each(|v| *v = round(*v, dtype));
                    },
                );
            d
        })
        .collect();
    (loss, grads)
}
