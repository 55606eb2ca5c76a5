//! The residual add fused into the RMSNorm that follows it (issue 48, item 3): the layer's
//! `h = x + a` (`crate::add`) then `y = norm(h)` ([`crate::norm`]) as one pass over each row, and
//! in the backward `dh = d_out + norm_backward(dy)` (the residual stream's gradient plus the
//! norm's) as one. Both norm forms: Llama's (`w` in the input's type, `T(T(h·r)·w)`) and the f32
//! weight of [`crate::rms_norm_plus_one`] (Gemma's `1 + w`, added once at load; OLMo 2's `w`):
//! `T(h·r·w)` in f32, one rounding.
//!
//! The op's files: this one (what the layer calls: [`add_rms_norm`], [`add_rms_norm_backward`]),
//! `op.rs` (the candle ops: checks, `cpu_fwd` on the reference, `cuda_fwd` on the kernels),
//! `reference.rs` (the plain formulation on f32 slices, restating `add` then `norm` step by step:
//! what the kernels are checked against), `cuda.rs` (launchers of `kernels/add_norm.cuh`),
//! `check.rs` (the kernels against the reference, for `rtune selftest`).
//!
//! On CUDA the fused op runs unless `RTUNE_UNFUSED=add_norm` ([`crate::fused`]); on the CPU the
//! layer keeps the two ops (`add` and `norm` are each one pass already there).

#[cfg(feature = "kernels")]
pub mod check;
#[cfg(feature = "kernels")]
pub mod cuda;
pub mod op;
pub mod reference;
#[cfg(test)]
mod tests;

use candle_core::{DType, Result, Tensor};

use crate::fused::{self, Fused};
use crate::norm::NormCache;
pub use reference::Weight;

/// The norm weight's form: of the input's type (`rms_norm`), or f32 (`rms_norm_plus_one`). An
/// f32 weight on f32 inputs is the typed form (the two norms are one function there).
fn form(x: &Tensor, f32_weight: bool) -> Weight {
    if f32_weight && x.dtype() != DType::F32 {
        Weight::F32
    } else {
        Weight::Typed
    }
}

/// The residual add and the RMSNorm after it: `h = x + res`, `y = norm(h)` with weight `w: (D)`
/// (Gemma's/OLMo 2's f32 form when `f32_weight`: [`crate::rms_norm_plus_one`], else
/// [`crate::rms_norm`]). `x, res: (N, D)` → `(h, y, cache of the norm)`. One kernel on CUDA
/// ([`op::add_rms_norm`]); `add` then the norm elsewhere, or with `RTUNE_UNFUSED=add_norm`.
pub fn add_rms_norm(
    x: &Tensor,
    res: &Tensor,
    w: &Tensor,
    eps: f64,
    f32_weight: bool,
) -> Result<(Tensor, Tensor, NormCache)> {
    if fused::on(x.device(), Fused::AddNorm)? {
        fused::ran(Fused::AddNorm);
        let (h, y) = op::add_rms_norm(x, res, w, eps, form(x, f32_weight))?;
        return Ok((h.clone(), y, NormCache { x: h, eps }));
    }
    let h = crate::add(x, res)?;
    let (y, c) = if f32_weight {
        crate::rms_norm_plus_one(&h, w, eps)?
    } else {
        crate::rms_norm(&h, w, eps)?
    };
    Ok((h, y, c))
}

/// [`add_rms_norm`]'s backward: `dres + norm_backward(dy)` (the residual stream's gradient plus
/// the norm's), `dres, dy: (N, D)`; `c` the norm's cache (its input `h`). `dres` is not changed.
pub fn add_rms_norm_backward(
    dres: &Tensor,
    dy: &Tensor,
    w: &Tensor,
    c: &NormCache,
    f32_weight: bool,
) -> Result<Tensor> {
    if fused::on(dy.device(), Fused::AddNorm)? {
        fused::ran(Fused::AddNorm);
        return op::add_rms_norm_bwd(dy, &c.x, dres, w, c.eps, form(&c.x, f32_weight));
    }
    let dn = if f32_weight {
        crate::rms_norm_plus_one_backward(dy, w, c)?
    } else {
        crate::rms_norm_backward(dy, w, c)?
    };
    crate::add(dres, &dn)
}
