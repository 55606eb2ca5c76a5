//! rtune's own CUDA kernels run on the CPU under the host emulation (`scripts/flash-emu/`: emu.h,
//! kernels_lib.cpp), against their references, f32, bf16 and f16, forward and backward — what
//! `tests/fused_cuda.rs`, `tests/nf4_cuda.rs` and `rtune selftest` check on a GPU, here on every CI
//! run without one (issue 48):
//! - `kernels/fused.cu` (RMSNorm and the residual add fused into it, SwiGLU, GeGLU, RoPE and its
//!   in-place q/k form, cross-entropy and its soft-capped form, the widening cast) and
//!   `kernels/attn.cu` (the attention softmax): each op's `reference.rs`, the selftest's tolerances;
//! - `kernels/adamw.cu` (multi-tensor norm, clip coefficient, AdamW): `rtune_ops::adamw`'s loop
//!   for loop restatement, bit for bit as on a GPU;
//! - `kernels/nf4.cu` (plain and double-quantized dequantization, one tensor or a group of them
//!   in one launch): the CPU dequantization, exactly;
//! - `kernels/dropout.cu` (the LoRA dropout's Philox masks): `DropoutKey::factor`, exactly.
//!
//! - `kernels/flash_attn.cu`: its own harness under the same emulation (`scripts/flash-emu.sh`,
//!   against a dense f64 attention), run from here.
//!
//! The kernels' source is compiled by g++ (C++20) into a shared library, which this test loads:
//! each of its launches runs a block's threads as OS threads (barriers for `__syncthreads`, a slot
//! array for the warp shuffles), blocks one after another. Launch shapes are smaller than the
//! launchers' (2–3 blocks of 32–64 threads): the kernels loop over rows and elements in grid and
//! block strides, so a small grid runs every stride path the real one runs, and more. Shapes cover
//! the vector path (16-byte aligned buffers, rows a multiple of the vector width) and the scalar
//! one (odd lengths, buffers one element into their allocation).
//!
//! What the emulation does not check: the real warp scheduling, shared-memory banks, occupancy,
//! the device's `expf` (within 2 f32 ulps of the host's, which the f32 tolerance covers) or speed —
//! that is `rtune selftest` on a card. Tolerances: `rtune_backend::check::tolerance`, the
//! selftest's own (reasons there).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use half::{bf16, f16};
use rtune_backend::check::{compare, tolerance, Comparison, Op, Rng};
use rtune_backend::dropout::DropoutKey;
use rtune_backend::Precision;
use rtune_ops::adamw::{check_step, chunk_table, offsets, CHECK_STEPS};
use rtune_ops::add_norm::reference::Weight;
use rtune_ops::nf4::quantize::quantize_nf4;
use rtune_ops::nf4::weight::Absmax;
use rtune_ops::{add_norm, attention, ce, geglu, norm, rope, swiglu};

// ---------------------------------------------------------------------------------------------
// The emulated device

type Grid = unsafe extern "C" fn(u32, u32);
type Index = unsafe extern "C" fn(u32);

struct Emu {
    lib: libloading::Library,
    grid: Grid,
    block: Index,
    thread: Index,
}

/// The library, built and loaded once per test binary.
fn emu() -> &'static Emu {
    static EMU: OnceLock<Emu> = OnceLock::new();
    EMU.get_or_init(|| {
        let so = build();
        // SAFETY: loading the library just built from the repository's kernels and emulation; its
        // initialisers only zero globals.
        let lib = unsafe { libloading::Library::new(&so) }
            .unwrap_or_else(|e| panic!("{}: {e}", so.display()));
        let _ = std::fs::remove_dir_all(so.parent().unwrap());
        // SAFETY: the three entry points of kernels_lib.cpp, with these C signatures.
        unsafe {
            let grid = *lib.get::<Grid>(b"emu_grid").unwrap();
            let block = *lib.get::<Index>(b"emu_block").unwrap();
            let thread = *lib.get::<Index>(b"emu_thread").unwrap();
            Emu {
                lib,
                grid,
                block,
                thread,
            }
        }
    })
}

/// g++ on kernels_lib.cpp with `kernels/attn.cu`'s dynamic shared array made a plain `extern` (the
/// library defines it); the library's path.
fn build() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::env::temp_dir().join(format!("rtune-kernel-emu-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let attn = std::fs::read_to_string(root.join("kernels/attn.cu")).unwrap();
    assert!(
        attn.contains("extern __shared__"),
        "attn.cu has no dynamic shared array to patch: update kernels_lib.cpp and this build"
    );
    std::fs::write(
        out.join("attn_emu.cu"),
        attn.replace("extern __shared__", "extern"),
    )
    .unwrap();
    let so = out.join("libkernel_emu.so");
    let emu = root.join("scripts/flash-emu");
    let o = Command::new("g++")
        .args([
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-DEMU_STATIC_SHARED",
        ])
        .arg(format!("-I{}", emu.join("inc").display()))
        .arg(format!("-I{}", emu.display()))
        .arg(format!("-I{}", root.join("kernels").display()))
        .arg(format!("-I{}", out.display()))
        .args(["-include", "emu.h"])
        .arg(emu.join("kernels_lib.cpp"))
        .arg("-o")
        .arg(&so)
        .arg("-lpthread")
        .output()
        .unwrap_or_else(|e| panic!("g++ (C++20) is needed to emulate the kernels: {e}"));
    assert!(
        o.status.success(),
        "g++ failed on the emulated kernels:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    so
}

/// One launch at a time: the emulation's block state is global.
static LAUNCH: Mutex<()> = Mutex::new(());

/// `blocks` blocks of `threads` threads each running `kernel` (which calls one entry point).
fn launch(blocks: u32, threads: u32, kernel: impl Fn() + Sync) {
    assert!(threads.is_multiple_of(32) && threads <= 1024);
    let e = emu();
    let _one = LAUNCH.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: kernels_lib.cpp's launch state setters; every thread of a block is started below
    // before any can wait at a barrier sized for them all.
    unsafe { (e.grid)(blocks, threads) };
    for b in 0..blocks {
        // SAFETY: as above; the previous block's threads have all returned.
        unsafe { (e.block)(b) };
        std::thread::scope(|s| {
            for t in 0..threads {
                let kernel = &kernel;
                s.spawn(move || {
                    // SAFETY: sets this OS thread's emulated `threadIdx` (a thread-local).
                    unsafe { (e.thread)(t) };
                    kernel();
                });
            }
        });
    }
}

/// The entry point `name` (e.g. `rms_norm_fwd_bf16`) as a function of type `F`.
fn entry<F: Copy>(name: &str) -> F {
    // SAFETY: the caller names an `extern "C"` kernel of fused.cu / attn.cu and gives its
    // signature as `F` (pointers, `int` = i32, `long long` = i64, `float` = f32).
    unsafe {
        *emu()
            .lib
            .get::<F>(name.as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Element types and buffers

trait Elem: Copy + Default + Send + Sync + 'static {
    const SUFFIX: &'static str;
    const P: Precision;
    fn of(x: f32) -> Self;
    fn f(self) -> f32;
}
impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
    const P: Precision = Precision::F32;
    fn of(x: f32) -> Self {
        x
    }
    fn f(self) -> f32 {
        self
    }
}
impl Elem for bf16 {
    const SUFFIX: &'static str = "bf16";
    const P: Precision = Precision::Bf16;
    fn of(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn f(self) -> f32 {
        self.to_f32()
    }
}
impl Elem for f16 {
    const SUFFIX: &'static str = "f16";
    const P: Precision = Precision::F16;
    fn of(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn f(self) -> f32 {
        self.to_f32()
    }
}

/// Values at a 16-byte aligned address plus `offset` elements (offset 1: the scalar path).
struct Buf<T> {
    v: Vec<T>,
    start: usize,
    n: usize,
}

impl<T: Elem> Buf<T> {
    fn new(n: usize, offset: usize) -> Self {
        let v = vec![T::default(); n + offset + 16];
        let misalign = v.as_ptr() as usize % 16 / std::mem::size_of::<T>();
        let start = (16 / std::mem::size_of::<T>() - misalign) % (16 / std::mem::size_of::<T>());
        Buf {
            v,
            start: start + offset,
            n,
        }
    }
    fn of(x: &[f32], offset: usize) -> Self {
        let mut b = Self::new(x.len(), offset);
        for (d, &s) in b.v[b.start..].iter_mut().zip(x) {
            *d = T::of(s);
        }
        b
    }
    /// The address, for a kernel argument (an integer: a launch's closure is shared by threads).
    fn at(&self) -> usize {
        self.v[self.start..].as_ptr() as usize
    }
    fn at_mut(&mut self) -> usize {
        self.v[self.start..].as_mut_ptr() as usize
    }
    fn read(&self) -> Vec<f32> {
        self.v[self.start..self.start + self.n]
            .iter()
            .map(|x| x.f())
            .collect()
    }
}

fn c<T>(a: usize) -> *const T {
    a as *const T
}
fn m<T>(a: usize) -> *mut T {
    a as *mut T
}

/// One output compared: `(kernel, shape, comparison)`.
type Checked = (String, String, Comparison);

fn check<T: Elem>(op: Op, shape: &str, got: &[f32], want: &[f32]) -> Checked {
    let p = if op.f32_output() {
        Precision::F32
    } else {
        T::P
    };
    (
        format!("{}_{}", op.name(), T::SUFFIX),
        shape.to_string(),
        compare(got, want, p, tolerance(op, T::P)),
    )
}

/// [`check`], and for a kernel whose roundings are the reference's own (each intermediate rounded
/// at the same point) no more than `frac` of the elements off by a bit in bf16/f16 (in f32 for
/// `all_types`): the 2-ulp tolerance alone would pass one rounding too many or too few (Llama's
/// `T(h·r)` for an f32 weight, T-rounded products for f32 tables).
fn check_bits<T: Elem>(
    op: Op,
    shape: &str,
    got: &[f32],
    want: &[f32],
    (frac, all_types): (f64, bool),
) -> Checked {
    let (k, s, mut c) = check::<T>(op, shape, got, want);
    let differ = got
        .iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    if (T::P != Precision::F32 || all_types) && differ as f64 > frac * got.len() as f64 {
        c.pass = false;
    }
    (
        k,
        format!("{s} ({differ} of {} differ in bits)", got.len()),
        c,
    )
}

/// Prints every result and fails listing those that did not pass.
fn report(results: Vec<Checked>) {
    let line = |(k, s, c): &Checked| {
        format!(
            "{k} {s}: max rel err {:.2e} (worst element {}: {} vs {}) {}",
            c.max_rel_err,
            c.worst,
            c.got,
            c.want,
            if c.pass { "PASS" } else { "FAIL" }
        )
    };
    for r in &results {
        eprintln!("{}", line(r));
    }
    let failed: Vec<String> = results.iter().filter(|r| !r.2.pass).map(line).collect();
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
}

/// `f::<T>(args)` for f32, bf16 and f16, every result.
macro_rules! each_type {
    ($f:ident($($arg:expr),*)) => {
        [$f::<f32>($($arg),*), $f::<bf16>($($arg),*), $f::<f16>($($arg),*)].concat()
    };
}

// ---------------------------------------------------------------------------------------------
// The kernels

fn rms_norm<T: Elem>(rows: usize, dim: usize, offset: usize, seed: u64) -> Vec<Checked> {
    let (p, eps, mut rng) = (T::P, 1e-5f32, Rng::new(seed));
    let (x, w, dy) = norm::reference::check_inputs(&mut rng, rows, dim, p);
    let (xb, wb, dyb) = (
        Buf::<T>::of(&x, offset),
        Buf::<T>::of(&w, offset),
        Buf::<T>::of(&dy, offset),
    );
    let (mut y, mut dx) = (
        Buf::<T>::new(rows * dim, offset),
        Buf::<T>::new(rows * dim, offset),
    );
    type Fwd<T> = unsafe extern "C" fn(*const T, *const T, *mut T, i32, i32, f32);
    type Bwd<T> = unsafe extern "C" fn(*const T, *const T, *const T, *mut T, i32, i32, f32);
    let fwd: Fwd<T> = entry(&format!("rms_norm_fwd_{}", T::SUFFIX));
    let bwd: Bwd<T> = entry(&format!("rms_norm_bwd_{}", T::SUFFIX));
    let (xa, wa, dya, ya, dxa) = (xb.at(), wb.at(), dyb.at(), y.at_mut(), dx.at_mut());
    let (r, d) = (rows as i32, dim as i32);
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(3, 64, || unsafe { fwd(c(xa), c(wa), m(ya), r, d, eps) });
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(2, 32, || unsafe {
        bwd(c(dya), c(xa), c(wa), m(dxa), r, d, eps)
    });
    let shape = format!("({rows}, {dim})+{offset}");
    vec![
        check::<T>(
            Op::typed("rms_norm_fwd"),
            &shape,
            &y.read(),
            &norm::reference::rms_norm_fwd(&x, &w, rows, dim, eps, p),
        ),
        check::<T>(
            Op::typed("rms_norm_bwd"),
            &shape,
            &dx.read(),
            &norm::reference::rms_norm_bwd(&dy, &x, &w, rows, dim, eps, p),
        ),
    ]
}

type GluFwd<T> = unsafe extern "C" fn(*const T, *const T, *mut T, i64);
type GluBwd<T> = unsafe extern "C" fn(*const T, *const T, *const T, *mut T, i64);

/// SwiGLU and GeGLU: `h = act(g)·u`; the backward writes `[dg, du]` (2n).
fn glu<T: Elem>(n: usize, offset: usize, seed: u64) -> Vec<Checked> {
    let (p, mut rng) = (T::P, Rng::new(seed));
    let (g, u, dh) = (
        rng.normals(n, 4.0, p),
        rng.normals(n, 1.0, p),
        rng.normals(n, 1.0, p),
    );
    let (gb, ub, dhb) = (
        Buf::<T>::of(&g, offset),
        Buf::<T>::of(&u, offset),
        Buf::<T>::of(&dh, offset),
    );
    let shape = format!("({n})+{offset}");
    type Ref = fn(&[f32], &[f32], Precision) -> Vec<f32>;
    type RefBwd = fn(&[f32], &[f32], &[f32], Precision) -> Vec<f32>;
    let acts: [(&str, Ref, RefBwd); 2] = [
        (
            "swiglu",
            swiglu::reference::swiglu_fwd,
            swiglu::reference::swiglu_bwd,
        ),
        (
            "geglu",
            geglu::reference::geglu_fwd,
            geglu::reference::geglu_bwd,
        ),
    ];
    let mut out = Vec::new();
    for (name, want_fwd, want_bwd) in acts {
        let fwd: GluFwd<T> = entry(&format!("{name}_fwd_{}", T::SUFFIX));
        let bwd: GluBwd<T> = entry(&format!("{name}_bwd_{}", T::SUFFIX));
        let (mut h, mut o) = (Buf::<T>::new(n, offset), Buf::<T>::new(2 * n, offset));
        let (ga, ua, dha, ha, oa) = (gb.at(), ub.at(), dhb.at(), h.at_mut(), o.at_mut());
        // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
        // or writes for this shape, and lives until the launch returns.
        launch(3, 64, || unsafe { fwd(c(ga), c(ua), m(ha), n as i64) });
        // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
        // or writes for this shape, and lives until the launch returns.
        launch(2, 64, || unsafe {
            bwd(c(dha), c(ga), c(ua), m(oa), n as i64)
        });
        let (f, b) = match name {
            "swiglu" => ("swiglu_fwd", "swiglu_bwd"),
            _ => ("geglu_fwd", "geglu_bwd"),
        };
        out.push(check::<T>(
            Op::typed(f),
            &shape,
            &h.read(),
            &want_fwd(&g, &u, p),
        ));
        out.push(check::<T>(
            Op::typed(b),
            &shape,
            &o.read(),
            &want_bwd(&dh, &g, &u, p),
        ));
    }
    out
}

/// `(b, h, t, dh)`; cos/sin `(b, 1, t, dh)` from Llama's frequencies at random positions, rounded
/// to T as the model's tables are.
fn rope_check<T: Elem>(
    (b, h, t, dh): (usize, usize, usize, usize),
    offset: usize,
    seed: u64,
) -> Vec<Checked> {
    let (p, mut rng) = (T::P, Rng::new(seed));
    let (cos, sin) = rope::reference::check_tables(&mut rng, (b, t, dh), p);
    let n = b * h * t * dh;
    let (x, dy) = (rng.normals(n, 1.0, p), rng.normals(n, 1.0, p));
    let (xb, dyb, cb, sb) = (
        Buf::<T>::of(&x, offset),
        Buf::<T>::of(&dy, offset),
        Buf::<T>::of(&cos, offset),
        Buf::<T>::of(&sin, offset),
    );
    let (mut y, mut dx) = (Buf::<T>::new(n, offset), Buf::<T>::new(n, offset));
    type K<T> = unsafe extern "C" fn(*const T, *const T, *const T, *mut T, i64, i64, i64, i64);
    let fwd: K<T> = entry(&format!("rope_fwd_{}", T::SUFFIX));
    let bwd: K<T> = entry(&format!("rope_bwd_{}", T::SUFFIX));
    let (xa, dya, ca, sa, ya, dxa) = (xb.at(), dyb.at(), cb.at(), sb.at(), y.at_mut(), dx.at_mut());
    let d = [b, h, t, dh].map(|v| v as i64);
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(2, 64, || unsafe {
        fwd(c(xa), c(ca), c(sa), m(ya), d[0], d[1], d[2], d[3])
    });
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(3, 32, || unsafe {
        bwd(c(dya), c(ca), c(sa), m(dxa), d[0], d[1], d[2], d[3])
    });
    let shape = format!("({b}, {h}, {t}, {dh})+{offset}");
    let s4 = (b, h, t, dh);
    vec![
        check::<T>(
            Op::typed("rope_fwd").with_tol(1e-6, 1e-6),
            &shape,
            &y.read(),
            &rope::reference::rope_fwd(&x, &cos, &sin, s4, p),
        ),
        check::<T>(
            Op::typed("rope_bwd").with_tol(1e-6, 1e-6),
            &shape,
            &dx.read(),
            &rope::reference::rope_bwd(&dy, &cos, &sin, s4, p),
        ),
    ]
}

/// Cross-entropy over `(n, v)` logits, every fourth target's logit 30 (a near-zero loss); the
/// forward writes `(lse, loss)` per row in f32, the backward `(n, v)` in T.
fn ce_check<T: Elem>(n: usize, v: usize, offset: usize, seed: u64) -> Vec<Checked> {
    let (p, mut rng) = (T::P, Rng::new(seed));
    let mut logits = rng.normals(n * v, 3.0, p);
    let targets: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
    for (i, &tg) in targets.iter().enumerate().step_by(4) {
        logits[i * v + tg as usize] = p.round(30.0);
    }
    let scale = 1.0 / n.max(1) as f32;
    let want_fwd = ce::reference::ce_fwd(&logits, &targets, n, v);
    let lse: Vec<f32> = want_fwd.iter().step_by(2).copied().collect();
    let want_bwd = ce::reference::ce_bwd(&logits, &targets, &lse, scale, n, v, p);
    let lb = Buf::<T>::of(&logits, offset);
    let mut tb = Buf::<f32>::new(n, offset);
    for (d, &s) in tb.v[tb.start..].iter_mut().zip(&targets) {
        *d = f32::from_bits(s);
    }
    let lseb = Buf::<f32>::of(&lse, offset);
    let (mut o, mut d) = (Buf::<f32>::new(2 * n, offset), Buf::<T>::new(n * v, offset));
    type Fwd<T> = unsafe extern "C" fn(*const T, *const u32, *mut f32, i32, i32);
    type Bwd<T> = unsafe extern "C" fn(*const T, *const u32, *const f32, f32, *mut T, i32, i32);
    let fwd: Fwd<T> = entry(&format!("ce_fwd_{}", T::SUFFIX));
    let bwd: Bwd<T> = entry(&format!("ce_bwd_{}", T::SUFFIX));
    let (la, ta, lsea, oa, da) = (lb.at(), tb.at(), lseb.at(), o.at_mut(), d.at_mut());
    let (ni, vi) = (n as i32, v as i32);
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(3, 64, || unsafe { fwd(c(la), c(ta), m(oa), ni, vi) });
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(2, 64, || unsafe {
        bwd(c(la), c(ta), c(lsea), scale, m(da), ni, vi)
    });
    let shape = format!("({n}, {v})+{offset}");
    vec![
        check::<T>(Op::f32_out("ce_fwd"), &shape, &o.read(), &want_fwd),
        check::<T>(Op::typed("ce_bwd"), &shape, &d.read(), &want_bwd),
    ]
}

/// The attention softmax over `heads·tq` rows of `tk` keys: a causal mask for the last `tq`
/// positions with one fully masked row (NaN on both sides), raw scores ~ N(0, 16²); the forward
/// with the row kept in shared memory (`cached`) and recomputed.
fn attn_check<T: Elem>(
    (heads, tq, tk): (usize, usize, usize),
    offset: usize,
    seed: u64,
) -> Vec<Checked> {
    let (p, mut rng, scale) = (T::P, Rng::new(seed), 0.125f32);
    let rows = heads * tq;
    let mask = attention::reference::check_mask(tq, tk);
    let raw = rng.normals(rows * tk, 16.0, p);
    let dp = rng.normals(rows * tk, 1.0, p);
    let want_fwd = attention::reference::attn_softmax_fwd(&raw, &mask, tk, scale, p);
    let want_bwd = attention::reference::attn_softmax_bwd(&want_fwd, &dp, tk, scale, p);
    let (rb, mb, pb, dpb) = (
        Buf::<T>::of(&raw, offset),
        Buf::<f32>::of(&mask, offset),
        Buf::<f32>::of(&want_fwd, offset),
        Buf::<T>::of(&dp, offset),
    );
    type Fwd<T> = unsafe extern "C" fn(*const T, *const f32, *mut f32, i32, i32, i32, f32, i32);
    type Bwd<T> = unsafe extern "C" fn(*const f32, *const T, *mut T, i32, i32, f32);
    let fwd: Fwd<T> = entry(&format!("attn_softmax_fwd_{}", T::SUFFIX));
    let bwd: Bwd<T> = entry(&format!("attn_softmax_bwd_{}", T::SUFFIX));
    let (r, t, mr) = (rows as i32, tk as i32, tq as i32);
    let mut out = Vec::new();
    for cached in [0, 1] {
        let mut o = Buf::<f32>::new(rows * tk, offset);
        let (ra, ma, oa) = (rb.at(), mb.at(), o.at_mut());
        // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
        // or writes for this shape, and lives until the launch returns.
        launch(3, 64, || unsafe {
            fwd(c(ra), c(ma), m(oa), r, t, mr, scale, cached)
        });
        let shape = format!("({heads}·{tq}, {tk})+{offset} cached {cached}");
        out.push(check::<T>(
            Op::f32_out("attn_softmax_fwd"),
            &shape,
            &o.read(),
            &want_fwd,
        ));
    }
    let mut d = Buf::<T>::new(rows * tk, offset);
    let (pa, dpa, da) = (pb.at(), dpb.at(), d.at_mut());
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(2, 32, || unsafe { bwd(c(pa), c(dpa), m(da), r, t, scale) });
    let shape = format!("({heads}·{tq}, {tk})+{offset}");
    out.push(check::<T>(
        Op::typed("attn_softmax_bwd"),
        &shape,
        &d.read(),
        &want_bwd,
    ));
    out
}

/// The widening cast, exact, with the type's specials (±0, ±inf, NaN, extremes) in front.
fn widen_check<T: Elem>(n: usize, offset: usize, seed: u64) -> Vec<Checked> {
    let (p, mut rng) = (T::P, Rng::new(seed));
    let mut x = rng.normals(n, 1.0, p);
    let special = [0.0, -0.0, f32::INFINITY, -f32::INFINITY, f32::NAN, 1e-3];
    for (d, s) in x.iter_mut().zip(special) {
        *d = p.round(s);
    }
    let xb = Buf::<T>::of(&x, offset);
    let mut y = Buf::<f32>::new(n, offset);
    type K<T> = unsafe extern "C" fn(*const T, *mut f32, i64);
    let k: K<T> = entry(&format!("widen_{}", T::SUFFIX));
    let (xa, ya) = (xb.at(), y.at_mut());
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(2, 64, || unsafe { k(c(xa), m(ya), n as i64) });
    vec![check::<T>(
        Op::exact("widen"),
        &format!("({n})+{offset}"),
        &y.read(),
        &rtune_backend::cast::reference::widen(&x),
    )]
}

/// The residual add + RMSNorm: the forward writes `h` and `y`, the backward accumulates into the
/// residual gradient in place (one buffer passed as `dres` and `dh`, as the launcher does).
/// `w_scale` multiplies the kernel's weight and `kernel` is the kernel's weight form (`weight`'s
/// and 1 but in the wrong-kernel test).
fn add_norm_check<T: Elem>(
    (rows, dim): (usize, usize),
    (weight, kernel): (Weight, Weight),
    offset: usize,
    seed: u64,
    w_scale: f32,
) -> Vec<Checked> {
    let (p, eps, mut rng) = (T::P, 1e-6f32, Rng::new(seed));
    let shape = (rows, dim);
    let (x, res, w, dy, dres) = add_norm::reference::check_inputs(&mut rng, shape, p, weight);
    let (want_h, want_y) =
        add_norm::reference::add_rms_norm_fwd(&x, &res, &w, shape, eps, p, weight);
    let want_dh =
        add_norm::reference::add_rms_norm_bwd(&dy, &want_h, &w, &dres, shape, eps, p, weight);
    let (xb, rb, dyb) = (
        Buf::<T>::of(&x, offset),
        Buf::<T>::of(&res, offset),
        Buf::<T>::of(&dy, offset),
    );
    let kw: Vec<f32> = w.iter().map(|&v| v * w_scale).collect();
    let (wt, wf) = (Buf::<T>::of(&kw, offset), Buf::<f32>::of(&kw, offset));
    let (mut h, mut y) = (
        Buf::<T>::new(rows * dim, offset),
        Buf::<T>::new(rows * dim, offset),
    );
    let mut dh = Buf::<T>::of(&dres, offset);
    let (stem, wa) = match kernel {
        Weight::Typed => ("add_rms_norm", wt.at()),
        Weight::F32 => ("add_rms_norm1", wf.at()),
    };
    // The weight pointer's type does not change the C ABI: one signature for both stems.
    type Fwd<T> =
        unsafe extern "C" fn(*const T, *const T, *const u8, *mut T, *mut T, i32, i32, f32);
    type Bwd<T> =
        unsafe extern "C" fn(*const T, *const T, *const u8, *const T, *mut T, i32, i32, f32);
    let fwd: Fwd<T> = entry(&format!("{stem}_fwd_{}", T::SUFFIX));
    let bwd: Bwd<T> = entry(&format!("{stem}_bwd_{}", T::SUFFIX));
    let (xa, ra, dya, ha, ya, dha) = (
        xb.at(),
        rb.at(),
        dyb.at(),
        h.at_mut(),
        y.at_mut(),
        dh.at_mut(),
    );
    let (r, d) = (rows as i32, dim as i32);
    // SAFETY: the entry point's own signature (the weight a T or f32 array as the stem says);
    // every buffer holds what the kernel reads or writes for this shape and lives until the
    // launch returns.
    launch(3, 64, || unsafe {
        fwd(c(xa), c(ra), c(wa), m(ha), m(ya), r, d, eps)
    });
    // SAFETY: as above; dres and dh are one buffer, which the kernel allows.
    launch(2, 32, || unsafe {
        bwd(c(dya), c(ha), c(wa), c(dha), m(dha), r, d, eps)
    });
    let label = format!("({rows}, {dim})+{offset}");
    let (f, b) = match weight {
        Weight::Typed => ("add_rms_norm_fwd", "add_rms_norm_bwd"),
        Weight::F32 => ("add_rms_norm1_fwd", "add_rms_norm1_bwd"),
    };
    // `r` from f32 sums in another order than the reference's f64 may tip a rounding: 1%.
    let bits = (0.01, false);
    vec![
        check::<T>(Op::typed(f), &format!("{label} h"), &h.read(), &want_h),
        check_bits::<T>(Op::typed(f), &label, &y.read(), &want_y, bits),
        check_bits::<T>(Op::typed(b), &label, &dh.read(), &want_dh, bits),
    ]
}

fn add_norm_both<T: Elem>(shape: (usize, usize), offset: usize, seed: u64) -> Vec<Checked> {
    [
        add_norm_check::<T>(shape, (Weight::Typed, Weight::Typed), offset, seed, 1.0),
        add_norm_check::<T>(shape, (Weight::F32, Weight::F32), offset, seed + 100, 1.0),
    ]
    .concat()
}

/// RoPE on q and k in place, forward then backward on the forward's output, tables `(bc, 1, t, r)`
/// of `C` (T, or f32: the f32-table mode). `table_bc` is the batch the kernel is told the tables
/// have (`bc` but in the wrong-kernel test), `ref_pc` the reference's rounding of products (`C`'s
/// but in the wrong-kernel test).
fn rope_qk_check<T: Elem, C: Elem>(
    (b, hq, hk, t, dh): (usize, usize, usize, usize, usize),
    (bc, r): (usize, usize),
    offset: usize,
    seed: u64,
    (table_bc, ref_pc): (usize, Precision),
) -> Vec<Checked> {
    let (p, mut rng) = (T::P, Rng::new(seed));
    let (pc, ref_pc) = (C::P, ref_pc);
    let (cos, sin) = rope::reference::check_tables(&mut rng, (bc, t, r), pc);
    let (q, k) = (
        rng.normals(b * hq * t * dh, 1.0, p),
        rng.normals(b * hk * t * dh, 1.0, p),
    );
    let s5 = (b, hq, hk, t, dh);
    let (mut wq, mut wk) = (q.clone(), k.clone());
    rope::reference::rope_qk(
        &mut wq,
        &mut wk,
        &cos,
        &sin,
        s5,
        (bc, r),
        (ref_pc, p),
        false,
    );
    let (mut bq, mut bk) = (wq.clone(), wk.clone());
    rope::reference::rope_qk(&mut bq, &mut bk, &cos, &sin, s5, (bc, r), (ref_pc, p), true);
    let (mut qb, mut kb) = (Buf::<T>::of(&q, offset), Buf::<T>::of(&k, offset));
    let (cb, sb) = (Buf::<C>::of(&cos, offset), Buf::<C>::of(&sin, offset));
    let f32t = if C::SUFFIX == T::SUFFIX { "" } else { "_f32t" };
    #[rustfmt::skip]
    type K<T, C> = unsafe extern "C" fn(
        *mut T, *mut T, *const C, *const C, i64, i64, i64, i64, i64, i64, i64,
    );
    let fwd: K<T, C> = entry(&format!("rope_qk{f32t}_fwd_{}", T::SUFFIX));
    let bwd: K<T, C> = entry(&format!("rope_qk{f32t}_bwd_{}", T::SUFFIX));
    let (qa, ka, ca, sa) = (qb.at_mut(), kb.at_mut(), cb.at(), sb.at());
    let d = [b, hq, hk, t, dh, r, table_bc].map(|v| v as i64);
    // SAFETY: the entry point's own signature; q, k, cos, sin hold what the kernel reads or writes
    // for this shape (a smaller told batch of tables reads less), alive until the launch returns.
    launch(2, 64, || unsafe {
        fwd(
            m(qa),
            m(ka),
            c(ca),
            c(sa),
            d[0],
            d[1],
            d[2],
            d[3],
            d[4],
            d[5],
            d[6],
        )
    });
    let (fq, fk) = (qb.read(), kb.read());
    // SAFETY: as above.
    launch(3, 32, || unsafe {
        bwd(
            m(qa),
            m(ka),
            c(ca),
            c(sa),
            d[0],
            d[1],
            d[2],
            d[3],
            d[4],
            d[5],
            d[6],
        )
    });
    let tables = if f32t.is_empty() { "" } else { " f32 tables" };
    let label = format!("({b}, {hq}/{hk}, {t}, {dh}) r {r} bc {bc}{tables}+{offset}");
    let (f, g) = (
        Op::typed("rope_qk_fwd").with_tol(1e-6, 1e-6),
        Op::typed("rope_qk_bwd").with_tol(1e-6, 1e-6),
    );
    // No sums: every rounding is the reference's, every type bit for bit.
    let bits = (0.0, true);
    vec![
        check_bits::<T>(f, &format!("{label} q"), &fq, &wq, bits),
        check_bits::<T>(f, &format!("{label} k"), &fk, &wk, bits),
        check_bits::<T>(g, &format!("{label} q"), &qb.read(), &bq, bits),
        check_bits::<T>(g, &format!("{label} k"), &kb.read(), &bk, bits),
    ]
}

/// Soft-capped cross-entropy over `(n, v)` logits ~ 10·N(0, 1), one target in four at 60 (capped
/// near the cap); `kernel_cap` is the cap the kernels get (`cap` but in the wrong-kernel test).
fn ce_capped_check<T: Elem>(
    (n, v): (usize, usize),
    cap: f64,
    offset: usize,
    seed: u64,
    kernel_cap: f64,
) -> Vec<Checked> {
    let (p, mut rng) = (T::P, Rng::new(seed));
    let (logits, targets) = ce::reference::check_inputs(&mut rng, (n, v), (10.0, 60.0), p);
    let scale = 1.0 / n.max(1) as f32;
    let want_fwd = ce::reference::ce_capped_fwd(&logits, &targets, (n, v), cap, p);
    let lse: Vec<f32> = want_fwd.iter().step_by(2).copied().collect();
    let want_bwd = ce::reference::ce_capped_bwd(&logits, &targets, &lse, scale, (n, v), cap, p);
    let lb = Buf::<T>::of(&logits, offset);
    let mut tb = Buf::<f32>::new(n, offset);
    for (d, &s) in tb.v[tb.start..].iter_mut().zip(&targets) {
        *d = f32::from_bits(s);
    }
    let lseb = Buf::<f32>::of(&lse, offset);
    let (mut o, mut d) = (Buf::<f32>::new(2 * n, offset), Buf::<T>::new(n * v, offset));
    type Fwd<T> = unsafe extern "C" fn(*const T, *const u32, *mut f32, i32, i32, f32, f32);
    #[rustfmt::skip]
    type Bwd<T> = unsafe extern "C" fn(
        *const T, *const u32, *const f32, f32, *mut T, i32, i32, f32, f32,
    );
    let fwd: Fwd<T> = entry(&format!("ce_capped_fwd_{}", T::SUFFIX));
    let bwd: Bwd<T> = entry(&format!("ce_capped_bwd_{}", T::SUFFIX));
    let (la, ta, lsea, oa, da) = (lb.at(), tb.at(), lseb.at(), o.at_mut(), d.at_mut());
    let (ni, vi) = (n as i32, v as i32);
    // As the launcher passes them: the cap and its reciprocal taken in f64.
    let (kc, ki) = (kernel_cap as f32, (1.0 / kernel_cap) as f32);
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(3, 64, || unsafe {
        fwd(c(la), c(ta), m(oa), ni, vi, kc, ki)
    });
    // SAFETY: as above.
    launch(2, 64, || unsafe {
        bwd(c(la), c(ta), c(lsea), scale, m(da), ni, vi, kc, ki)
    });
    let shape = format!("({n}, {v}) cap {cap}+{offset}");
    vec![
        check::<T>(Op::f32_out("ce_capped_fwd"), &shape, &o.read(), &want_fwd),
        check::<T>(Op::typed("ce_capped_bwd"), &shape, &d.read(), &want_bwd),
    ]
}

// ---------------------------------------------------------------------------------------------
// The tests: vector-path shapes at offset 0, scalar ones (odd lengths) one element in.

#[test]
fn rms_norm_kernels_match_the_reference_emulated() {
    report(
        [
            each_type!(rms_norm(5, 264, 0, 1)),
            each_type!(rms_norm(4, 77, 1, 2)),
        ]
        .concat(),
    );
}

#[test]
fn glu_kernels_match_the_reference_emulated() {
    report([each_type!(glu(1000, 0, 3)), each_type!(glu(333, 1, 4))].concat());
}

#[test]
fn rope_kernels_match_the_reference_emulated() {
    report(
        [
            each_type!(rope_check((2, 3, 5, 16), 0, 5)),
            each_type!(rope_check((1, 2, 7, 10), 1, 6)),
        ]
        .concat(),
    );
}

#[test]
fn cross_entropy_kernels_match_the_reference_emulated() {
    report(
        [
            each_type!(ce_check(6, 520, 0, 7)),
            each_type!(ce_check(3, 101, 1, 8)),
        ]
        .concat(),
    );
}

#[test]
fn attention_softmax_kernels_match_the_reference_emulated() {
    report(
        [
            each_type!(attn_check((2, 5, 40), 0, 9)),
            each_type!(attn_check((2, 3, 13), 1, 10)),
        ]
        .concat(),
    );
}

#[test]
fn widen_kernel_is_exact_emulated() {
    report(
        [
            each_type!(widen_check(1000, 0, 11)),
            each_type!(widen_check(333, 1, 12)),
        ]
        .concat(),
    );
}

#[test]
fn add_rms_norm_kernels_match_the_reference_emulated() {
    report(
        [
            each_type!(add_norm_both((5, 264), 0, 21)),
            each_type!(add_norm_both((4, 77), 1, 22)),
        ]
        .concat(),
    );
}

#[test]
fn rope_qk_kernels_match_the_reference_emulated() {
    // Full rotation with per-batch tables; partial rotary (r 12 of 16, Phi-4-mini's 3/4) with
    // one table for every batch row; f32 tables on bf16/f16 q, k; odd shapes one element in.
    let full = ((2, 4, 2, 5, 16), (2, 16));
    let partial = ((2, 3, 1, 5, 16), (1, 12));
    let odd = ((1, 3, 1, 7, 10), (1, 6));
    report(
        [
            rope_qk_check::<f32, f32>(full.0, full.1, 0, 31, (full.1 .0, Precision::F32)),
            rope_qk_check::<bf16, bf16>(full.0, full.1, 0, 31, (full.1 .0, Precision::Bf16)),
            rope_qk_check::<f16, f16>(full.0, full.1, 0, 31, (full.1 .0, Precision::F16)),
            rope_qk_check::<bf16, f32>(full.0, full.1, 0, 32, (full.1 .0, Precision::F32)),
            rope_qk_check::<f16, f32>(full.0, full.1, 0, 32, (full.1 .0, Precision::F32)),
            rope_qk_check::<f32, f32>(partial.0, partial.1, 0, 33, (1, Precision::F32)),
            rope_qk_check::<bf16, bf16>(partial.0, partial.1, 0, 33, (1, Precision::Bf16)),
            rope_qk_check::<bf16, f32>(partial.0, partial.1, 0, 34, (1, Precision::F32)),
            rope_qk_check::<f16, f16>(odd.0, odd.1, 1, 35, (1, Precision::F16)),
            rope_qk_check::<bf16, f32>(odd.0, odd.1, 1, 36, (1, Precision::F32)),
            rope_qk_check::<f32, f32>(odd.0, odd.1, 1, 37, (1, Precision::F32)),
        ]
        .concat(),
    );
}

#[test]
fn soft_capped_cross_entropy_kernels_match_the_reference_emulated() {
    report(
        [
            each_type!(ce_capped_check((6, 520), 30.0, 0, 41, 30.0)),
            each_type!(ce_capped_check((3, 101), 30.0, 1, 42, 30.0)),
            each_type!(ce_capped_check((2, 64), 5.0, 0, 43, 5.0)),
        ]
        .concat(),
    );
}

/// The new kernels' checks fail on a wrong kernel result: the fused norm with a 1% wrong weight,
/// or with one rounding too few (the f32-weight kernel where Llama's rounds `h·r` to bf16); RoPE
/// on q/k told the tables have one batch row when they have two (the second batch row rotated by
/// the first's positions), or rounding each product to bf16 where f32 tables round once; the
/// soft-capped cross-entropy with cap 31 for 30.
#[test]
fn a_wrong_fused_kernel_result_fails_the_comparison() {
    let failed = |rs: Vec<Checked>, what: &str| {
        let passed: Vec<&Checked> = rs.iter().filter(|r| r.2.pass).collect();
        // Every output that depends on the wrong input must fail (h does not depend on w).
        let wrong: Vec<&Checked> = rs.iter().filter(|r| !r.1.ends_with(" h")).collect();
        assert!(
            wrong.iter().all(|r| !r.2.pass),
            "{what}: passed {:?}",
            passed.iter().map(|r| (&r.0, &r.1)).collect::<Vec<_>>()
        );
    };
    failed(
        add_norm_check::<bf16>((3, 64), (Weight::Typed, Weight::Typed), 0, 51, 1.01),
        "norm weight ×1.01",
    );
    failed(
        add_norm_check::<f32>((3, 64), (Weight::F32, Weight::F32), 0, 52, 1.01),
        "f32 weight ×1.01",
    );
    failed(
        add_norm_check::<bf16>((3, 64), (Weight::Typed, Weight::F32), 0, 57, 1.0),
        "the f32-weight kernel for Llama's norm",
    );
    let s = (2, 2, 1, 4, 16);
    failed(
        rope_qk_check::<bf16, bf16>(s, (2, 16), 0, 53, (1, Precision::Bf16)),
        "tables read as batch 1",
    );
    failed(
        rope_qk_check::<f16, f32>(s, (2, 16), 0, 54, (1, Precision::F32)),
        "f32 tables read as batch 1",
    );
    failed(
        rope_qk_check::<bf16, bf16>(s, (2, 16), 0, 58, (2, Precision::F32)),
        "bf16-table roundings for the f32-table mode",
    );
    failed(
        ce_capped_check::<f32>((4, 128), 30.0, 0, 55, 31.0),
        "cap 31 for 30",
    );
    failed(
        ce_capped_check::<bf16>((4, 128), 30.0, 0, 56, 31.0),
        "bf16: cap 31 for 30",
    );
}

/// The emulation itself: a kernel with a wrong result is caught. The RMSNorm forward is run with
/// a weight vector other than the reference's; the comparison must fail.
#[test]
fn a_wrong_kernel_result_fails_the_comparison() {
    let (rows, dim) = (2, 64);
    let mut rng = Rng::new(13);
    let x = rng.normals(rows * dim, 1.0, Precision::F32);
    let w = vec![1.0f32; dim];
    let (xb, wb) = (
        Buf::<f32>::of(&x, 0),
        Buf::<f32>::of(&vec![1.01f32; dim], 0),
    );
    let mut y = Buf::<f32>::new(rows * dim, 0);
    type Fwd = unsafe extern "C" fn(*const f32, *const f32, *mut f32, i32, i32, f32);
    let fwd: Fwd = entry("rms_norm_fwd_f32");
    let (xa, wa, ya) = (xb.at(), wb.at(), y.at_mut());
    // SAFETY: the entry point's own signature; every buffer holds what the kernel reads
    // or writes for this shape, and lives until the launch returns.
    launch(2, 32, || unsafe {
        fwd(c(xa), c(wa), m(ya), rows as i32, dim as i32, 1e-5)
    });
    let want = norm::reference::rms_norm_fwd(&x, &w, rows, dim, 1e-5, Precision::F32);
    let r = check::<f32>(Op::typed("rms_norm_fwd"), "(2, 64)", &y.read(), &want);
    assert!(!r.2.pass, "a 1% wrong weight passed: {:?}", r.2);
}

/// The multi-tensor optimizer step as `AdamW::step_device` launches it (norm partials, the
/// clip coefficient, the update), on tensors of odd sizes (one of no gradient, one empty, one whose
/// gradient starts one element into its buffer), over four steps: clipped, loss-scaled,
/// unclipped, and one with an infinite gradient (skipped: nothing moves). Bit for bit against
/// `rtune_ops::adamw`'s restatement (the kernels fix every sum's order and round every operation
/// alone), as on a GPU.
#[test]
fn adamw_kernels_equal_the_reference_bit_for_bit_emulated() {
    let sizes = [1usize, 3, 0, 31, 2047, 2049, 4097, 65, 10007];
    let mut rng = Rng::new(14);
    let (off, total) = offsets(&sizes);
    let chunks = chunk_table(&sizes);
    let n_chunks = chunks.len() / 2;
    let mut master = rng.normals(total, 0.05, Precision::F32);
    let (mut m1, mut m2) = (vec![0f32; total], vec![0f32; total]);
    let (mut dmaster, mut dm, mut dv) = (master.clone(), m1.clone(), m2.clone());
    let mut partials = vec![0f64; n_chunks];
    let mut norm_coef = [0f64; 2];
    type Partial = unsafe extern "C" fn(*const u64, *const u64, u64, f32, *mut f64);
    type Finalize = unsafe extern "C" fn(*const f64, u64, f64, *mut f64);
    #[rustfmt::skip]
    type Update = unsafe extern "C" fn(
        *const u64, *const u64, u64, *const f64, *mut f32, *mut f32, *mut f32,
        f32, f32, f32, f32, f32, f32, f32, f32,
    );
    let partial: Partial = entry("mt_sq_norm_partial");
    let finalize: Finalize = entry("mt_norm_finalize");
    let update: Update = entry("mt_adamw");
    let mut step = 0u64;
    for (i, (name, ..)) in CHECK_STEPS.iter().enumerate() {
        let st = check_step(
            &mut rng,
            &sizes,
            i,
            &mut step,
            (&mut master, &mut m1, &mut m2),
        );
        let (grads, sc, want) = (&st.grads, st.scalars, &st.written);
        let (max_norm, norm, coef, unscale) = (st.max_norm, st.norm, st.coef, st.unscale);
        let shifted: Vec<f32> = [&[0.0][..], &grads[5]].concat();
        let mut outs: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0f32; n]).collect();
        let mut table = Vec::new();
        for k in 0..sizes.len() {
            let g = match k {
                1 => 0,
                5 => shifted[1..].as_ptr() as u64,
                _ if sizes[k] == 0 => 0,
                _ => grads[k].as_ptr() as u64,
            };
            let o = if sizes[k] == 0 {
                0
            } else {
                outs[k].as_mut_ptr() as u64
            };
            table.extend([g, o, off[k] as u64, sizes[k] as u64]);
        }
        let (ta, ca, pa, nca) = (
            table.as_ptr() as usize,
            chunks.as_ptr() as usize,
            partials.as_mut_ptr() as usize,
            norm_coef.as_mut_ptr() as usize,
        );
        let (ma, mma, va) = (
            dmaster.as_mut_ptr() as usize,
            dm.as_mut_ptr() as usize,
            dv.as_mut_ptr() as usize,
        );
        let nc = n_chunks as u64;
        // SAFETY: the entry points' own signatures; the table's pointers are `grads`', `shifted`'s
        // and `outs`' (sizes[k] elements each), alive until the launches return; offsets are
        // prefix sums (≤ total), partials hold n_chunks.
        launch(3, 256, || unsafe {
            partial(c(ta), c(ca), nc, unscale, m(pa))
        });
        // SAFETY: as above; norm_coef holds 2.
        launch(1, 256, || unsafe { finalize(c(pa), nc, max_norm, m(nca)) });
        // SAFETY: as above.
        launch(2, 256, || unsafe {
            update(
                c(ta),
                c(ca),
                nc,
                c(nca),
                m(ma),
                m(mma),
                m(va),
                sc.unscale,
                sc.w1,
                sc.b2,
                sc.w2,
                sc.eps,
                sc.bc2_sqrt,
                sc.step_size,
                sc.decay,
            )
        });
        let bits = |x: f64| x.to_bits();
        assert_eq!(
            (bits(norm_coef[0]), bits(norm_coef[1])),
            (bits(norm), bits(coef)),
            "{name}: (norm, coef) {norm_coef:?}, reference ({norm}, {coef})"
        );
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&dmaster, &master), "{name}: master weights differ");
        assert!(same(&dm, &m1) && same(&dv, &m2), "{name}: moments differ");
        match want {
            Some(w) => {
                for (k, (o, w)) in outs.iter().zip(w).enumerate() {
                    assert!(same(o, w), "{name}: tensor {k}'s written weights differ");
                }
            }
            None => assert!(
                outs.iter().flatten().all(|&x| x == 0.0),
                "{name}: a skipped step wrote"
            ),
        }
        eprintln!("adamw {name}: norm {norm:e} coef {coef} — equal bit for bit");
    }
    assert_eq!(step, 3, "the infinite gradient's step was not skipped");
}

/// NF4 dequantization, plain and double-quantized scales, to f32, bf16 and f16: equal to the CPU
/// dequantization element for element (the kernel multiplies code value by scale once, rounds
/// once), on tensors with a partial last group of 16 and a partial last block of 64.
#[test]
fn nf4_dequant_kernels_equal_the_cpu_emulated() {
    fn run<T: Elem + PartialEq + std::fmt::Debug>(
        w: &rtune_ops::nf4::weight::Nf4Weight,
        cpu: Vec<T>,
        what: &str,
    ) {
        let n = w.numel();
        let mut out = Buf::<T>::new(n, 0);
        let (pk, qm, oa) = (
            w.packed.as_ptr() as usize,
            w.quant_map.as_ptr() as usize,
            out.at_mut(),
        );
        let threads = n.div_ceil(16);
        let blocks = threads.div_ceil(64) as u32;
        match &w.absmax {
            Absmax::Plain(a) => {
                type K<T> = unsafe extern "C" fn(*const u8, *const f32, *const f32, *mut T, i64);
                let k: K<T> = entry(&format!("nf4_dequant_plain_{}", T::SUFFIX));
                let aa = a.as_ptr() as usize;
                // SAFETY: the entry point's own signature; packed, absmax and the output hold what
                // the weight's n elements need.
                launch(blocks, 64, || unsafe {
                    k(c(pk), c(aa), c(qm), m(oa), n as i64)
                });
            }
            Absmax::Double {
                codes,
                nested_absmax,
                nested_quant_map,
                offset,
                nested_blocksize,
            } => {
                #[rustfmt::skip]
                type K<T> = unsafe extern "C" fn(
                    *const u8, *const u8, *const f32, *const f32, f32, i32, *const f32, *mut T, i64,
                );
                let k: K<T> = entry(&format!("nf4_dequant_double_{}", T::SUFFIX));
                let (ca, na, nm) = (
                    codes.as_ptr() as usize,
                    nested_absmax.as_ptr() as usize,
                    nested_quant_map.as_ptr() as usize,
                );
                let (o, bs) = (*offset, *nested_blocksize as i32);
                // SAFETY: as above, with the nested scales' tables.
                launch(blocks, 64, || unsafe {
                    k(c(pk), c(ca), c(na), c(nm), o, bs, c(qm), m(oa), n as i64)
                });
            }
        }
        let got = &out.v[out.start..out.start + n];
        if let Some(i) = (0..n).find(|&i| got[i] != cpu[i]) {
            panic!(
                "{what} {}: element {i} of {:?}: emulated {:?}, cpu {:?}",
                T::SUFFIX,
                w.shape,
                got[i],
                cpu[i]
            );
        }
    }
    let mut rng = Rng::new(15);
    for shape in [&[15usize][..], &[3, 43], &[64, 64], &[1001, 37]] {
        let n: usize = shape.iter().product();
        let x: Vec<f32> = (0..n)
            .map(|i| {
                rng.normal() * 0.01 * (1.0 + (i % 7) as f32) * if i % 997 == 0 { 20.0 } else { 1.0 }
            })
            .collect();
        for dq in [false, true] {
            let what = if dq { "double" } else { "plain" };
            let w = quantize_nf4(&x, shape, dq).unwrap();
            run::<f32>(&w, w.dequantize_f32(), what);
            let mut b = vec![bf16::ZERO; n];
            w.dequantize_into_bf16(&mut b).unwrap();
            run::<bf16>(&w, b, what);
            let mut h = vec![f16::ZERO; n];
            w.dequantize_into_f16(&mut h).unwrap();
            run::<f16>(&w, h, what);
        }
    }
}

/// The grouped NF4 kernel (issue 48, item 4): several weights of unequal sizes in one launch —
/// plain and double-quantized scales, an FP4 table, sizes with a partial last group of 16 and
/// block of 64 (so the plan pads between them) and back-to-back ones — equal bit for bit to the
/// per-tensor CPU dequantization of each at its offset, with the padding between them untouched.
#[test]
fn nf4_grouped_kernel_equals_the_per_tensor_cpu_emulated() {
    use rtune_ops::nf4::group::{self, GroupTable};
    use rtune_ops::nf4::weight::Nf4Weight;
    type K<T> = unsafe extern "C" fn(GroupTable, *mut T);
    /// Each weight at the next multiple of 256 bytes (as `rtune-model`'s plan places them).
    fn slots(ws: &[&Nf4Weight], bytes: usize) -> (Vec<(usize, usize)>, usize) {
        let mut at = 0usize;
        let s = ws
            .iter()
            .map(|w| {
                let o = at.next_multiple_of(256 / bytes);
                at = o + w.numel();
                (o, w.numel())
            })
            .collect();
        (s, at)
    }
    fn run<T: Elem + PartialEq + std::fmt::Debug>(ws: &[&Nf4Weight], want: &[T], sentinel: T) {
        let (slots, total) = slots(ws, std::mem::size_of::<T>());
        let mut out = Buf::<T>::new(total, 0);
        out.v.iter_mut().for_each(|x| *x = sentinel);
        let addrs: Vec<_> = ws.iter().map(|w| group::host_addresses(w)).collect();
        let t = group::table(ws, &addrs, &slots, 64).unwrap();
        let k: K<T> = entry(&format!("nf4_dequant_group_{}", T::SUFFIX));
        let oa = out.at_mut();
        // SAFETY: the entry point's signature (the table by value, as the .cu declares it); every
        // address in the table is a live buffer of a weight in `ws`, the output holds every slot.
        launch(t.total_blocks as u32, 64, || unsafe { k(t, m(oa)) });
        let got = &out.v[out.start..out.start + total];
        if let Some(i) = (0..total).find(|&i| got[i] != want[i]) {
            panic!(
                "grouped {} at element {i} of {total} (slots {slots:?}): emulated {:?}, cpu {:?}",
                T::SUFFIX,
                got[i],
                want[i]
            );
        }
    }
    let mut rng = Rng::new(48);
    let mut weight = |shape: [usize; 2], dq: bool| {
        let x: Vec<f32> = (0..shape[0] * shape[1])
            .map(|i| rng.normal() * 0.02 * if i % 501 == 0 { 30.0 } else { 1.0 })
            .collect();
        quantize_nf4(&x, &shape, dq).unwrap()
    };
    // in = 37: 37·out elements, neither a multiple of 16 nor of 64, padded apart; in = 128:
    // back to back (a q/k/v of a GQA layer, scaled down).
    let mut fp4 = weight([9, 37], true);
    fp4.quant_map = rtune_ops::nf4::FP4;
    fp4.quant_type = rtune_ops::nf4::QuantType::Fp4;
    let odd = [
        weight([21, 37], false),
        weight([3, 37], true),
        fp4,
        weight([40, 37], false),
    ];
    let gqa = [
        weight([64, 128], true),
        weight([16, 128], true),
        weight([16, 128], false),
    ];
    for ws in [&odd[..], &gqa[..]] {
        let ws: Vec<&Nf4Weight> = ws.iter().collect();
        let (sl, total) = slots(&ws, 2);
        // in = 128: back to back; in = 37: padded apart.
        assert_eq!(
            total == ws.iter().map(|w| w.numel()).sum::<usize>(),
            ws[0].shape[1] == 128
        );
        let s = bf16::from_f32(-3.5);
        let mut want = vec![s; total];
        group::dequantize_group_bf16(&ws, &sl, &mut want).unwrap();
        run::<bf16>(&ws, &want, s);
        let s = f16::from_f32(-3.5);
        let mut want = vec![s; total];
        group::dequantize_group_f16(&ws, &sl, &mut want).unwrap();
        run::<f16>(&ws, &want, s);
        let (sl, total) = slots(&ws, 4);
        let mut want = vec![-3.5f32; total];
        group::dequantize_group_f32(&ws, &sl, &mut want).unwrap();
        run::<f32>(&ws, &want, -3.5);
    }
}

/// The LoRA dropout kernel, `y = f32(x)·m(i)`: the same Philox masks as the CPU's
/// `DropoutKey::factor`, element for element, for f32/bf16/f16 inputs and a length that is no
/// multiple of 4 (the last Philox block partly used), with a seed and salt using both 32-bit halves.
#[test]
fn dropout_kernel_draws_the_cpu_masks_emulated() {
    fn run<T: Elem>(n: usize, key: DropoutKey) {
        let mut rng = Rng::new(16);
        let x = rng.normals(n, 1.0, T::P);
        let xb = Buf::<T>::of(&x, 0);
        let mut y = Buf::<f32>::new(n, 0);
        type K<T> = unsafe extern "C" fn(*const T, *mut f32, u64, u32, u32, u32, u32, u32, f32);
        let k: K<T> = entry(&format!("lora_dropout_{}", T::SUFFIX));
        let (xa, ya) = (xb.at(), y.at_mut());
        let (s, t) = (key.seed, key.salt);
        let (th, sc) = (key.threshold(), key.scale());
        // SAFETY: the entry point's own signature; x and y hold n elements.
        launch(2, 64, || unsafe {
            k(
                c(xa),
                m(ya),
                n as u64,
                s as u32,
                (s >> 32) as u32,
                t as u32,
                (t >> 32) as u32,
                th,
                sc,
            )
        });
        let got = y.read();
        let dropped = got.iter().filter(|&&v| v == 0.0).count();
        for (i, (&g, &xi)) in got.iter().zip(&x).enumerate() {
            let want = xi * key.factor(i as u64);
            assert_eq!(
                g.to_bits(),
                want.to_bits(),
                "{} element {i}: {g} vs {want}",
                T::SUFFIX
            );
        }
        // p = 0.3 of 1001: about 300 dropped (a test that compared zeros with zeros would see 0).
        assert!(
            (200..400).contains(&dropped),
            "{} dropped {dropped} of {n}",
            T::SUFFIX
        );
    }
    let key = DropoutKey {
        p: 0.3,
        seed: 0x1234_5678_9abc_def0,
        salt: (7 << 32) | 3,
    };
    run::<f32>(1001, key);
    run::<bf16>(1001, key);
    run::<f16>(1001, key);
}

/// `flash_attn.cu` under its own harness (`scripts/flash-emu.sh`: the same emulation, whole-tile
/// wmma fragments, its shared-memory budget; f32 and bf16 against a dense f64 attention: causal
/// GQA, MQA, sliding windows, packed rows, odd T, unaligned buffers), in its own process: tens of
/// seconds of wall time on a loaded 2-core machine.
#[test]
fn flash_attention_kernels_match_a_dense_attention_emulated() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/flash-emu.sh");
    let o = Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    let out = String::from_utf8_lossy(&o.stdout);
    eprintln!("{out}");
    assert!(
        o.status.success() && out.contains("PASS") && !out.contains("FAIL"),
        "flash-emu.sh: {}\n{out}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
}
