//! bf16 matrix products on the CPU through oneDNN (Debian's `libdnnl2`, oneDNN 2.6, or a 3.x such as
//! PyPI's `onednn-cpu-gomp`; both C APIs, the version read with `dnnl_version` at load), loaded at
//! run time like the BLAS ([`crate::blas`]): no build-time dependency, and the library PyTorch runs
//! its CPU bf16 GEMMs through under `torch.autocast` (its AVX-512 BF16 `vdpbf16ps` and AMX kernels).
//!
//! The matmul primitive takes bf16 `A (…, M, K)` and `B (…, K, N)` in any strides (a transposed
//! weight is a stride, not a copy) and writes a packed `C (…, M, N)` in bf16 or f32, accumulating
//! in f32 (oneDNN's matmul accumulates bf16 products in f32 and rounds once into `C`) — the
//! semantics of `torch.matmul` on bf16 inputs and of candle's own bf16 matmul. Primitives are
//! created once per shape, strides and output dtype and cached.
//!
//! Used when the CPU has AVX-512 BF16 or AMX-BF16 ([`crate::cpu_features`]) and a oneDNN loads;
//! otherwise bf16 matmuls stay on candle's gemm, with one notice the first time one runs.
//! `RTUNE_ONEDNN`: unset → [`default_names`] (the system's `libdnnl.so.2`, then a wheel's
//! `libdnnl.so.3` in a Python environment's `lib/`, [`crate::dl`], then the system's
//! `libdnnl.so.3`); `off` → never; a path → that library; `force` → use it even without the bf16
//! instructions (oneDNN then converts to f32 itself). [`describe`] says which library and version
//! bf16 GEMMs take, for `rtune check` and run.json (`oneDNN (libdnnl.so.2, oneDNN 2.6.3)`).
//!
//! PyPI's `onednn` wheel (2026.x, oneDNN 3.13) is built for the SYCL CPU runtime: its CPU engine
//! needs a SYCL CPU device, which its dependencies do not provide (no OpenCL adapter), so
//! `dnnl_engine_create` fails and rtune falls back with that message; `onednn-cpu-gomp` (3.2, GNU
//! OpenMP, 182 MB installed against 2.7 GB) is the 3.x that runs here.
//!
//! [`acc`]: `C = alpha·A·B + C` into the caller's rows (output scale and sum post-op), the CPU
//! engine of the bf16 LoRA branch ([`crate::blas::acc`]).
//!
//! [`tile`]: small products from rayon's workers (the tiled attention's `S = Q·Kᵀ`), each thread
//! with its own stream and primitives, one OpenMP thread each.
//!
//! Frozen weights (`onednn/packed.rs`): a bf16 weight registered with [`pack`] at load is reordered once,
//! on its first product, into the blocked layout oneDNN's kernel asks for (weights memory of
//! `format_tag::any`), in each orientation it is used in (`x·Wᵀ` forward, `dy·W` backward); later
//! products read that copy instead of re-blocking the plain weight inside every call.
//!
//! The C API is declared in `onednn/api.rs` from `oneapi/dnnl/dnnl.h` of oneDNN 2.6 and 3.x (`Versioned` holds
//! the calls that differ): in 2.x the memory and matmul descriptors are structs the library fills
//! (696 and 2800 bytes there), held here in buffers with room to spare; in 3.x a memory
//! descriptor is a handle, kept in the same buffer's first 8 bytes; the enum values used are the
//! same in both headers (`dnnl_bf16 = 2`, `dnnl_f32 = 3`,
//! `dnnl_cpu = 1`, `DNNL_ARG_SRC = 1`, `DNNL_ARG_DST = 17`, `DNNL_ARG_WEIGHTS = 33`).
//!
//! The files: `api.rs` (the C API), `library.rs` (the library loaded: version, symbols, engine),
//! `primitive.rs` (a product's `Key`, its primitive made once and cached), `exec.rs` (a product
//! run on the caller's buffers), `packed.rs`, [`acc`], [`tile`] and `tests.rs`; this file decides
//! whether and which oneDNN serves ([`get`]) and offers [`matmul`].

mod api;
mod exec;
mod library;
mod primitive;

use api::{
    as_fn, Api, ExecArg, Handle, Md, ARG_DST, ARG_SRC, DT_BF16, DT_F32, MAX_NDIMS, MD_BYTES,
    STREAM_DEFAULT, SUCCESS,
};
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use library::load;
use primitive::{dims_strides, packed_strides, Key, Out, Primitive};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, Once, OnceLock};

pub mod acc;
mod packed;
pub mod tile;
pub use packed::{pack, packed_bytes, register, Packed};

/// What the lock guards: a stream runs one primitive at a time, and the caches are filled there.
struct State {
    stream: Handle,
    cache: HashMap<Key, Primitive>,
    frozen: packed::Registry,
}

/// The loaded library with its CPU engine, one stream and the primitive cache.
pub struct OneDnn {
    api: Api,
    engine: Handle,
    state: Mutex<State>,
    /// `libdnnl.so.2 (oneDNN 2.6.3)`.
    pub name: String,
}

// SAFETY: the engine is immutable after creation and oneDNN's CPU engine may be used from any
// thread; the stream and the primitives are only touched under `state`'s lock.
unsafe impl Send for OneDnn {}
// SAFETY: as for Send.
unsafe impl Sync for OneDnn {}

/// Why bf16 GEMMs do not go through oneDNN (the fallback's notice).
#[derive(Debug, Clone, PartialEq)]
pub enum Fallback {
    /// `RTUNE_ONEDNN=off`.
    Off,
    /// The CPU has neither AVX-512 BF16 nor AMX-BF16.
    NoBf16Instructions,
    /// The library did not load or a call failed; the message says which.
    Library(String),
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fallback::Off => write!(f, "RTUNE_ONEDNN=off"),
            Fallback::NoBf16Instructions => {
                write!(f, "the CPU has neither AVX-512 BF16 nor AMX-BF16")
            }
            Fallback::Library(m) => write!(f, "{m}"),
        }
    }
}

/// Products that read a packed frozen weight (tests check that the packed path ran).
static PACKED_RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

static ONEDNN: OnceLock<std::result::Result<OneDnn, Fallback>> = OnceLock::new();

/// Decides from `RTUNE_ONEDNN` and the CPU whether to load oneDNN, and which files to try:
/// a path the user names alone; otherwise [`default_names`] of the `libdnnl.so.3` files found in
/// the Python environments' `lib/` folders (`wheel_v3`, [`crate::dl::wheel_dirs`]).
pub fn choose(
    env: Option<&str>,
    bf16_cpu: bool,
    wheel_v3: &[String],
) -> std::result::Result<Vec<String>, Fallback> {
    match env.unwrap_or("") {
        "off" | "0" => Err(Fallback::Off),
        "force" => Ok(default_names(wheel_v3)),
        _ if !bf16_cpu => Err(Fallback::NoBf16Instructions),
        "" | "auto" => Ok(default_names(wheel_v3)),
        path => Ok(vec![path.to_string()]),
    }
}

/// The files tried when `RTUNE_ONEDNN` names none, first loaded wins: Debian 12's 2.6 from the
/// loader's path, then a 3.x from a wheel (`pip install onednn-cpu-gomp`), then a system 3.x. 2.6
/// comes first because 3.2 was not faster where it was measured (README, "Speed: BLAS and the
/// CUDA path": AMD EPYC, AVX-512 BF16, no AMX); name a 3.x in `RTUNE_ONEDNN` to use it.
pub fn default_names(wheel_v3: &[String]) -> Vec<String> {
    let mut names = vec!["libdnnl.so.2".to_string()];
    names.extend(wheel_v3.iter().cloned());
    names.extend(["libdnnl.so.3".to_string(), "libdnnl.so".to_string()]);
    names
}

/// The library for bf16 GEMMs, loaded once; `Err` says why not (see [`choose`]).
pub fn get() -> std::result::Result<&'static OneDnn, &'static Fallback> {
    ONEDNN
        .get_or_init(|| {
            let bf16_cpu = crate::cpu_features::get().bf16();
            let wheels = crate::dl::in_wheels("libdnnl.so.3");
            // A resumed run's recorded library unless the user names one ([`crate::pin`]).
            match crate::pin::onednn(std::env::var("RTUNE_ONEDNN").ok().as_deref()) {
                crate::pin::Choice::Default => load(&choose(None, bf16_cpu, &wheels)?),
                crate::pin::Choice::User(e) => load(&choose(Some(&e), bf16_cpu, &wheels)?),
                crate::pin::Choice::Recorded(r) => {
                    let names = choose(Some(&r), bf16_cpu, &wheels)?;
                    load(&names).or_else(|e| {
                        crate::pin::lose(format!(
                            "this resumed run recorded bf16 GEMMs through {r}, which does not \
                             load now ({e}); a fresh run's choice serves"
                        ));
                        load(&choose(None, bf16_cpu, &wheels)?)
                    })
                }
            }
        })
        .as_ref()
}

/// Lets oneDNN's OpenMP threads sleep as soon as a primitive ends (`OMP_WAIT_POLICY=passive`),
/// unless the environment has chosen (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` set). Debian's oneDNN
/// runs on GNU OpenMP, whose idle threads otherwise spin ~300 000 rounds after each GEMM: between
/// two GEMMs the step's other work (casts, norms, attention; rayon threads) then shares its cores
/// with spinning threads. Measured on 2 cores (bench-small, `--dtype bf16-autocast`, two
/// interleaved rounds, 2026-12-02): 823 / 752 tokens/s spinning, 979 / 954 passive.
///
/// Call early in `main`, before threads start (setting the environment is only sound while one
/// thread runs) and before oneDNN loads (libgomp reads it when it loads).
pub fn init_env() {
    let get = |k| std::env::var_os(k);
    if let Some(policy) = wait_policy(get("OMP_WAIT_POLICY"), get("GOMP_SPINCOUNT")) {
        // Sound only while one thread runs: the contract above.
        std::env::set_var("OMP_WAIT_POLICY", policy);
    }
}

/// The `OMP_WAIT_POLICY` [`init_env`] sets given the environment's `OMP_WAIT_POLICY` and
/// `GOMP_SPINCOUNT`: `passive` when neither is set, nothing (the user's choice) otherwise.
fn wait_policy(
    omp: Option<std::ffi::OsString>,
    spin: Option<std::ffi::OsString>,
) -> Option<&'static str> {
    (omp.is_none() && spin.is_none()).then_some("passive")
}

/// Which path bf16 GEMMs take: `oneDNN (libdnnl.so.2, oneDNN 2.6.3)` or `candle's gemm (...)`.
pub fn describe() -> String {
    match get() {
        Ok(d) => format!("oneDNN ({})", d.name),
        Err(why) => format!("candle's gemm ({why})"),
    }
}

/// Prints the fallback's one-line notice, once per process.
fn notice(why: &Fallback) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| tracing::info!("bf16 matmuls use candle's gemm, not oneDNN: {why}"));
}

/// The matmul as a candle op: bf16 operands, `dst` output.
struct Gemm {
    lib: &'static OneDnn,
    dst: DType,
}

impl CustomOp2 for Gemm {
    fn name(&self) -> &'static str {
        "onednn-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::BF16(a), CpuStorage::BF16(b)) = (s1, s2) else {
            candle_core::bail!("onednn-matmul: bf16 operands only");
        };
        let (a, b) = (&a[l1.start_offset()..], &b[l2.start_offset()..]);
        let (out, _) = self.lib.run(a, l1, b, l2, self.dst)?;
        let (da, db) = (l1.dims(), l2.dims());
        let r = da.len();
        let mut dims = da[..r - 1].to_vec();
        dims.push(db[r - 1]);
        Ok((out, Shape::from(dims)))
    }
}

/// Whether oneDNN takes these operands: CPU, bf16, same rank 2..=12, equal batch dims, inner
/// dims matching, every dim and stride nonzero-sized and positive.
fn takes(a: &Tensor, b: &Tensor) -> bool {
    let (da, db) = (a.dims(), b.dims());
    let r = da.len();
    a.device().is_cpu()
        && b.device().is_cpu()
        && a.dtype() == DType::BF16
        && b.dtype() == DType::BF16
        && (2..=MAX_NDIMS).contains(&r)
        && db.len() == r
        && da[..r - 2] == db[..r - 2]
        && da[r - 1] == db[r - 2]
        && da.iter().chain(db).all(|&d| d > 0)
        // No broadcast (stride 0) dims: oneDNN's plain formats want real strides.
        && [a, b].iter().all(|t| {
            t.dims()
                .iter()
                .zip(t.stride())
                .all(|(&d, &s)| s > 0 || d == 1)
        })
}

/// `a·b` for bf16 CPU tensors through oneDNN, in `dst` (`BF16` as `Tensor::matmul` returns, or
/// `F32`: the accumulator unrounded); `None` when oneDNN is not in use (the notice printed once)
/// or does not take the operands, so that the caller falls back.
pub fn matmul(a: &Tensor, b: &Tensor, dst: DType) -> Option<Result<Tensor>> {
    if !takes(a, b) {
        return None;
    }
    match get() {
        Ok(lib) => Some(a.apply_op2_no_bwd(b, &Gemm { lib, dst })),
        Err(why) => {
            notice(why);
            None
        }
    }
}

/// The implementation oneDNN picks for a `(m, k)·(k, n)` bf16 GEMM (`brg:avx512_core_bf16`, ...),
/// for reports; `None` without oneDNN.
pub fn implementation(m: usize, k: usize, n: usize) -> Option<String> {
    let lib = get().ok()?;
    let a = Layout::contiguous((m, k));
    let b = Layout::contiguous((k, n));
    let (ad, as_) = dims_strides(&a);
    let (bd, bs) = dims_strides(&b);
    let mut guard = lib.state.lock().ok()?;
    let key = Key {
        cs: packed_strides(&[ad[0], bd[1]]),
        ad,
        as_,
        bd,
        bs,
        dst: DT_BF16,
        packed: false,
        alpha: 1f32.to_bits(),
        sum: false,
    };
    let p = lib.primitive(&mut guard.cache, key).ok()?;
    Some(p.imp.clone())
}

#[cfg(test)]
mod tests;
