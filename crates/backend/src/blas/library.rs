//! A CBLAS opened ([`crate::dl::open`]): its `cblas_sgemm`, and OpenBLAS's kernel-set name and
//! thread calls where it has them.

use super::{Blas, Sgemm};
use std::ffi::{c_char, c_int, c_void};

/// The first of `names` that opens ([`crate::dl::open`]) and exports `cblas_sgemm`.
pub(super) fn open(names: &[String]) -> Option<Blas> {
    for name in names {
        // SAFETY: dlsym with valid C strings; the handle is never closed, so the function
        // pointer stays valid for the life of the process.
        unsafe {
            let Ok(h) = crate::dl::open(name) else {
                continue;
            };
            let sym = libc::dlsym(h, c"cblas_sgemm".as_ptr());
            if sym.is_null() {
                continue;
            }
            let core = libc::dlsym(h, c"openblas_get_corename".as_ptr());
            let core = if core.is_null() {
                String::new()
            } else {
                let f: unsafe extern "C" fn() -> *const c_char = std::mem::transmute(core);
                let p = f();
                if p.is_null() {
                    String::new()
                } else {
                    format!(
                        " ({})",
                        std::ffi::CStr::from_ptr(p).to_string_lossy().to_lowercase()
                    )
                }
            };
            let (get, set) = (
                libc::dlsym(h, c"openblas_get_num_threads".as_ptr()),
                libc::dlsym(h, c"openblas_set_num_threads".as_ptr()),
            );
            let threads = (!get.is_null() && !set.is_null()).then(|| {
                (
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(get),
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(set),
                )
            });
            let name = format!("{name}{core}");
            return Some(Blas {
                sgemm: std::mem::transmute::<*mut c_void, Sgemm>(sym),
                threads,
                described: name.clone(),
                name,
            });
        }
    }
    None
}
