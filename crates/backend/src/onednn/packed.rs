//! Frozen bf16 weights packed once for oneDNN's matmul.
//!
//! oneDNN's bf16 kernels (`brg:avx512_core_bf16`, `brg:avx512_core_amx`) read `B` in a blocked
//! layout (pairs of `K` rows interleaved for `vdpbf16ps` / AMX tiles, `N` in blocks of 16–64
//! columns). Handed a plain `B` — the frozen weight `W: (out, in)` as `Wᵀ` in the forward `x·Wᵀ`,
//! as `W` in the backward `dy·W` — every call re-blocks it into scratch memory first. The weights
//! never change, so a weight registered with [`pack`] is reordered once, on its first product
//! in each orientation, into the layout the primitive reports for `B` of `format_tag::any`
//! (`dnnl_primitive_desc_query_md(weights_md)`), and later products read that copy. The values are
//! the same bf16 numbers in another order in memory: the product is the plain one's up to the
//! kernel's summation order.
//!
//! The layout is the primitive's choice for the operands' shapes; a later product whose primitive
//! asks for another (a different row count can) takes the plain path. The copy costs the weight's
//! bf16 bytes once per orientation used: up to twice the frozen weights' bf16 bytes (+33% peak RSS
//! on bench-small), for a speed-up measured at 1.07–1.18× under load and not yet on an idle machine
//! or on AMX. So packing is opt-in: `RTUNE_ONEDNN_PACK=on` turns it on.

use super::{
    bf16, c_void, get, ExecArg, Handle, Layout, Md, OneDnn, Result, Tensor, ARG_DST, ARG_SRC,
    DT_BF16, MD_BYTES, SUCCESS,
};
use candle_core::{CpuStorage, DType, Storage};
use std::collections::HashMap;

/// A registered weight, by the address of its first element.
#[derive(Default)]
pub(super) struct Registry {
    entries: HashMap<usize, Entry>,
}

struct Entry {
    /// Held so that the address stays this weight's while the entry lives.
    _keep: Tensor,
    /// `(out, in)` and its strides as registered.
    dims: [usize; 2],
    stride: [usize; 2],
    /// [`Packed`] handles alive for it.
    pins: usize,
    /// The copies made so far, one per orientation.
    packs: Vec<Pack>,
}

/// One orientation's packed copy.
struct Pack {
    /// The operand as the product takes it: `W` or `Wᵀ`.
    dims: [usize; 2],
    stride: [usize; 2],
    md: Md,
    buf: AlignedBuf,
}

/// Bytes aligned to 64 (a cache line, what oneDNN allocates its own buffers at).
struct AlignedBuf {
    bytes: Vec<u8>,
    off: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let bytes = vec![0u8; len + 64];
        let off = bytes.as_ptr().align_offset(64);
        Self { bytes, off }
    }
    fn ptr(&mut self) -> *mut c_void {
        self.bytes[self.off..].as_mut_ptr().cast()
    }
    fn len(&self) -> usize {
        self.bytes.len() - 64
    }
}

fn dims2(l: &Layout) -> Option<([usize; 2], [usize; 2])> {
    match (l.dims(), l.stride()) {
        (&[r, c], &[sr, sc]) => Some(([r, c], [sr, sc])),
        _ => None,
    }
}

impl Entry {
    /// Whether `l` is this weight as registered or transposed.
    fn takes(&self, l: &Layout) -> bool {
        let Some((d, s)) = dims2(l) else {
            return false;
        };
        (d == self.dims && s == self.stride)
            || (d == [self.dims[1], self.dims[0]] && s == [self.stride[1], self.stride[0]])
    }
}

fn md_copy(from: &Md) -> Md {
    let mut m = Md([0; 1024]);
    m.0[..MD_BYTES].copy_from_slice(&from.0[..MD_BYTES]);
    m
}

impl Registry {
    /// Whether `b` (the operand's first element) laid out as `lb` is a registered weight or its
    /// transpose.
    pub(super) fn holds(&self, b: &[bf16], lb: &Layout) -> bool {
        self.entries
            .get(&(b.as_ptr() as usize))
            .is_some_and(|e| e.takes(lb))
    }

    /// The packed copy of the registered `b` as laid out in `lb`, made now in `want`'s layout if
    /// this orientation has none; `None` when the copy's layout is not `want` (the caller then
    /// takes the plain path). Runs on `stream`, under the caller's lock.
    pub(super) fn packed(
        &mut self,
        lib: &OneDnn,
        stream: Handle,
        b: &[bf16],
        lb: &Layout,
        want: &Md,
    ) -> Result<Option<*mut c_void>> {
        let Some(entry) = self.entries.get_mut(&(b.as_ptr() as usize)) else {
            return Ok(None);
        };
        let Some((dims, stride)) = dims2(lb).filter(|_| entry.takes(lb)) else {
            return Ok(None);
        };
        let api = &lib.api;
        let i = match entry
            .packs
            .iter()
            .position(|p| p.dims == dims && p.stride == stride)
        {
            Some(i) => i,
            None => {
                entry
                    .packs
                    .push(reorder(lib, stream, b, dims, stride, want)?);
                entry.packs.len() - 1
            }
        };
        let p = &mut entry.packs[i];
        // SAFETY: both are initialized memory descriptors.
        let same = unsafe { (api.md_equal)(lib.md(&p.md), lib.md(want)) } != 0;
        Ok(same.then(|| p.buf.ptr()))
    }

    /// Bytes held in packed copies.
    fn bytes(&self) -> usize {
        let packs = self.entries.values().flat_map(|e| &e.packs);
        packs.map(|p| p.buf.len()).sum()
    }
}

/// A copy of the plain `(dims, stride)` bf16 matrix at `b` in `want`'s layout, by oneDNN's reorder.
fn reorder(
    lib: &OneDnn,
    stream: Handle,
    b: &[bf16],
    dims: [usize; 2],
    stride: [usize; 2],
    want: &Md,
) -> Result<Pack> {
    let api = &lib.api;
    let fail = |what: &str, st| {
        candle_core::Error::Msg(format!(
            "onednn: packing a {dims:?} weight: {what} returned status {st}"
        ))
    };
    let d = dims.map(|x| x as i64);
    let s = stride.map(|x| x as i64);
    let mut src = Md([0; 1024]);
    // SAFETY: as in `OneDnn::create`: a descriptor buffer larger than oneDNN's, 2-element arrays.
    let st = unsafe { (api.md_init_by_strides)(&mut src, 2, d.as_ptr(), DT_BF16, s.as_ptr()) };
    if st != SUCCESS {
        return Err(fail("memory_desc_init", st));
    }
    // SAFETY: an initialized descriptor.
    let size = unsafe { (api.md_get_size)(lib.md(want)) };
    let mut buf = AlignedBuf::new(size);
    let (mut pd, mut prim): (Handle, Handle) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut mems: [Handle; 2] = [std::ptr::null_mut(); 2];
    // SAFETY: the descriptors are initialized; `b` holds the plain matrix `src` describes (the
    // registered weight, kept alive by its entry) and `buf` the `size` bytes `want` needs; the
    // reorder runs and is waited for before the handles are destroyed.
    let st = unsafe {
        let null = std::ptr::null_mut();
        let mut st = (api.reorder_pd_create)(
            &mut pd,
            lib.md(&src),
            lib.engine,
            lib.md(want),
            lib.engine,
            null,
        );
        if st == SUCCESS {
            st = (api.primitive_create)(&mut prim, pd);
            (api.pd_destroy)(pd);
        }
        if st == SUCCESS {
            st = (api.memory_create)(
                &mut mems[0],
                lib.md(&src),
                lib.engine,
                b.as_ptr() as *mut c_void,
            );
        }
        if st == SUCCESS {
            st = (api.memory_create)(&mut mems[1], lib.md(want), lib.engine, buf.ptr());
        }
        if st == SUCCESS {
            let args = [
                ExecArg {
                    arg: ARG_SRC,
                    memory: mems[0],
                },
                ExecArg {
                    arg: ARG_DST,
                    memory: mems[1],
                },
            ];
            st = (api.primitive_execute)(prim, stream, 2, args.as_ptr());
            if st == SUCCESS {
                st = (api.stream_wait)(stream);
            }
        }
        for m in mems {
            if !m.is_null() {
                (api.memory_destroy)(m);
            }
        }
        if !prim.is_null() {
            (api.primitive_destroy)(prim);
        }
        st
    };
    if st != SUCCESS {
        return Err(fail("reorder", st));
    }
    Ok(Pack {
        dims,
        stride,
        md: md_copy(want),
        buf,
    })
}

/// A frozen weight registered by [`pack`]; dropping the last handle of a weight forgets it and
/// frees its packed copies.
pub struct Packed {
    addr: usize,
}

impl Drop for Packed {
    fn drop(&mut self) {
        let Ok(lib) = get() else { return };
        let mut state = lib.state.lock().unwrap_or_else(|e| e.into_inner());
        let entries = &mut state.frozen.entries;
        if let Some(e) = entries.get_mut(&self.addr) {
            e.pins -= 1;
            if e.pins == 0 {
                entries.remove(&self.addr);
            }
        }
    }
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed({:#x})", self.addr)
    }
}

/// Whether packing is on: `RTUNE_ONEDNN_PACK` set to `on` or `1` (off by default: see the module
/// note for its memory cost).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        matches!(
            std::env::var("RTUNE_ONEDNN_PACK").as_deref(),
            Ok("on") | Ok("1")
        )
    })
}

/// Registers `w`, a frozen bf16 CPU matrix `(out, in)` with positive strides, so that products
/// taking it (or its transpose) as the right operand run on a packed copy (see the module note);
/// `None`, and nothing registered, when oneDNN is not in use, packing is off, or `w` is not such
/// a matrix. Keep the handle as long as the weight: the registry holds the weight alive until the
/// last handle drops.
pub fn pack(w: &Tensor) -> Option<Packed> {
    if !enabled() {
        return None;
    }
    register(w)
}

/// [`pack`] whatever `RTUNE_ONEDNN_PACK` says (the bench's probe and the tests).
pub fn register(w: &Tensor) -> Option<Packed> {
    if !w.device().is_cpu() || w.dtype() != DType::BF16 {
        return None;
    }
    let (dims, stride) = dims2(w.layout())?;
    if dims.contains(&0) || stride.contains(&0) {
        return None;
    }
    let lib = get().ok()?;
    let addr = {
        let (s, l) = w.storage_and_layout();
        let Storage::Cpu(CpuStorage::BF16(v)) = &*s else {
            return None;
        };
        v.get(l.start_offset()..)?.as_ptr() as usize
    };
    let mut state = lib.state.lock().unwrap_or_else(|e| e.into_inner());
    let e = state.frozen.entries.entry(addr).or_insert_with(|| Entry {
        _keep: w.clone(),
        dims,
        stride,
        pins: 0,
        packs: Vec::new(),
    });
    if e.dims != dims || e.stride != stride {
        // Another view starting at the same element is registered; leave it to the plain path.
        return None;
    }
    e.pins += 1;
    Some(Packed { addr })
}

/// Bytes held in packed copies of frozen weights (0 without oneDNN), for reports and tests.
pub fn packed_bytes() -> usize {
    get().map_or(0, |lib| {
        let state = lib.state.lock().unwrap_or_else(|e| e.into_inner());
        state.frozen.bytes()
    })
}
