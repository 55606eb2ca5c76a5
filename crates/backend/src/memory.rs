//! Device memory figures from the driver's stream-ordered memory pool.
//!
//! cudarc (and so candle) allocates with `cuMemAllocAsync` from the device's default pool when the
//! device supports it (every GPU since Pascal with a recent driver). The pool keeps a high-water mark
//! of the bytes handed out (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`): the exact peak of what the program
//! held, not a sample. [`keep_pool`] also raises the pool's release threshold so freed memory stays
//! cached between steps instead of going back to the driver at every synchronisation.

use cudarc::driver::result::{self, device};
use cudarc::driver::sys::{CUmemPool_attribute, CUmemoryPool};
use std::ffi::c_void;

use crate::{drv, Result};

fn pool(ordinal: usize) -> Result<CUmemoryPool> {
    let dev = device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
    // SAFETY: `dev` came from cuDeviceGet.
    unsafe { device::get_default_mem_pool(dev) }.map_err(drv("cuDeviceGetDefaultMemPool"))
}

fn set(ordinal: usize, attr: CUmemPool_attribute, mut v: u64) -> Result<()> {
    let p = pool(ordinal)?;
    // SAFETY: both attributes written here take a cuuint64_t.
    unsafe {
        cudarc::driver::sys::cuMemPoolSetAttribute(p, attr, &mut v as *mut u64 as *mut c_void)
    }
    .result()
    .map_err(drv("cuMemPoolSetAttribute"))
}

fn get(ordinal: usize, attr: CUmemPool_attribute) -> Result<u64> {
    let p = pool(ordinal)?;
    let mut v = 0u64;
    // SAFETY: both attributes read here are cuuint64_t.
    unsafe {
        cudarc::driver::sys::cuMemPoolGetAttribute(p, attr, &mut v as *mut u64 as *mut c_void)
    }
    .result()
    .map_err(drv("cuMemPoolGetAttribute"))?;
    Ok(v)
}

/// Keeps freed memory in the pool (release threshold = unlimited): a training step then reuses the
/// previous step's blocks instead of asking the driver again.
pub fn keep_pool(ordinal: usize) -> Result<()> {
    set(
        ordinal,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        u64::MAX,
    )
}

/// Peak bytes allocated from the pool since the last [`reset_peak`] (or the start).
pub fn peak_bytes(ordinal: usize) -> Result<u64> {
    get(ordinal, CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
}

/// Bytes allocated from the pool now.
pub fn used_bytes(ordinal: usize) -> Result<u64> {
    get(
        ordinal,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
    )
}

/// Restarts the high-water mark (the driver accepts only 0 here).
pub fn reset_peak(ordinal: usize) -> Result<()> {
    set(
        ordinal,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        0,
    )
}

/// `(free, total)` bytes of the current context's device, as `cudaMemGetInfo`.
pub fn free_and_total() -> Result<(usize, usize)> {
    result::mem_get_info().map_err(drv("cuMemGetInfo"))
}
