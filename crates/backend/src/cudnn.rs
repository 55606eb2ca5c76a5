//! cuDNN's fused attention (SDPA) as rtune reaches it: the C ABI of `kernels/cudnn_sdpa.cpp`
//! ([`SdpaDesc`], the calls on [`Cudnn`]) and the library loaded at run time ([`get`]), never a
//! build requirement. The shim is compiled by `build.rs` with the `kernels` feature when
//! `RTUNE_CUDNN_INCLUDE` names its headers (`scripts/cudnn-headers.sh`; `cfg(rtune_cudnn)`);
//! without it [`get`] says so and attention runs rtune's own kernel. What an attention call maps
//! to a descriptor, and when it falls back, is the attention op's (`rtune_ops::attention::cudnn`).
//!
//! The library: `RTUNE_CUDNN_LIB` (a path or file name), else `libcudnn.so.9` on the loader's
//! path (the `nvidia-cudnn-cu13` wheel's `nvidia/cudnn/lib` in `LD_LIBRARY_PATH`, or the
//! system's). cuDNN 9 only; the front end checks each graph against the loaded version (strided
//! `Stats`, which rtune's `(B, T, H)` log-sum-exp needs, from 9.12 forward and 9.26 backward:
//! older versions answer "unsupported" and the own kernel runs).

use std::sync::{Mutex, OnceLock};

/// `rtune_sdpa_desc` of `kernels/cudnn_sdpa.h`: same fields, same order, 208 bytes. Strides are
/// in elements, in cuDNN's logical order (B, H, S, D); `lse` is `(B, H, S)`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SdpaDesc {
    pub b: i64,
    pub h: i64,
    pub hkv: i64,
    pub s: i64,
    pub d: i64,
    pub q: [i64; 4],
    pub k: [i64; 4],
    pub v: [i64; 4],
    pub o: [i64; 4],
    pub lse: [i64; 3],
    /// [`SDPA_BF16`] or [`SDPA_F16`].
    pub dtype: i32,
    /// 0: causal; `w > 0`: query `i` sees keys `i − w < j ≤ i`.
    pub window: i32,
    pub scale: f32,
    pub pad: i32,
}

/// `RTUNE_SDPA_BF16`, `RTUNE_SDPA_F16` of the header.
pub const SDPA_BF16: i32 = 1;
pub const SDPA_F16: i32 = 2;

/// Why attention does not go through cuDNN (the fallback's notice).
#[derive(Debug, Clone, PartialEq)]
pub enum Fallback {
    /// This build has no shim (`kernels` off, or `RTUNE_CUDNN_INCLUDE` unset when it was built).
    NotBuilt,
    /// The library did not load; the message says which file and why.
    Library(String),
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fallback::NotBuilt => write!(
                f,
                "built without kernels/cudnn_sdpa.cpp (the `kernels` feature with \
                 RTUNE_CUDNN_INCLUDE from scripts/cudnn-headers.sh)"
            ),
            Fallback::Library(m) => write!(f, "{m}"),
        }
    }
}

/// What a graph call did: ran, or cuDNN cannot express or run it (the reason): the caller runs
/// its own kernel.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome<T> {
    Done(T),
    Unsupported(String),
}

/// cuDNN, loaded.
#[derive(Debug)]
pub struct Cudnn {
    /// cuDNN's version number, e.g. 92801 for 9.28.1.
    pub version: i64,
    /// The file that loaded.
    pub name: String,
}

/// The files [`get`] tries, from `RTUNE_CUDNN_LIB`.
pub fn library_names(env: Option<&str>) -> Vec<String> {
    match env.map(str::trim) {
        Some(p) if !p.is_empty() => vec![p.to_string()],
        _ => vec!["libcudnn.so.9".to_string()],
    }
}

/// cuDNN, loaded once per process; `Err` says why not.
pub fn get() -> Result<&'static Cudnn, &'static Fallback> {
    static CUDNN: OnceLock<Result<Cudnn, Fallback>> = OnceLock::new();
    CUDNN
        .get_or_init(|| {
            let names = library_names(std::env::var("RTUNE_CUDNN_LIB").ok().as_deref());
            ffi::load(&names)
        })
        .as_ref()
}

/// Which attention engine runs on CUDA, in words: `cuDNN 9.28.1 (libcudnn.so.9)` or why not.
pub fn describe() -> String {
    match get() {
        Ok(c) => format!(
            "cuDNN {}.{}.{} ({})",
            c.version / 10000,
            c.version / 100 % 100,
            c.version % 100,
            c.name
        ),
        Err(why) => format!("rtune's flash kernel ({why})"),
    }
}

/// Prints the fallback's one-line notice, once per process and reason (a reason is a shape's
/// or the library's: a training run meets a handful).
pub fn notice(why: &str) {
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if !seen.iter().any(|s| s == why) {
        tracing::info!("attention runs rtune's flash kernel, not cuDNN: {why}");
        seen.push(why.to_string());
    }
}

#[cfg(all(feature = "kernels", rtune_cudnn))]
mod ffi {
    //! The calls into `kernels/cudnn_sdpa.cpp` (linked by build.rs).
    use super::{Cudnn, Fallback, Outcome, SdpaDesc};
    use crate::{KernelError, Result};
    use std::ffi::{c_char, c_int, c_void, CStr, CString};

    const OK: c_int = 0;
    const UNSUPPORTED: c_int = 1;
    const ERR_LEN: usize = 1024;

    extern "C" {
        fn rtune_cudnn_load(path: *const c_char, err: *mut c_char, len: usize) -> i64;
        fn rtune_cudnn_sdpa_workspace(
            d: *const SdpaDesc,
            bwd: c_int,
            err: *mut c_char,
            len: usize,
        ) -> i64;
        fn rtune_cudnn_sdpa_fwd(
            d: *const SdpaDesc,
            stream: *mut c_void,
            q: *const c_void,
            k: *const c_void,
            v: *const c_void,
            o: *mut c_void,
            lse: *mut f32,
            ws: *mut c_void,
            ws_len: usize,
            err: *mut c_char,
            len: usize,
        ) -> c_int;
        fn rtune_cudnn_sdpa_bwd(
            d: *const SdpaDesc,
            stream: *mut c_void,
            q: *const c_void,
            k: *const c_void,
            v: *const c_void,
            o: *const c_void,
            d_o: *const c_void,
            lse: *const f32,
            dq: *mut c_void,
            dk: *mut c_void,
            dv: *mut c_void,
            ws: *mut c_void,
            ws_len: usize,
            err: *mut c_char,
            len: usize,
        ) -> c_int;
    }

    fn message(buf: &[u8]) -> String {
        CStr::from_bytes_until_nul(buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "(no message)".into())
    }

    pub(super) fn load(names: &[String]) -> std::result::Result<Cudnn, Fallback> {
        let mut tried = Vec::new();
        for name in names {
            let Ok(c) = CString::new(name.as_str()) else {
                tried.push(format!("{name:?}: has a NUL byte"));
                continue;
            };
            let mut err = [0u8; ERR_LEN];
            // SAFETY: a NUL-terminated path and a writable buffer of ERR_LEN bytes.
            let v = unsafe { rtune_cudnn_load(c.as_ptr(), err.as_mut_ptr().cast(), ERR_LEN) };
            if v > 0 {
                return Ok(Cudnn {
                    version: v,
                    name: name.clone(),
                });
            }
            tried.push(message(&err));
        }
        Err(Fallback::Library(format!(
            "cuDNN 9 did not load ({}); set RTUNE_CUDNN_LIB or put the nvidia-cudnn-cu13 \
             wheel's nvidia/cudnn/lib in LD_LIBRARY_PATH",
            tried.join("; ")
        )))
    }

    fn fail(op: &'static str, err: &[u8]) -> KernelError {
        KernelError::Cudnn {
            op,
            message: message(err),
        }
    }

    impl Cudnn {
        /// The workspace bytes of `d`'s forward (`bwd` false) or backward graph on the thread's
        /// current device, building and caching the graph on first use.
        pub fn workspace(&self, d: &SdpaDesc, bwd: bool) -> Result<Outcome<usize>> {
            let mut err = [0u8; ERR_LEN];
            // SAFETY: `d` is a valid descriptor; the buffer holds ERR_LEN bytes.
            let n = unsafe {
                rtune_cudnn_sdpa_workspace(d, bwd as c_int, err.as_mut_ptr().cast(), ERR_LEN)
            };
            match n {
                n if n >= 0 => Ok(Outcome::Done(n as usize)),
                -1 => Ok(Outcome::Unsupported(message(&err))),
                _ => Err(fail("sdpa workspace", &err)),
            }
        }

        /// The forward on `stream` (a `cudaStream_t`): `o` and `lse` from `q, k, v`.
        ///
        /// # Safety
        /// Every pointer is device memory of the current context laid out as `d` says (`ws`:
        /// at least [`Self::workspace`]'s bytes), live until the stream has run the graph.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn fwd(
            &self,
            d: &SdpaDesc,
            stream: *mut c_void,
            [q, k, v]: [*const c_void; 3],
            o: *mut c_void,
            lse: *mut f32,
            ws: *mut c_void,
            ws_len: usize,
        ) -> Result<Outcome<()>> {
            let mut err = [0u8; ERR_LEN];
            let e = err.as_mut_ptr().cast();
            // SAFETY: the caller's contract; the error buffer holds ERR_LEN bytes.
            let r =
                unsafe { rtune_cudnn_sdpa_fwd(d, stream, q, k, v, o, lse, ws, ws_len, e, ERR_LEN) };
            Self::outcome("sdpa forward", r, &err)
        }

        /// The backward on `stream`: `dq, dk, dv` from the forward's `q, k, v, o, lse` and `d_o`.
        ///
        /// # Safety
        /// As [`Self::fwd`].
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn bwd(
            &self,
            d: &SdpaDesc,
            stream: *mut c_void,
            [q, k, v, o, d_o]: [*const c_void; 5],
            lse: *const f32,
            [dq, dk, dv]: [*mut c_void; 3],
            ws: *mut c_void,
            ws_len: usize,
        ) -> Result<Outcome<()>> {
            let mut err = [0u8; ERR_LEN];
            let e = err.as_mut_ptr().cast();
            // SAFETY: the caller's contract; the error buffer holds ERR_LEN bytes.
            let r = unsafe {
                rtune_cudnn_sdpa_bwd(
                    d, stream, q, k, v, o, d_o, lse, dq, dk, dv, ws, ws_len, e, ERR_LEN,
                )
            };
            Self::outcome("sdpa backward", r, &err)
        }

        fn outcome(op: &'static str, r: c_int, err: &[u8]) -> Result<Outcome<()>> {
            match r {
                OK => Ok(Outcome::Done(())),
                UNSUPPORTED => Ok(Outcome::Unsupported(message(err))),
                _ => Err(fail(op, err)),
            }
        }
    }
}

#[cfg(not(all(feature = "kernels", rtune_cudnn)))]
mod ffi {
    //! Stand-in without the shim: nothing loads, so no [`Cudnn`] exists to call.
    use super::{Cudnn, Fallback};

    pub(super) fn load(_: &[String]) -> std::result::Result<Cudnn, Fallback> {
        Err(Fallback::NotBuilt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_library_comes_from_the_environment_or_the_loader_path() {
        assert_eq!(library_names(None), ["libcudnn.so.9"]);
        assert_eq!(library_names(Some(" ")), ["libcudnn.so.9"]);
        assert_eq!(
            library_names(Some("/opt/x/libcudnn.so.9")),
            ["/opt/x/libcudnn.so.9"]
        );
    }

    /// The shim linked into the test binary: a file that is not there gives the loader's message
    /// naming it; a real cuDNN 9 (`RTUNE_TEST_CUDNN_LIB`, e.g. the `nvidia-cudnn-cu13` wheel's
    /// `nvidia/cudnn/lib/libcudnn.so.9`) loads with its version without a GPU, and a graph asked
    /// for without one is an error returned through the C ABI (no C++ exception escapes: that
    /// would abort the test).
    #[cfg(all(feature = "kernels", rtune_cudnn))]
    #[test]
    fn the_shim_loads_cudnn_or_says_why() {
        let e = ffi::load(&["/nonexistent/libcudnn.so.9".into()]).unwrap_err();
        assert!(
            matches!(&e, Fallback::Library(m) if m.contains("dlopen /nonexistent/libcudnn.so.9")),
            "{e}"
        );
        let Ok(path) = std::env::var("RTUNE_TEST_CUDNN_LIB") else {
            eprintln!("RTUNE_TEST_CUDNN_LIB unset: loading a real cuDNN is not tested");
            return;
        };
        let c = ffi::load(&[path]).unwrap();
        assert!((90000..100000).contains(&c.version), "{}", c.version);
        let d = SdpaDesc {
            b: 1,
            h: 2,
            hkv: 1,
            s: 8,
            d: 64,
            q: [1024, 512, 64, 1],
            k: [512, 512, 64, 1],
            v: [512, 512, 64, 1],
            o: [1024, 64, 128, 1],
            lse: [16, 1, 2],
            dtype: SDPA_BF16,
            window: 0,
            scale: 0.125,
            pad: 0,
        };
        match c.workspace(&d, false) {
            Err(crate::KernelError::Cudnn { message, .. }) => eprintln!("no GPU: {message}"),
            other => panic!("a graph without a GPU: {other:?}"),
        }
    }

    /// `rtune_sdpa_desc`'s layout (kernels/cudnn_sdpa.h): 5 sizes, 4 × 4 strides, 3 lse strides
    /// (i64), then dtype, window, scale, pad (4 bytes each).
    #[test]
    fn the_descriptor_has_the_c_header_layout() {
        use std::mem::{offset_of, size_of};
        assert_eq!(size_of::<SdpaDesc>(), 208);
        assert_eq!(offset_of!(SdpaDesc, q), 40);
        assert_eq!(offset_of!(SdpaDesc, o), 136);
        assert_eq!(offset_of!(SdpaDesc, lse), 168);
        assert_eq!(offset_of!(SdpaDesc, dtype), 192);
        assert_eq!(offset_of!(SdpaDesc, window), 196);
        assert_eq!(offset_of!(SdpaDesc, scale), 200);
    }
}
