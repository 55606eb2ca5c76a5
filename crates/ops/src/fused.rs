//! Which of the fused CUDA kernels of issue 48 (item 3) the CUDA path takes, so that one GPU call
//! can measure each one's share against the unfused path it replaces: `RTUNE_UNFUSED`, a comma
//! list of [`Fused`] names (or `all`), turns them off; unset, every one wired is on. Read once per
//! process. The CPU always runs the unfused ops (each one pass there already).
//!
//! Wired so far: `ce_softcap` (the soft-capped cross-entropy, `crate::ce`) and `cudnn` (attention
//! through cuDNN's fused SDPA, `crate::attention::cudnn`; off, the own flash kernel runs). The residual add +
//! RMSNorm (`crate::add_norm`) and RoPE in place on q/k (`rope::cuda::rope_qk`) have kernels,
//! launchers and checks but no caller in the layer yet: they get a name here when they do.

use std::sync::OnceLock;

use candle_core::{bail, Device, Result};

/// A fused CUDA path with an off switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fused {
    /// The final-logit soft cap inside the cross-entropy's kernels (`ce_capped_{fwd,bwd}`)
    /// instead of `softcap_logits` → `ce_fwd` / `ce_bwd` → `softcap_logits_backward`.
    CeSoftcap,
    /// The tiled attention through cuDNN's fused SDPA (`crate::attention::cudnn`, item 1) instead
    /// of rtune's own flash kernel (`kernels/flash_attn.cu`).
    Cudnn,
}

impl Fused {
    /// Every switch, with its name in `RTUNE_UNFUSED`.
    pub const ALL: [(Fused, &'static str); 2] =
        [(Fused::CeSoftcap, "ce_softcap"), (Fused::Cudnn, "cudnn")];

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

/// Whether the fused path `f` runs on `dev`: a CUDA device, and `f` not turned off by
/// `RTUNE_UNFUSED`.
pub fn on(dev: &Device, f: Fused) -> Result<bool> {
    static OFF: OnceLock<std::result::Result<Vec<Fused>, String>> = OnceLock::new();
    if !dev.is_cuda() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unfused_names_parse_and_unknown_ones_are_refused() {
        assert_eq!(parse_unfused("").unwrap(), vec![]);
        assert_eq!(parse_unfused("ce_softcap").unwrap(), vec![Fused::CeSoftcap]);
        assert_eq!(
            parse_unfused(" all ").unwrap(),
            vec![Fused::CeSoftcap, Fused::Cudnn]
        );
        assert_eq!(parse_unfused("cudnn").unwrap(), vec![Fused::Cudnn]);
        let e = parse_unfused("ce_softcap,rope").unwrap_err().to_string();
        assert!(e.contains("\"rope\"") && e.contains("cudnn"), "{e}");
        assert!(!on(&Device::Cpu, Fused::Cudnn).unwrap());
        // The CPU never takes a fused path.
        assert!(!on(&Device::Cpu, Fused::CeSoftcap).unwrap());
        assert_eq!(Fused::CeSoftcap.name(), "ce_softcap");
    }
}
