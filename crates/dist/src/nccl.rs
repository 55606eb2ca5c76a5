//! NCCL for data-parallel CUDA ranks (issue 16; feature `cuda`): [`Nccl`], this rank's
//! communicator, bound to a CUDA stream of its own — the second stream beside candle's compute
//! stream — and [`Nccl::all_reduce_sum`], the in-place sum all-reduce of an f32 candle tensor on
//! that stream.
//!
//! Set-up (`ncclCommInitRank`): rank 0 draws the unique id (`ncclGetUniqueId`), MPI broadcasts
//! its 128 bytes ([`World::broadcast`]), and every rank joins with it on the GPU candle opened
//! for it (`local_rank`, see [`DataParallel::gpu`](crate::DataParallel::gpu)). A world of one
//! (`rtune selftest`) needs no broadcast. The communicator is made through cudarc's
//! `nccl::result` layer, not its safe `Comm`: the watchdog must reach the raw handle from its own
//! thread to call `ncclCommAbort` on a hang, and cudarc's `Comm` neither exposes the handle nor
//! is `Send`.
//!
//! Order between the two streams is cudarc's event tracking (on once the context has a second
//! stream): the all-reduce waits for the last write of the tensor's buffer on the compute stream,
//! and a later read of it on the compute stream waits for the all-reduce. The host waits only in
//! [`Nccl::synchronize`], which the gradient buckets (`buckets.rs`) run under the watchdog.

use std::ffi::{c_char, c_void};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CpuStorage, CudaDevice, CudaStorage, InplaceOp1, InplaceOp2, Layout, Tensor};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DriverError, SyncOnDrop};
use cudarc::nccl::{result, sys};

use crate::gather_plan::{self, Plan, Primitives};
use crate::{DistError, World};

/// This rank's NCCL communicator and its stream.
pub struct Nccl {
    raw: sys::ncclComm_t,
    /// The handle as the watchdog's abort hook sees it (0 once destroyed).
    shared: Arc<AtomicUsize>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    pub rank: usize,
    pub size: usize,
}

impl Nccl {
    /// Joins the communicator of `world` on `dev`. Collective: every rank of `world` calls it at
    /// the same point. The watchdog aborts the communicator before ending a hung rank.
    pub fn init(world: &World, dev: &CudaDevice) -> Result<Self, DistError> {
        let ctx = dev.cuda_stream().context().clone();
        let ordinal = ctx.ordinal();
        let nerr = |op| {
            move |e: result::NcclError| DistError::Nccl {
                op,
                ordinal,
                message: format!("{e:?}"),
            }
        };
        let derr = |op| {
            move |e: DriverError| DistError::Nccl {
                op,
                ordinal,
                message: e.to_string(),
            }
        };
        let mut bytes: Vec<u8> = if world.is_root() {
            let id = result::get_uniqueid().map_err(nerr("ncclGetUniqueId"))?;
            id.internal.iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        world.broadcast("the NCCL unique id", 0, &mut bytes);
        let mut internal: [c_char; 128] = [0; 128];
        if bytes.len() != internal.len() {
            return Err(DistError::Nccl {
                op: "the unique id's broadcast",
                ordinal,
                message: format!("{} bytes received, 128 expected", bytes.len()),
            });
        }
        for (d, s) in internal.iter_mut().zip(&bytes) {
            *d = *s as c_char;
        }
        let id = sys::ncclUniqueId { internal };
        let stream = ctx.new_stream().map_err(derr("a second stream"))?;
        ctx.bind_to_thread().map_err(derr("binding the device"))?;
        let (rank, size) = (world.rank, world.size);
        let mut raw = MaybeUninit::<sys::ncclComm_t>::uninit();
        // Every rank joins here; NCCL's own bootstrap may take seconds on many hosts.
        world.expect_long("the NCCL set-up");
        world
            .watch("the NCCL communicator's set-up (ncclCommInitRank)", || {
                // SAFETY: `raw` is writable for one handle; `id` is rank 0's, and `size`, `rank`
                // this world's, as NCCL requires of every joining rank.
                unsafe { result::comm_init_rank(raw.as_mut_ptr(), size as i32, id, rank as i32) }
            })
            .map_err(nerr("ncclCommInitRank"))?;
        // SAFETY: ncclCommInitRank succeeded, so it wrote the handle.
        let raw = unsafe { raw.assume_init() };
        let shared = Arc::new(AtomicUsize::new(raw as usize));
        let hook = Arc::clone(&shared);
        world.on_timeout(Box::new(move || {
            let h = hook.swap(0, Ordering::SeqCst);
            if h != 0 {
                // SAFETY: `h` is a live communicator (Drop zeroes `shared` before destroying it).
                // ncclCommAbort is meant to be called while the owner waits on a collective that
                // will not complete, from another thread: it releases the spinning kernels.
                let _ = unsafe { result::comm_abort(h as sys::ncclComm_t) };
            }
        }));
        Ok(Self {
            raw,
            shared,
            stream,
            ordinal,
            rank,
            size,
        })
    }

    /// Launches `t = Σ_ranks t` (f32, contiguous) on this communicator's stream, in place; returns
    /// at once. `t` must own its buffer (no other tensor may share it): it is written in place.
    pub fn all_reduce_sum(&self, t: &Tensor) -> candle_core::Result<()> {
        t.inplace_op1(&AllReduce(self))
    }

    /// Launches `out` = every rank's `mine` in rank order, rank r's `counts[r]` elements of
    /// `out`'s dtype (`mine`: this rank's, that many; `out`: their sum), on this communicator's
    /// stream; returns at once (module overview: the ordering). Collective: every rank calls it
    /// with the same `counts`. The calls are [`gather_plan::plan`]'s, which it returns.
    pub fn all_gather_into(
        &self,
        mine: &Tensor,
        counts: &[usize],
        out: &Tensor,
    ) -> candle_core::Result<Plan> {
        let elem = out.dtype().size_in_bytes();
        let bytes: Vec<usize> = counts.iter().map(|&n| n * elem).collect();
        let plan = gather_plan::plan(&bytes);
        self.all_gather_planned(&plan, mine, out)?;
        Ok(plan)
    }

    /// [`all_gather_into`](Self::all_gather_into) by a given plan (byte counts): the selftest runs
    /// [`gather_plan::broadcasts`] in a world of one, where [`gather_plan::plan`] would pick the
    /// all-gather.
    pub fn all_gather_planned(
        &self,
        plan: &Plan,
        mine: &Tensor,
        out: &Tensor,
    ) -> candle_core::Result<()> {
        if plan.counts.len() != self.size {
            candle_core::bail!(
                "NCCL all-gather: {} counts for a world of {}",
                plan.counts.len(),
                self.size
            );
        }
        if mine.dtype() != out.dtype() {
            candle_core::bail!(
                "NCCL all-gather: shard {:?} into a {:?} buffer",
                mine.dtype(),
                out.dtype()
            );
        }
        let elem = out.dtype().size_in_bytes();
        let (have, want) = (mine.elem_count() * elem, plan.counts[self.rank]);
        if have != want {
            candle_core::bail!(
                "NCCL all-gather: rank {}'s shard {:?} is {have} bytes, its count {want}",
                self.rank,
                mine.shape()
            );
        }
        if out.elem_count() * elem != plan.total() {
            candle_core::bail!(
                "NCCL all-gather: buffer {:?} is {} bytes, the shards {}",
                out.shape(),
                out.elem_count() * elem,
                plan.total()
            );
        }
        out.inplace_op2(mine, &AllGather { nccl: self, plan })
    }

    /// Waits until every all-reduce launched so far is done.
    pub fn synchronize(&self) -> Result<(), DistError> {
        self.stream.synchronize().map_err(|e| DistError::Nccl {
            op: "stream synchronize",
            ordinal: self.ordinal,
            message: e.to_string(),
        })
    }

    /// The NCCL library's version (`ncclGetVersion`: 22307 for 2.23.7, 23007 for 2.30.7).
    pub fn version() -> Option<i32> {
        result::get_nccl_version().ok()
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if self.shared.swap(0, Ordering::SeqCst) != 0 {
            let _ = self.stream.synchronize();
            // ncclCommAbort rather than ncclCommDestroy (as cudarc's own `Comm` does): it frees
            // this rank's resources without waiting on the other ranks, which may still be busy
            // (rank 0 writing the adapter) or gone.
            // SAFETY: the handle is live (the abort hook has not taken it) and no collective is
            // pending on it (its stream was just synchronised); nothing uses it afterwards.
            let _ = unsafe { result::comm_abort(self.raw) };
        }
    }
}

/// A sharded base's device gathers through this communicator (`rtune_model::device_gather`):
/// `out[at ..]` by [`Nccl::all_gather_into`], launched on the communicator's stream.
pub struct NcclGather(pub std::rc::Rc<Nccl>);

impl rtune_model::DeviceGather for NcclGather {
    fn all_gather(
        &self,
        what: &str,
        mine: &Tensor,
        counts: &[usize],
        out: &Tensor,
        at: usize,
    ) -> candle_core::Result<()> {
        let n: usize = counts.iter().sum();
        let slot = out.narrow(0, at, n)?;
        self.0
            .all_gather_into(mine, counts, &slot)
            .map(|_| ())
            .map_err(|e| candle_core::Error::Msg(format!("{what}: {e}")))
    }
}

/// The sum all-reduce as a candle in-place op (candle hands it the tensor's CUDA buffer).
struct AllReduce<'a>(&'a Nccl);

impl InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce-sum"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("an NCCL all-reduce needs a CUDA tensor, not a CPU one")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("an NCCL all-reduce needs a contiguous tensor")
        };
        let nccl = self.0;
        let slice = storage.as_cuda_slice_mut::<f32>()?;
        let mut view = slice.slice_mut(start..end);
        // Waits (on the NCCL stream) for the buffer's last write; records this write when dropped.
        let (ptr, _written) = view.device_ptr_mut(&nccl.stream);
        // SAFETY: `ptr` addresses `end − start` f32 of device memory on this communicator's GPU,
        // alive until the recorded write completes (cudarc frees a buffer only after its events);
        // in place (send = receive) is allowed by NCCL; the stream is the communicator's.
        let launched = unsafe {
            result::all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                end - start,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                nccl.raw,
                nccl.stream.cu_stream() as sys::cudaStream_t,
            )
        };
        launched.map_err(|e| candle_core::Error::Msg(format!("ncclAllReduce: {e:?}")))?;
        Ok(())
    }
}

/// The all-gather as a candle in-place op: `out` (written) from `mine` (read), both CUDA.
struct AllGather<'a> {
    nccl: &'a Nccl,
    plan: &'a Plan,
}

/// The device address of a CUDA storage's first byte whatever its dtype, with cudarc's guard
/// (`$ptr`: `device_ptr` to read, `device_ptr_mut` to write) on `$stream`.
macro_rules! storage_ptr {
    ($slice:expr, $ptr:ident, $stream:expr) => {
        match $slice {
            CudaStorageSlice::U8(s)
            | CudaStorageSlice::F6E2M3(s)
            | CudaStorageSlice::F6E3M2(s)
            | CudaStorageSlice::F4(s)
            | CudaStorageSlice::F8E8M0(s) => s.$ptr($stream),
            CudaStorageSlice::U32(s) => s.$ptr($stream),
            CudaStorageSlice::I16(s) => s.$ptr($stream),
            CudaStorageSlice::I32(s) => s.$ptr($stream),
            CudaStorageSlice::I64(s) => s.$ptr($stream),
            CudaStorageSlice::BF16(s) => s.$ptr($stream),
            CudaStorageSlice::F16(s) => s.$ptr($stream),
            CudaStorageSlice::F32(s) => s.$ptr($stream),
            CudaStorageSlice::F64(s) => s.$ptr($stream),
            CudaStorageSlice::F8E4M3(s) => s.$ptr($stream),
        }
    };
}

/// The first byte of a contiguous tensor's elements in its storage.
fn first_byte(l: &Layout, elem: usize) -> candle_core::Result<usize> {
    match l.contiguous_offsets() {
        Some((start, _)) => Ok(start * elem),
        None => candle_core::bail!("an NCCL all-gather needs contiguous tensors"),
    }
}

impl InplaceOp2 for AllGather<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-gather"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("an NCCL all-gather needs CUDA tensors, not CPU ones")
    }

    fn cuda_fwd(
        &self,
        out: &mut CudaStorage,
        out_l: &Layout,
        mine: &CudaStorage,
        mine_l: &Layout,
    ) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        let nccl = self.nccl;
        let elem = out.dtype().size_in_bytes();
        let (send_at, recv_at) = (first_byte(mine_l, elem)?, first_byte(out_l, elem)?);
        // Each waits (on the NCCL stream) for the buffer's last write; dropped after the calls,
        // they record the read of the shard and the write of the buffer.
        let (send, _read): (u64, SyncOnDrop<'_>) =
            storage_ptr!(&mine.slice, device_ptr, &nccl.stream);
        let (recv, _written): (u64, SyncOnDrop<'_>) =
            storage_ptr!(&mut out.slice, device_ptr_mut, &nccl.stream);
        let mut issue = Issue {
            nccl,
            send: send + send_at as u64,
            recv: recv + recv_at as u64,
        };
        gather_plan::execute(self.plan, &mut issue)
            .map_err(|e| candle_core::Error::Msg(format!("NCCL all-gather: {e:?}")))
    }
}

/// A plan's calls as NCCL calls on the communicator's stream, over one rank's send and receive
/// addresses. Bytes (`ncclUint8`): these collectives copy, whatever the type.
struct Issue<'a> {
    nccl: &'a Nccl,
    send: u64,
    recv: u64,
}

impl Primitives for Issue<'_> {
    type Error = result::NcclError;

    fn all_gather(&mut self, count: usize) -> Result<(), result::NcclError> {
        // SAFETY: `send` addresses this rank's `count` bytes and `recv` the `size · count` of the
        // buffer (checked against the plan by `all_gather_planned`), on the communicator's GPU and
        // alive until the recorded events complete; the stream is the communicator's.
        unsafe {
            result::all_gather(
                self.send as *const c_void,
                self.recv as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                self.nccl.raw,
                self.nccl.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map(|_| ())
    }

    fn group_start(&mut self) -> Result<(), result::NcclError> {
        result::group_start().map(|_| ())
    }

    fn broadcast(&mut self, root: usize, at: usize, count: usize) -> Result<(), result::NcclError> {
        // SAFETY: as in `all_gather`: on `root`, `send` addresses its `count` bytes; `recv + at`
        // is slot `root`, `count` bytes inside the buffer (the plan's offsets).
        unsafe {
            result::broadcast(
                self.send as *const c_void,
                (self.recv + at as u64) as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                root as i32,
                self.nccl.raw,
                self.nccl.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map(|_| ())
    }

    fn group_end(&mut self) -> Result<(), result::NcclError> {
        result::group_end().map(|_| ())
    }
}
