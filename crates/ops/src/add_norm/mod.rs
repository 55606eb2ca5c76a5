//! The residual add fused into the RMSNorm that follows it (issue 48, item 3): the layer's
//! `h = x + a` (`crate::add`) then `y = norm(h)` ([`crate::norm`]) as one pass over each row, and
//! in the backward `dh = d_out + norm_backward(dy)` (the residual stream's gradient plus the
//! norm's) as one. Both norm forms: Llama's (`w` in the input's type, `T(T(h·r)·w)`) and the f32
//! weight of [`crate::rms_norm_plus_one`] (Gemma's `1 + w`, added once at load; OLMo 2's `w`):
//! `T(h·r·w)` in f32, one rounding.
//!
//! The op's files: this one, `reference.rs` (the plain formulation on f32 slices, restating
//! `add` then `norm` step by step: what the kernels are checked against), `cuda.rs` (launchers of
//! `kernels/add_norm.cuh`), `check.rs` (the kernels against the reference, for `rtune selftest`).
//! On the CPU the layer keeps the two ops (`add` and `norm` are each one pass already there).

#[cfg(feature = "kernels")]
pub mod check;
#[cfg(feature = "kernels")]
pub mod cuda;
pub mod reference;
#[cfg(test)]
mod tests;
