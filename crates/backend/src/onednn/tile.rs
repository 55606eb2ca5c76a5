//! `C = A·Bᵀ` for small bf16 tiles through oneDNN from any thread, with no lock: the tiled
//! attention's score products (`S = Q·Kᵀ`, `dP = dO·Vᵀ`, 64 × 64 × `Dh`) on rayon's workers.
//!
//! The shared path (`OneDnn::exec`) runs one product at a time behind a mutex on one
//! stream, each with the process's OpenMP team: from a dozen rayon tasks at once that serializes
//! them and nests teams. Here each thread has its own stream and its own primitives, created on
//! that thread: Debian's oneDNN 2.6 is built with `DNNL_ENABLE_CONCURRENT_EXEC=OFF`, where the
//! library's scratchpad is shared and "primitives can be created and executed in parallel but
//! cannot migrate between threads" (oneDNN's `dnnl_scratchpad_mode_t` documentation) — a
//! primitive per thread keeps to that. Each such thread asks OpenMP for one thread
//! (`omp_set_num_threads(1)`: a per-thread setting in GNU OpenMP), since rayon already spreads
//! the tiles over the cores. The engine is shared (oneDNN's CPU engine is thread-safe).
//!
//! Measured per 64 × 64 tile product (2-core AMD EPYC, AVX-512 BF16, load 7; `OMP_WAIT_POLICY`
//! passive as `rtune` sets it): the gemm crate in f32 (the tiles converted) 27–57 µs, oneDNN
//! with one OpenMP thread 5–11 µs (Dh 64 and 128), with two 19–26 µs.
//!
//! A thread's stream and primitives live as long as the thread (rayon's workers: the process);
//! the primitives are destroyed when a thread ends, the stream is left to the process's end.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

use candle_core::Result;
use half::bf16;

use super::{get, Handle, Key, OneDnn, Primitive};
use super::{DT_F32, STREAM_DEFAULT, SUCCESS};

/// This thread's stream and primitives.
struct Local {
    lib: &'static OneDnn,
    stream: Handle,
    cache: HashMap<Key, Primitive>,
}

impl Drop for Local {
    fn drop(&mut self) {
        for p in self.cache.values() {
            // SAFETY: the primitive was created on this thread and is not executing.
            unsafe { (self.lib.api.primitive_destroy)(p.handle) };
        }
    }
}

thread_local! {
    static LOCAL: RefCell<Option<Local>> = const { RefCell::new(None) };
}

/// `omp_set_num_threads(1)` for the calling thread, when the GNU OpenMP runtime oneDNN loaded is
/// there (looked up without loading it: `RTLD_NOLOAD`); nothing otherwise.
fn one_omp_thread() {
    let name = c"libgomp.so.1";
    // SAFETY: dlopen with RTLD_NOLOAD only returns a handle to a library already loaded (never
    // closed here: it stays loaded for oneDNN); dlsym's result has the C signature
    // `void omp_set_num_threads(int)`.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if h.is_null() {
            return;
        }
        let f = libc::dlsym(h, c"omp_set_num_threads".as_ptr());
        if !f.is_null() {
            let f: unsafe extern "C" fn(std::ffi::c_int) = super::as_fn(f);
            f(1);
        }
    }
}

/// `c (m × n, row stride ldc) = a (m × k, row stride lda) · bᵀ`, `b (n × k, row stride ldb)`,
/// bf16 operands summed in f32 into f32 `c` (overwritten), on this thread. `None` when oneDNN is
/// not in use. An error is also reported once (the caller, the tiled attention, falls back).
pub fn gemm_nt(
    (a, lda): (&[bf16], usize),
    (b, ldb): (&[bf16], usize),
    (c, ldc): (&mut [f32], usize),
    (m, n, k): (usize, usize, usize),
) -> Option<Result<()>> {
    let lib = get().ok()?;
    if m == 0 || n == 0 {
        return Some(Ok(()));
    }
    // Rows `ld` apart holding `cols` elements each, the last one ending inside `len`.
    let covers = |len: usize, rows: usize, ld: usize, cols: usize| {
        cols <= ld && (rows - 1) * ld + cols <= len
    };
    if k == 0
        || !covers(a.len(), m, lda, k)
        || !covers(b.len(), n, ldb, k)
        || !covers(c.len(), m, ldc, n)
    {
        return Some(Err(candle_core::Error::Msg(format!(
            "onednn tile {m}×{k}·({n}×{k})ᵀ: out of its buffers (a {} at {lda}, b {} at {ldb}, \
             c {} at {ldc})",
            a.len(),
            b.len(),
            c.len()
        ))));
    }
    let key = Key {
        ad: vec![m as i64, k as i64],
        as_: vec![lda as i64, 1],
        bd: vec![k as i64, n as i64],
        bs: vec![1, ldb as i64],
        cs: vec![ldc as i64, 1],
        dst: DT_F32,
        packed: false,
        alpha: 1f32.to_bits(),
        sum: false,
    };
    let out = LOCAL.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.is_none() {
            one_omp_thread();
            let mut stream: Handle = std::ptr::null_mut();
            // SAFETY: an out-pointer to a handle; the engine lives as long as the process.
            let st = unsafe { (lib.api.stream_create)(&mut stream, lib.engine, STREAM_DEFAULT) };
            if st != SUCCESS {
                candle_core::bail!("onednn tile: stream_create returned status {st}");
            }
            *cell = Some(Local {
                lib,
                stream,
                cache: HashMap::new(),
            });
        }
        let local = cell.as_mut().expect("set above");
        if !local.cache.contains_key(&key) {
            let p = lib.create(&key)?;
            local.cache.insert(key.clone(), p);
        }
        let p = &local.cache[&key];
        run(lib, local.stream, p, a.as_ptr(), b.as_ptr(), c.as_mut_ptr())
    });
    if let Err(e) = &out {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| tracing::warn!("{e} (the caller falls back to its own product)"));
    }
    Some(out)
}

/// Executes `p` on `stream` over the three buffers and waits for it.
fn run(
    lib: &OneDnn,
    stream: Handle,
    p: &Primitive,
    a: *const bf16,
    b: *const bf16,
    c: *mut f32,
) -> Result<()> {
    // SAFETY: the caller's buffers, whose extents `gemm_nt` checked against the primitive's dims
    // and strides; oneDNN reads A and B and writes C's `m × n` elements, and the call is waited
    // for before the buffers' borrows end. The primitive and the stream are this thread's.
    let st = unsafe { lib.execute(stream, p, a.cast(), b as *mut c_void, c.cast()) };
    if st != SUCCESS {
        candle_core::bail!("onednn tile product: execute returned status {st}");
    }
    Ok(())
}
