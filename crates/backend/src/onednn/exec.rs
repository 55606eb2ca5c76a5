//! Running a product: the caller's buffers wrapped as oneDNN memory, a registered frozen weight's
//! packed copy taken when the primitive reads that layout, the product tallied for reports
//! ([`crate::served`]).

use super::api::{
    ExecArg, Handle, Md, Status, ARG_DST, ARG_SRC, ARG_WEIGHTS, DT_BF16, DT_F32, SUCCESS,
};
use super::primitive::{dims_strides, packed_strides, Key, Out, Primitive};
use super::{OneDnn, State, PACKED_RUNS};
use candle_core::{CpuStorage, DType, Layout, Result};
use half::bf16;
use std::ffi::c_void;

impl OneDnn {
    /// `C = A·B` for bf16 slices laid out as `la`, `lb` (offsets applied by the caller), into a
    /// new packed output of `dst` dtype (`BF16` or `F32`). Returns the output and the
    /// implementation oneDNN chose.
    pub(super) fn run(
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
    pub(super) unsafe fn execute(
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
    pub(super) fn exec(
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
