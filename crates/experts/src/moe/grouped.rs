//! The experts' fast CPU path (f32): the same math as the per-expert path of [`super`], laid out
//! for speed. The `R = T·k` routed rows are ordered by expert (expert `e`'s rows
//! `off[e]..off[e+1]`), and each expert is one job: its rows of `x` gathered into the worker's
//! scratch (reused across jobs, layers and steps: no fresh pages), gate/up, the SwiGLU
//! ([`act::rows_forward`]) and down, its outputs written in place into shared `(R, ·)` buffers
//! (no per-expert tensors) while its intermediates are still in the worker's cache; the backward
//! likewise (`dy`'s rows gathered and weighted, down, the activation, gate/up, `x`'s rows gathered
//! again for `dA`). Kept for the backward: `x` itself (shared, not copied), gate/up's outputs,
//! the activations and down's output. Measured against the earlier layout (every expert's
//! gate/up, then the activation over all rows through strided tensor copies, then every expert's
//! down, with `(R, H)` copies of `x`, `dy` and `w·dy`), `benches/moe_vs_peft.sh`'s model, release
//! binary, 8 steps, timed spans at load 7-10: the experts' forward + backward 5.3-5.6 CPU s
//! against 6.0-6.8, the run's peak RSS 803 against 946 MB.
//!
//! [`Engine::Blas`] (when `rtune_backend::blas` loaded a CBLAS, as `rtune` does): the products
//! of depth ≤ 32 go through the dense path's OpenBLAS (`rtune_backend::blas::sgemm`) on a CPU
//! without AVX-512, the others (and all of them with AVX-512) through the `gemm` crate
//! ([`cblas_takes`]), each
//! expert's on one thread, the experts spread over rayon's threads
//! ([`rtune_backend::blas::one_thread`]: OpenBLAS 0.3.21's threaded level 3 serialises callers
//! from several threads on one lock, its one-thread calls do not). OpenBLAS threading each
//! product instead, one expert after another, ran the frozen products at the dense GEMM's own
//! rate (`moe_timing`: 78 GFLOP per CPU second) but lost ~14% of the op to its idle workers'
//! `sched_yield` between the small products; the one-thread layout beat it in each of three
//! interleaved pairs of `moe_timing` at load ~9 (1497 / 1336 / 772 ms against 1728 / 2701 / 1064
//! ms a forward + backward). The `gemm` crate on one thread per expert gave 21.6 then (an
//! AVX-512 machine, under load); on the AVX2-only EPYC of [`cblas_takes`] it ran the same shapes
//! at 72–93 GFLOP/s, on an idle AVX-512 Xeon at 95–160. [`Engine::Gemm`] (no CBLAS): that
//! `gemm`-crate layout (candle's CPU GEMM, `Parallelism::None`) for every product. The weighted
//! combine and `dx` sum each token's rows in expert order, as the per-expert path's `index_add`
//! does. The frozen weights' gradients are never formed: only `dx`, `∂L/∂w` and the LoRA
//! factors'.
//!
//! A stack held in panels ([`panels`]: f32 on an AVX2 CPU without AVX-512, as the model loads it)
//! runs its two frozen products, `X_e W_eᵀ` and `dY_e W_e`, on the panel kernels under either
//! engine, reading the weight in place (no packing a product); the LoRA products stay as above.
//! On a CPU with AVX-512 the stacks stay row-major, and the forward turns each expert's frozen
//! weight into its transpose before `X_e W_eᵀ` ([`turns_weights`]), so that the `gemm` crate
//! packs it as vectors rather than gathering it element by element.
//!
//! Per expert `e` with rows `X_e: (n, in)`, weight `W_e: (out, in)`, LoRA `A_e: (r, in)`,
//! `B_e: (out, r)` (PEFT's `lora_B` repacked once a call to `(E, out, r)`), scale `s`:
//! forward `Y_e = X_e W_eᵀ + s (X_e A_eᵀ) B_eᵀ (+ bias_e)`; backward from `dY_e`:
//! `dX_e = dY_e W_e + (s dY_e B_e) A_e`, `dB_e = s dY_eᵀ (X_e A_eᵀ)`, `dA_e = (s dY_e B_e)ᵀ X_e`.

use candle_core::{bail, DType, Result, Tensor};
use rayon::prelude::*;

use super::panels;
use super::stack::{ExpertWeight, Source, Weights};
use super::transpose;
use super::view::View;
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

/// The depth at or below which [`Engine::Blas`] keeps a product on the CBLAS on a CPU without
/// AVX-512: the rank-`r` updates `y += s (x Aᵀ) Bᵀ` and `dx += (s dy B) A`.
const RANK_UPDATE_K: usize = 32;

/// Whether [`Engine::Blas`] hands a product of depth `k` to the CBLAS rather than the `gemm`
/// crate. Measured on a 2-core AVX2-only AMD EPYC (OpenBLAS 0.3.21 Zen, one thread a product,
/// `n = 128` rows, the bench's mean per expert; GFLOP/s OpenBLAS vs `gemm`, hot operands): the
/// frozen products 84.0 vs 83.6 (gate/up forward), 78.7 vs 81.4 (down forward), 84.7 vs 89.6 and
/// 85.3 vs 91.2 (their input gradients); the LoRA products of depth `in`, `out` or `n` 57–65 vs
/// 72–93 (`x Aᵀ`, `dy B`, `dB`, `dA`); the rank-16 updates 70.8 vs 65.5 and 65.2 vs 65.8. The
/// whole op on `moe_timing`'s layer, forward + backward, best of 8 interleaved: 205 ms with every
/// product on OpenBLAS, 195–198 ms with this split. On a CPU with AVX-512 no product goes to the
/// CBLAS: on a 2-core Intel Xeon (Ice Lake, AVX-512, OpenBLAS 0.3.21 SkylakeX) `product_timing`
/// gave the `gemm` crate 95.1 vs 82.3 (gate/up forward), 121.5 vs 105.1 (down forward), 143.4 vs
/// 115.6 and 159.7 vs 111.4 (input gradients), 144.1 vs 78.3 (`dA`), 106.5 vs 82.5 and 116.7 vs
/// 85.3 (the rank-16 updates), level on the rest; `benches/moe_vs_peft.sh`'s run for 24 steps,
/// alternating, gave more tokens/s with every product on the `gemm` crate than with every
/// product on OpenBLAS (the rule before) in 7 of 8 pairs, +6.8% on the mean of the first four.
fn cblas_takes(k: usize) -> bool {
    k <= RANK_UPDATE_K && !rtune_backend::cpu_features::get().avx512f
}

/// Whether [`expert_fwd`] turns a row-major expert weight `W (out, in)` into `Wᵀ (in, out)`
/// ([`forward_turned`]: [`transpose::transpose`], in AVX-512 registers) before its forward
/// product `x Wᵀ`, for the products [`turn_keeps_bits`] admits: on CPUs with AVX-512, where every
/// expert product runs on the `gemm` crate ([`cblas_takes`]).
///
/// Why: the crate vectorizes along `out` (`y`'s rows), so it packs `W` read across its rows one
/// scalar at a time. Its packing took 10.5% of the bench's step on a 2-core AVX-512-BF16/AMX Xeon
/// (`perf`), mostly that copy; with the turn 6.0%, plus 4.0% in the transpose. `Wᵀ` packs as
/// contiguous vectors. Measured on that Xeon:
/// - one thread, 64 experts' weights cold (`tests::panel_timing`), GFLOP/s: gate/up forward
///   128.8–135.4 turned against 119.8–120.5 read across, down forward 136.8–144.9 against
///   122.2–127.7;
/// - the whole run (`rtune train` on the bench's config, 24 steps, alternating with the binary
///   before): ahead in 6 of 8 pairs, mean 4143.9 against 4081.9 tokens/s (+1.5%);
/// - a probe not kept: a scalar blocked transpose lost (91–98 GFLOP/s), and the backward `dy W`,
///   which reads `W` along its rows already, ran 103–127 against 145–166 on `W` held as `Wᵀ`: so
///   the weights stay row-major and only the forward turns them.
///
/// The same sums either way: the product's bits do not change
/// (`tests::turned_weights_give_the_same_bits`).
fn turns_weights() -> bool {
    cfg!(target_arch = "x86_64") && rtune_backend::cpu_features::get().avx512f
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
        && cblas_takes(k)
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

/// A stack's weights for one call: the dense stack's view, the panels' (read guard held), or
/// the NF4 experts.
enum StackView<'a> {
    Dense(View<'a>),
    Panels(panels::PanelRead<'a>),
    Nf4(&'a super::Nf4Stack),
}

impl<'a> StackView<'a> {
    fn of(s: &'a Source<'a>, what: &str) -> Result<StackView<'a>> {
        Ok(match s {
            Source::Dense(t) => StackView::Dense(View::of(t, what)?),
            Source::Panels(p) => StackView::Panels(p.read()?),
            Source::Nf4(q) => StackView::Nf4(q),
        })
    }

    fn w(&self) -> Weights<'_> {
        match self {
            StackView::Dense(v) => Weights::Dense(v.s()),
            StackView::Panels(p) => Weights::Panels(p.slice()),
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
#[derive(Debug, Clone)]
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
        if l.b.dims2()? != (out, r * e) || er != r * e {
            bail!(
                "moe grouped: lora_B {:?} with lora_A {:?} is not (out, r·{e})",
                l.b.dims(),
                l.a.dims()
            );
        }
        // (out, r·E) -> (out, r, E) -> (E, out, r): expert e's B_e packed.
        let b = l.b.contiguous()?;
        let packed = by_expert(View::of(&b, "lora_B")?.s(), out, r, e);
        Ok(Some(Lora {
            a: l.a.contiguous()?,
            b: Tensor::from_vec(packed, (e, out, r), l.b.device())?,
            r,
            scale: l.scale as f32,
        }))
    }
}

/// Experts a job of the repacks between PEFT's `B (out, r·E)` and `(E, out, r)`: 16 columns of a
/// row of PEFT's layout are one cache line.
const REPACK_EXPERTS: usize = 16;

/// PEFT's `B (out, r·E)`, column `j·E + e` expert `e`'s rank `j`, as `(E, out, r)` (expert `e`'s
/// `B_e (out, r)` packed): what `permute((2, 0, 1))` copies, over rayon's threads by blocks of
/// experts. For each row `o`, a block's `(r, 16)` piece is transposed into a small buffer and each
/// expert's `r` values then stored in one piece: storing them one by one wrote 16 lines
/// `out·r` floats apart (24 KiB on the bench's model, one L1 set) a value at a time: 3.6 ms a
/// call before, 2.5 after, fresh pages included (`perf` on `benches/moe_vs_peft.sh`'s model).
fn by_expert(b: &[f32], out: usize, r: usize, e_n: usize) -> Vec<f32> {
    let per = out * r;
    let mut dst = zeroed(e_n * per);
    dst.par_chunks_mut(REPACK_EXPERTS * per)
        .enumerate()
        .for_each(|(blk, d)| {
            let e0 = blk * REPACK_EXPERTS;
            let ne = d.len() / per.max(1);
            let mut tmp = vec![0f32; ne * r];
            for o in 0..out {
                for j in 0..r {
                    let src = &b[o * r * e_n + j * e_n + e0..][..ne];
                    for (de, v) in src.iter().enumerate() {
                        tmp[de * r + j] = *v;
                    }
                }
                for (de, t) in tmp.chunks_exact(r.max(1)).enumerate() {
                    d[de * per + o * r..][..r].copy_from_slice(t);
                }
            }
        });
    dst
}

/// [`by_expert`]'s inverse: `(E, out, r)` as PEFT's `(out, r·E)`, one row of `out` a job.
fn by_rank(db: &[f32], out: usize, r: usize, e_n: usize) -> Vec<f32> {
    let mut dst = zeroed(out * r * e_n);
    dst.par_chunks_mut(r * e_n)
        .enumerate()
        .for_each(|(o, row)| {
            for e in 0..e_n {
                let src = &db[(e * out + o) * r..][..r];
                for (j, v) in src.iter().enumerate() {
                    row[j * e_n + e] = *v;
                }
            }
        });
    dst
}

/// `n` zeros, written over rayon's threads (a large buffer's fill is otherwise this thread's
/// alone while the others wait for the experts' jobs).
fn zeroed(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(0f32, n));
    v
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
    /// The input `(T, H)` (shared with the caller's, not copied; the backward gathers each
    /// expert's rows again for `dA`), the gate/up outputs `(R, 2I)`, the activations `(R, I)`,
    /// the down projection's output before its routing weight `(R, H)`.
    x: Tensor,
    gu: Tensor,
    m: Tensor,
    d: Tensor,
    /// `X_e A_eᵀ` of both pairs, `(R, r)`.
    xa_gu: Option<Tensor>,
    xa_dn: Option<Tensor>,
    /// Both pairs as the forward read them, `B` repacked per expert: the backward's, not
    /// repacked again (`E·out·r` values a pair while the cache lives).
    lora_gu: Option<Lora>,
    lora_dn: Option<Lora>,
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

/// Expert `e`'s rows of `src (T, width)` at `token`, into `out (n, width)`.
fn gather_into(src: &[f32], token: &[u32], width: usize, out: &mut [f32]) {
    for (o, &t) in out.chunks_exact_mut(width).zip(token) {
        let t = t as usize;
        o.copy_from_slice(&src[t * width..(t + 1) * width]);
    }
}

/// A worker's scratch buffer ([`with_scratch`]).
type Scratch = std::thread::LocalKey<std::cell::Cell<Vec<f32>>>;

thread_local! {
    /// Each worker's scratch for its expert jobs (the gathered rows, the backward's
    /// intermediates), grown to the largest job and kept: the jobs of every layer and step reuse
    /// it rather than allocating and faulting in fresh pages.
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    /// Each worker's turned expert weight (`expert_fwd`), kept likewise.
    static TURNED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `f` on `len` elements of this thread's `key` buffer (their values are a previous job's: `f`
/// writes each before it reads it). A job nested in `f` (rayon may run one while `f` waits)
/// finds the buffer taken and grows a fresh one.
fn with_scratch<R>(key: &'static Scratch, len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut v = key.take();
    if v.len() < len {
        v.resize(len, 0.0);
    }
    let r = f(&mut v[..len]);
    key.set(v);
    r
}

/// One expert's projection forward: `y (n, out) = x (n, in) · weᵀ (+ s (x Aᵀ) Bᵀ) (+ bias)`,
/// `xa (n, r) = x Aᵀ` (empty without LoRA). `lora`: this expert's `A_e (r, in)`, `B_e (out, r)`,
/// `r`, `s`.
#[allow(clippy::too_many_arguments)]
fn expert_fwd(
    engine: Engine,
    x: &[f32],
    we: &ExpertWeight,
    bias: Option<&[f32]>,
    lora: Option<(&[f32], &[f32], usize, f32)>,
    y: &mut [f32],
    xa: &mut [f32],
    (n, inp, out): (usize, usize, usize),
) -> Result<()> {
    let xe = M::rows(x, inp);
    match we {
        ExpertWeight::Rows(we) if turns_weights() && turn_keeps_bits(n, out, inp) => {
            forward_turned(engine, xe, we, y, (n, inp, out))?
        }
        ExpertWeight::Rows(we) => mm(engine, y, false, 1.0, xe, M::t(we, inp), (n, out, inp))?,
        ExpertWeight::Panels(we) => panels::forward(x, we, y, (n, inp, out))?,
    }
    if let Some((ae, be, r, s)) = lora {
        mm(engine, xa, false, 1.0, xe, M::t(ae, inp), (n, r, inp))?;
        mm(engine, y, true, s, M::rows(xa, r), M::t(be, r), (n, out, r))?;
    }
    if let Some(be) = bias {
        y.chunks_mut(out)
            .for_each(|row| row.iter_mut().zip(be).for_each(|(y, b)| *y += b));
    }
    Ok(())
}

/// `y (n, out) = x · weᵀ` with `we (out, in)` turned into `weᵀ (in, out)` first (in this
/// thread's [`TURNED`] buffer): [`turns_weights`].
fn forward_turned(
    engine: Engine,
    x: M,
    we: &[f32],
    y: &mut [f32],
    (n, inp, out): (usize, usize, usize),
) -> Result<()> {
    with_scratch(&TURNED, out * inp, |wt| -> Result<()> {
        transpose::transpose(we, inp, wt, out, (out, inp), false);
        mm(engine, y, false, 1.0, x, M::rows(wt, out), (n, out, inp))
    })
}

/// Whether the `gemm` crate runs `x Wᵀ` (`n` rows, `W (out, in)`) through its general kernel
/// both with `W` read across its rows and turned: the same sums in the same order, only packed
/// from another layout ([`turns_weights`]). Its small paths sum in another order and need `W`
/// along its rows: one row or one output (a dot-product gemv where the turned weight would take
/// an axpy one), `n·out ≤ 256` (its horizontal kernels), depth ≤ 2. Those products are too small
/// for the turn to pay anyway.
fn turn_keeps_bits(n: usize, out: usize, inp: usize) -> bool {
    n >= 2 && out >= 2 && n * out > 256 && inp > 2
}

/// One expert's projection backward from `dy (n, out)`: `dx (n, in) = dy we (+ (s dy B) A)`;
/// with LoRA (`A_e`, `B_e`, `r`, `s`, the forward's `x Aᵀ (n, r)`, and this expert's gradient
/// blocks `dA_e (r, in)`, `dB_e (out, r)`) also `dB_e = s dyᵀ (x Aᵀ)`, `dA_e = (s dy B)ᵀ x`;
/// `dyb (n, r)` and `tr` (panels: [`panels::backward_scratch`]) are scratch. `x (n, in)` is read
/// only with LoRA.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn expert_bwd(
    engine: Engine,
    dy: &[f32],
    x: &[f32],
    we: &ExpertWeight,
    lora: Option<(&[f32], &[f32], usize, f32, &[f32])>,
    grads: Option<(&mut [f32], &mut [f32])>,
    dx: &mut [f32],
    (dyb, tr): (&mut [f32], &mut [f32]),
    (n, inp, out): (usize, usize, usize),
) -> Result<()> {
    match we {
        ExpertWeight::Rows(we) => mm(
            engine,
            dx,
            false,
            1.0,
            M::rows(dy, out),
            M::rows(we, inp),
            (n, inp, out),
        )?,
        ExpertWeight::Panels(we) => panels::backward(dy, we, dx, false, tr, (n, inp, out))?,
    }
    let (Some((ae, be, r, s, xae)), Some((da, db))) = (lora, grads) else {
        return Ok(());
    };
    let dye = M::rows(dy, out);
    mm(engine, dyb, false, s, dye, M::rows(be, r), (n, r, out))?;
    mm(
        engine,
        db,
        false,
        s,
        M::t(dy, out),
        M::rows(xae, r),
        (out, r, n),
    )?;
    mm(
        engine,
        da,
        false,
        1.0,
        M::t(dyb, r),
        M::rows(x, inp),
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
    )
}

/// Expert `e`'s block of a LoRA view: `(A_e (r, in), B_e (out, r), r, s)`.
fn expert_lora<'a>(
    l: Option<(&'a [f32], &'a [f32], usize, f32)>,
    e: usize,
    (inp, out): (usize, usize),
) -> Option<(&'a [f32], &'a [f32], usize, f32)> {
    l.map(|(a, b, r, s)| {
        (
            &a[e * r * inp..(e + 1) * r * inp],
            &b[e * out * r..(e + 1) * out * r],
            r,
            s,
        )
    })
}

/// Per expert its blocks `(dA_e (r, in), dB_e (out, r))` of `da (E·r, in)`, `db (E, out, r)`;
/// `None` for each of the `e_n` experts without LoRA (`r` 0).
#[allow(clippy::type_complexity)]
fn blocks<'a>(
    da: &'a mut [f32],
    db: &'a mut [f32],
    e_n: usize,
    r: usize,
    (inp, out): (usize, usize),
) -> Vec<Option<(&'a mut [f32], &'a mut [f32])>> {
    match r {
        0 => (0..e_n).map(|_| None).collect(),
        r => da
            .chunks_mut(r * inp)
            .zip(db.chunks_mut(out * r))
            .map(Some)
            .collect(),
    }
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

/// [`super::moe_forward`] on this path: `x: (T, H)`, the groups made, `weights` `T × k`. One
/// job per expert: its rows gathered into the worker's scratch, gate/up, the activation and
/// down, each expert's intermediates staying in the worker's cache between the three.
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
    let (wgu, wdn) = (gate_up.w(), down.w());
    let (lgu, ldn) = (
        Lora::of(&ex.lora_gate_up, e_n)?,
        Lora::of(&ex.lora_down, e_n)?,
    );
    let bias = |b: Option<&Tensor>| b.map(|b| b.contiguous()).transpose();
    let (bgu, bdn) = (bias(ex.gate_up_bias)?, bias(ex.down_bias)?);
    let (vbgu, vbdn) = (
        view_opt(bgu.as_ref(), "gate_up bias")?,
        view_opt(bdn.as_ref(), "down bias")?,
    );
    let (vbgu, vbdn) = (vbgu.as_ref().map(View::s), vbdn.as_ref().map(View::s));
    let (vlgu, vldn) = (
        LoraView::of(lgu.as_ref(), None)?,
        LoraView::of(ldn.as_ref(), None)?,
    );
    let (flgu, fldn) = (
        vlgu.as_ref().map(LoraView::fwd),
        vldn.as_ref().map(LoraView::fwd),
    );
    let (rgu, rdn) = (flgu.map_or(0, |l| l.2), fldn.map_or(0, |l| l.2));
    let vx = View::of(&x, "x")?;
    let xv = vx.s();
    // (R, 2I) gate/up outputs, (R, I) activations, (R, H) down outputs, (R, r) LoRA inputs.
    let mut gu = zeroed(rows * 2 * i);
    let mut m = zeroed(rows * i);
    let mut d = zeroed(rows * h);
    let mut xa_gu = zeroed(rows * rgu);
    let mut xa_dn = zeroed(rows * rdn);
    let jobs: Vec<_> = split(&mut gu, &off, 2 * i)
        .into_iter()
        .zip(split(&mut m, &off, i))
        .zip(split(&mut d, &off, h))
        .zip(split(&mut xa_gu, &off, rgu))
        .zip(split(&mut xa_dn, &off, rdn))
        .enumerate()
        .collect();
    each(engine, jobs, |(e, ((((gu, m), d), xa_gu), xa_dn))| {
        let n = off[e + 1] - off[e];
        if n == 0 {
            return Ok(());
        }
        with_scratch(&SCRATCH, n * h, |xe| -> Result<()> {
            gather_into(xv, &token[off[e]..off[e + 1]], h, xe);
            // An NF4 expert is dequantized for its products only, one stack at a time.
            let we = wgu.expert_f32(e, 2 * i * h)?;
            let b = vbgu.map(|b| &b[e * 2 * i..(e + 1) * 2 * i]);
            let l = expert_lora(flgu, e, (h, 2 * i));
            expert_fwd(engine, xe, &we, b, l, gu, xa_gu, (n, h, 2 * i))?;
            Ok(())
        })?;
        act::rows_forward(gu, m, ex.act, i)?;
        let we = wdn.expert_f32(e, h * i)?;
        let b = vbdn.map(|b| &b[e * h..(e + 1) * h]);
        let l = expert_lora(fldn, e, (i, h));
        expert_fwd(engine, m, &we, b, l, d, xa_dn, (n, i, h))
    })?;
    let w_row: Vec<f32> = slot.iter().map(|&s| weights[s]).collect();
    let y = combine(&d, Some(&w_row), &rows_of, g.k, h);
    let xa = |v: Vec<f32>, r: usize| -> Result<Option<Tensor>> {
        match r {
            0 => Ok(None),
            r => Ok(Some(Tensor::from_vec(v, (rows, r), dev)?)),
        }
    };
    drop((vlgu, vldn));
    let cache = Cache {
        xa_gu: xa(xa_gu, rgu)?,
        xa_dn: xa(xa_dn, rdn)?,
        lora_gu: lgu,
        lora_dn: ldn,
        off,
        token,
        slot,
        rows_of,
        x: x.clone(),
        gu: Tensor::from_vec(gu, (rows, 2 * i), dev)?,
        m: Tensor::from_vec(m, (rows, i), dev)?,
        d: Tensor::from_vec(d, (rows, h), dev)?,
    };
    drop(vx);
    Ok((Tensor::from_vec(y, (t, h), dev)?, cache))
}

/// [`super::moe_backward`] on this path: `dx (T, H)`, `∂L/∂w` by slot, the LoRA gradients in
/// PEFT's layouts. One job per expert, as the forward: its rows of `dy` gathered and weighted,
/// down's backward, the activation's, gate/up's (its input rows gathered again for `dA`).
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
    if c.off.len() != e_n + 1
        || c.rows_of.len() != t * k
        || weights.len() != rows
        || c.x.dims() != [t, h]
    {
        bail!(
            "moe grouped backward: a cache of {} rows over {} experts (x {:?}) for dy {:?}, {} \
             weights",
            rows,
            c.off.len().saturating_sub(1),
            c.x.dims(),
            dy.dims(),
            weights.len()
        );
    }
    let dev = dy.device();
    let dy = dy.contiguous()?;
    let vdy = View::of(&dy, "dy")?;
    let (vx, vgu, vm, vd) = (
        View::of(&c.x, "x")?,
        View::of(&c.gu, "gate_up output")?,
        View::of(&c.m, "act")?,
        View::of(&c.d, "d")?,
    );
    let (dyv, xv, guv, mv, dv) = (vdy.s(), vx.s(), vgu.s(), vm.s(), vd.s());
    let (gate_up, down) = (ex.gate_up.source()?, ex.down.source()?);
    let (gate_up, down) = (
        StackView::of(&gate_up, "gate_up")?,
        StackView::of(&down, "down")?,
    );
    let (wgu, wdn) = (gate_up.w(), down.w());
    // The forward's pairs (B repacked there); the experts' must be the same ones.
    let (lgu, ldn) = (c.lora_gu.as_ref(), c.lora_dn.as_ref());
    if ex.lora_gate_up.is_some() != lgu.is_some() || ex.lora_down.is_some() != ldn.is_some() {
        bail!("moe grouped backward: LoRA on the experts differs from the forward's");
    }
    let (vlgu, vldn) = (
        LoraView::of(lgu, c.xa_gu.as_ref())?,
        LoraView::of(ldn, c.xa_dn.as_ref())?,
    );
    let (sgu, sdn) = (
        vlgu.as_ref().map(LoraView::bwd).transpose()?,
        vldn.as_ref().map(LoraView::bwd).transpose()?,
    );
    let (rgu, rdn) = (sgu.map_or(0, |l| l.2), sdn.map_or(0, |l| l.2));
    // Per row its ∂L/∂w; (R, H) input gradients, summed per token below; the LoRA gradients,
    // `dA (E·r, in)` (PEFT's layout) and `dB (E, out, r)`.
    let mut dweights = vec![0f32; rows];
    let mut dxs = zeroed(rows * h);
    let (mut da_gu, mut db_gu) = (zeroed(e_n * rgu * h), zeroed(e_n * 2 * i * rgu));
    let (mut da_dn, mut db_dn) = (zeroed(e_n * rdn * i), zeroed(e_n * h * rdn));
    let jobs: Vec<_> = split(&mut dweights, &c.off, 1)
        .into_iter()
        .zip(split(&mut dxs, &c.off, h))
        .zip(blocks(&mut da_gu, &mut db_gu, e_n, rgu, (h, 2 * i)))
        .zip(blocks(&mut da_dn, &mut db_dn, e_n, rdn, (i, h)))
        .enumerate()
        .collect();
    each(engine, jobs, |(e, (((dw, dx), ggu), gdn))| {
        let (lo, hi) = (c.off[e], c.off[e + 1]);
        let n = hi - lo;
        if n == 0 {
            return Ok(());
        }
        let r = rgu.max(rdn);
        // Scratch: dd (n, H), dm (n, I), dgu (n, 2I), x rows (n, H) when gate/up has LoRA,
        // dy·B (n, r), the panel products' transposes (panels only).
        let xn = if sgu.is_some() { n * h } else { 0 };
        let trn = match wgu.in_panels() || wdn.in_panels() {
            true => panels::backward_scratch(n, i, h).max(panels::backward_scratch(n, h, 2 * i)),
            false => 0,
        };
        with_scratch(
            &SCRATCH,
            n * h + n * i + n * 2 * i + xn + n * r + trn,
            |s| -> Result<()> {
                let (dd, s) = s.split_at_mut(n * h);
                let (dm, s) = s.split_at_mut(n * i);
                let (dgu, s) = s.split_at_mut(n * 2 * i);
                let (xe, s) = s.split_at_mut(xn);
                let (dyb, tr) = s.split_at_mut(n * r);
                // ∂L/∂w of row j: ⟨dy_t, d_j⟩; the down output's gradient dd_j = w_j · dy_t.
                for (j, (ddr, dwj)) in dd.chunks_exact_mut(h).zip(dw.iter_mut()).enumerate() {
                    let row = lo + j;
                    let tk = c.token[row] as usize;
                    let dyr = &dyv[tk * h..(tk + 1) * h];
                    let dr = &dv[row * h..(row + 1) * h];
                    *dwj = rtune_backend::cpu::sum2(dyr, dr, |a, b| a * b);
                    let w = weights[c.slot[row]];
                    ddr.iter_mut().zip(dyr).for_each(|(o, v)| *o = v * w);
                }
                let we = wdn.expert_f32(e, h * i)?;
                let l = sdn.map(|(a, b, r, s, xa)| {
                    let (ae, be, r, s) =
                        expert_lora(Some((a, b, r, s)), e, (i, h)).unwrap_or_default();
                    (ae, be, r, s, &xa[lo * r..hi * r])
                });
                let me = &mv[lo * i..hi * i];
                expert_bwd(
                    engine,
                    dd,
                    me,
                    &we,
                    l,
                    gdn,
                    dm,
                    (&mut dyb[..n * rdn], &mut *tr),
                    (n, i, h),
                )?;
                drop(we);
                act::rows_backward(dm, &guv[lo * 2 * i..hi * 2 * i], dgu, ex.act, i)?;
                if !xe.is_empty() {
                    gather_into(xv, &c.token[lo..hi], h, xe);
                }
                let we = wgu.expert_f32(e, 2 * i * h)?;
                let l = sgu.map(|(a, b, r, s, xa)| {
                    let (ae, be, r, s) =
                        expert_lora(Some((a, b, r, s)), e, (h, 2 * i)).unwrap_or_default();
                    (ae, be, r, s, &xa[lo * r..hi * r])
                });
                expert_bwd(
                    engine,
                    dgu,
                    xe,
                    &we,
                    l,
                    ggu,
                    dx,
                    (&mut dyb[..n * rgu], tr),
                    (n, h, 2 * i),
                )
            },
        )
    })?;
    let mut dw_slot = vec![0f32; rows];
    for (r, &s) in c.slot.iter().enumerate() {
        dw_slot[s] = dweights[r];
    }
    let dx = combine(&dxs, None, &c.rows_of, k, h);
    let peft = |da: Vec<f32>,
                db: Vec<f32>,
                r: usize,
                (inp, out): (usize, usize)|
     -> Result<Option<(Tensor, Tensor)>> {
        if r == 0 {
            return Ok(None);
        }
        let da = Tensor::from_vec(da, (e_n * r, inp), dev)?;
        // (E, out, r) -> (out, r, E) -> (out, r·E).
        let db = Tensor::from_vec(by_rank(&db, out, r, e_n), (out, r * e_n), dev)?;
        Ok(Some((da, db)))
    };
    Ok((
        Tensor::from_vec(dx, (t, h), dev)?,
        dw_slot,
        peft(da_gu, db_gu, rgu, (h, 2 * i))?,
        peft(da_dn, db_dn, rdn, (i, h))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The repacks against candle's `permute` + `contiguous` (the plain reference): exact, as
    /// both only move values. 37 experts: two full blocks of 16 and a tail of 5.
    #[test]
    fn repacks_move_b_as_permute_does() -> Result<()> {
        let (out, r, e) = (5, 3, 37);
        let v: Vec<f32> = (0..out * r * e).map(|x| x as f32 * 0.5 - 7.0).collect();
        let peft = Tensor::from_vec(v.clone(), (out, r * e), &Device::Cpu)?;
        let want = peft
            .reshape((out, r, e))?
            .permute((2, 0, 1))?
            .contiguous()?;
        let packed = by_expert(&v, out, r, e);
        assert_eq!(packed, want.flatten_all()?.to_vec1::<f32>()?);
        let back = by_rank(&packed, out, r, e);
        assert_eq!(back, v);
        Ok(())
    }

    /// The turned forward ([`forward_turned`], on any CPU: the transpose has a portable loop)
    /// against the product read across `W`'s rows, for every row count a job gets up to 160, on
    /// the bench's two shapes and a small one: bit for bit wherever [`turn_keeps_bits`] admits the
    /// turn, and the rule admits every row count from 2 on the bench's shapes. Values with mixed
    /// signs and magnitudes, so that another summation order would show in the last bits.
    #[test]
    fn turned_weights_give_the_same_bits() -> Result<()> {
        let vals = |len: usize, salt: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 7919 + salt) % 1999) as f32 - 999.0) * 1.3e-3)
                .collect()
        };
        let mut admitted = 0;
        for (inp, out) in [(512, 384), (192, 512), (24, 40)] {
            let w = vals(out * inp, 1);
            for n in 1..=160 {
                if !turn_keeps_bits(n, out, inp) {
                    continue;
                }
                admitted += 1;
                let x = vals(n * inp, n);
                let (mut read, mut turned) = (vec![0f32; n * out], vec![0f32; n * out]);
                let xm = M::rows(&x, inp);
                mm(
                    Engine::Gemm,
                    &mut read,
                    false,
                    1.0,
                    xm,
                    M::t(&w, inp),
                    (n, out, inp),
                )?;
                forward_turned(Engine::Gemm, xm, &w, &mut turned, (n, inp, out))?;
                let same = read
                    .iter()
                    .zip(&turned)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "({inp}, {out}), {n} rows: the turned product's bits differ"
                );
            }
        }
        assert_eq!(admitted, 2 * 159 + 154);
        Ok(())
    }

    /// Timing, not a check (`cargo test --release -p rtune-experts --lib product_timing --
    /// --ignored --nocapture`): each product of one expert's job (`n = 128` rows, the bench's
    /// mean, LoRA r 16) on OpenBLAS (one thread) and on the `gemm` crate, the figures behind
    /// [`cblas_takes`] (measured on an AVX2-only EPYC and an AVX-512 Xeon); rerun it on a CPU of
    /// another kind before changing the rule.
    #[test]
    #[ignore]
    fn product_timing() -> Result<()> {
        if rtune_backend::blas::init().is_none() {
            eprintln!("no CBLAS found: nothing to compare");
            return Ok(());
        }
        let _one = rtune_backend::blas::one_thread();
        let n = 128;
        let vals = |k: usize| -> Vec<f32> { (0..k).map(|i| (i % 1000) as f32 * 1e-3).collect() };
        // (what, m, n, k, a stored transposed, b stored transposed)
        for (what, m, nn, k, ta, tb) in [
            ("gate/up forward", n, 384, 512, false, true),
            ("down forward", n, 512, 192, false, true),
            ("gate/up dx", n, 512, 384, false, false),
            ("down dx", n, 192, 512, false, false),
            ("x A^T", n, 16, 512, false, true),
            ("dy B", n, 16, 384, false, false),
            ("dB", 384, 16, n, true, false),
            ("dA", 16, 512, n, true, false),
            ("y += xa B^T", n, 384, 16, false, true),
            ("dx += dyb A", n, 512, 16, false, false),
        ] {
            let (a, b, mut c) = (vals(m * k), vals(k * nn), vec![0f32; m * nn]);
            let am = if ta { M::t(&a, m) } else { M::rows(&a, k) };
            let bm = if tb { M::t(&b, k) } else { M::rows(&b, nn) };
            // The rank-r updates accumulate into their output, as in the jobs.
            let acc = what.contains("+=");
            let reps = 1000;
            let mut rate = |engine: Engine| -> Result<f64> {
                let t0 = std::time::Instant::now();
                for _ in 0..reps {
                    match engine {
                        // Straight to the CBLAS, whatever `cblas_takes` says.
                        Engine::Blas => {
                            rtune_backend::blas::sgemm(
                                operand(am),
                                operand(bm),
                                &mut c,
                                (m, nn, k),
                                1.0,
                                if acc { 1.0 } else { 0.0 },
                            )?;
                        }
                        Engine::Gemm => mm(engine, &mut c, acc, 1.0, am, bm, (m, nn, k))?,
                    }
                }
                let s = t0.elapsed().as_secs_f64();
                Ok(2.0 * (m * nn * k * reps) as f64 / s / 1e9)
            };
            let (blas, gemm) = (rate(Engine::Blas)?, rate(Engine::Gemm)?);
            eprintln!(
                "{what:16} {m}x{k}·{k}x{nn}: OpenBLAS {blas:.1}, gemm crate {gemm:.1} GFLOP/s; \
                 cblas_takes: {}",
                cblas_takes(k)
            );
        }
        Ok(())
    }

    /// Timing, not a check (`cargo test --release -p rtune-experts --lib panel_timing --
    /// --ignored --nocapture`): the frozen products of one expert's job (`n = 128` rows) on the
    /// `gemm` crate against the panel kernels (`super::super::panels`), the weights cycling over
    /// 64 experts (cold, as in a step), one thread.
    #[test]
    #[ignore]
    fn panel_timing() -> Result<()> {
        use super::super::panels;
        // Rows per expert as a step deals them (≈ 128 ± 11 of 16384 over 128 experts).
        let ns = [113usize, 121, 128, 135, 142, 107, 131, 126, 119, 139];
        let vals = |k: usize| -> Vec<f32> { (0..k).map(|i| (i % 1000) as f32 * 1e-3).collect() };
        let experts = 64;
        let nmax = 160;
        for (what, inp, out, fwd) in [
            ("gate/up forward", 512, 384, true),
            ("down forward", 192, 512, true),
            ("gate/up dx", 512, 384, false),
            ("down dx", 192, 512, false),
        ] {
            let w = vals(experts * out * inp);
            let p = panels::PanelStack::pack(&w, (experts, out, inp))?;
            let p = p.read()?;
            let (x, dy) = (vals(nmax * inp), vals(nmax * out));
            let (mut y, mut dx) = (vec![0f32; nmax * out], vec![0f32; nmax * inp]);
            let mut scratch = vec![0f32; panels::backward_scratch(nmax, inp, out)];
            let reps = 640;
            let flop: f64 = (0..reps)
                .map(|k| 2.0 * (ns[k % ns.len()] * inp * out) as f64)
                .sum();
            for round in 0..3 {
                let t0 = std::time::Instant::now();
                for k in 0..reps {
                    let n = ns[k % ns.len()];
                    let we = &w[(k % experts) * out * inp..][..out * inp];
                    match fwd {
                        true => mm(
                            Engine::Gemm,
                            &mut y,
                            false,
                            1.0,
                            M::rows(&x, inp),
                            M::t(we, inp),
                            (n, out, inp),
                        )?,
                        false => mm(
                            Engine::Gemm,
                            &mut dx,
                            false,
                            1.0,
                            M::rows(&dy, out),
                            M::rows(we, inp),
                            (n, inp, out),
                        )?,
                    }
                }
                let g = flop / t0.elapsed().as_secs_f64() / 1e9;
                // The forward with the weight turned first (`forward_turned`, as AVX-512 CPUs
                // run it).
                let t0 = std::time::Instant::now();
                for k in (0..reps).filter(|_| fwd) {
                    let n = ns[k % ns.len()];
                    let we = &w[(k % experts) * out * inp..][..out * inp];
                    forward_turned(Engine::Gemm, M::rows(&x, inp), we, &mut y, (n, inp, out))?;
                }
                let turned = flop / t0.elapsed().as_secs_f64() / 1e9;
                let t0 = std::time::Instant::now();
                for k in 0..reps {
                    let n = ns[k % ns.len()];
                    let we = p.expert(k % experts)?;
                    match fwd {
                        true => panels::forward(&x, we, &mut y, (n, inp, out))?,
                        false => {
                            panels::backward(&dy, we, &mut dx, false, &mut scratch, (n, inp, out))?
                        }
                    }
                }
                let q = flop / t0.elapsed().as_secs_f64() / 1e9;
                match fwd {
                    true => eprintln!(
                        "{what:16} round {round}: gemm crate {g:.1} (W turned first \
                         {turned:.1}), panels {q:.1} GFLOP/s"
                    ),
                    false => {
                        eprintln!(
                            "{what:16} round {round}: gemm crate {g:.1}, panels {q:.1} GFLOP/s"
                        )
                    }
                }
            }
        }
        Ok(())
    }
}
