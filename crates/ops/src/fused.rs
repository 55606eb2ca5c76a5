//! Which of the fused CUDA kernels of issue 48 (item 3) the CUDA path takes, so that one GPU call
//! can measure each one's share against the unfused path it replaces: `RTUNE_UNFUSED`, a comma
//! list of [`Fused`] names (or `all`), turns them off; unset, every one wired is on. Read once per
//! process. The CPU runs the unfused ops (each one pass there already), but for `lora_bf16`
//! when asked for with `RTUNE_ONEDNN_LORA=on` and oneDNN is in use (issue 47: the bf16 LoRA
//! products on its bf16 kernels, `rtune_backend::onednn::acc::lora_bf16`), and `onednn_attn`
//! (the tiled attention's bf16 score products on oneDNN, `crate::attention::tiled`) whenever
//! oneDNN is in use.
//!
//! Wired: `ce_softcap` (the soft-capped cross-entropy, `crate::ce`), `add_norm` (the residual add
//! and the RMSNorm after it, forward and backward: `crate::add_norm::add_rms_norm`, called by the
//! decoder layer), `lora_bf16` (the LoRA branch in bf16/f16 on cuBLAS with `beta = 1`:
//! `rtune-model`'s `linear` and `group`, through [`crate::lora::acc`]), `cudnn` (attention through
//! cuDNN's fused SDPA, `crate::attention::cudnn`; off, the own flash kernel runs), `nf4_group`
//! and `nf4_prefetch` (a QLoRA layer's grouped NF4 dequantization into reused buffers and its
//! prefetch on a side stream: ``rtune-model`'s `group/nf4.rs`).
//!
//! Not wired: RoPE on q and k in place (`rope::cuda::rope_qk`). The attention makes q and k
//! contiguous `(B, H, T, Dh)` copies of the projection's `(N, H·Dh)` columns before rotating them;
//! rotating those copies in place saves one launch and an allocation, not a pass over memory
//! (copy, then read and write again, either way). The pass is saved by rotating in the
//! projection's own layout, which needs an attention that reads strided `(B, T, H, Dh)` inputs
//! (cuDNN's does): the kernel's caller comes with that.
//!
//! Tests (feature `test-util`): [`forced`] runs a closure with chosen fused paths taken on the CPU
//! too (each op's `cpu_fwd` is its slice reference, so the layer's wiring of the fused op is
//! checked against the unfused ops without a GPU), and counts the fused ops it ran, so a test
//! fails if the wiring falls back to the unfused ops; [`without`] runs one with chosen paths
//! off (the unfused reference a test compares against, where the CPU would take the fused one).

use std::sync::OnceLock;

use candle_core::{bail, Device, Result};

/// A fused CUDA path with an off switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fused {
    /// The final-logit soft cap inside the cross-entropy's kernels (`ce_capped_{fwd,bwd}`)
    /// instead of `softcap_logits` → `ce_fwd` / `ce_bwd` → `softcap_logits_backward`.
    CeSoftcap,
    /// The residual add and the RMSNorm after it as one kernel (`add_rms_norm{,1}_{fwd,bwd}`)
    /// instead of `add` → `rms_norm` (and `rms_norm_bwd` → `add` in the backward).
    AddNorm,
    /// The LoRA branch in the compute dtype on cuBLAS (bf16/f16 without dropout or DoRA): its
    /// products added into the frozen path's by GEMMs with `beta = 1` ([`crate::lora::acc`])
    /// instead of in f32 from casts of the input and the output gradient.
    LoraBf16,
    /// The tiled attention through cuDNN's fused SDPA (`crate::attention::cudnn`, item 1) instead
    /// of rtune's own flash kernel (`kernels/flash_attn.cu`).
    Cudnn,
    /// A QLoRA layer's q/k/v (and gate/up) NF4 weights dequantized by one launch into one of two
    /// reused buffers (`rtune-model`'s `group/nf4.rs`, item 4) instead of one launch and one allocation per
    /// weight; off, [`Fused::Nf4Prefetch`] is off too.
    Nf4Group,
    /// The CPU tiled attention's score products (`S = Q·Kᵀ`, and `dP = dO·Vᵀ` in the
    /// backward) of bf16 inputs through oneDNN on each rayon worker
    /// (`rtune_backend::onednn::tile`; when oneDNN is in use) instead of the gemm crate in f32.
    OnednnAttn,
    /// With [`Fused::Nf4Group`]: the next group's dequantization issued ahead of its use on a
    /// side stream (`rtune_backend::ring`'s prediction); off, every group is dequantized on request
    /// on the compute stream (still into the reused buffers).
    Nf4Prefetch,
}

impl Fused {
    /// Every switch, with its name in `RTUNE_UNFUSED`.
    pub const ALL: [(Fused, &'static str); 7] = [
        (Fused::CeSoftcap, "ce_softcap"),
        (Fused::AddNorm, "add_norm"),
        (Fused::LoraBf16, "lora_bf16"),
        (Fused::Cudnn, "cudnn"),
        (Fused::Nf4Group, "nf4_group"),
        (Fused::Nf4Prefetch, "nf4_prefetch"),
        (Fused::OnednnAttn, "onednn_attn"),
    ];

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(f, _)| *f == self)
            .map_or("?", |e| e.1)
    }
}

/// The names `RTUNE_UNFUSED` turns off, checked: an unknown name is an error naming it and the
/// known ones (a misspelt switch would otherwise measure the fused path as the unfused one).
pub fn parse_unfused(value: &str) -> Result<Vec<Fused>> {
    let mut off = Vec::new();
    for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if name == "all" {
            off.extend(Fused::ALL.iter().map(|e| e.0));
            continue;
        }
        match Fused::ALL.iter().find(|e| e.1 == name) {
            Some(e) => off.push(e.0),
            None => {
                let known: Vec<&str> = Fused::ALL.iter().map(|e| e.1).collect();
                bail!(
                    "RTUNE_UNFUSED={value:?}: unknown name {name:?}; expected `all` or a comma \
                     list of {known:?}"
                )
            }
        }
    }
    Ok(off)
}

/// `RTUNE_UNFUSED` checked now (it is otherwise read at the first fused op on a GPU): a command
/// calls this before building anything, so a misspelt switch, or one this build does not have,
/// is refused at once with the known names.
pub fn check_env() -> Result<()> {
    match std::env::var("RTUNE_UNFUSED") {
        Ok(v) => parse_unfused(&v).map(|_| ()),
        Err(_) => Ok(()),
    }
}

/// Whether the fused path `f` runs on `dev`: a CUDA device (or, for `lora_bf16`, a CPU with
/// `RTUNE_ONEDNN_LORA=on` and oneDNN in use; for `onednn_attn`, a CPU with oneDNN in use), and
/// `f` not turned off by `RTUNE_UNFUSED`.
pub fn on(dev: &Device, f: Fused) -> Result<bool> {
    static OFF: OnceLock<std::result::Result<Vec<Fused>, String>> = OnceLock::new();
    #[cfg(any(test, feature = "test-util"))]
    let (cpu_forced, denied) = (force::is_forced(f), force::is_denied(f));
    #[cfg(not(any(test, feature = "test-util")))]
    let (cpu_forced, denied) = (false, false);
    if denied {
        return Ok(false);
    }
    let cpu = dev.is_cpu()
        && match f {
            Fused::LoraBf16 => rtune_backend::onednn::acc::lora_bf16(),
            Fused::OnednnAttn => rtune_backend::onednn::get().is_ok(),
            _ => false,
        };
    if !dev.is_cuda() && !cpu_forced && !cpu {
        return Ok(false);
    }
    let off = OFF.get_or_init(|| match std::env::var("RTUNE_UNFUSED") {
        Ok(v) => parse_unfused(&v).map_err(|e| e.to_string()),
        Err(_) => Ok(Vec::new()),
    });
    match off {
        Ok(off) => Ok(!off.contains(&f)),
        Err(e) => bail!("{e}"),
    }
}

/// Marks that a fused path ran (counted under `forced`, in tests; nothing otherwise).
pub fn ran(f: Fused) {
    #[cfg(any(test, feature = "test-util"))]
    force::count(f);
    #[cfg(not(any(test, feature = "test-util")))]
    let _ = f;
}

#[cfg(any(test, feature = "test-util"))]
pub use force::{forced, without};

/// The tests' override: fused paths taken on the CPU, per thread.
#[cfg(any(test, feature = "test-util"))]
mod force {
    use super::Fused;
    use std::cell::RefCell;

    thread_local! {
        /// The forced paths and how many fused ops of each ran (`None` outside [`forced`]).
        static FORCED: RefCell<Option<Vec<(Fused, usize)>>> = const { RefCell::new(None) };
        /// The paths turned off inside [`without`].
        static DENIED: RefCell<Vec<Fused>> = const { RefCell::new(Vec::new()) };
    }

    pub(super) fn is_denied(f: Fused) -> bool {
        DENIED.with(|c| c.borrow().contains(&f))
    }

    /// `body()` with the fused paths `fs` off on every device of this thread, whatever the
    /// device or `RTUNE_UNFUSED` would choose (the unfused reference of a comparison).
    pub fn without<R>(fs: &[Fused], body: impl FnOnce() -> R) -> R {
        let prev = DENIED.with(|c| std::mem::replace(&mut *c.borrow_mut(), fs.to_vec()));
        let out = body();
        DENIED.with(|c| *c.borrow_mut() = prev);
        out
    }

    pub(super) fn is_forced(f: Fused) -> bool {
        FORCED.with(|c| {
            c.borrow()
                .as_ref()
                .is_some_and(|v| v.iter().any(|e| e.0 == f))
        })
    }

    pub(super) fn count(f: Fused) {
        FORCED.with(|c| {
            if let Some(e) = c.borrow_mut().iter_mut().flatten().find(|e| e.0 == f) {
                e.1 += 1;
            }
        })
    }

    /// `body()` with the fused paths `fs` taken on every device of this thread (on the CPU the
    /// fused ops run their slice references), and how many fused ops of each of `fs` ran, in
    /// `fs`' order. Not reentrant: the counts of an outer call restart.
    pub fn forced<R>(fs: &[Fused], body: impl FnOnce() -> R) -> (R, Vec<usize>) {
        FORCED.with(|c| *c.borrow_mut() = Some(fs.iter().map(|&f| (f, 0)).collect()));
        let out = body();
        let counts = FORCED.with(|c| c.borrow_mut().take()).unwrap_or_default();
        (out, counts.into_iter().map(|e| e.1).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unfused_names_parse_and_unknown_ones_are_refused() {
        assert_eq!(parse_unfused("").unwrap(), vec![]);
        assert_eq!(parse_unfused("ce_softcap").unwrap(), vec![Fused::CeSoftcap]);
        assert_eq!(
            parse_unfused(" all ").unwrap(),
            vec![
                Fused::CeSoftcap,
                Fused::AddNorm,
                Fused::LoraBf16,
                Fused::Cudnn,
                Fused::Nf4Group,
                Fused::Nf4Prefetch,
                Fused::OnednnAttn
            ]
        );
        assert_eq!(parse_unfused("nf4_group").unwrap(), vec![Fused::Nf4Group]);
        assert_eq!(parse_unfused("add_norm").unwrap(), vec![Fused::AddNorm]);
        assert_eq!(parse_unfused("cudnn").unwrap(), vec![Fused::Cudnn]);
        assert_eq!(
            parse_unfused("onednn_attn").unwrap(),
            vec![Fused::OnednnAttn]
        );
        assert_eq!(
            on(&Device::Cpu, Fused::OnednnAttn).unwrap(),
            rtune_backend::onednn::get().is_ok()
                && !std::env::var("RTUNE_UNFUSED").is_ok_and(|v| v.contains("onednn_attn"))
        );
        let e = parse_unfused("ce_softcap,rope").unwrap_err().to_string();
        assert!(e.contains("\"rope\"") && e.contains("cudnn"), "{e}");
        assert!(!on(&Device::Cpu, Fused::Cudnn).unwrap());
        // The CPU never takes a fused path.
        assert!(!on(&Device::Cpu, Fused::CeSoftcap).unwrap());
        assert_eq!(Fused::CeSoftcap.name(), "ce_softcap");
        // ... unless a test forces it, and then only the paths it names, on its own thread.
        let (on_cpu, n) = forced(&[Fused::AddNorm], || {
            ran(Fused::AddNorm);
            ran(Fused::CeSoftcap);
            [Fused::AddNorm, Fused::CeSoftcap].map(|f| on(&Device::Cpu, f).unwrap())
        });
        assert_eq!((on_cpu, n), ([true, false], vec![1]));
        assert!(!on(&Device::Cpu, Fused::AddNorm).unwrap());
    }
}
