//! Run-time libraries (OpenBLAS, MKL, oneDNN): where rtune looks for them and how it opens one
//! whose dependencies sit beside it. None is a build requirement.
//!
//! Where: a path the user names (`RTUNE_BLAS`, `RTUNE_MKL`, `RTUNE_ONEDNN`), then the `lib/`
//! folders PyPI wheels install shared libraries into — the `mkl` and `onednn` wheels put
//! `libmkl_rt.so.3` and `libdnnl.so.3` in `<prefix>/lib`, with `<prefix>` the active virtual
//! environment (`VIRTUAL_ENV`), conda environment (`CONDA_PREFIX`), or the one `rtune` itself is
//! installed in (`<prefix>/bin/rtune`, as `scripts/build-wheels.sh` finds NVIDIA's wheels
//! relative to the binary) — then the loader's own path (the system's libraries).
//!
//! How: a wheel's libraries carry no RUNPATH (the `onednn` wheel's `libdnnl.so.3` needs
//! `libtbb.so.12`, `libsycl.so.9`, ... from the same folder), so [`open`] opens each dependency
//! the loader reports missing from the library's own folder first (global, so that the library's
//! own load finds it by its soname), then the library.

use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};

/// The `lib/` folders of the Python environments a wheel's libraries may be in, in the order
/// searched: `VIRTUAL_ENV`, `CONDA_PREFIX`, the prefix of the running executable (`<prefix>/bin/x`).
/// Folders that do not exist are left out.
pub fn wheel_dirs() -> Vec<PathBuf> {
    let exe_prefix = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent()?.parent().map(Path::to_path_buf));
    let prefixes = [
        std::env::var_os("VIRTUAL_ENV").map(PathBuf::from),
        std::env::var_os("CONDA_PREFIX").map(PathBuf::from),
        exe_prefix,
    ];
    let mut dirs: Vec<PathBuf> = Vec::new();
    for p in prefixes.into_iter().flatten() {
        let d = p.join("lib");
        if d.is_dir() && !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    dirs
}

/// The candidate files for `file` (a soname such as `libdnnl.so.3`) in the wheel folders, in
/// [`wheel_dirs`]'s order, those that exist.
pub fn in_wheels(file: &str) -> Vec<String> {
    wheel_dirs()
        .into_iter()
        .map(|d| d.join(file))
        .filter(|p| p.is_file())
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

/// The soname the loader could not find, from a `dlerror` message
/// (`"libtbb.so.12: cannot open shared object file: No such file or directory"`).
fn missing(err: &str) -> Option<&str> {
    let (name, rest) = err.split_once(": cannot open shared object file")?;
    let _ = rest;
    // `dlopen` of a path reports "<path>: cannot open ..." for the file itself: only bare sonames
    // are dependencies.
    (!name.contains('/') && !name.is_empty()).then_some(name)
}

/// The last `dlerror` message.
fn last_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

/// Opens `name` (`RTLD_NOW | RTLD_LOCAL`; a path or a soname for the loader's search). When it is
/// a path and a dependency is missing, the dependency is opened from the same folder first
/// (recursively, up to 64 libraries). The handle is never closed. `Err` is the loader's message.
pub fn open(name: &str) -> Result<*mut c_void, String> {
    let dir = Path::new(name)
        .parent()
        .filter(|d| !d.as_os_str().is_empty());
    let mut budget = 64;
    open_in(name, dir, libc::RTLD_NOW | libc::RTLD_LOCAL, &mut budget)
}

fn open_in(
    name: &str,
    dir: Option<&Path>,
    flags: libc::c_int,
    budget: &mut usize,
) -> Result<*mut c_void, String> {
    let c = CString::new(name).map_err(|_| format!("{name:?}: a NUL in the name"))?;
    loop {
        // SAFETY: dlopen with a valid C string.
        let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
        if !h.is_null() {
            return Ok(h);
        }
        let err = last_error();
        let (Some(dir), Some(dep)) = (dir, missing(&err)) else {
            return Err(err);
        };
        let dep_path = dir.join(dep);
        if *budget == 0 || !dep_path.is_file() {
            return Err(err);
        }
        *budget -= 1;
        let dep_path = dep_path.to_string_lossy().into_owned();
        open_in(
            &dep_path,
            Some(dir),
            libc::RTLD_NOW | libc::RTLD_GLOBAL,
            budget,
        )?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_dependency_is_read_from_the_loader_message() {
        let m = "libtbb.so.12: cannot open shared object file: No such file or directory";
        assert_eq!(missing(m), Some("libtbb.so.12"));
        // The library itself missing is not a dependency to look for.
        let m = "/nonexistent/libdnnl.so.3: cannot open shared object file: No such file";
        assert_eq!(missing(m), None);
        assert_eq!(missing("libdnnl.so.3: undefined symbol: foo"), None);
    }

    #[test]
    fn a_bogus_path_fails_with_the_loaders_message() {
        let e = open("/nonexistent/libbogus.so.1").unwrap_err();
        assert!(e.contains("/nonexistent/libbogus.so.1"), "{e}");
    }
}
