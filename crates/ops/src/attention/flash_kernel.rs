//! Host side of `kernels/flash_attn.cu`: tiled attention (FlashAttention-2's algorithm) forward
//! ([`flash_fwd`]) and backward ([`flash_bwd`]) for f32, bf16 and f16 on tensors already on the
//! GPU, head dims [`HEAD_DIMS`]. The kernels are loaded and cached per CUDA context by
//! [`FlashKernels`], each opted in to the shared memory its tiles need ([`smem_bytes`]).
//! Semantics and layouts: [`crate::flash_ref`] (the CPU reference with the same tiling), which is
//! also what `crates/ops/src/attention/tiled.rs` computes on the CPU.

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute_enum};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::sync::{Arc, Mutex};

pub use crate::attention::flash_ref::{FlashShape, BC, BR, HEAD_DIMS};
use rtune_backend::launch::{bad, int, need, numel, FusedFloat};
use rtune_backend::{drv, Result};

/// Threads per block of the tiled kernels (`THREADS` in `flash_attn.cu`: one warp per 16 query
/// rows).
const THREADS: u32 = (BR / 16 * 32) as u32;

/// The kernel's element strides and sizes, `FlashParams` in `flash_attn.cu` (same fields, same
/// order, `repr(C)`: 12 × i64, 5 × i32, f32 = 120 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct FlashParams {
    q_b: i64,
    q_h: i64,
    q_t: i64,
    k_b: i64,
    k_h: i64,
    k_t: i64,
    o_b: i64,
    o_h: i64,
    o_t: i64,
    l_b: i64,
    l_h: i64,
    l_t: i64,
    b: i32,
    h: i32,
    hkv: i32,
    t: i32,
    sb: i32,
    scale: f32,
}

// SAFETY: plain repr(C) data laid out as the kernel's `FlashParams`, passed by value.
unsafe impl DeviceRepr for FlashParams {}

/// The three tiled kernels of one element type and head dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashKernel {
    Fwd,
    BwdDkdv,
    BwdDq,
}

impl FlashKernel {
    const ALL: [FlashKernel; 3] = [FlashKernel::Fwd, FlashKernel::BwdDkdv, FlashKernel::BwdDq];
    fn name(self) -> &'static str {
        match self {
            FlashKernel::Fwd => "flash_fwd",
            FlashKernel::BwdDkdv => "flash_bwd_dkdv",
            FlashKernel::BwdDq => "flash_bwd_dq",
        }
    }
}

/// Dynamic shared memory of `kernel` for elements of `elem` bytes and head dim `dh`: the regions
/// `flash_attn.cu` carves, each rounded up to 128 bytes (the kernel traps if given less).
pub fn smem_bytes(kernel: FlashKernel, elem: usize, dh: usize) -> usize {
    let r = |n: usize| n.div_ceil(128) * 128;
    let lt = dh + 16 / elem; // T tiles of dh
    let lp = BC + 16 / elem; // T tiles of BC (P, dS)
    let ls = BC + 4; // f32 tiles of BC (S, dP)
    let la = dh + 4; // f32 accumulators of dh
    match kernel {
        FlashKernel::Fwd => {
            r(BR * lt * elem)
                + 2 * r(BC * lt * elem)
                + r(BR * ls * 4)
                + r(BR * lp * elem)
                + r(BR * la * 4)
                + 4 * r(BR * 4)
        }
        FlashKernel::BwdDkdv => {
            2 * r(BC * lt * elem)
                + 2 * r(BC * la * 4)
                + 2 * r(BR * lt * elem)
                + 2 * r(BR * ls * 4)
                + 2 * r(BR * lp * elem)
                + 3 * r(BR * 4)
        }
        FlashKernel::BwdDq => {
            2 * r(BR * lt * elem)
                + 2 * r(BC * lt * elem)
                + 2 * r(BR * ls * 4)
                + 2 * r(BR * lp * elem)
                + r(BR * la * 4)
                + 3 * r(BR * 4)
        }
    }
}

const SUFFIXES: [&str; 3] = ["f32", "bf16", "f16"];
const ELEM: [usize; 3] = [4, 2, 2];

/// The kernels of `flash_attn.cu` loaded into one CUDA context.
pub struct FlashKernels {
    /// `[(type × HEAD_DIMS + dh index) × 3 + kernel]`, types as [`FusedFloat::INDEX`].
    tiled: Vec<CudaFunction>,
    /// `flash_bwd_pre_<type>`, by type.
    pre: Vec<CudaFunction>,
    /// The device's opt-in shared memory per block (bytes).
    smem_max: usize,
}

static LOADED: Mutex<Vec<(usize, Arc<FlashKernels>)>> = Mutex::new(Vec::new());

impl FlashKernels {
    /// Loads `flash_attn.ptx` into `ctx` and opts each tiled kernel in to the shared memory it
    /// needs, where the device allows it (a kernel needing more than the device has fails at
    /// launch with an error naming both; use [`Self::get`]).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let module = ctx
            .load_module(Ptx::from_src(rtune_backend::image::FLASH_ATTN.ptx))
            .map_err(drv("loading flash_attn.ptx"))?;
        let smem_max = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("flash attention: shared memory per block"))?
            as usize;
        let mut tiled = Vec::new();
        let mut pre = Vec::new();
        for (ti, s) in SUFFIXES.into_iter().enumerate() {
            pre.push(
                module
                    .load_function(&format!("flash_bwd_pre_{s}"))
                    .map_err(drv("loading a flash attention kernel"))?,
            );
            for dh in HEAD_DIMS {
                for k in FlashKernel::ALL {
                    let f = module
                        .load_function(&format!("{}_{s}_d{dh}", k.name()))
                        .map_err(drv("loading a flash attention kernel"))?;
                    let need = smem_bytes(k, ELEM[ti], dh);
                    if need <= smem_max {
                        f.set_attribute(
                            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            need as i32,
                        )
                        .map_err(drv("flash attention: opting in to shared memory"))?;
                    }
                    tiled.push(f);
                }
            }
        }
        Ok(FlashKernels {
            tiled,
            pre,
            smem_max,
        })
    }

    /// The kernels of `ctx`, loaded on first use and cached for the life of the process.
    pub fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Self>> {
        rtune_backend::launch::per_context(&LOADED, ctx, Self::load)
    }

    /// `kernel` for `T` and `dh`, with its launch shape for `grid`; an error when `dh` has no
    /// kernel or its tiles do not fit the device's shared memory.
    fn tiled<T: FusedFloat>(
        &self,
        op: &'static str,
        kernel: FlashKernel,
        dh: usize,
        grid: (u32, u32, u32),
    ) -> Result<(&CudaFunction, LaunchConfig)> {
        let Some(di) = HEAD_DIMS.iter().position(|&d| d == dh) else {
            return Err(bad(
                op,
                format!("head dim {dh} has no kernel (built for {HEAD_DIMS:?})"),
            ));
        };
        let smem = smem_bytes(kernel, std::mem::size_of::<T>(), dh);
        if smem > self.smem_max {
            return Err(bad(
                op,
                format!(
                    "{} for {} head dim {dh} needs {smem} bytes of shared memory a block, \
                     the device allows {}",
                    kernel.name(),
                    T::SUFFIX,
                    self.smem_max
                ),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let at = (T::INDEX * HEAD_DIMS.len() + di) * FlashKernel::ALL.len() + kernel as usize;
        Ok((&self.tiled[at], cfg))
    }
}

/// The checked sizes of a call and its kernel parameters (contiguous layouts of
/// [`crate::flash_ref`]).
fn params(op: &'static str, s: &FlashShape, scale: f32) -> Result<FlashParams> {
    if s.hkv == 0 || !s.h.is_multiple_of(s.hkv) {
        return Err(bad(
            op,
            format!("{} kv heads do not divide {} heads", s.hkv, s.h),
        ));
    }
    if !(s.sb == 1 || s.sb == s.b) {
        return Err(bad(
            op,
            format!("`starts` has {} rows, want 1 or {}", s.sb, s.b),
        ));
    }
    if s.h > 65535 || s.b > 65535 {
        return Err(bad(op, format!("{} heads, {} rows: over 65535", s.h, s.b)));
    }
    numel(op, &[s.b, s.h, s.t, s.dh])?;
    let (h, hkv, t, dh) = (s.h as i64, s.hkv as i64, s.t as i64, s.dh as i64);
    Ok(FlashParams {
        q_b: h * t * dh,
        q_h: t * dh,
        q_t: dh,
        k_b: hkv * t * dh,
        k_h: t * dh,
        k_t: dh,
        o_b: t * h * dh,
        o_h: dh,
        o_t: h * dh,
        l_b: t * h,
        l_h: 1,
        l_t: h,
        b: int(op, "batch", s.b)?,
        h: int(op, "heads", s.h)?,
        hkv: int(op, "kv heads", s.hkv)?,
        t: int(op, "t", s.t)?,
        sb: int(op, "starts rows", s.sb)?,
        scale,
    })
}

/// Tiled attention forward: `o: (B, T, H, Dh)` and `lse: (B, T, H)` f32 from `q: (B, H, T, Dh)`,
/// `k, v: (B, Hkv, T, Dh)` and `starts: (SB, T)` u32 (query `i` sees keys `starts[i] ..= i`;
/// every `starts[i] ≤ i`, as `crate::AttnMask` builds them: a query that sees no key gets `O = 0`,
/// `lse = +∞`). All contiguous.
#[allow(clippy::too_many_arguments)]
pub fn flash_fwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    s: &FlashShape,
    q: &CudaView<'_, T>,
    k: &CudaView<'_, T>,
    v: &CudaView<'_, T>,
    starts: &CudaView<'_, u32>,
    o: &mut CudaViewMut<'_, T>,
    lse: &mut CudaViewMut<'_, f32>,
    scale: f32,
) -> Result<()> {
    const OP: &str = "flash_fwd";
    let p = params(OP, s, scale)?;
    let nq = numel(OP, &[s.b, s.h, s.t, s.dh])?;
    let nk = numel(OP, &[s.b, s.hkv, s.t, s.dh])?;
    need(OP, "q", q.len(), nq)?;
    need(OP, "k", k.len(), nk)?;
    need(OP, "v", v.len(), nk)?;
    need(OP, "starts", starts.len(), s.sb * s.t)?;
    need(OP, "o", o.len(), nq)?;
    need(OP, "lse", lse.len(), s.b * s.t * s.h)?;
    if nq == 0 {
        return Ok(());
    }
    let kern = FlashKernels::get(stream.context())?;
    let grid = (s.t.div_ceil(BR) as u32, s.h as u32, s.b as u32);
    let (f, cfg) = kern.tiled::<T>(OP, FlashKernel::Fwd, s.dh, grid)?;
    let mut a = stream.launch_builder(f);
    a.arg(q).arg(k).arg(v).arg(starts).arg(o).arg(lse).arg(&p);
    // SAFETY: argument types and order match flash_fwd_<T>_d<dh> in flash_attn.cu; sizes checked
    // above; the dynamic shared memory is smem_bytes(Fwd) (the kernel traps if it is less).
    unsafe { a.launch(cfg) }.map_err(drv(OP))?;
    Ok(())
}

/// Tiled attention backward: `dq: (B, H, T, Dh)`, `dk, dv: (B, Hkv, T, Dh)` from the forward's
/// inputs, its `o: (B, T, H, Dh)` and `lse: (B, T, H)`, and `d_o: (B, T, H, Dh)`. Three launches
/// on `stream`: `D = rowsum(dO ∘ O)` into a `(B, T, H)` f32 buffer allocated here, dK/dV per key
/// tile, dQ per query tile (no atomics: deterministic).
#[allow(clippy::too_many_arguments)]
pub fn flash_bwd<T: FusedFloat>(
    stream: &Arc<CudaStream>,
    s: &FlashShape,
    [q, k, v, o, d_o]: [&CudaView<'_, T>; 5],
    lse: &CudaView<'_, f32>,
    starts: &CudaView<'_, u32>,
    dq: &mut CudaViewMut<'_, T>,
    dk: &mut CudaViewMut<'_, T>,
    dv: &mut CudaViewMut<'_, T>,
    scale: f32,
) -> Result<()> {
    const OP: &str = "flash_bwd";
    let p = params(OP, s, scale)?;
    let nq = numel(OP, &[s.b, s.h, s.t, s.dh])?;
    let nk = numel(OP, &[s.b, s.hkv, s.t, s.dh])?;
    let rows = s.b * s.t * s.h;
    for (what, len, want) in [
        ("q", q.len(), nq),
        ("k", k.len(), nk),
        ("v", v.len(), nk),
        ("o", o.len(), nq),
        ("d_o", d_o.len(), nq),
        ("lse", lse.len(), rows),
        ("starts", starts.len(), s.sb * s.t),
        ("dq", dq.len(), nq),
        ("dk", dk.len(), nk),
        ("dv", dv.len(), nk),
    ] {
        need(OP, what, len, want)?;
    }
    if nq == 0 {
        return Ok(());
    }
    let kern = FlashKernels::get(stream.context())?;
    let mut dd = stream.alloc_zeros::<f32>(rows).map_err(drv(OP))?;
    let dh_i = int(OP, "head dim", s.dh)?;
    // D: one warp per (b, i, h), 8 warps a block, grid-stride.
    let pre_cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(8).clamp(1, 65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut a = stream.launch_builder(&kern.pre[T::INDEX]);
    a.arg(o).arg(d_o).arg(&mut dd).arg(&p).arg(&dh_i);
    // SAFETY: matches flash_bwd_pre_<T>(o, d_o, dd, params, dh); dd holds B·T·H floats.
    unsafe { a.launch(pre_cfg) }.map_err(drv(OP))?;

    let grid = (s.t.div_ceil(BC) as u32, s.hkv as u32, s.b as u32);
    let (f, cfg) = kern.tiled::<T>(OP, FlashKernel::BwdDkdv, s.dh, grid)?;
    let mut a = stream.launch_builder(f);
    a.arg(q)
        .arg(k)
        .arg(v)
        .arg(d_o)
        .arg(lse)
        .arg(&dd)
        .arg(starts)
        .arg(dk)
        .arg(dv)
        .arg(&p);
    // SAFETY: matches flash_bwd_dkdv_<T>_d<dh>; sizes checked above; shared memory as in
    // smem_bytes(BwdDkdv).
    unsafe { a.launch(cfg) }.map_err(drv(OP))?;

    let grid = (s.t.div_ceil(BR) as u32, s.h as u32, s.b as u32);
    let (f, cfg) = kern.tiled::<T>(OP, FlashKernel::BwdDq, s.dh, grid)?;
    let mut a = stream.launch_builder(f);
    a.arg(q)
        .arg(k)
        .arg(v)
        .arg(d_o)
        .arg(lse)
        .arg(&dd)
        .arg(starts)
        .arg(dq)
        .arg(&p);
    // SAFETY: matches flash_bwd_dq_<T>_d<dh>; sizes checked above; shared memory as in
    // smem_bytes(BwdDq).
    unsafe { a.launch(cfg) }.map_err(drv(OP))?;
    Ok(())
}
