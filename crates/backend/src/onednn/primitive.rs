//! The matmul primitives: what one multiplies ([`Key`]), made once per key and cached
//! ([`OneDnn::primitive`]), with the output scale and sum post-op of each oneDNN version
//! ([`OneDnn::attr`]).

use super::api::{
    Handle, MatmulDesc, Md, MdRef, Status, Versioned, DT_BF16, ELTWISE_LINEAR_V3, FORMAT_TAG_ANY,
    MD_BYTES, QUERY_IMPL_INFO_STR, QUERY_WEIGHTS_MD, SUCCESS,
};
use super::OneDnn;
use candle_core::{Layout, Result};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};

/// A cached primitive: what it multiplies and the implementation oneDNN chose for it.
pub(super) struct Primitive {
    pub(super) handle: Handle,
    pub(super) src: Md,
    pub(super) weights: Md,
    pub(super) dst: Md,
    /// oneDNN's implementation name (`brg:avx512_core_bf16`, ...).
    pub(super) imp: String,
}

/// A primitive's operands: dims and strides of `A`, `B`, the output's strides and dtype, whether
/// `B` is a packed frozen weight (its layout then the primitive's choice, `format_tag::any`), and
/// the output's attributes: the scale `alpha` (its f32 bits) and whether the product is added
/// into what the output holds (`C = alpha·A·B + C`, oneDNN's sum post-op: `beta = 1`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Key {
    pub(super) ad: Vec<i64>,
    pub(super) as_: Vec<i64>,
    pub(super) bd: Vec<i64>,
    pub(super) bs: Vec<i64>,
    pub(super) cs: Vec<i64>,
    pub(super) dst: c_int,
    pub(super) packed: bool,
    pub(super) alpha: u32,
    pub(super) sum: bool,
}

/// Where a product's output goes: a new packed buffer, or the caller's rows at `cs` strides,
/// scaled by `alpha` and, when `sum`, added into what they hold.
pub(super) struct Out {
    pub(super) ptr: *mut c_void,
    pub(super) cs: Vec<i64>,
    pub(super) alpha: f32,
    pub(super) sum: bool,
}

/// The packed row-major strides of `dims`.
pub(super) fn packed_strides(dims: &[i64]) -> Vec<i64> {
    let mut cs = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        cs[i] = cs[i + 1] * dims[i + 1];
    }
    cs
}

/// The `(dims, strides)` of a layout's matrices, batch dims first, at most [`MAX_NDIMS`].
pub(super) fn dims_strides(l: &Layout) -> (Vec<i64>, Vec<i64>) {
    (
        l.dims().iter().map(|&d| d as i64).collect(),
        l.stride().iter().map(|&s| s as i64).collect(),
    )
}

impl OneDnn {
    /// `md` as the C API takes it: 2.x the struct's address, 3.x the handle stored in its first
    /// 8 bytes (see `Api::md_init_by_strides`).
    pub(super) fn md(&self, md: &Md) -> MdRef {
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
    pub(super) fn primitive<'a>(
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

    pub(super) fn create(&self, key: &Key) -> Result<Primitive> {
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
    pub(super) unsafe fn attr(&self, alpha: f32, sum: bool) -> std::result::Result<Handle, Status> {
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
}
