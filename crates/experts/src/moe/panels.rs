//! Frozen f32 expert weights held in 16-row panels, and the two products the experts run on them,
//! reading the panels in place.
//!
//! Why: the `gemm` crate packs an operand before it multiplies. For an expert's frozen `W (out,
//! in)` that is the whole matrix before every forward product (3.6% of the bench's step) and its
//! transpose block by block in the backward (2.1%): the weights are cold (each expert is touched
//! once a pass), the rows few (`n ≈ T·k / E`, 128 in the bench), so the copy is not paid back.
//! Held once in the layout the kernel reads, the weight is packed at load and never again.
//!
//! Layout of one expert (`out_p = ⌈out/16⌉·16` rows, the padding rows zero): panel `p` holds rows
//! `16p..16p+16` column by column, element `(o, i)` at `(p·in + i)·16 + o mod 16`. Both products
//! read it in place:
//! - forward `y (n, out) = x (n, in) · Wᵀ`: a tile is 16 outputs (two 8-wide vectors, one panel's
//!   column `i`: contiguous) by 6 rows of `x` (broadcast from `x`'s rows in place, no copy);
//!   over `in` in chunks of `KC` (256), a panel's chunk (16 KiB) reused from L1 by every row tile;
//! - backward `dx (n, in) = dy (n, out) · W`: a tile is 16 rows (two vectors: `dy` copied
//!   transposed into panels of 16 rows, `n·out` elements against `W`'s `out·in`) by 6 inputs
//!   (broadcast from `W`: for output `o`, inputs `i..i+6` are 16 floats apart in one panel), over
//!   `out` in chunks of `KB` (128); the tiles go to `dx` transposed, turned back once at the end
//!   (8 × 8 register transposes). A last panel of ≤ 8 rows runs one vector.
//!
//! Measured (`grouped::tests::panel_timing`, a 2-core AVX2-only AMD EPYC, one thread, 64 experts'
//! weights cold, each job's rows 107–142 as a step of the bench deals them; GFLOP/s, panels
//! against the `gemm` crate on row-major `W`): gate/up forward 86.8–87.6 against 81.8–82.5, down
//! forward 81.5–89.1 against 74.3–76.3, gate/up `dx` 81.3–82.4 against 78.2–82.4, down `dx`
//! 81.0–81.5 against 84.6–85.5 (the two transposes cost the backward ~4%: its tiles alone run
//! 88–93). `KB` 64 or 256, or the row panels outermost, measured slower.
//!
//! [`fast`] says whether this layout is used (x86-64 with AVX2 and FMA, without AVX-512). With
//! AVX-512 the frozen products run on the `gemm` crate's AVX-512 kernels from row-major `W`
//! (`grouped::cblas_takes`): on an Ice Lake Xeon they beat these AVX2 kernels (`panel_timing`
//! 90–133 against 69–89 GFLOP/s), and panel kernels written for AVX-512 (a panel a vector, 2
//! panels × 12 a tile) drew level with them over a whole run (benches/README.md, session 38), so
//! none is kept. The portable loops ([`forward`]/[`backward`] without
//! AVX2) compute the same sums in the same order, for the tests on any CPU. The plain reference
//! is the row-major product in f64 (`tests`).

use candle_core::{bail, Device, Result, Tensor};

use super::transpose::transpose;
use super::view::View;

/// Rows of `W` per panel (two 8-wide f32 vectors).
pub const PANEL: usize = 16;
/// Rows of `x` (forward) or inputs of `W` (backward) per tile: 12 accumulators of 8, with the
/// two panel vectors and a broadcast, in AVX2's 16 registers.
const NR: usize = 6;
/// The forward's depth per chunk: a panel's chunk, `16·KC` f32 (16 KiB), stays in L1 across the
/// row tiles.
const KC: usize = 256;
/// The backward's depth per chunk: a row panel's chunk of transposed `dy`, `16·KB` f32 (8 KiB),
/// in L1 across the input tiles; the `W` columns it meets (`KB/16` panels) from L2.
const KB: usize = 128;

/// Whether experts' frozen f32 weights are held in panels on this CPU (module note).
pub fn fast() -> bool {
    let f = rtune_backend::cpu_features::get();
    cfg!(target_arch = "x86_64") && f.avx2 && f.fma && !f.avx512f
}

/// A layer's expert stack `(E, out, in)` in f32 panels (module note): `E·expert_len` elements
/// of a 1-D f32 CPU tensor.
#[derive(Debug, Clone)]
pub struct PanelStack {
    data: Tensor,
    /// `(E, out, in)`.
    pub dims: (usize, usize, usize),
}

/// Elements of one expert in panels: `⌈out/16⌉·16·in`.
pub fn expert_len(out: usize, inp: usize) -> usize {
    out.div_ceil(PANEL) * PANEL * inp
}

/// A [`PanelStack`]'s elements for one op's products ([`PanelStack::read`]).
pub struct PanelRead<'a> {
    elems: View<'a>,
    dims: (usize, usize, usize),
}

impl PanelRead<'_> {
    /// The elements as a plain slice (shareable between the op's threads).
    pub fn slice(&self) -> PanelSlice<'_> {
        PanelSlice {
            data: self.elems.s(),
            dims: self.dims,
        }
    }

    /// Expert `e`'s panels ([`expert_len`] elements).
    pub fn expert(&self, e: usize) -> Result<&[f32]> {
        self.slice().expert(e)
    }
}

/// A [`PanelRead`]'s elements.
#[derive(Debug, Clone, Copy)]
pub struct PanelSlice<'a> {
    data: &'a [f32],
    dims: (usize, usize, usize),
}

impl<'a> PanelSlice<'a> {
    /// Expert `e`'s panels ([`expert_len`] elements).
    pub fn expert(&self, e: usize) -> Result<&'a [f32]> {
        let (e_n, out, inp) = self.dims;
        let len = expert_len(out, inp);
        match self.data.get(e * len..(e + 1) * len) {
            Some(w) => Ok(w),
            None => bail!(
                "moe panels: expert {e} of a stack of {e_n} ({} elements)",
                self.data.len()
            ),
        }
    }
}

impl PanelStack {
    /// `w`: the stack's `E·out·in` elements, row-major `(E, out, in)`, into a fresh buffer.
    pub fn pack(w: &[f32], dims: (usize, usize, usize)) -> Result<PanelStack> {
        let (e_n, out, inp) = dims;
        if w.len() != e_n * out * inp {
            bail!("moe panels: {} elements for a {dims:?} stack", w.len());
        }
        let len = expert_len(out, inp);
        let mut data = vec![0f32; e_n * len];
        if len > 0 {
            for (we, pe) in w.chunks_exact(out * inp).zip(data.chunks_exact_mut(len)) {
                to_panels(we, pe, (out, inp), inp);
            }
        }
        Ok(PanelStack {
            data: Tensor::from_vec(data, e_n * len, &Device::Cpu)?,
            dims,
        })
    }

    /// `t: (E, out, in)` f32 on the CPU, taken over: when `out` is a multiple of 16 (no padding
    /// rows: the panels are as large as the stack) its buffer is rewritten in place, expert by
    /// expert (one expert's two copies alive besides the stack, as a model loads); otherwise
    /// packed into a fresh buffer ([`PanelStack::pack`]).
    pub fn from_tensor(t: Tensor) -> Result<PanelStack> {
        let dims = t.dims3()?;
        let (e_n, out, inp) = dims;
        let t = t.contiguous()?.flatten_all()?;
        if out % PANEL != 0 {
            return PanelStack::pack(View::of(&t, "panels stack")?.s(), dims);
        }
        let len = out * inp;
        for e in 0..e_n {
            // Expert e's row-major values copied out (the read guard dropped before the write).
            let w = View::of(&t, "panels stack")?.s()[e * len..(e + 1) * len].to_vec();
            let p = pack_expert(&w, (out, inp))?;
            t.slice_set(&Tensor::from_vec(p, len, &Device::Cpu)?, 0, e * len)?;
        }
        Ok(PanelStack { data: t, dims })
    }

    /// The elements for one op (the stack's read guard held while it lives).
    pub fn read(&self) -> Result<PanelRead<'_>> {
        Ok(PanelRead {
            elems: View::of(&self.data, "panels stack")?,
            dims: self.dims,
        })
    }

    /// Expert `e`'s `(out, in)` row-major, as loaded.
    pub fn unpack(&self, e: usize) -> Result<Vec<f32>> {
        let (_, out, inp) = self.dims;
        let read = self.read()?;
        let pe = read.expert(e)?;
        let mut w = vec![0f32; out * inp];
        for (o, row) in w.chunks_exact_mut(inp.max(1)).enumerate().take(out) {
            let (p, r) = (o / PANEL, o % PANEL);
            for (i, v) in row.iter_mut().enumerate() {
                *v = pe[(p * inp + i) * PANEL + r];
            }
        }
        Ok(w)
    }

    /// The whole stack row-major `(E, out, in)`, as loaded.
    pub fn unpack_all(&self) -> Result<Vec<f32>> {
        let mut w = Vec::with_capacity(self.dims.0 * self.dims.1 * self.dims.2);
        for e in 0..self.dims.0 {
            w.extend(self.unpack(e)?);
        }
        Ok(w)
    }

    /// Bytes held (the padding rows included).
    pub fn resident_bytes(&self) -> usize {
        self.data.elem_count() * 4
    }
}

/// The bounds [`forward`] and [`backward`] rely on (their raw pointers stay inside).
fn check(
    what: &str,
    (a, a_len): (&str, usize),
    w: usize,
    (c, c_len): (&str, usize),
    (n, inp, out): (usize, usize, usize),
) -> Result<()> {
    let want_a = n * if what == "forward" { inp } else { out };
    let want_c = n * if what == "forward" { out } else { inp };
    if a_len < want_a || c_len < want_c || w != expert_len(out, inp) {
        bail!(
            "moe panels {what}: {a} of {a_len}, W of {w}, {c} of {c_len} elements for n {n}, in \
             {inp}, out {out} (want ≥ {want_a}, {}, ≥ {want_c})",
            expert_len(out, inp)
        );
    }
    Ok(())
}

/// `y (n, out) = x (n, in) · Wᵀ` (overwritten), `w` one expert's panels.
pub fn forward(
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    (n, inp, out): (usize, usize, usize),
) -> Result<()> {
    check(
        "forward",
        ("x", x.len()),
        w.len(),
        ("y", y.len()),
        (n, inp, out),
    )?;
    if n == 0 || out == 0 {
        return Ok(());
    }
    if inp == 0 {
        y[..n * out].fill(0.0);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 and FMA are present (checked); the lengths were checked above, and the
        // kernel reads and writes only within them (its comments say where).
        unsafe { avx2::forward(x, w, y, (n, inp, out)) };
        return Ok(());
    }
    plain_forward(x, w, y, (n, inp, out));
    Ok(())
}

/// `dx (n, in) = [dx +] dy (n, out) · W`, `w` one expert's panels; `scratch` holds `dy` and
/// `dx` transposed (at least [`backward_scratch`] elements, any values).
pub fn backward(
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    acc: bool,
    scratch: &mut [f32],
    (n, inp, out): (usize, usize, usize),
) -> Result<()> {
    check(
        "backward",
        ("dy", dy.len()),
        w.len(),
        ("dx", dx.len()),
        (n, inp, out),
    )?;
    let want = backward_scratch(n, inp, out);
    if scratch.len() < want {
        bail!(
            "moe panels backward: {} elements of scratch, want {want}",
            scratch.len()
        );
    }
    if n == 0 || inp == 0 {
        return Ok(());
    }
    if out == 0 {
        if !acc {
            dx[..n * inp].fill(0.0);
        }
        return Ok(());
    }
    // `dy` in row panels, then `dx` transposed (the scratch without its `dx` part: `in` 0).
    let (dyp, dxt) = scratch[..want].split_at_mut(backward_scratch(n, 0, out));
    to_panels(dy, dyp, (n, out), out.div_ceil(PANEL) * PANEL);
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: as in `forward`.
        unsafe { avx2::backward(dyp, w, dxt, (n, inp, out)) };
        unpack_dx(dxt, dx, acc, (n, inp));
        return Ok(());
    }
    plain_backward(dyp, w, dxt, (n, inp, out));
    unpack_dx(dxt, dx, acc, (n, inp));
    Ok(())
}

/// Scratch elements [`backward`] wants: `dy` in panels of 16 rows, `⌈n/16⌉·16 × ⌈out/16⌉·16`,
/// and `dx` transposed, `in × ⌈n/16⌉·16`.
pub fn backward_scratch(n: usize, inp: usize, out: usize) -> usize {
    let n_p = n.div_ceil(PANEL) * PANEL;
    n_p * (out.div_ceil(PANEL) * PANEL + inp)
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    let f = rtune_backend::cpu_features::get();
    f.avx2 && f.fma
}

/// One expert's row-major `w (out, in)` in panels ([`expert_len`] elements, module note): what
/// [`PanelStack::from_tensor`] writes back expert by expert.
pub fn pack_expert(w: &[f32], (out, inp): (usize, usize)) -> Result<Vec<f32>> {
    if w.len() != out * inp {
        bail!(
            "moe panels: {} elements for an ({out}, {inp}) expert",
            w.len()
        );
    }
    let mut pe = vec![0f32; expert_len(out, inp)];
    if !pe.is_empty() {
        to_panels(w, &mut pe, (out, inp), inp);
    }
    Ok(pe)
}

/// `src (rows, cols)` row-major into panels of 16 rows, `cols_p ≥ cols` columns each: element
/// `(r, c)` at `(⌊r/16⌋·cols_p + c)·16 + r mod 16`, zero past `rows` and `cols`. `W` (`cols_p =
/// in`) and the backward's `dy` (`cols_p = ⌈out/16⌉·16`, whole chunks of 16 outputs).
fn to_panels(src: &[f32], dst: &mut [f32], (rows, cols): (usize, usize), cols_p: usize) {
    for (q, panel) in dst.chunks_exact_mut(cols_p * PANEL).enumerate() {
        let n = rows.saturating_sub(q * PANEL).min(PANEL);
        if n < PANEL || cols_p != cols {
            panel.fill(0.0);
        }
        transpose(
            &src[q * PANEL * cols..],
            cols,
            panel,
            PANEL,
            (n, cols),
            false,
        );
    }
}

/// [`forward`] without SIMD: each output a sum over `in` in chunks of [`KC`], in the kernel's
/// order (a chunk's partial sum added to the output so far).
fn plain_forward(x: &[f32], w: &[f32], y: &mut [f32], (n, inp, out): (usize, usize, usize)) {
    for k0 in (0..inp).step_by(KC) {
        let k1 = (k0 + KC).min(inp);
        for t in 0..n {
            for o in 0..out {
                let (p, r) = (o / PANEL, o % PANEL);
                let mut s = 0f32;
                for i in k0..k1 {
                    s = x[t * inp + i].mul_add(w[(p * inp + i) * PANEL + r], s);
                }
                let c = &mut y[t * out + o];
                *c = if k0 == 0 { s } else { *c + s };
            }
        }
    }
}

/// `dxt (in, n_p)`, transposed, into `dx (n, in)` (`=` or `+=`).
fn unpack_dx(dxt: &[f32], dx: &mut [f32], acc: bool, (n, inp): (usize, usize)) {
    transpose(dxt, n.div_ceil(PANEL) * PANEL, dx, inp, (inp, n), acc);
}

/// [`backward`] without SIMD, from the transposed `dy` into the transposed `dxt (in, n_p)`:
/// each sum over `out` in chunks of [`KB`] (the kernel's order, as [`plain_forward`]).
fn plain_backward(dyp: &[f32], w: &[f32], dxt: &mut [f32], (n, inp, out): (usize, usize, usize)) {
    let (n_p, out_p) = (n.div_ceil(PANEL) * PANEL, out.div_ceil(PANEL) * PANEL);
    for o0 in (0..out_p).step_by(KB) {
        let o1 = (o0 + KB).min(out_p);
        for t in 0..n_p {
            let (q, r) = (t / PANEL, t % PANEL);
            for i in 0..inp {
                let mut s = 0f32;
                for o in o0..o1 {
                    let (p, ro) = (o / PANEL, o % PANEL);
                    s = dyp[(q * out_p + o) * PANEL + r].mul_add(w[(p * inp + i) * PANEL + ro], s);
                }
                let c = &mut dxt[i * n_p + t];
                *c = if o0 == 0 { s } else { *c + s };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{KB, KC, NR, PANEL};
    use std::arch::x86_64::*;

    /// [`super::forward`]'s kernel. Callers: AVX2 + FMA present, `x ≥ n·in`, `w =
    /// expert_len(out, in)`, `y ≥ n·out`, `n, in, out > 0`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn forward(
        x: &[f32],
        w: &[f32],
        y: &mut [f32],
        (n, inp, out): (usize, usize, usize),
    ) {
        // SAFETY: the caller's lengths: panel p's columns < in of `w`, rows < n of `x`
        // (rows past `n` clamped), outputs < out of `y`'s rows < n.
        unsafe {
            let panels = out.div_ceil(PANEL);
            let (xp, wp, yp) = (x.as_ptr(), w.as_ptr(), y.as_mut_ptr());
            for k0 in (0..inp).step_by(KC) {
                let kc = KC.min(inp - k0);
                for p in 0..panels {
                    let cols = PANEL.min(out - p * PANEL);
                    // Panel p's columns k0..k0+kc: `kc` × 16 contiguous.
                    let a = wp.add((p * inp + k0) * PANEL);
                    for t0 in (0..n).step_by(NR) {
                        let rows = NR.min(n - t0);
                        // Rows past `n` read the last row again (in bounds) and are not stored.
                        let xr: [*const f32; NR] =
                            std::array::from_fn(|j| xp.add((t0 + j.min(rows - 1)) * inp + k0));
                        let mut c = [[_mm256_setzero_ps(); 2]; NR];
                        for i in 0..kc {
                            let a0 = _mm256_loadu_ps(a.add(i * PANEL));
                            let a1 = _mm256_loadu_ps(a.add(i * PANEL + 8));
                            for j in 0..NR {
                                let b = _mm256_broadcast_ss(&*xr[j].add(i));
                                c[j][0] = _mm256_fmadd_ps(a0, b, c[j][0]);
                                c[j][1] = _mm256_fmadd_ps(a1, b, c[j][1]);
                            }
                        }
                        for (j, cj) in c.iter().enumerate().take(rows) {
                            // Row t0+j's outputs p·16.. (cols of them) within `y`'s n·out.
                            let dst = yp.add((t0 + j) * out + p * PANEL);
                            if cols == PANEL {
                                let (d0, d1) = (dst, dst.add(8));
                                if k0 == 0 {
                                    _mm256_storeu_ps(d0, cj[0]);
                                    _mm256_storeu_ps(d1, cj[1]);
                                } else {
                                    _mm256_storeu_ps(d0, _mm256_add_ps(_mm256_loadu_ps(d0), cj[0]));
                                    _mm256_storeu_ps(d1, _mm256_add_ps(_mm256_loadu_ps(d1), cj[1]));
                                }
                            } else {
                                let mut tmp = [0f32; PANEL];
                                _mm256_storeu_ps(tmp.as_mut_ptr(), cj[0]);
                                _mm256_storeu_ps(tmp.as_mut_ptr().add(8), cj[1]);
                                for (o, &v) in tmp.iter().enumerate().take(cols) {
                                    let d = dst.add(o);
                                    *d = if k0 == 0 { v } else { *d + v };
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// One tile of [`backward`]: rows `8·H` of the panel at `a` (`oc` outputs, 16 floats each)
    /// times the 6 columns at `wb` of `oc / 16` panels `in·16` apart. Callers: AVX2 + FMA, those
    /// elements in bounds.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const H: usize>(
        a: *const f32,
        wb: &[*const f32; NR],
        oc: usize,
        inp: usize,
    ) -> [[__m256; H]; NR] {
        let mut c = [[_mm256_setzero_ps(); H]; NR];
        for pp in 0..oc / PANEL {
            // Output rows 16·pp + r of the chunk: panel pp, in steps of `in·16`.
            let step = pp * inp * PANEL;
            for r in 0..PANEL {
                let o = pp * PANEL + r;
                // SAFETY: the caller's bounds.
                unsafe {
                    let av: [__m256; H] =
                        std::array::from_fn(|h| _mm256_loadu_ps(a.add(o * PANEL + 8 * h)));
                    for j in 0..NR {
                        let b = _mm256_broadcast_ss(&*wb[j].add(step + r));
                        for h in 0..H {
                            c[j][h] = _mm256_fmadd_ps(av[h], b, c[j][h]);
                        }
                    }
                }
            }
        }
        c
    }

    /// [`super::backward`]'s kernel on `dyp` (`dy` in row panels, [`super::to_panels`]) into
    /// `dxt (in, n_p)`, `dx` transposed: tile (inputs `i0..i0+6`, rows `16q..16q+16`) is 6
    /// runs of 16 contiguous. Callers: AVX2 + FMA present, `dyp` of `n_p·out_p`, `w =
    /// expert_len(out, in)`, `dxt` of `in·n_p` elements, `n, in, out > 0`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn backward(
        dyp: &[f32],
        w: &[f32],
        dxt: &mut [f32],
        (n, inp, out): (usize, usize, usize),
    ) {
        let (n_p, out_p) = (n.div_ceil(PANEL) * PANEL, out.div_ceil(PANEL) * PANEL);
        let (ap, wp, dp) = (dyp.as_ptr(), w.as_ptr(), dxt.as_mut_ptr());
        for o0 in (0..out_p).step_by(KB) {
            let oc = KB.min(out_p - o0);
            for q in 0..n_p / PANEL {
                // Rows 16q.. of the chunk: 16·oc contiguous, reused from L1 by every input tile.
                let a = ap.wrapping_add((q * out_p + o0) * PANEL);
                for i0 in (0..inp).step_by(NR) {
                    let cols = NR.min(inp - i0);
                    // Panel o0/16's columns i0..i0+6 (past `in`: the last again, not stored).
                    let wb: [*const f32; NR] = std::array::from_fn(|j| {
                        wp.wrapping_add((o0 / PANEL * inp + i0 + j.min(cols - 1)) * PANEL)
                    });
                    // SAFETY: as `tile` wants (the caller's lengths).
                    let c = unsafe {
                        match n - q * PANEL {
                            // A last panel of ≤ 8 rows: its first vector only.
                            rows if rows <= 8 => {
                                let c = tile::<1>(a, &wb, oc, inp);
                                c.map(|[v]| [v, _mm256_setzero_ps()])
                            }
                            _ => tile::<2>(a, &wb, oc, inp),
                        }
                    };
                    for (j, cj) in c.iter().enumerate().take(cols) {
                        // SAFETY: input i0+j < in, rows 16q..16q+16 ≤ n_p of `dxt`.
                        unsafe {
                            let d = dp.add((i0 + j) * n_p + q * PANEL);
                            let (d0, d1) = (d, d.add(8));
                            if o0 == 0 {
                                _mm256_storeu_ps(d0, cj[0]);
                                _mm256_storeu_ps(d1, cj[1]);
                            } else {
                                _mm256_storeu_ps(d0, _mm256_add_ps(_mm256_loadu_ps(d0), cj[0]));
                                _mm256_storeu_ps(d1, _mm256_add_ps(_mm256_loadu_ps(d1), cj[1]));
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        // A small LCG: values in [-1, 1), reproducible.
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// The plain reference: row-major `W (out, in)`, each output's sum in f64 with the sum of
    /// its terms' magnitudes (the error bound's scale).
    fn ref_forward(x: &[f32], w: &[f32], (n, inp, out): (usize, usize, usize)) -> Vec<(f64, f64)> {
        let mut y = vec![(0f64, 0f64); n * out];
        for t in 0..n {
            for o in 0..out {
                let terms = (0..inp).map(|i| x[t * inp + i] as f64 * w[o * inp + i] as f64);
                y[t * out + o] = terms.fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
            }
        }
        y
    }

    fn ref_backward(
        dy: &[f32],
        w: &[f32],
        (n, inp, out): (usize, usize, usize),
    ) -> Vec<(f64, f64)> {
        let mut dx = vec![(0f64, 0f64); n * inp];
        for t in 0..n {
            for i in 0..inp {
                let terms = (0..out).map(|o| dy[t * out + o] as f64 * w[o * inp + i] as f64);
                dx[t * inp + i] = terms.fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
            }
        }
        dx
    }

    /// Within the f32 bound of a `depth`-term sum in any order, `(depth + 1)·ε·Σ|terms|` (+1:
    /// the partial sums of chunks added to the output), of the f64 reference; `plus` added to
    /// both (an accumulated output).
    fn close(got: &[f32], want: &[(f64, f64)], depth: usize, plus: f64, what: &str) {
        for (k, (&g, &(w, mag))) in got.iter().zip(want).enumerate() {
            let tol = (depth + 2) as f64 * f32::EPSILON as f64 * (mag + plus.abs());
            assert!(
                (g as f64 - (w + plus)).abs() <= tol,
                "{what}[{k}]: {g} vs {} (tol {tol:e})",
                w + plus
            );
        }
    }

    #[test]
    fn pack_and_unpack_are_exact() -> Result<()> {
        let dims = (3, 37, 11);
        let w = vals(3 * 37 * 11, 1);
        let s = PanelStack::pack(&w, dims)?;
        assert_eq!(s.unpack_all()?, w);
        assert_eq!(s.resident_bytes(), 3 * 48 * 11 * 4);
        // Row 20 is row 4 of panel 1: its column 3 at (1·11 + 3)·16 + 4 of expert 1.
        assert_eq!(
            s.read()?.expert(1)?[(11 + 3) * 16 + 4],
            w[37 * 11 + 20 * 11 + 3]
        );
        assert!(s.read()?.expert(3).is_err());
        // Taken over in place (out a multiple of 16) or packed afresh (37 rows): the same.
        for (dims, seed) in [((3, 32, 11), 5), (dims, 1)] {
            let w = vals(dims.0 * dims.1 * dims.2, seed);
            let t = Tensor::from_vec(w.clone(), dims, &Device::Cpu)?;
            let a = PanelStack::from_tensor(t)?;
            let b = PanelStack::pack(&w, dims)?;
            for e in 0..dims.0 {
                assert_eq!(a.read()?.expert(e)?, b.read()?.expert(e)?);
            }
            assert_eq!(a.unpack_all()?, w);
        }
        Ok(())
    }

    /// Both products against the row-major reference on shapes with every tail (rows not a
    /// multiple of 6 or 16, outputs not of 16, inputs not of 6, depths over one chunk of 256),
    /// on this CPU's kernel and on the portable loops.
    #[test]
    fn products_match_the_row_major_reference() -> Result<()> {
        for &(n, inp, out) in &[
            (1, 1, 1),
            (7, 13, 17),
            (33, 300, 40),
            (16, 6, 16),
            (128, 64, 530),
            (5, 512, 384),
        ] {
            let w = vals(out * inp, 2);
            let s = PanelStack::pack(&w, (1, out, inp))?;
            let read = s.read()?;
            let we = read.expert(0)?;
            let x = vals(n * inp, 3);
            let dy = vals(n * out, 4);
            let want_y = ref_forward(&x, &w, (n, inp, out));
            let want_dx = ref_backward(&dy, &w, (n, inp, out));
            let mut y = vec![f32::NAN; n * out];
            forward(&x, we, &mut y, (n, inp, out))?;
            close(&y, &want_y, inp, 0.0, "y");
            let mut scratch = vec![f32::NAN; backward_scratch(n, inp, out)];
            let mut dx = vec![f32::NAN; n * inp];
            backward(&dy, we, &mut dx, false, &mut scratch, (n, inp, out))?;
            close(&dx, &want_dx, out, 0.0, "dx");
            // Accumulating adds to what is there.
            let mut dx2 = vec![1.0f32; n * inp];
            backward(&dy, we, &mut dx2, true, &mut scratch, (n, inp, out))?;
            close(&dx2, &want_dx, out, 1.0, "dx + 1");
            // The portable loops: the same sums.
            let mut yp = vec![f32::NAN; n * out];
            plain_forward(&x, we, &mut yp, (n, inp, out));
            close(&yp, &want_y, inp, 0.0, "plain y");
            let (dyp, dxt) = scratch.split_at_mut(backward_scratch(n, 0, out));
            plain_backward(dyp, we, dxt, (n, inp, out));
            let mut dxp = vec![f32::NAN; n * inp];
            unpack_dx(dxt, &mut dxp, false, (n, inp));
            close(&dxp, &want_dx, out, 0.0, "plain dx");
            // In the same order, FMA for FMA: bit for bit (where the kernel ran).
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&yp), bits(&y), "plain y ({n}, {inp}, {out})");
            assert_eq!(bits(&dxp), bits(&dx), "plain dx ({n}, {inp}, {out})");
        }
        Ok(())
    }
}
