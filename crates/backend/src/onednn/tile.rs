//! `C = A·Bᵀ` and `C += A·B` for small bf16 tiles through oneDNN from any thread, with no lock:
//! the tiled attention's tile products (`S = Q·Kᵀ`, `dP = dO·Vᵀ`, 64 × 64 × `Dh`; `acc += P·V`,
//! `dQ += dS·K`, `dK += dSᵀ·Q`, `dV += Pᵀ·dO`) on rayon's workers.
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
    product((a, lda), (b, [1, ldb]), (c, ldc), (m, n, k), false)
}

/// `c (m × n, row stride ldc) += a (m × k, row stride lda) · b`, `b (k × n, row stride ldb)`:
/// bf16 operands summed in f32 and added into f32 `c` (oneDNN's sum post-op, `beta = 1`), on
/// this thread — the tiled attention's `acc += P·V` and its backward's `dQ += dS·K`,
/// `dK += dSᵀ·Q`, `dV += Pᵀ·dO` (the transposed operands copied by the caller, so every `a` is
/// row-major). `None` and errors as [`gemm_nt`].
pub fn gemm_nn_acc(
    (a, lda): (&[bf16], usize),
    (b, ldb): (&[bf16], usize),
    (c, ldc): (&mut [f32], usize),
    (m, n, k): (usize, usize, usize),
) -> Option<Result<()>> {
    product((a, lda), (b, [ldb, 1]), (c, ldc), (m, n, k), true)
}

/// `c (m × n, row stride ldc) [+]= a (m × k, row stride lda) · b`, `b (k × n)` at strides
/// `bs` (`[row, column]`: `[ldb, 1]` row-major, `[1, ldb]` the transpose of an `n × k` matrix),
/// added into `c` when `sum`.
fn product(
    (a, lda): (&[bf16], usize),
    (b, bs): (&[bf16], [usize; 2]),
    (c, ldc): (&mut [f32], usize),
    (m, n, k): (usize, usize, usize),
    sum: bool,
) -> Option<Result<()>> {
    let lib = get().ok()?;
    if m == 0 || n == 0 {
        return Some(Ok(()));
    }
    // A `rows × cols` view at strides `[rs, cs]` (one of them 1) lies inside `len` elements
    // (its last element is the farthest), its lines (rows, or columns of a transpose) no longer
    // than their stride.
    let covers = |len: usize, (rows, cols): (usize, usize), [rs, cs]: [usize; 2]| {
        let (line, ld) = if cs == 1 { (cols, rs) } else { (rows, cs) };
        line <= ld && (rows - 1) * rs + (cols - 1) * cs < len
    };
    if k == 0
        || !covers(a.len(), (m, k), [lda, 1])
        || !covers(b.len(), (k, n), bs)
        || !covers(c.len(), (m, n), [ldc, 1])
    {
        return Some(Err(candle_core::Error::Msg(format!(
            "onednn tile {m}×{k}·{k}×{n}: out of its buffers (a {} at {lda}, b {} at {bs:?}, \
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
        bs: vec![bs[0] as i64, bs[1] as i64],
        cs: vec![ldc as i64, 1],
        dst: DT_F32,
        packed: false,
        alpha: 1f32.to_bits(),
        sum,
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
    // SAFETY: the caller's buffers, whose extents `product` checked against the primitive's dims
    // and strides; oneDNN reads A and B and writes C's `m × n` elements, and the call is waited
    // for before the buffers' borrows end. The primitive and the stream are this thread's.
    let st = unsafe { lib.execute(stream, p, a.cast(), b as *mut c_void, c.cast()) };
    if st != SUCCESS {
        candle_core::bail!("onednn tile product: execute returned status {st}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) rounded to bf16 (a small LCG: no RNG crate needed).
    fn values(n: usize, seed: u64) -> Vec<bf16> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
            })
            .collect()
    }

    /// `gemm_nn_acc` against the plain loop in f64 (bf16 products are exact; oneDNN sums them
    /// in f32, in any order): each entry of `c + a·b` within the bound of a sum of `k + 1` terms
    /// in f32, `(k + 1)·2⁻²⁴·(|c| + Σ|a·b|)`, on full 64-wide tiles and on tails, with row strides
    /// wider than the rows (`V` read in place from `(T, Dh)` rows, `dO` from `(T, H·Dh)` ones, `c`
    /// a tile of `BC` columns). And `gemm_nt` against its loop, within the same bound.
    #[test]
    fn tile_products_are_the_plain_sums() {
        if get().is_err() {
            eprintln!("oneDNN is not in use here: nothing to compare");
            assert!(gemm_nn_acc((&[], 1), (&[], 1), (&mut [], 1), (1, 1, 1)).is_none());
            return;
        }
        for (m, n, k, lda, ldb, ldc) in [(64, 64, 64, 64, 64, 64), (37, 64, 50, 64, 192, 80)] {
            let a = values((m - 1) * lda + k, 1);
            let b = values((k - 1) * ldb + n, 2);
            let c0: Vec<f32> = values((m - 1) * ldc + n, 3)
                .iter()
                .map(|x| x.to_f32())
                .collect();
            let mut c = c0.clone();
            gemm_nn_acc((&a, lda), (&b, ldb), (&mut c, ldc), (m, n, k))
                .expect("oneDNN in use")
                .unwrap();
            let eps = (k + 1) as f64 * 2f64.powi(-24);
            let mut worst = 0f64; // the largest error as a share of its bound
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|t| a[i * lda + t].to_f64() * b[t * ldb + j].to_f64());
                    let c0 = c0[i * ldc + j] as f64;
                    let want = c0 + terms.clone().sum::<f64>();
                    let bound = eps * (c0.abs() + terms.map(f64::abs).sum::<f64>());
                    worst = worst.max((c[i * ldc + j] as f64 - want).abs() / bound);
                }
            }
            assert!(worst <= 1.0, "{m}×{k}·{k}×{n} += : {worst} of the bound");
            // gemm_nt: c = a·bᵀ with b (n × k) rows `ldb` apart, overwritten.
            let bt = values((n - 1) * ldb + k, 4);
            gemm_nt((&a, lda), (&bt, ldb), (&mut c, ldc), (m, n, k))
                .expect("oneDNN in use")
                .unwrap();
            let mut worst = 0f64;
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|t| a[i * lda + t].to_f64() * bt[j * ldb + t].to_f64());
                    let want: f64 = terms.clone().sum();
                    let bound = eps * terms.map(f64::abs).sum::<f64>();
                    worst = worst.max((c[i * ldc + j] as f64 - want).abs() / bound);
                }
            }
            assert!(worst <= 1.0, "{m}×{k}·({n}×{k})ᵀ: {worst} of the bound");
        }
        // Out of its buffers: an error, nothing read or written.
        let a = values(10, 5);
        let e = gemm_nn_acc((&a, 4), (&a, 4), (&mut [0f32; 4], 4), (4, 4, 4)).unwrap();
        assert!(e.is_err());
    }
}
