//! The CPU's instruction-set extensions, detected once per process: the one place rtune asks the
//! CPU what it has. The fused ops' CPU loops pick their AVX-512F / AVX2 build from it
//! ([`crate::cpu`]), the BLAS loader checks AVX-512 before trusting OpenBLAS's SkylakeX kernels
//! ([`crate::blas`]), and reports list it ([`Features::list`]).
//!
//! Detection is std's `is_x86_feature_detected!` (CPUID plus the OS's XSAVE state, so a feature
//! the OS does not enable reads as absent). AMX has no stable `is_x86_feature_detected!` name: it is
//! read from CPUID leaf 7 directly (the CPU has it; Linux still grants the tile state per process on
//! request, which nothing in rtune makes). Every field is `false` off x86-64.

use std::sync::OnceLock;

/// The extensions rtune cares about (the fused ops' loops, the BLAS choice, the run record).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Features {
    pub sse4_2: bool,
    pub avx: bool,
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512dq: bool,
    pub avx512vl: bool,
    pub avx512_bf16: bool,
    /// AMX tiles with bf16 (`amx-tile` and `amx-bf16` in CPUID; see the module note on the OS).
    pub amx_bf16: bool,
}

impl Features {
    /// Detects the running CPU's extensions (use [`get`]: it does this once).
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            Features {
                sse4_2: has!("sse4.2"),
                avx: has!("avx"),
                avx2: has!("avx2"),
                fma: has!("fma"),
                f16c: has!("f16c"),
                avx512f: has!("avx512f"),
                avx512bw: has!("avx512bw"),
                avx512dq: has!("avx512dq"),
                avx512vl: has!("avx512vl"),
                avx512_bf16: has!("avx512bf16"),
                amx_bf16: amx_bf16(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Features::default()
    }

    /// AVX-512 F, BW, DQ and VL together: what OpenBLAS's SkylakeX kernels use.
    pub fn avx512_skylake(&self) -> bool {
        self.avx512f && self.avx512bw && self.avx512dq && self.avx512vl
    }

    /// Native bf16 products (AVX-512 BF16 or AMX-BF16): what oneDNN's bf16 matmul needs.
    pub fn bf16(&self) -> bool {
        self.avx512_bf16 || self.amx_bf16
    }

    /// The names of the extensions present, in a fixed order (`sse4.2`, `avx`, `avx2`, `fma`,
    /// `f16c`, `avx512f`, `avx512bw`, `avx512dq`, `avx512vl`, `avx512bf16`, `amx-bf16`), as
    /// reports and run records print them.
    pub fn list(&self) -> Vec<&'static str> {
        [
            ("sse4.2", self.sse4_2),
            ("avx", self.avx),
            ("avx2", self.avx2),
            ("fma", self.fma),
            ("f16c", self.f16c),
            ("avx512f", self.avx512f),
            ("avx512bw", self.avx512bw),
            ("avx512dq", self.avx512dq),
            ("avx512vl", self.avx512vl),
            ("avx512bf16", self.avx512_bf16),
            ("amx-bf16", self.amx_bf16),
        ]
        .into_iter()
        .filter_map(|(name, on)| on.then_some(name))
        .collect()
    }
}

/// The running CPU's extensions, detected on the first call.
pub fn get() -> &'static Features {
    static FEATURES: OnceLock<Features> = OnceLock::new();
    FEATURES.get_or_init(Features::detect)
}

/// CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE (Intel SDM vol. 2A, CPUID).
#[cfg(target_arch = "x86_64")]
fn amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // CPUID exists on every x86-64 CPU; leaf 7 only where the maximum leaf (leaf 0's EAX) reaches it.
    #[allow(unused_unsafe)]
    // SAFETY: CPUID is available on every x86-64 CPU and has no side effects.
    let (max_leaf, edx) = unsafe {
        let max = __cpuid(0).eax;
        (max, if max >= 7 { __cpuid_count(7, 0).edx } else { 0 })
    };
    max_leaf >= 7 && edx & (1 << 22) != 0 && edx & (1 << 24) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The list follows the fields, and what the CPU reports agrees with std's detection (so the
    /// fused ops' dispatch, which reads these fields, picks the paths std would).
    #[test]
    fn features_agree_with_std_and_list_them() {
        let f = get();
        assert_eq!(f, &Features::detect(), "detection is stable");
        let list = f.list();
        assert_eq!(list.contains(&"avx2"), f.avx2);
        assert_eq!(list.contains(&"avx512f"), f.avx512f);
        assert_eq!(list.contains(&"amx-bf16"), f.amx_bf16);
        #[cfg(target_arch = "x86_64")]
        {
            assert!(f.sse4_2 == std::arch::is_x86_feature_detected!("sse4.2"));
            assert!(f.avx2 == std::arch::is_x86_feature_detected!("avx2"));
            assert!(f.avx512f == std::arch::is_x86_feature_detected!("avx512f"));
            // An AVX-512 CPU has AVX2, and AVX2 CPUs have AVX.
            assert!(!f.avx512f || f.avx2);
            assert!(!f.avx2 || f.avx);
        }
        let all = Features {
            sse4_2: true,
            avx: true,
            avx2: true,
            fma: true,
            f16c: true,
            avx512f: true,
            avx512bw: true,
            avx512dq: true,
            avx512vl: true,
            avx512_bf16: true,
            amx_bf16: true,
        };
        assert_eq!(all.list().len(), 11);
        assert!(all.avx512_skylake());
        assert!(Features::default().list().is_empty());
        assert!(!Features {
            avx512bw: false,
            ..all
        }
        .avx512_skylake());
    }
}
