//! candle's CUDA devices as the trainer uses them (feature `cuda`): opening `cuda:N` with the
//! memory pool set up ([`open`]), the card in words ([`describe`]), and the read-out of the driver
//! errors cudarc records where it cannot return them ([`deferred_error`]). (A QLoRA base resident on
//! the GPU as NF4 is `rtune_ops::nf4`.)

use candle_core::{CudaDevice, Device, Result};

fn kerr(e: crate::KernelError) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// `e` without the backtraces candle wraps around errors (the error itself, one line).
fn without_backtrace(e: candle_core::Error) -> candle_core::Error {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => without_backtrace(*inner),
        other => other,
    }
}

/// The CUDA device behind a candle device.
pub fn cuda_device(d: &Device) -> Result<&CudaDevice> {
    match d {
        Device::Cuda(c) => Ok(c),
        other => candle_core::bail!("expected a CUDA device, got {other:?}"),
    }
}

/// Opens `cuda:N` for training: candle's device, with the stream-ordered memory pool told to keep
/// what it has allocated (by default it returns memory to the driver at every synchronisation,
/// so each step would allocate its activations from the driver again).
pub fn open(ordinal: usize) -> Result<Device> {
    // No driver or no device is a one-line error (candle attaches a backtrace to the driver's
    // error, which the CLI would print frame by frame).
    let d = Device::new_cuda(ordinal).map_err(without_backtrace)?;
    crate::memory::keep_pool(ordinal).map_err(kerr)?;
    Ok(d)
}

/// `cuda:N`'s card in words for `rtune check` and `rtune bench`: name, compute capability and
/// memory, e.g. `cuda:0, NVIDIA H200 (sm_90), 149.4 GB of which 148.9 GB free`.
pub fn describe(device: &Device) -> Result<String> {
    let d = cuda_device(device)?;
    let ctx = d.cuda_stream().context().clone();
    let e = |what: &str, err: cudarc::driver::DriverError| {
        candle_core::Error::Msg(format!("describing cuda:{}: {what}: {err}", ctx.ordinal()))
    };
    let name = ctx.name().map_err(|err| e("cuDeviceGetName", err))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|err| e("compute capability", err))?;
    ctx.bind_to_thread()
        .map_err(|err| e("cuCtxSetCurrent", err))?;
    let (free, total) = crate::memory::free_and_total().map_err(kerr)?;
    Ok(format!(
        "cuda:{}, {name} (sm_{major}{minor}), {:.1} GB of which {:.1} GB free",
        ctx.ordinal(),
        total as f64 / 1e9,
        free as f64 / 1e9
    ))
}

/// The driver error cudarc recorded, if any, since the last call (then clears it). cudarc cannot
/// return errors from `Drop` (freeing a device or pinned buffer, destroying an event or stream,
/// the stream waits it inserts for event tracking): it stores the last one in the context's error
/// slot (`CudaContext::record_err`), where nothing reads it unless asked. The trainer asks at every
/// step boundary and at the end of the run. `Ok` on a non-CUDA device.
pub fn deferred_error(device: &Device) -> std::result::Result<(), cudarc::driver::DriverError> {
    match device {
        Device::Cuda(d) => d.cuda_stream().context().check_err(),
        _ => Ok(()),
    }
}
