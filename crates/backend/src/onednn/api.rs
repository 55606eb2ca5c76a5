//! oneDNN's C API as rtune calls it, declared here from `oneapi/dnnl/dnnl.h` of 2.6 and 3.x (see
//! the module note: [`Versioned`] holds the calls that differ): the entry points ([`Api`]), the
//! descriptor buffers and the enum values used.

use std::ffi::{c_char, c_int, c_void};

pub(super) type Status = c_int;
pub(super) type Handle = *mut c_void;

pub(super) const SUCCESS: Status = 0;
pub(super) const DT_BF16: c_int = 2;
pub(super) const DT_F32: c_int = 3;
pub(super) const ENGINE_CPU: c_int = 1;
pub(super) const STREAM_DEFAULT: u32 = 1;
pub(super) const ARG_SRC: c_int = 1;
pub(super) const ARG_DST: c_int = 17;
pub(super) const ARG_WEIGHTS: c_int = 33;
pub(super) const QUERY_IMPL_INFO_STR: c_int = 8;
/// `dnnl_query_weights_md` (`dnnl_query_some_md = 128`, then src, diff_src, weights).
pub(super) const QUERY_WEIGHTS_MD: c_int = 131;
/// `dnnl_format_tag_any`: the primitive picks the layout.
pub(super) const FORMAT_TAG_ANY: c_int = 1;
/// `sizeof(dnnl_memory_desc_t)` in oneDNN 2.x: what a queried descriptor is copied as.
pub(super) const MD_BYTES: usize = 696;
/// `DNNL_MAX_NDIMS`.
pub(super) const MAX_NDIMS: usize = 12;

/// Room for a `dnnl_memory_desc_t` (696 bytes in 2.6) and a `dnnl_matmul_desc_t` (2800), 8-aligned.
#[repr(C, align(8))]
pub(super) struct Md(pub(super) [u8; 1024]);
#[repr(C, align(8))]
pub(super) struct MatmulDesc(pub(super) [u8; 4096]);

#[repr(C)]
pub(super) struct ExecArg {
    pub(super) arg: c_int,
    pub(super) memory: Handle,
}

#[repr(C)]
pub(super) struct Version {
    pub(super) major: c_int,
    pub(super) minor: c_int,
    pub(super) patch: c_int,
    pub(super) hash: *const c_char,
}

/// The entry points rtune calls, from `dnnl.h`.
pub(super) struct Api {
    pub(super) engine_create: unsafe extern "C" fn(*mut Handle, c_int, usize) -> Status,
    pub(super) stream_create: unsafe extern "C" fn(*mut Handle, Handle, u32) -> Status,
    pub(super) stream_wait: unsafe extern "C" fn(Handle) -> Status,
    /// 2.x `dnnl_memory_desc_init_by_strides` fills the struct in `Md`; 3.x
    /// `dnnl_memory_desc_create_with_strides` writes a descriptor handle into its first 8 bytes.
    pub(super) md_init_by_strides:
        unsafe extern "C" fn(*mut Md, c_int, *const i64, c_int, *const i64) -> Status,
    /// The version-specific calls: the matmul's creation, its output scale and sum post-op.
    pub(super) v: Versioned,
    pub(super) pd_query: unsafe extern "C" fn(Handle, c_int, c_int, *mut c_void) -> Status,
    pub(super) pd_destroy: unsafe extern "C" fn(Handle) -> Status,
    pub(super) primitive_create: unsafe extern "C" fn(*mut Handle, Handle) -> Status,
    pub(super) primitive_execute:
        unsafe extern "C" fn(Handle, Handle, c_int, *const ExecArg) -> Status,
    pub(super) memory_create:
        unsafe extern "C" fn(*mut Handle, MdRef, Handle, *mut c_void) -> Status,
    pub(super) memory_destroy: unsafe extern "C" fn(Handle) -> Status,
    pub(super) md_init_by_tag:
        unsafe extern "C" fn(*mut Md, c_int, *const i64, c_int, c_int) -> Status,
    /// 2.x: a pointer to the struct inside the primitive descriptor; 3.x: a handle it owns.
    pub(super) pd_query_md: unsafe extern "C" fn(Handle, c_int, c_int) -> MdRef,
    pub(super) reorder_pd_create:
        unsafe extern "C" fn(*mut Handle, MdRef, Handle, MdRef, Handle, Handle) -> Status,
    pub(super) md_get_size: unsafe extern "C" fn(MdRef) -> usize,
    pub(super) md_equal: unsafe extern "C" fn(MdRef, MdRef) -> c_int,
    pub(super) primitive_destroy: unsafe extern "C" fn(Handle) -> Status,
    pub(super) attr_create: unsafe extern "C" fn(*mut Handle) -> Status,
    pub(super) attr_destroy: unsafe extern "C" fn(Handle) -> Status,
    pub(super) attr_set_post_ops: unsafe extern "C" fn(Handle, Handle) -> Status,
    pub(super) post_ops_create: unsafe extern "C" fn(*mut Handle) -> Status,
    pub(super) post_ops_destroy: unsafe extern "C" fn(Handle) -> Status,
}

/// A memory descriptor as the C API takes it: 2.x `const dnnl_memory_desc_t *` (the struct's
/// address), 3.x `const_dnnl_memory_desc_t` (the handle). [`OneDnn::md`] makes one from an [`Md`].
pub(super) type MdRef = *const c_void;

/// The calls whose form changed between oneDNN 2.x and 3.x.
pub(super) enum Versioned {
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
pub(super) const ELTWISE_LINEAR_V3: c_int = 0x26;

/// A looked-up symbol as the function pointer type `F`.
///
/// # Safety
/// `F` must be a function pointer type whose signature is the symbol's.
pub(super) unsafe fn as_fn<F: Copy>(p: *mut c_void) -> F {
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `F` is a function pointer (the caller's contract): the same size as `p`.
    unsafe { std::mem::transmute_copy(&p) }
}
