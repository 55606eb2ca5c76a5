//! The experts' fast CPU path (f32): the same math as the per-expert path of [`super`], laid out
//! for speed. The `R = T·k` routed rows are gathered once into one buffer sorted by expert
//! (`xs: (R, H)`, expert `e`'s rows `off[e]..off[e+1]`); each expert's products run on its own
//! contiguous row block, written in place into shared `(R, ·)` buffers (no per-expert tensors).
//! [`Engine::Blas`] (when `rtune_backend::blas` loaded a CBLAS, as `rtune` does): the products
//! go through the dense path's OpenBLAS (`rtune_backend::blas::sgemm`), each expert's on one
//! thread, the experts spread over rayon's threads ([`rtune_backend::blas::one_thread`]: OpenBLAS
//! 0.3.21's threaded level 3 serialises callers from several threads on one lock, its one-thread
//! calls do not). OpenBLAS threading each product instead, one expert after another, ran the
//! frozen products at the dense GEMM's own rate (`moe_timing`: 78 GFLOP per CPU second) but lost
//! ~14% of the op to its idle workers' `sched_yield` between the small products; the one-thread
//! layout beat it in each of three interleaved pairs of `moe_timing` at load ~9 (1497 / 1336 /
//! 772 ms against 1728 / 2701 / 1064 ms a forward + backward). The `gemm` crate on one thread per
//! expert gave 21.6. [`Engine::Gemm`] (no CBLAS): that `gemm`-crate layout (candle's CPU GEMM,
//! `Parallelism::None`). The activation runs once over
//! all rows; the weighted
//! combine and `dx` sum each token's rows in expert order, as the per-expert path's `index_add`
//! does. The frozen weights' gradients are never formed: only `dx`, `∂L/∂w` and the LoRA factors'.
//!
//! Per expert `e` with rows `X_e: (n, in)`, weight `W_e: (out, in)`, LoRA `A_e: (r, in)`,
//! `B_e: (out, r)` (PEFT's `lora_B` repacked once a call to `(E, out, r)`), scale `s`:
//! forward `Y_e = X_e W_eᵀ + s (X_e A_eᵀ) B_eᵀ (+ bias_e)`; backward from `dY_e`:
//! `dX_e = dY_e W_e + (s dY_e B_e) A_e`, `dB_e = s dY_eᵀ (X_e A_eᵀ)`, `dA_e = (s dY_e B_e)ᵀ X_e`.

use candle_core::{bail, CpuStorage, DType, Device, Result, Storage, Tensor};
use rayon::prelude::*;
use std::ops::Deref;

use super::stack::{Source, Weights};
use super::{act, dims, Experts, Groups};

/// Whether the fast path takes these operands: every tensor f32 on the CPU (an NF4 stack
/// dequantizes to f32 on the CPU, one expert a job).
pub(super) fn applies(x: &Tensor, ex: &Experts) -> bool {
    let f32_cpu = |t: &Tensor| t.dtype() == DType::F32 && t.device().is_cpu();
    let lora =
        |l: &Option<super::ExpertLora>| l.as_ref().is_none_or(|l| f32_cpu(l.a) && f32_cpu(l.b));
    f32_cpu(x)
        && ex.gate_up.f32_cpu()
        && ex.down.f32_cpu()
        && ex.gate_up_bias.is_none_or(f32_cpu)
        && ex.down_bias.is_none_or(f32_cpu)
        && lora(&ex.lora_gate_up)
        && lora(&ex.lora_down)
}

/// A contiguous f32 CPU tensor's elements, read in place (the read guard held while borrowed).
struct View<'a> {
    guard: Box<dyn Deref<Target = Storage> + 'a>,
    start: usize,
    len: usize,
}

impl View<'_> {
    fn of<'a>(t: &'a Tensor, what: &str) -> Result<View<'a>> {
        if !t.is_contiguous() {
            bail!("moe grouped: {what} {:?} is not contiguous", t.dims());
        }
        let (guard, layout) = t.storage_and_layout();
        if !matches!(&*guard, Storage::Cpu(CpuStorage::F32(_))) {
            bail!("moe grouped: {what} is not f32 on the CPU");
        }
        let start = layout.start_offset();
        Ok(View {
            guard: Box::new(guard),
            start,
            len: t.elem_count(),
        })
    }

    fn s(&self) -> &[f32] {
        match &**self.guard {
            Storage::Cpu(CpuStorage::F32(v)) => &v[self.start..self.start + self.len],
            // Checked in `of`.
            _ => &[],
        }
    }
}

/// A matrix view into a slice: element `(i, j)` at `i·rs + j·cs`.
#[derive(Clone, Copy)]
struct M<'a> {
    d: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> M<'a> {
    /// Row-major `(·, cols)`.
    fn rows(d: &'a [f32], cols: usize) -> Self {
        M { d, rs: cols, cs: 1 }
    }
    /// The transpose of a row-major `(·, cols)` matrix.
    fn t(d: &'a [f32], cols: usize) -> Self {
        M { d, rs: 1, cs: cols }
    }
    fn covers(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.d.len()
    }
}

/// Where the experts' products run (module note).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Engine {
    Blas,
    Gemm,
}

impl Engine {
    /// [`Engine::Blas`] when a CBLAS is loaded.
    pub(super) fn detect() -> Engine {
        match rtune_backend::blas::loaded() {
            Some(_) => Engine::Blas,
            None => Engine::Gemm,
        }
    }
}

/// An [`M`] as a CBLAS operand: row-major as stored (unit column stride) or transposed (unit row
/// stride).
fn operand(m: M) -> rtune_backend::blas::Operand {
    let (trans, ld) = if m.cs == 1 {
        (false, m.rs)
    } else {
        (true, m.cs)
    };
    rtune_backend::blas::Operand {
        data: m.d,
        trans,
        ld,
    }
}

/// `c (m×n, row-major packed) = [c +] beta · a b`, `a: m×k`, `b: k×n`: through the CBLAS
/// (its threads) for [`Engine::Blas`], on this thread otherwise.
fn mm(
    engine: Engine,
    c: &mut [f32],
    acc: bool,
    beta: f32,
    a: M,
    b: M,
    (m, n, k): (usize, usize, usize),
) -> Result<()> {
    if engine == Engine::Blas
        && (a.cs == 1 || a.rs == 1)
        && (b.cs == 1 || b.rs == 1)
        && rtune_backend::blas::sgemm(
            operand(a),
            operand(b),
            c,
            (m, n, k),
            beta,
            if acc { 1.0 } else { 0.0 },
        )?
    {
        return Ok(());
    }
    // The bounds of the raw pointers below: a real check (a wrong size must be an error, not an
    // out-of-bounds access).
    if !(a.covers(m, k) && b.covers(k, n) && c.len() >= m * n) {
        bail!("moe grouped: product {m}×{k}·{k}×{n} out of its buffers");
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !acc {
            c[..m * n].fill(0.0);
        }
        return Ok(());
    }
    // SAFETY: every element of the three views is in bounds (checked above); `c` is borrowed
    // mutably and does not alias `a` or `b` (shared borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            acc,
            a.d.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.d.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
    Ok(())
}

/// `buf` of `(R, width)` split into each expert's row block.
fn split<'a>(mut buf: &'a mut [f32], off: &[usize], width: usize) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(off.len().saturating_sub(1));
    for w in off.windows(2) {
        let (head, rest) = std::mem::take(&mut buf).split_at_mut((w[1] - w[0]) * width);
        out.push(head);
        buf = rest;
    }
    out
}

/// A stack's weights for one call: the dense stack's view, or the NF4 experts.
enum StackView<'a> {
    Dense(View<'a>),
    Nf4(&'a super::Nf4Stack),
}

impl<'a> StackView<'a> {
    fn of(s: &'a Source<'a>, what: &str) -> Result<StackView<'a>> {
        Ok(match s {
            Source::Dense(t) => StackView::Dense(View::of(t, what)?),
            Source::Nf4(q) => StackView::Nf4(q),
        })
    }

    fn w(&self) -> Weights<'_> {
        match self {
            StackView::Dense(v) => Weights::Dense(v.s()),
            StackView::Nf4(q) => Weights::Nf4(q),
        }
    }
}

/// An optional tensor's view.
fn view_opt<'a>(t: Option<&'a Tensor>, what: &str) -> Result<Option<View<'a>>> {
    t.map(|t| View::of(t, what)).transpose()
}

/// A [`Lora`]'s views, and the forward's `X Aᵀ` `(R, r)` for the backward.
struct LoraView<'a> {
    a: View<'a>,
    b: View<'a>,
    r: usize,
    scale: f32,
    xa: Option<View<'a>>,
}

impl<'a> LoraView<'a> {
    fn of(l: Option<&'a Lora>, xa: Option<&'a Tensor>) -> Result<Option<LoraView<'a>>> {
        let Some(l) = l else { return Ok(None) };
        Ok(Some(LoraView {
            a: View::of(&l.a, "lora_A")?,
            b: View::of(&l.b, "lora_B")?,
            r: l.r,
            scale: l.scale,
            xa: view_opt(xa, "x·Aᵀ")?,
        }))
    }

    fn fwd(&self) -> (&[f32], &[f32], usize, f32) {
        (self.a.s(), self.b.s(), self.r, self.scale)
    }

    #[allow(clippy::type_complexity)]
    fn bwd(&self) -> Result<(&[f32], &[f32], usize, f32, &[f32])> {
        let Some(xa) = &self.xa else {
            bail!("moe grouped backward: LoRA given but the forward ran without it");
        };
        Ok((self.a.s(), self.b.s(), self.r, self.scale, xa.s()))
    }
}

/// A LoRA pair as the kernels read it: `a: (E·r, in)` (PEFT's), `b: (E, out, r)` (repacked).
struct Lora {
    a: Tensor,
    b: Tensor,
    r: usize,
    scale: f32,
}

impl Lora {
    fn of(l: &Option<super::ExpertLora>, e: usize) -> Result<Option<Lora>> {
        let Some(l) = l else { return Ok(None) };
        let (er, _) = l.a.dims2()?;
        let out = l.b.dim(0)?;
        let r = er / e;
        // (out, r·E) -> (out, r, E) -> (E, out, r): expert e's B_e packed.
        let b = l.b.reshape((out, r, e))?.permute((2, 0, 1))?.contiguous()?;
        Ok(Some(Lora {
            a: l.a.contiguous()?,
            b,
            r,
            scale: l.scale as f32,
        }))
    }
}

/// The forward's cache: rows sorted by expert and what the backward reads.
#[derive(Debug)]
pub(super) struct Cache {
    /// Expert `e`'s rows `off[e]..off[e+1]`; `token[i]`, `slot[i]` of row `i`.
    off: Vec<usize>,
    token: Vec<u32>,
    slot: Vec<usize>,
    /// Per token, its `k` rows ascending (expert order).
    rows_of: Vec<u32>,
    /// `(R, H)`, `(R, 2I)`, `(R, H)` (the down projection before its routing weight).
    xs: Tensor,
    gu: Tensor,
    d: Tensor,
    /// `X_e A_eᵀ` of both pairs, `(R, r)`.
    xa_gu: Option<Tensor>,
    xa_dn: Option<Tensor>,
}

/// Row order, offsets and each token's rows of `g`.
fn order(g: &Groups, t: usize) -> (Vec<usize>, Vec<u32>, Vec<usize>, Vec<u32>) {
    let k = g.k;
    let mut off = Vec::with_capacity(g.tokens.len() + 1);
    off.push(0);
    for toks in &g.tokens {
        off.push(off.last().copied().unwrap_or(0) + toks.len());
    }
    let token: Vec<u32> = g.tokens.iter().flatten().copied().collect();
    let slot: Vec<usize> = g.slots.iter().flatten().copied().collect();
    let mut rows_of = vec![0u32; t * k];
    for (i, &s) in slot.iter().enumerate() {
        rows_of[s] = i as u32;
    }
    // Slots t·k..t·k+k hold token t's rows; ascending row = expert order.
    rows_of.chunks_mut(k).for_each(|c| c.sort_unstable());
    (off, token, slot, rows_of)
}

/// `out (T, H)`: token `t`'s row is the sum over its rows `i` (ascending) of `w_i · src_i`
/// (`w` absent: 1), from zero — the per-expert path's `index_add` order.
fn combine(src: &[f32], w: Option<&[f32]>, rows_of: &[u32], k: usize, h: usize) -> Vec<f32> {
    let t = rows_of.len() / k;
    let mut out = vec![0f32; t * h];
    out.par_chunks_mut(h)
        .zip(rows_of.par_chunks(k))
        .for_each(|(o, rows)| {
            for &i in rows {
                let i = i as usize;
                let s = &src[i * h..(i + 1) * h];
                match w {
                    Some(w) => o.iter_mut().zip(s).for_each(|(o, s)| *o += s * w[i]),
                    None => o.iter_mut().zip(s).for_each(|(o, s)| *o += s),
                }
            }
        });
    out
}

/// `(R, width)` rows `src[token[i]]`.
fn gather(src: &[f32], token: &[u32], width: usize) -> Vec<f32> {
    let mut out = vec![0f32; token.len() * width];
    out.par_chunks_mut(width)
        .zip(token.par_iter())
        .for_each(|(o, &t)| o.copy_from_slice(&src[t as usize * width..(t as usize + 1) * width]));
    out
}

/// One stack's forward over every expert's rows: `y (R, out)` and `xa (R, r)` from `x (R, in)`.
fn linear_fwd(
    engine: Engine,
    x: &[f32],
    w: Weights,
    bias: Option<&[f32]>,
    lora: Option<(&[f32], &[f32], usize, f32)>,
    off: &[usize],
    (inp, out): (usize, usize),
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    let rows = off.last().copied().unwrap_or(0);
    let mut y = vec![0f32; rows * out];
    let r = lora.map_or(0, |l| l.2);
    let mut xa = vec![0f32; rows * r];
    let ys = split(&mut y, off, out);
    let xas = split(&mut xa, off, r);
    let jobs: Vec<_> = ys.into_iter().zip(xas).enumerate().collect();
    each(engine, jobs, |(e, (y, xa))| {
        let n = off[e + 1] - off[e];
        if n == 0 {
            return Ok(());
        }
        let xe = M::rows(&x[off[e] * inp..off[e + 1] * inp], inp);
        // An NF4 expert with rows is dequantized here, dropped when this job ends.
        let we = w.expert_f32(e, out * inp)?;
        mm(engine, y, false, 1.0, xe, M::t(&we, inp), (n, out, inp))?;
        if let Some((a, b, r, s)) = lora {
            let ae = &a[e * r * inp..(e + 1) * r * inp];
            let be = &b[e * out * r..(e + 1) * out * r];
            mm(engine, xa, false, 1.0, xe, M::t(ae, inp), (n, r, inp))?;
            mm(engine, y, true, s, M::rows(xa, r), M::t(be, r), (n, out, r))?;
        }
        if let Some(b) = bias {
            let be = &b[e * out..(e + 1) * out];
            y.chunks_mut(out)
                .for_each(|row| row.iter_mut().zip(be).for_each(|(y, b)| *y += b));
        }
        Ok(())
    })?;
    Ok((y, lora.map(|_| xa)))
}

/// One stack's backward over every expert's rows: `dx (R, in)` from `dy (R, out)`, and the LoRA
/// gradients `dA (E·r, in)` (PEFT's layout) and `dB (E, out, r)`.
#[allow(clippy::type_complexity)]
fn linear_bwd(
    engine: Engine,
    dy: &[f32],
    x: &[f32],
    w: Weights,
    lora: Option<(&[f32], &[f32], usize, f32, &[f32])>,
    off: &[usize],
    (inp, out): (usize, usize),
) -> Result<(Vec<f32>, Option<(Vec<f32>, Vec<f32>)>)> {
    let e_n = off.len() - 1;
    let rows = off[e_n];
    let r = lora.map_or(0, |l| l.2);
    let mut dx = vec![0f32; rows * inp];
    let mut dyb = vec![0f32; rows * r];
    let mut da = vec![0f32; e_n * r * inp];
    let mut db = vec![0f32; e_n * out * r];
    let dxs = split(&mut dx, off, inp);
    let dybs = split(&mut dyb, off, r);
    // Per expert, its rows of dA and dB (none without LoRA).
    let grads: Vec<Option<(&mut [f32], &mut [f32])>> = match lora {
        Some(_) => da
            .chunks_mut(r * inp)
            .zip(db.chunks_mut(out * r))
            .map(Some)
            .collect(),
        None => (0..e_n).map(|_| None).collect(),
    };
    let jobs: Vec<_> = dxs.into_iter().zip(dybs).zip(grads).enumerate().collect();
    each(engine, jobs, |(e, ((dx, dyb), grads))| {
        let n = off[e + 1] - off[e];
        if n == 0 {
            return Ok(());
        }
        let dye = &dy[off[e] * out..off[e + 1] * out];
        // As in the forward: an NF4 expert dequantized for this job only.
        let we = w.expert_f32(e, out * inp)?;
        mm(
            engine,
            dx,
            false,
            1.0,
            M::rows(dye, out),
            M::rows(&we, inp),
            (n, inp, out),
        )?;
        if let (Some((a, b, r, s, xa)), Some((da, db))) = (lora, grads) {
            let xe = &x[off[e] * inp..off[e + 1] * inp];
            let ae = &a[e * r * inp..(e + 1) * r * inp];
            let be = &b[e * out * r..(e + 1) * out * r];
            let xae = &xa[off[e] * r..off[e + 1] * r];
            mm(
                engine,
                dyb,
                false,
                s,
                M::rows(dye, out),
                M::rows(be, r),
                (n, r, out),
            )?;
            mm(
                engine,
                db,
                false,
                s,
                M::t(dye, out),
                M::rows(xae, r),
                (out, r, n),
            )?;
            mm(
                engine,
                da,
                false,
                1.0,
                M::t(dyb, r),
                M::rows(xe, inp),
                (r, inp, n),
            )?;
            mm(
                engine,
                dx,
                true,
                1.0,
                M::rows(dyb, r),
                M::rows(ae, inp),
                (n, inp, r),
            )?;
        }
        Ok(())
    })?;
    Ok((dx, lora.map(|_| (da, db))))
}

/// `per` on each expert's job, spread over rayon's threads: for [`Engine::Blas`] with OpenBLAS
/// held to one thread a product ([`rtune_backend::blas::one_thread`]), or in order on this thread
/// when the library cannot be told (the CBLAS threads each product); for [`Engine::Gemm`] the
/// `gemm` crate on one thread a product.
fn each<J: Send>(
    engine: Engine,
    jobs: Vec<J>,
    per: impl Fn(J) -> Result<()> + Sync + Send,
) -> Result<()> {
    match engine {
        // OpenBLAS told to run each product on the calling thread: the experts over rayon's.
        Engine::Blas => match rtune_backend::blas::one_thread() {
            Some(_one) => jobs.into_par_iter().try_for_each(per),
            None => jobs.into_iter().try_for_each(per),
        },
        Engine::Gemm => jobs.into_par_iter().try_for_each(per),
    }
}

fn tensor(v: Vec<f32>, shape: (usize, usize), dev: &Device) -> Result<Tensor> {
    Tensor::from_vec(v, shape, dev)
}

/// [`super::moe_forward`] on this path: `x: (T, H)`, the groups made, `weights` `T × k`.
pub(super) fn forward(
    engine: Engine,
    x: &Tensor,
    g: &Groups,
    weights: &[f32],
    ex: &Experts,
) -> Result<(Tensor, Cache)> {
    let (e_n, i, h) = dims(x, ex)?;
    let t = x.dim(0)?;
    let dev = x.device();
    let (off, token, slot, rows_of) = order(g, t);
    let rows = token.len();
    let x = x.contiguous()?;
    let (gate_up, down) = (ex.gate_up.source()?, ex.down.source()?);
    let (gate_up, down) = (
        StackView::of(&gate_up, "gate_up")?,
        StackView::of(&down, "down")?,
    );
    let (lgu, ldn) = (
        Lora::of(&ex.lora_gate_up, e_n)?,
        Lora::of(&ex.lora_down, e_n)?,
    );
    let xs = gather(View::of(&x, "x")?.s(), &token, h);
    let bias = |b: Option<&Tensor>| b.map(|b| b.contiguous()).transpose();
    let (bgu, bdn) = (bias(ex.gate_up_bias)?, bias(ex.down_bias)?);
    let (vbgu, vbdn) = (
        view_opt(bgu.as_ref(), "gate_up bias")?,
        view_opt(bdn.as_ref(), "down bias")?,
    );
    let (vlgu, vldn) = (
        LoraView::of(lgu.as_ref(), None)?,
        LoraView::of(ldn.as_ref(), None)?,
    );
    // gate/up: (R, H) → (R, 2I).
    let (gu, xa_gu) = linear_fwd(
        engine,
        &xs,
        gate_up.w(),
        vbgu.as_ref().map(View::s),
        vlgu.as_ref().map(LoraView::fwd),
        &off,
        (h, 2 * i),
    )?;
    let gu = tensor(gu, (rows, 2 * i), dev)?;
    let m = act::act_forward(&gu, ex.act)?.contiguous()?; // (R, I)
    let (d, xa_dn) = linear_fwd(
        engine,
        View::of(&m, "act")?.s(),
        down.w(),
        vbdn.as_ref().map(View::s),
        vldn.as_ref().map(LoraView::fwd),
        &off,
        (i, h),
    )?;
    let w_row: Vec<f32> = slot.iter().map(|&s| weights[s]).collect();
    let y = combine(&d, Some(&w_row), &rows_of, g.k, h);
    let xa = |v: Option<Vec<f32>>, r: Option<usize>| -> Result<Option<Tensor>> {
        match (v, r) {
            (Some(v), Some(r)) => Ok(Some(tensor(v, (rows, r), dev)?)),
            _ => Ok(None),
        }
    };
    let cache = Cache {
        xa_gu: xa(xa_gu, lgu.as_ref().map(|l| l.r))?,
        xa_dn: xa(xa_dn, ldn.as_ref().map(|l| l.r))?,
        off,
        token,
        slot,
        rows_of,
        xs: tensor(xs, (rows, h), dev)?,
        gu,
        d: tensor(d, (rows, h), dev)?,
    };
    Ok((tensor(y, (t, h), dev)?, cache))
}

/// [`super::moe_backward`] on this path: `dx (T, H)`, `∂L/∂w` by slot, the LoRA gradients in
/// PEFT's layouts.
#[allow(clippy::type_complexity)]
pub(super) fn backward(
    engine: Engine,
    dy: &Tensor,
    weights: &[f32],
    ex: &Experts,
    c: &Cache,
    k: usize,
) -> Result<(
    Tensor,
    Vec<f32>,
    Option<(Tensor, Tensor)>,
    Option<(Tensor, Tensor)>,
)> {
    let (e_n, i, h) = dims(dy, ex)?;
    let t = dy.dim(0)?;
    let rows = c.token.len();
    if c.off.len() != e_n + 1 || c.rows_of.len() != t * k || weights.len() != rows {
        bail!(
            "moe grouped backward: a cache of {} rows over {} experts for dy {:?}, {} weights",
            rows,
            c.off.len().saturating_sub(1),
            dy.dims(),
            weights.len()
        );
    }
    let dev = dy.device();
    let dy = dy.contiguous()?;
    let dys = gather(View::of(&dy, "dy")?.s(), &c.token, h); // (R, H)
    let vd = View::of(&c.d, "d")?;
    let d = vd.s();
    // ∂L/∂w of row i: ⟨dy_t, d_i⟩; the down input gradient dd_i = w_i · dy_t.
    let mut dweights = vec![0f32; rows];
    let mut dd = vec![0f32; rows * h];
    dd.par_chunks_mut(h)
        .zip(dweights.par_iter_mut())
        .enumerate()
        .for_each(|(r, (dd, dw))| {
            let (dyr, dr) = (&dys[r * h..(r + 1) * h], &d[r * h..(r + 1) * h]);
            *dw = dyr.iter().zip(dr).map(|(a, b)| a * b).sum();
            let w = weights[c.slot[r]];
            dd.iter_mut().zip(dyr).for_each(|(o, v)| *o = v * w);
        });
    let mut dw_slot = vec![0f32; rows];
    for (r, &s) in c.slot.iter().enumerate() {
        dw_slot[s] = dweights[r];
    }
    let (gate_up, down) = (ex.gate_up.source()?, ex.down.source()?);
    let (gate_up, down) = (
        StackView::of(&gate_up, "gate_up")?,
        StackView::of(&down, "down")?,
    );
    let (lgu, ldn) = (
        Lora::of(&ex.lora_gate_up, e_n)?,
        Lora::of(&ex.lora_down, e_n)?,
    );
    let m = act::act_forward(&c.gu, ex.act)?.contiguous()?; // (R, I)
    let vm = View::of(&m, "act")?;
    let (vgu, vdn) = (
        LoraView::of(lgu.as_ref(), c.xa_gu.as_ref())?,
        LoraView::of(ldn.as_ref(), c.xa_dn.as_ref())?,
    );
    let (sgu, sdn) = (
        vgu.as_ref().map(LoraView::bwd).transpose()?,
        vdn.as_ref().map(LoraView::bwd).transpose()?,
    );
    let (dm, gdn) = linear_bwd(engine, &dd, vm.s(), down.w(), sdn, &c.off, (i, h))?;
    let dm = tensor(dm, (rows, i), dev)?;
    let dgu = act::act_backward(&dm, &c.gu, ex.act)?.contiguous()?; // (R, 2I)
    let (dxs, ggu) = linear_bwd(
        engine,
        View::of(&dgu, "d gate_up")?.s(),
        View::of(&c.xs, "xs")?.s(),
        gate_up.w(),
        sgu,
        &c.off,
        (h, 2 * i),
    )?;
    let dx = combine(&dxs, None, &c.rows_of, k, h);
    let peft = |g: Option<(Vec<f32>, Vec<f32>)>,
                l: &Option<Lora>,
                (inp, out): (usize, usize)|
     -> Result<Option<(Tensor, Tensor)>> {
        let (Some((da, db)), Some(l)) = (g, l) else {
            return Ok(None);
        };
        let r = l.r;
        let da = Tensor::from_vec(da, (e_n * r, inp), dev)?;
        // (E, out, r) -> (out, r, E) -> (out, r·E).
        let db = Tensor::from_vec(db, (e_n, out, r), dev)?
            .permute((1, 2, 0))?
            .contiguous()?
            .reshape((out, r * e_n))?;
        Ok(Some((da, db)))
    };
    Ok((
        tensor(dx, (t, h), dev)?,
        dw_slot,
        peft(ggu, &lgu, (h, 2 * i))?,
        peft(gdn, &ldn, (i, h))?,
    ))
}
