//! The CPU reference of `kernels/flash_attn.cu` (tiled attention, FlashAttention-2's algorithm):
//! the kernels restated step by step on f32 slices, with the same tiles ([`BR`] queries × [`BC`]
//! keys), the same key ranges, the same online-softmax update order and the same roundings to the
//! kernel's [`Precision`] (P and dS rounded before their tile products, outputs rounded once).
//! Always compiled: `crates/ops/src/attention/tests/flash_ref.rs` tests it against the plain
//! attention path of `crates/ops/src (each op folder)` on the CPU, and [`crate::flash_check`] (with
//! `cuda`) runs the kernels against it.
//!
//! Layouts (contiguous, as crates/ops/src/attention/tiled.rs passes them): `q, dq: (B, H, T, Dh)`,
//! `k, v, dk, dv: (B, Hkv, T, Dh)`, `o, dO: (B, T, H, Dh)`, `lse: (B, T, H)`,
//! `starts: (SB, T)` with `SB` 1 or `B`: query `i` sees keys `starts[i] ..= i`.
//!
//! Forward, per (row, head, query tile `i0 = n·BR`): key tiles from `lo = min starts` of the tile
//! up to its last query, `BC` at a time; per row `m_new = max(m, max s)`, `e = exp(s − m_new)`,
//! `α = exp(m − m_new)` (1 while `m_new = −∞`), `l = l·α + Σe`, `acc = acc·α + Σ T(e)·v`;
//! `O = T(acc / l)`, `lse = m + ln l` (a query with no visible key: `O = 0`, `lse = +∞`).
//! Backward: `D = rowsum(dO ∘ O)`; per (row, kv head, key tile `j0 = n·BC`), over the group's
//! query heads and the query tiles from `⌊j0 / BR⌋·BR` on that see a key of the tile:
//! `P = exp(S·scale − lse)`, `dS = P·(dP − D)·scale`, `dV += T(P)ᵀ·dO`, `dK += T(dS)ᵀ·Q`; and
//! per query tile over the forward's key tiles `dQ += T(dS)·K`. Every dot product is a sequential
//! chain of f32 fused multiply-adds in the index order (the kernels' f32 path; the tensor cores
//! sum bf16/f16 products in an order of their own, within the f32 tolerance of these sums).

use rtune_backend::Precision;

/// Queries per tile (`BR` in `flash_attn.cu`).
pub const BR: usize = 32;
/// Keys per tile (`BC` in `flash_attn.cu`).
pub const BC: usize = 32;
/// The head dims the kernels are instantiated for.
pub const HEAD_DIMS: [usize; 3] = [64, 96, 128];

/// The sizes of one call: `q: (b, h, t, dh)`, `k, v: (b, hkv, t, dh)`, `starts: (sb, t)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashShape {
    pub b: usize,
    pub h: usize,
    pub hkv: usize,
    pub t: usize,
    pub dh: usize,
    /// Rows of `starts`: 1 (shared by the batch) or `b`.
    pub sb: usize,
}

impl FlashShape {
    /// Query heads per kv head.
    pub fn g(&self) -> usize {
        self.h / self.hkv
    }
    /// Row `i` of head `h` of batch row `b` in `(B, heads, T, Dh)`.
    fn bhtd(&self, heads: usize, b: usize, h: usize, i: usize) -> usize {
        ((b * heads + h) * self.t + i) * self.dh
    }
    /// Row `i` of head `h` of batch row `b` in `(B, T, H, Dh)`.
    fn bthd(&self, b: usize, i: usize, h: usize) -> usize {
        ((b * self.t + i) * self.h + h) * self.dh
    }
    /// `(b, i, h)` in `(B, T, H)`.
    fn bth(&self, b: usize, i: usize, h: usize) -> usize {
        (b * self.t + i) * self.h + h
    }
    fn starts<'a>(&self, st: &'a [u32], b: usize) -> &'a [u32] {
        let r = if self.sb == 1 { 0 } else { b };
        &st[r * self.t..(r + 1) * self.t]
    }
}

/// `Σ a[i]·b[i]` as a chain of f32 fused multiply-adds from 0 (the kernels' f32 `fmaf` loop).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |s, (x, y)| x.mul_add(*y, s))
}

/// The key range `[lo, hi)` of the query tile `i0..i0 + nr` (`tile_keys` in the kernel).
fn tile_keys(st: &[u32], i0: usize, nr: usize) -> (usize, usize) {
    let lo = st[i0..i0 + nr]
        .iter()
        .map(|&s| s as usize)
        .min()
        .unwrap_or(i0);
    (lo, i0 + nr)
}

/// Whether query `i` sees key `j`.
fn visible(st: &[u32], i: usize, j: usize) -> bool {
    st[i] as usize <= j && j <= i
}

/// Forward: `(o, lse)`, `o: (B, T, H, Dh)` rounded to `p`, `lse: (B, T, H)`. Inputs hold values of
/// precision `p`.
pub fn forward(
    s: &FlashShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    starts: &[u32],
    scale: f32,
    p: Precision,
) -> (Vec<f32>, Vec<f32>) {
    let dh = s.dh;
    let mut o = vec![0f32; s.b * s.t * s.h * dh];
    let mut lse = vec![0f32; s.b * s.t * s.h];
    for b in 0..s.b {
        let st = s.starts(starts, b);
        for h in 0..s.h {
            let hk = h / s.g();
            for i0 in (0..s.t).step_by(BR) {
                let nr = BR.min(s.t - i0);
                let (lo, hi) = tile_keys(st, i0, nr);
                let mut m = vec![f32::NEG_INFINITY; nr];
                let mut l = vec![0f32; nr];
                let mut acc = vec![0f32; nr * dh];
                let mut j0 = lo;
                while j0 < hi {
                    let j1 = (j0 + BC).min(hi);
                    for r in 0..nr {
                        let i = i0 + r;
                        let qi = &q[s.bhtd(s.h, b, h, i)..][..dh];
                        let sc: Vec<f32> = (j0..j1)
                            .map(|j| {
                                if visible(st, i, j) {
                                    dot(qi, &k[s.bhtd(s.hkv, b, hk, j)..][..dh]) * scale
                                } else {
                                    f32::NEG_INFINITY
                                }
                            })
                            .collect();
                        let mt = sc.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                        let mn = m[r].max(mt);
                        let e: Vec<f32> = sc
                            .iter()
                            .map(|&x| {
                                if x == f32::NEG_INFINITY {
                                    0.0
                                } else {
                                    (x - mn).exp()
                                }
                            })
                            .collect();
                        let alpha = if mn == f32::NEG_INFINITY {
                            1.0
                        } else {
                            (m[r] - mn).exp()
                        };
                        l[r] = l[r] * alpha + e.iter().sum::<f32>();
                        m[r] = mn;
                        let ar = &mut acc[r * dh..(r + 1) * dh];
                        for (d, a) in ar.iter_mut().enumerate() {
                            let mut x = *a * alpha;
                            for (c, &ec) in e.iter().enumerate() {
                                x = p.round(ec).mul_add(v[s.bhtd(s.hkv, b, hk, j0 + c) + d], x);
                            }
                            *a = x;
                        }
                    }
                    j0 = j1;
                }
                for r in 0..nr {
                    let at = s.bthd(b, i0 + r, h);
                    for d in 0..dh {
                        let x = if l[r] > 0.0 {
                            acc[r * dh + d] / l[r]
                        } else {
                            0.0
                        };
                        o[at + d] = p.round(x);
                    }
                    lse[s.bth(b, i0 + r, h)] = if l[r] > 0.0 {
                        m[r] + l[r].ln()
                    } else {
                        f32::INFINITY
                    };
                }
            }
        }
    }
    (o, lse)
}

/// `(P, dS)` of query `i` (head `h`) and key `j` (kv head `hk`), rounded to `p`; zeros where `i`
/// does not see `j`.
#[allow(clippy::too_many_arguments)]
fn scores_at(
    s: &FlashShape,
    x: &Inputs<'_>,
    (b, h, hk): (usize, usize, usize),
    st: &[u32],
    dd: &[f32],
    (i, j): (usize, usize),
    scale: f32,
    p: Precision,
) -> (f32, f32) {
    if !visible(st, i, j) {
        return (0.0, 0.0);
    }
    let dh = s.dh;
    let qi = &x.q[s.bhtd(s.h, b, h, i)..][..dh];
    let doi = &x.d_o[s.bthd(b, i, h)..][..dh];
    let kj = &x.k[s.bhtd(s.hkv, b, hk, j)..][..dh];
    let vj = &x.v[s.bhtd(s.hkv, b, hk, j)..][..dh];
    let at = s.bth(b, i, h);
    let pr = (dot(qi, kj) * scale - x.lse[at]).exp();
    let ds = pr * (dot(doi, vj) - dd[at]) * scale;
    (p.round(pr), p.round(ds))
}

/// The backward's inputs.
struct Inputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    d_o: &'a [f32],
    lse: &'a [f32],
}

/// Backward: `(dq, dk, dv)` shaped like `q, k, v`, rounded to `p`. `o, d_o: (B, T, H, Dh)` (the
/// forward's `o`), `lse: (B, T, H)`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    s: &FlashShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    d_o: &[f32],
    lse: &[f32],
    starts: &[u32],
    scale: f32,
    p: Precision,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let dh = s.dh;
    let x = Inputs { q, k, v, d_o, lse };
    // D = rowsum(dO ∘ O), (B, T, H)
    let dd: Vec<f32> = (0..s.b * s.t * s.h)
        .map(|n| dot(&d_o[n * dh..(n + 1) * dh], &o[n * dh..(n + 1) * dh]))
        .collect();
    let mut dq = vec![0f32; q.len()];
    let mut dk = vec![0f32; k.len()];
    let mut dv = vec![0f32; v.len()];
    for b in 0..s.b {
        let st = s.starts(starts, b);
        // dK, dV: per key tile, over the group's heads and the query tiles that see it.
        for hk in 0..s.hkv {
            for j0 in (0..s.t).step_by(BC) {
                let j1 = (j0 + BC).min(s.t);
                let nc = j1 - j0;
                let (mut ak, mut av) = (vec![0f32; nc * dh], vec![0f32; nc * dh]);
                for h in hk * s.g()..(hk + 1) * s.g() {
                    for i0 in (j0 / BR * BR..s.t).step_by(BR) {
                        let nr = BR.min(s.t - i0);
                        let (lo, hi) = tile_keys(st, i0, nr);
                        if lo >= j1 || hi <= j0 {
                            continue;
                        }
                        let pd: Vec<(f32, f32)> = (0..nr * nc)
                            .map(|e| {
                                let (i, j) = (i0 + e / nc, j0 + e % nc);
                                scores_at(s, &x, (b, h, hk), st, &dd, (i, j), scale, p)
                            })
                            .collect();
                        for c in 0..nc {
                            for d in 0..dh {
                                let (mut yk, mut yv) = (ak[c * dh + d], av[c * dh + d]);
                                for r in 0..nr {
                                    let (pr, ds) = pd[r * nc + c];
                                    yv = pr.mul_add(d_o[s.bthd(b, i0 + r, h) + d], yv);
                                    yk = ds.mul_add(q[s.bhtd(s.h, b, h, i0 + r) + d], yk);
                                }
                                (ak[c * dh + d], av[c * dh + d]) = (yk, yv);
                            }
                        }
                    }
                }
                let at = s.bhtd(s.hkv, b, hk, j0);
                for n in 0..nc * dh {
                    dk[at + n] = p.round(ak[n]);
                    dv[at + n] = p.round(av[n]);
                }
            }
        }
        // dQ: per query tile, over the forward's key tiles.
        for h in 0..s.h {
            let hk = h / s.g();
            for i0 in (0..s.t).step_by(BR) {
                let nr = BR.min(s.t - i0);
                let (lo, hi) = tile_keys(st, i0, nr);
                let mut aq = vec![0f32; nr * dh];
                let mut j0 = lo;
                while j0 < hi {
                    let j1 = (j0 + BC).min(hi);
                    for r in 0..nr {
                        let ds: Vec<f32> = (j0..j1)
                            .map(|j| scores_at(s, &x, (b, h, hk), st, &dd, (i0 + r, j), scale, p).1)
                            .collect();
                        for d in 0..dh {
                            let mut y = aq[r * dh + d];
                            for (c, &dsc) in ds.iter().enumerate() {
                                y = dsc.mul_add(k[s.bhtd(s.hkv, b, hk, j0 + c) + d], y);
                            }
                            aq[r * dh + d] = y;
                        }
                    }
                    j0 = j1;
                }
                let at = s.bhtd(s.h, b, h, i0);
                for n in 0..nr * dh {
                    dq[at + n] = p.round(aq[n]);
                }
            }
        }
    }
    (dq, dk, dv)
}
