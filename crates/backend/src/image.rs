//! The compiled forms of each `kernels/*.cu` that `build.rs` embeds (one const per file, generated:
//! see `build.rs`), and which one a device loads:
//! the cubin (SASS) built for its architecture when there is one, else the PTX, JIT-compiled by the
//! driver on first load (seconds for all modules, once per process). Without the `cuda` feature
//! only the choice itself ([`pick_cubin`], plain logic) exists.
//!
//! Compatibility rule (CUDA's binary compatibility): a cubin for `sm_XY` runs on devices of the
//! same major version X and minor version ≥ Y (`sm_80` on 8.0, 8.6, 8.7, 8.9); never across major
//! versions, so 10.x and 12.x devices run the PTX. The highest such cubin is chosen.

/// The architectures `build.rs` builds a cubin of every kernel file for (`sm_80`: A100; `sm_90`:
/// H100, H200). `build.rs` has the same list.
pub const CUBIN_ARCHS: [u32; 2] = [80, 90];

/// The cubin architecture (`XY` of `sm_XY`) to load on a device of compute capability
/// `(major, minor)`, among `available`; `None`: load the PTX.
pub fn pick_cubin(cc: (i32, i32), available: &[u32]) -> Option<u32> {
    let (major, minor) = (u32::try_from(cc.0).ok()?, u32::try_from(cc.1).ok()?);
    available
        .iter()
        .copied()
        .filter(|a| a / 10 == major && a % 10 <= minor)
        .max()
}

/// What a device loaded for the kernel modules (for selftest's report).
pub fn describe_choice(cc: (i32, i32)) -> String {
    match pick_cubin(cc, &CUBIN_ARCHS) {
        Some(a) => format!("sm_{a} cubins (compute capability {}.{})", cc.0, cc.1),
        None => format!(
            "PTX, JIT-compiled by the driver (compute capability {}.{}: no cubin among sm_{:?})",
            cc.0, cc.1, CUBIN_ARCHS
        ),
    }
}

#[cfg(feature = "kernels")]
pub use cuda::*;

#[cfg(feature = "kernels")]
mod cuda {
    use std::sync::Arc;

    use cudarc::driver::{CudaContext, CudaModule};
    use cudarc::nvrtc::Ptx;

    use super::pick_cubin;
    use crate::{drv, Result};

    /// One kernel file, compiled: its PTX and a cubin per architecture of [`super::CUBIN_ARCHS`].
    pub struct KernelImage {
        /// The `.cu` file's stem.
        pub name: &'static str,
        pub ptx: &'static str,
        /// `(XY of sm_XY, cubin)`
        pub cubins: &'static [(u32, &'static [u8])],
    }

    // One `KernelImage` const per `kernels/*.cu` (`NF4`, `FUSED`, `ATTN`, `FLASH_ATTN`, `ADAMW`,
    // `DROPOUT`, ...) and `ALL`, written by build.rs from the files it compiled: a new kernel file
    // needs no entry here.
    include!(concat!(env!("OUT_DIR"), "/images.rs"));

    /// Loads `image` into `ctx`: the cubin for the device's architecture ([`pick_cubin`]), or the
    /// PTX when there is none or the driver refuses the cubin (then the PTX's error is returned).
    pub fn load(ctx: &Arc<CudaContext>, image: &KernelImage) -> Result<Arc<CudaModule>> {
        let cc = ctx
            .compute_capability()
            .map_err(drv("reading the compute capability"))?;
        let archs: Vec<u32> = image.cubins.iter().map(|(a, _)| *a).collect();
        let cubin = pick_cubin(cc, &archs)
            .and_then(|a| image.cubins.iter().find(|(x, _)| *x == a))
            .map(|(_, bytes)| *bytes);
        if let Some(bytes) = cubin {
            if let Ok(m) = ctx.load_module(Ptx::from_binary(bytes.to_vec())) {
                return Ok(m);
            }
        }
        ctx.load_module(Ptx::from_src(image.ptx))
            .map_err(drv("loading a kernel module's PTX"))
    }
}

#[cfg(test)]
mod tests {
    use super::{describe_choice, pick_cubin, CUBIN_ARCHS};

    #[test]
    fn the_cubin_of_the_same_major_and_lower_or_equal_minor() {
        let a = &CUBIN_ARCHS;
        assert_eq!(pick_cubin((8, 0), a), Some(80)); // A100
        assert_eq!(pick_cubin((8, 6), a), Some(80)); // A10, RTX 30xx
        assert_eq!(pick_cubin((8, 9), a), Some(80)); // L4, L40
        assert_eq!(pick_cubin((9, 0), a), Some(90)); // H100, H200
                                                     // No cubin runs across major versions: these JIT the PTX.
        assert_eq!(pick_cubin((7, 5), a), None);
        assert_eq!(pick_cubin((10, 0), a), None);
        assert_eq!(pick_cubin((12, 0), a), None);
        // The highest that qualifies; a cubin for a higher minor never runs on a lower one.
        assert_eq!(pick_cubin((8, 6), &[80, 86, 89]), Some(86));
        assert_eq!(pick_cubin((8, 0), &[86]), None);
        assert_eq!(pick_cubin((-1, 0), a), None);
    }

    #[test]
    fn the_choice_is_described() {
        assert!(describe_choice((9, 0)).starts_with("sm_90 cubins"));
        assert!(describe_choice((12, 0)).starts_with("PTX, JIT"));
    }
}
