//! The fused CUDA kernels (`kernels/fused.cu`: RMSNorm, SwiGLU, GeGLU, RoPE, cross-entropy, the
//! widening cast) and the attention softmax (`kernels/attn.cu`) run on the CPU under the host
//! emulation (`scripts/flash-emu/`: emu.h, fused_lib.cpp), against the ops' references (each
//! op's `reference.rs`), f32, bf16 and f16, forward and backward — what `tests/fused_cuda.rs` and
//! `rtune selftest` check on a GPU, here on every CI run without one (issue 48).
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
use rtune_backend::Precision;
use rtune_ops::{attention, ce, geglu, norm, rope, swiglu};

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
        // SAFETY: the three entry points of fused_lib.cpp, with these C signatures.
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

/// g++ on fused_lib.cpp with `kernels/attn.cu`'s dynamic shared array made a plain `extern` (the
/// library defines it); the library's path.
fn build() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::env::temp_dir().join(format!("rtune-kernel-emu-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let attn = std::fs::read_to_string(root.join("kernels/attn.cu")).unwrap();
    assert!(
        attn.contains("extern __shared__"),
        "attn.cu has no dynamic shared array to patch: update fused_lib.cpp and this build"
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
        .arg(emu.join("fused_lib.cpp"))
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
    // SAFETY: fused_lib.cpp's launch state setters; every thread of a block is started below
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
    let mut x = Vec::new();
    for _ in 0..rows {
        let scale = 10f32.powf(3.0 * rng.uniform() - 1.5);
        x.extend(rng.normals(dim, scale, p));
    }
    let w: Vec<f32> = (0..dim)
        .map(|_| p.round(1.0 + 0.2 * rng.normal()))
        .collect();
    let dy = rng.normals(rows * dim, 1.0, p);
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
    let mut mask = vec![0f32; tq * tk];
    for i in 0..tq {
        let pos = (tk + i).saturating_sub(tq);
        for (j, m) in mask[i * tk..(i + 1) * tk].iter_mut().enumerate() {
            if j > pos || (tq >= 3 && i == tq / 2) {
                *m = f32::NEG_INFINITY;
            }
        }
    }
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
