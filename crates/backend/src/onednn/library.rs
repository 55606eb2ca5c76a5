//! The library loaded: the first of the names that opens, its version read, its symbols looked up
//! for that version ([`Api`]), a CPU engine and stream made.

use super::api::{as_fn, Api, Version, Versioned, ENGINE_CPU, STREAM_DEFAULT, SUCCESS};
use super::{packed, Fallback, OneDnn, State};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Mutex;

pub(super) fn load(names: &[String]) -> std::result::Result<OneDnn, Fallback> {
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
