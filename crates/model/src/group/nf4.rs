//! A QLoRA group's frozen weights through the grouped NF4 dequantization
//! ([`rtune_ops::nf4::lease`], issue 48 item 4): the members' NF4 weights dequantized by one launch
//! into a reused buffer, the next group's ahead of time on a side stream. When the buffer is the
//! members' `(Σout, in)` concatenation it serves as the group's block (one GEMM, as [`super::fuse`]
//! makes for dense weights); otherwise each member's view is its weight.

use candle_core::{DType, Result};

use crate::linear::{Frozen, Linear};
use rtune_ops::nf4::lease::{self, Lease, Member};

/// The members' dequantized weights for this use, or `None` where each member dequantizes its
/// own (a member not 4-bit, members of different compute dtypes or devices, the grouped path off
/// or not taken: [`lease::lease`]).
pub(super) fn lease(members: &[&Linear]) -> Result<Option<Lease>> {
    let mut ms = Vec::with_capacity(members.len());
    let mut at: Option<(DType, &candle_core::Device)> = None;
    for m in members {
        let Frozen::Quant {
            q, dtype, device, ..
        } = &m.w
        else {
            return Ok(None);
        };
        match at {
            Some((d, dev)) if d != *dtype || !dev.same_device(device) => return Ok(None),
            _ => at = Some((*dtype, device)),
        }
        #[cfg(feature = "cuda")]
        let gpu = match &m.w {
            Frozen::Quant { gpu, .. } => gpu.as_ref(),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let gpu = None;
        ms.push(Member { q, gpu });
    }
    match at {
        Some((dtype, device)) => lease::lease(&ms, dtype, device),
        None => Ok(None),
    }
}
