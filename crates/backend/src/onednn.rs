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
//! The C API is declared here from `oneapi/dnnl/dnnl.h` of oneDNN 2.6 and 3.x (`Versioned` holds
//! the calls that differ): in 2.x the memory and matmul descriptors are structs the library fills
//! (696 and 2800 bytes there), held here in buffers with room to spare; in 3.x a memory
//! descriptor is a handle, kept in the same buffer's first 8 bytes; the enum values used are the
//! same in both headers (`dnnl_bf16 = 2`, `dnnl_f32 = 3`,
//! `dnnl_cpu = 1`, `DNNL_ARG_SRC = 1`, `DNNL_ARG_DST = 17`, `DNNL_ARG_WEIGHTS = 33`).

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Mutex, Once, OnceLock};

pub mod acc;
mod packed;
pub mod tile;
pub use packed::{pack, packed_bytes, register, Packed};

type Status = c_int;
type Handle = *mut c_void;

const SUCCESS: Status = 0;
const DT_BF16: c_int = 2;
const DT_F32: c_int = 3;
const ENGINE_CPU: c_int = 1;
const STREAM_DEFAULT: u32 = 1;
const ARG_SRC: c_int = 1;
const ARG_DST: c_int = 17;
const ARG_WEIGHTS: c_int = 33;
const QUERY_IMPL_INFO_STR: c_int = 8;
/// `dnnl_query_weights_md` (`dnnl_query_some_md = 128`, then src, diff_src, weights).
const QUERY_WEIGHTS_MD: c_int = 131;
/// `dnnl_format_tag_any`: the primitive picks the layout.
const FORMAT_TAG_ANY: c_int = 1;
/// `sizeof(dnnl_memory_desc_t)` in oneDNN 2.x: what a queried descriptor is copied as.
const MD_BYTES: usize = 696;
/// `DNNL_MAX_NDIMS`.
const MAX_NDIMS: usize = 12;

/// Room for a `dnnl_memory_desc_t` (696 bytes in 2.6) and a `dnnl_matmul_desc_t` (2800), 8-aligned.
#[repr(C, align(8))]
struct Md([u8; 1024]);
#[repr(C, align(8))]
struct MatmulDesc([u8; 4096]);

#[repr(C)]
struct ExecArg {
    arg: c_int,
    memory: Handle,
}

#[repr(C)]
struct Version {
    major: c_int,
    minor: c_int,
    patch: c_int,
    hash: *const c_char,
}

/// The entry points rtune calls, from `dnnl.h`.
struct Api {
    engine_create: unsafe extern "C" fn(*mut Handle, c_int, usize) -> Status,
    stream_create: unsafe extern "C" fn(*mut Handle, Handle, u32) -> Status,
    stream_wait: unsafe extern "C" fn(Handle) -> Status,
    /// 2.x `dnnl_memory_desc_init_by_strides` fills the struct in `Md`; 3.x
    /// `dnnl_memory_desc_create_with_strides` writes a descriptor handle into its first 8 bytes.
    md_init_by_strides:
        unsafe extern "C" fn(*mut Md, c_int, *const i64, c_int, *const i64) -> Status,
    /// The version-specific calls: the matmul's creation, its output scale and sum post-op.
    v: Versioned,
    pd_query: unsafe extern "C" fn(Handle, c_int, c_int, *mut c_void) -> Status,
    pd_destroy: unsafe extern "C" fn(Handle) -> Status,
    primitive_create: unsafe extern "C" fn(*mut Handle, Handle) -> Status,
    primitive_execute: unsafe extern "C" fn(Handle, Handle, c_int, *const ExecArg) -> Status,
    memory_create: unsafe extern "C" fn(*mut Handle, MdRef, Handle, *mut c_void) -> Status,
    memory_destroy: unsafe extern "C" fn(Handle) -> Status,
    md_init_by_tag: unsafe extern "C" fn(*mut Md, c_int, *const i64, c_int, c_int) -> Status,
    /// 2.x: a pointer to the struct inside the primitive descriptor; 3.x: a handle it owns.
    pd_query_md: unsafe extern "C" fn(Handle, c_int, c_int) -> MdRef,
    reorder_pd_create:
        unsafe extern "C" fn(*mut Handle, MdRef, Handle, MdRef, Handle, Handle) -> Status,
    md_get_size: unsafe extern "C" fn(MdRef) -> usize,
    md_equal: unsafe extern "C" fn(MdRef, MdRef) -> c_int,
    primitive_destroy: unsafe extern "C" fn(Handle) -> Status,
    attr_create: unsafe extern "C" fn(*mut Handle) -> Status,
    attr_destroy: unsafe extern "C" fn(Handle) -> Status,
    attr_set_post_ops: unsafe extern "C" fn(Handle, Handle) -> Status,
    post_ops_create: unsafe extern "C" fn(*mut Handle) -> Status,
    post_ops_destroy: unsafe extern "C" fn(Handle) -> Status,
}

/// A memory descriptor as the C API takes it: 2.x `const dnnl_memory_desc_t *` (the struct's
/// address), 3.x `const_dnnl_memory_desc_t` (the handle). [`OneDnn::md`] makes one from an [`Md`].
type MdRef = *const c_void;

/// The calls whose form changed between oneDNN 2.x and 3.x.
enum Versioned {
    V2 {
        matmul_desc_init:
            unsafe extern "C" fn(*mut MatmulDesc, MdRef, MdRef, MdRef, MdRef) -> Status,
        pd_create:
            unsafe extern "C" fn(*mut Handle, *const MatmulDesc, Handle, Handle, Handle) -> Status,
        /// `(attr, count, mask, scales)`: output scales (`dst = scale·Σ` before post-ops).
        attr_set_output_scales: unsafe extern "C" fn(Handle, i64, c_int, *const f32) -> Status,
        /// `(post_ops, scale)`: `dst = … + scale·dst_before`.
        post_ops_append_sum: unsafe extern "C" fn(Handle, f32) -> Status,
    },
    V3 {
        /// `(pd, engine, src, weights, bias, dst, attr)`.
        matmul_pd_create:
            unsafe extern "C" fn(*mut Handle, Handle, MdRef, MdRef, MdRef, MdRef, Handle) -> Status,
        /// `(out, md)`: a copy the caller owns of a descriptor the primitive descriptor owns.
        md_clone: unsafe extern "C" fn(*mut Md, MdRef) -> Status,
        /// `(post_ops, alg, alpha, beta)`: output scales are gone in 3.x; `alpha·Σ` is the
        /// eltwise `linear` post-op (`alpha·x + beta`), applied to the f32 sum before the next.
        post_ops_append_eltwise: unsafe extern "C" fn(Handle, c_int, f32, f32) -> Status,
        /// `(post_ops, scale, zero_point, data_type)`: `dst = … + scale·dst_before`.
        post_ops_append_sum: unsafe extern "C" fn(Handle, f32, i32, c_int) -> Status,
    },
}

/// `dnnl_eltwise_linear` in oneDNN 3.x's `dnnl_alg_kind_t` (relu = 0x20, ..., sqrt = 0x25, linear).
const ELTWISE_LINEAR_V3: c_int = 0x26;

/// A cached primitive: what it multiplies and the implementation oneDNN chose for it.
struct Primitive {
    handle: Handle,
    src: Md,
    weights: Md,
    dst: Md,
    /// oneDNN's implementation name (`brg:avx512_core_bf16`, ...).
    imp: String,
}

/// A primitive's operands: dims and strides of `A`, `B`, the output's strides and dtype, whether
/// `B` is a packed frozen weight (its layout then the primitive's choice, `format_tag::any`), and
/// the output's attributes: the scale `alpha` (its f32 bits) and whether the product is added
/// into what the output holds (`C = alpha·A·B + C`, oneDNN's sum post-op: `beta = 1`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    ad: Vec<i64>,
    as_: Vec<i64>,
    bd: Vec<i64>,
    bs: Vec<i64>,
    cs: Vec<i64>,
    dst: c_int,
    packed: bool,
    alpha: u32,
    sum: bool,
}

/// Where a product's output goes: a new packed buffer, or the caller's rows at `cs` strides,
/// scaled by `alpha` and, when `sum`, added into what they hold.
struct Out {
    ptr: *mut c_void,
    cs: Vec<i64>,
    alpha: f32,
    sum: bool,
}

/// The packed row-major strides of `dims`.
fn packed_strides(dims: &[i64]) -> Vec<i64> {
    let mut cs = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        cs[i] = cs[i + 1] * dims[i + 1];
    }
    cs
}

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
            let f = crate::cpu_features::get();
            let bf16_cpu = f.avx512_bf16 || f.amx_bf16;
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

/// A looked-up symbol as the function pointer type `F`.
///
/// # Safety
/// `F` must be a function pointer type whose signature is the symbol's.
unsafe fn as_fn<F: Copy>(p: *mut c_void) -> F {
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `F` is a function pointer (the caller's contract): the same size as `p`.
    unsafe { std::mem::transmute_copy(&p) }
}

fn load(names: &[String]) -> std::result::Result<OneDnn, Fallback> {
    let mut tried = Vec::new();
    for name in names {
        // The handle is never closed, so the symbols stay valid for the life of the process.
        let h = match crate::dl::open(name) {
            Ok(h) => h,
            Err(e) => {
                tried.push(e);
                continue;
            }
        };
        match load_one(name, h) {
            Ok(lib) => return Ok(lib),
            Err(e) => tried.push(e.to_string()),
        }
    }
    Err(Fallback::Library(format!(
        "no oneDNN loaded ({}); Debian: apt install libdnnl2, or pip install onednn-cpu-gomp",
        tried.join("; ")
    )))
}

/// The library `name` opened at `h`: its version read, its symbols looked up for that version,
/// a CPU engine and stream made.
fn load_one(name: &str, h: *mut c_void) -> std::result::Result<OneDnn, Fallback> {
    let sym = |s: &str| -> std::result::Result<*mut c_void, Fallback> {
        let cs = CString::new(s).expect("symbol names have no NUL");
        // SAFETY: a valid handle and C string.
        let p = unsafe { libc::dlsym(h, cs.as_ptr()) };
        if p.is_null() {
            Err(Fallback::Library(format!("{name} has no {s}")))
        } else {
            Ok(p)
        }
    };
    // SAFETY: `dnnl_version` is `const dnnl_version_t *(void)` in every version, and returns
    // a pointer to a static struct.
    let v = unsafe {
        let version: unsafe extern "C" fn() -> *const Version = as_fn(sym("dnnl_version")?);
        &*version()
    };
    let v3 = match v.major {
        2 => false,
        3 => true,
        _ => {
            return Err(Fallback::Library(format!(
                "{name} is oneDNN {}.{}; rtune speaks the 2.x and 3.x C APIs",
                v.major, v.minor
            )))
        }
    };
    // The descriptor calls that were renamed in 3.x keep their argument order (the out
    // pointer is `Md`'s first 8 bytes there: see `Api::md_init_by_strides`).
    let (by_strides, by_tag) = if v3 {
        (
            "dnnl_memory_desc_create_with_strides",
            "dnnl_memory_desc_create_with_tag",
        )
    } else {
        (
            "dnnl_memory_desc_init_by_strides",
            "dnnl_memory_desc_init_by_tag",
        )
    };
    // SAFETY: each symbol has the C signature declared in `Api` / `Versioned` for the major
    // version just read (oneDNN 2.6's and 3.x's dnnl.h).
    let api = unsafe {
        let v = if v3 {
            Versioned::V3 {
                matmul_pd_create: as_fn(sym("dnnl_matmul_primitive_desc_create")?),
                md_clone: as_fn(sym("dnnl_memory_desc_clone")?),
                post_ops_append_eltwise: as_fn(sym("dnnl_post_ops_append_eltwise")?),
                post_ops_append_sum: as_fn(sym("dnnl_post_ops_append_sum")?),
            }
        } else {
            Versioned::V2 {
                matmul_desc_init: as_fn(sym("dnnl_matmul_desc_init")?),
                pd_create: as_fn(sym("dnnl_primitive_desc_create")?),
                attr_set_output_scales: as_fn(sym("dnnl_primitive_attr_set_output_scales")?),
                post_ops_append_sum: as_fn(sym("dnnl_post_ops_append_sum")?),
            }
        };
        Api {
            engine_create: as_fn(sym("dnnl_engine_create")?),
            stream_create: as_fn(sym("dnnl_stream_create")?),
            stream_wait: as_fn(sym("dnnl_stream_wait")?),
            md_init_by_strides: as_fn(sym(by_strides)?),
            v,
            pd_query: as_fn(sym("dnnl_primitive_desc_query")?),
            pd_destroy: as_fn(sym("dnnl_primitive_desc_destroy")?),
            primitive_create: as_fn(sym("dnnl_primitive_create")?),
            primitive_execute: as_fn(sym("dnnl_primitive_execute")?),
            memory_create: as_fn(sym("dnnl_memory_create")?),
            memory_destroy: as_fn(sym("dnnl_memory_destroy")?),
            md_init_by_tag: as_fn(sym(by_tag)?),
            pd_query_md: as_fn(sym("dnnl_primitive_desc_query_md")?),
            reorder_pd_create: as_fn(sym("dnnl_reorder_primitive_desc_create")?),
            md_get_size: as_fn(sym("dnnl_memory_desc_get_size")?),
            md_equal: as_fn(sym("dnnl_memory_desc_equal")?),
            primitive_destroy: as_fn(sym("dnnl_primitive_destroy")?),
            attr_create: as_fn(sym("dnnl_primitive_attr_create")?),
            attr_destroy: as_fn(sym("dnnl_primitive_attr_destroy")?),
            attr_set_post_ops: as_fn(sym("dnnl_primitive_attr_set_post_ops")?),
            post_ops_create: as_fn(sym("dnnl_post_ops_create")?),
            post_ops_destroy: as_fn(sym("dnnl_post_ops_destroy")?),
        }
    };
    let (mut engine, mut stream) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out-pointers to handles; the engine outlives the stream (neither is destroyed).
    let ok = unsafe {
        (api.engine_create)(&mut engine, ENGINE_CPU, 0) == SUCCESS
            && (api.stream_create)(&mut stream, engine, STREAM_DEFAULT) == SUCCESS
    };
    if !ok {
        return Err(Fallback::Library(format!(
            "{name}: cannot create a CPU engine (a SYCL build such as PyPI's `onednn` wheel \
             finds no SYCL CPU device here; `onednn-cpu-gomp` is the OpenMP build)"
        )));
    }
    Ok(OneDnn {
        name: format!("{name}, oneDNN {}.{}.{}", v.major, v.minor, v.patch),
        api,
        engine,
        state: Mutex::new(State {
            stream,
            cache: HashMap::new(),
            frozen: packed::Registry::default(),
        }),
    })
}

/// The `(dims, strides)` of a layout's matrices, batch dims first, at most [`MAX_NDIMS`].
fn dims_strides(l: &Layout) -> (Vec<i64>, Vec<i64>) {
    (
        l.dims().iter().map(|&d| d as i64).collect(),
        l.stride().iter().map(|&s| s as i64).collect(),
    )
}

impl OneDnn {
    /// `md` as the C API takes it: 2.x the struct's address, 3.x the handle stored in its first
    /// 8 bytes (see `Api::md_init_by_strides`).
    fn md(&self, md: &Md) -> MdRef {
        match self.api.v {
            Versioned::V2 { .. } => (md as *const Md).cast(),
            Versioned::V3 { .. } => {
                let mut p = [0u8; 8];
                p.copy_from_slice(&md.0[..8]);
                usize::from_ne_bytes(p) as MdRef
            }
        }
    }

    /// The major version loaded: 2 or 3.
    pub fn major(&self) -> u32 {
        match self.api.v {
            Versioned::V2 { .. } => 2,
            Versioned::V3 { .. } => 3,
        }
    }

    /// The cached primitive for these operands, made on first use.
    fn primitive<'a>(
        &self,
        cache: &'a mut HashMap<Key, Primitive>,
        key: Key,
    ) -> Result<&'a Primitive> {
        if !cache.contains_key(&key) {
            let p = self.create(&key)?;
            cache.insert(key.clone(), p);
        }
        Ok(&cache[&key])
    }

    fn create(&self, key: &Key) -> Result<Primitive> {
        let Key {
            ad,
            as_,
            bd,
            bs,
            cs,
            dst,
            packed,
            alpha,
            sum,
        } = key;
        let api = &self.api;
        let r = ad.len();
        let mut cd: Vec<i64> = ad[..r - 2].to_vec();
        cd.extend([ad[r - 2], bd[r - 1]]);
        let fail = |what: &str, st: Status| {
            candle_core::Error::Msg(format!(
                "onednn matmul {ad:?}·{bd:?}: {what} returned status {st}"
            ))
        };
        let (mut src, mut weights, mut out) = (Md([0; 1024]), Md([0; 1024]), Md([0; 1024]));
        let mut desc = MatmulDesc([0; 4096]);
        let mut pd: Handle = std::ptr::null_mut();
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: the descriptors are buffers larger than oneDNN 2.x's structs, the dims and
        // strides arrays hold `r ≤ MAX_NDIMS` entries, and the handles are out-pointers.
        unsafe {
            let r = r as c_int;
            let st = (api.md_init_by_strides)(&mut src, r, ad.as_ptr(), DT_BF16, as_.as_ptr());
            if st != SUCCESS {
                return Err(fail("memory_desc_init (A)", st));
            }
            let st = if *packed {
                (api.md_init_by_tag)(&mut weights, r, bd.as_ptr(), DT_BF16, FORMAT_TAG_ANY)
            } else {
                (api.md_init_by_strides)(&mut weights, r, bd.as_ptr(), DT_BF16, bs.as_ptr())
            };
            if st != SUCCESS {
                return Err(fail("memory_desc_init (B)", st));
            }
            let st = (api.md_init_by_strides)(&mut out, r, cd.as_ptr(), *dst, cs.as_ptr());
            if st != SUCCESS {
                return Err(fail("memory_desc_init (C)", st));
            }
            let null = std::ptr::null_mut();
            let (s, w, o) = (self.md(&src), self.md(&weights), self.md(&out));
            let attr = self
                .attr(f32::from_bits(*alpha), *sum)
                .map_err(|st| fail("attr", st))?;
            let st = match &api.v {
                Versioned::V2 {
                    matmul_desc_init,
                    pd_create,
                    ..
                } => {
                    let st = matmul_desc_init(&mut desc, s, w, std::ptr::null(), o);
                    if st == SUCCESS {
                        pd_create(&mut pd, &desc, attr, self.engine, null)
                    } else {
                        st
                    }
                }
                Versioned::V3 {
                    matmul_pd_create, ..
                } => matmul_pd_create(&mut pd, self.engine, s, w, std::ptr::null(), o, attr),
            };
            if !attr.is_null() {
                (api.attr_destroy)(attr);
            }
            if st != SUCCESS {
                return Err(fail("primitive_desc_create", st));
            }
            let mut info: *const c_char = std::ptr::null();
            let imp = if (api.pd_query)(pd, QUERY_IMPL_INFO_STR, 0, &mut info as *mut _ as _)
                == SUCCESS
                && !info.is_null()
            {
                std::ffi::CStr::from_ptr(info)
                    .to_string_lossy()
                    .into_owned()
            } else {
                String::new()
            };
            if *packed {
                // The layout the implementation chose for `B`: what the packed copy is made in.
                let md = (api.pd_query_md)(pd, QUERY_WEIGHTS_MD, 0);
                if md.is_null() {
                    (api.pd_destroy)(pd);
                    return Err(fail("query weights_md", -1));
                }
                match &api.v {
                    Versioned::V2 { .. } => std::ptr::copy_nonoverlapping(
                        md.cast::<u8>(),
                        weights.0.as_mut_ptr(),
                        MD_BYTES,
                    ),
                    Versioned::V3 { md_clone, .. } => {
                        // The `format_tag::any` descriptor is replaced by the chosen layout's;
                        // the handle is the primitive's for the life of the process.
                        let st = md_clone(&mut weights, md);
                        if st != SUCCESS {
                            (api.pd_destroy)(pd);
                            return Err(fail("memory_desc_clone (weights)", st));
                        }
                    }
                }
            }
            let st = (api.primitive_create)(&mut handle, pd);
            (api.pd_destroy)(pd);
            if st != SUCCESS {
                return Err(fail("primitive_create", st));
            }
            Ok(Primitive {
                handle,
                src,
                weights,
                dst: out,
                imp,
            })
        }
    }

    /// The attributes of an output scaled by `alpha` and summed into (`sum`): null (none) for a
    /// plain product; the caller destroys it. `Err` is the failing call's status.
    ///
    /// # Safety
    /// Calls into the loaded library; the returned handle is the caller's to destroy.
    unsafe fn attr(&self, alpha: f32, sum: bool) -> std::result::Result<Handle, Status> {
        if alpha == 1.0 && !sum {
            return Ok(std::ptr::null_mut());
        }
        let api = &self.api;
        let mut attr: Handle = std::ptr::null_mut();
        // SAFETY: out-pointers to handles; the post-ops are copied into the attributes, then
        // destroyed; the scale is read during the call.
        unsafe {
            let st = (api.attr_create)(&mut attr);
            if st != SUCCESS {
                return Err(st);
            }
            let mut ops: Handle = std::ptr::null_mut();
            let mut st = (api.post_ops_create)(&mut ops);
            // 2.x: the scale is the output scale, ahead of every post-op; 3.x: the first
            // post-op, `linear` with `alpha`, ahead of the sum (the same f32 `alpha·Σ + C`).
            if st == SUCCESS {
                st = match &api.v {
                    Versioned::V2 {
                        attr_set_output_scales,
                        post_ops_append_sum,
                        ..
                    } => {
                        let mut st = SUCCESS;
                        if alpha != 1.0 {
                            st = attr_set_output_scales(attr, 1, 0, &alpha);
                        }
                        if st == SUCCESS && sum {
                            st = post_ops_append_sum(ops, 1.0);
                        }
                        st
                    }
                    Versioned::V3 {
                        post_ops_append_eltwise,
                        post_ops_append_sum,
                        ..
                    } => {
                        let mut st = SUCCESS;
                        if alpha != 1.0 {
                            st = post_ops_append_eltwise(ops, ELTWISE_LINEAR_V3, alpha, 0.0);
                        }
                        if st == SUCCESS && sum {
                            st = post_ops_append_sum(ops, 1.0, 0, 0);
                        }
                        st
                    }
                };
                if st == SUCCESS {
                    st = (api.attr_set_post_ops)(attr, ops);
                }
                (api.post_ops_destroy)(ops);
            }
            if st != SUCCESS {
                (api.attr_destroy)(attr);
                return Err(st);
            }
        }
        Ok(attr)
    }

    /// `C = A·B` for bf16 slices laid out as `la`, `lb` (offsets applied by the caller), into a
    /// new packed output of `dst` dtype (`BF16` or `F32`). Returns the output and the
    /// implementation oneDNN chose.
    fn run(
        &self,
        a: &[bf16],
        la: &Layout,
        b: &[bf16],
        lb: &Layout,
        dst: DType,
    ) -> Result<(CpuStorage, String)> {
        let r = la.dims().len();
        let elems: usize = la.dims()[..r - 1].iter().product::<usize>() * lb.dims()[r - 1];
        let mut out_f32: Vec<f32> = Vec::new();
        let mut out_bf16: Vec<bf16> = Vec::new();
        let ptr: *mut c_void = if dst == DType::F32 {
            out_f32.reserve_exact(elems);
            out_f32.as_mut_ptr().cast()
        } else {
            out_bf16.reserve_exact(elems);
            out_bf16.as_mut_ptr().cast()
        };
        let mut cd: Vec<i64> = la.dims()[..r - 1].iter().map(|&d| d as i64).collect();
        cd.push(lb.dims()[r - 1] as i64);
        let out = Out {
            ptr,
            cs: packed_strides(&cd),
            alpha: 1.0,
            sum: false,
        };
        let imp = self.exec(a, la, b, lb, dst, out)?;
        // SAFETY: `exec` returned Ok: oneDNN wrote every element of the packed output.
        unsafe {
            if dst == DType::F32 {
                out_f32.set_len(elems);
            } else {
                out_bf16.set_len(elems);
            }
        }
        Ok(if dst == DType::F32 {
            (CpuStorage::F32(out_f32), imp)
        } else {
            (CpuStorage::BF16(out_bf16), imp)
        })
    }

    /// Runs the matmul `p` on `stream` over `src`, `weights` and `dst` wrapped as memory objects of
    /// its descriptors, and waits for it; the status (`SUCCESS`, or the first failure).
    ///
    /// # Safety
    /// Each pointer holds its descriptor's every element for the life of the call (oneDNN reads
    /// `src` and `weights`, writes `dst` and, with a sum post-op, reads it first); `p` and `stream`
    /// are usable from the calling thread.
    unsafe fn execute(
        &self,
        stream: Handle,
        p: &Primitive,
        src: *const c_void,
        weights: *mut c_void,
        dst: *mut c_void,
    ) -> Status {
        let api = &self.api;
        let mut mems: [Handle; 3] = [std::ptr::null_mut(); 3];
        // SAFETY: the function's contract (every pointer covers its descriptor for the call, and
        // the call is waited for); each memory object made here is destroyed here, made or not.
        unsafe {
            let wrap = |m: &mut Handle, md: &Md, ptr: *mut c_void| {
                (api.memory_create)(m, self.md(md), self.engine, ptr)
            };
            let [ma, mb, mc] = &mut mems;
            let created = wrap(ma, &p.src, src.cast_mut()) == SUCCESS
                && wrap(mb, &p.weights, weights) == SUCCESS
                && wrap(mc, &p.dst, dst) == SUCCESS;
            let st = if created {
                let args = [
                    (ARG_SRC, mems[0]),
                    (ARG_WEIGHTS, mems[1]),
                    (ARG_DST, mems[2]),
                ]
                .map(|(arg, memory)| ExecArg { arg, memory });
                match (api.primitive_execute)(p.handle, stream, 3, args.as_ptr()) {
                    SUCCESS => (api.stream_wait)(stream),
                    e => e,
                }
            } else {
                -1
            };
            for m in mems {
                if !m.is_null() {
                    (api.memory_destroy)(m);
                }
            }
            st
        }
    }

    /// `C = alpha·A·B (+ C when out.sum)` into `out`, for bf16 slices laid out as `la`, `lb`;
    /// `dst` is C's dtype. Returns the implementation oneDNN chose.
    ///
    /// The caller guarantees that `out.ptr` holds C's every element at `out.cs` strides (and, when
    /// summed into, initialized ones) for the life of the call.
    fn exec(
        &self,
        a: &[bf16],
        la: &Layout,
        b: &[bf16],
        lb: &Layout,
        dst: DType,
        out: Out,
    ) -> Result<String> {
        let (ad, as_) = dims_strides(la);
        let (bd, bs) = dims_strides(lb);
        let r = ad.len();
        let dt = if dst == DType::F32 { DT_F32 } else { DT_BF16 };
        let mut guard = self.state.lock().expect("onednn lock");
        let State {
            stream,
            cache,
            frozen,
        } = &mut *guard;
        // A registered frozen weight: its packed copy, made on this first product, when the
        // primitive for these operands takes the layout it was made in; the plain path otherwise.
        let mut b_ptr = b.as_ptr() as *mut c_void;
        let mut key = Key {
            ad,
            as_,
            bd,
            bs,
            cs: out.cs,
            dst: dt,
            packed: false,
            alpha: out.alpha.to_bits(),
            sum: out.sum,
        };
        if frozen.holds(b, lb) {
            let pk = Key {
                packed: true,
                ..key.clone()
            };
            let p = self.primitive(cache, pk.clone())?;
            if let Some(ptr) = frozen.packed(self, *stream, b, lb, &p.weights)? {
                b_ptr = ptr;
                key = pk;
                PACKED_RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let packed = key.packed;
        let p = self.primitive(cache, key)?;
        crate::served::record(
            || {
                let b = if packed { ", packed B" } else { "" };
                format!("oneDNN ({}{b})", p.imp)
            },
            la.dims()[..r - 2].iter().product(),
            la.dims()[r - 2],
            la.dims()[r - 1],
            lb.dims()[r - 1],
        );
        // SAFETY: A and C are the caller's buffers, which the layouts describe and which outlive
        // the call (`exec`'s contract: C's every element at its strides); B is the caller's or a
        // packed copy in the primitive's layout, held by the registry under the lock held here.
        let st = unsafe { self.execute(*stream, p, a.as_ptr().cast(), b_ptr, out.ptr) };
        if st != SUCCESS {
            candle_core::bail!(
                "onednn matmul {:?}·{:?}: execute returned status {st}",
                la.dims(),
                lb.dims()
            );
        }
        Ok(p.imp.clone())
    }
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
