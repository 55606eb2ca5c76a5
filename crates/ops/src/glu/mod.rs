//! Gated linear units, `h = T(T(act(g))·u)`: what SwiGLU (`crate::swiglu`, Llama's MLP) and GeGLU
//! (`crate::geglu`, Gemma's) share — the candle ops (`op.rs`), the CPU loops (`cpu.rs`), the CUDA
//! launchers (`cuda.rs`, kernels `kernels/glu.cuh` instantiated per activation by `fused.cu`) and
//! the selftest check (`check.rs`). Each op's folder holds only its [`Activation`]: the f32 steps of
//! its gate and their derivative, in the order of the plain formulation it must equal.
//!
//! Backward: `dg = T((dh·u)·act'(g))`, `du = T(dh·a)` with `a` the gate as the backward forms it
//! (`Activation::bwd`), rounded to `T` first where the plain formulation keeps the gate as a `T`
//! tensor ([`Activation::ROUND_GATE_IN_BWD`]).

#[cfg(feature = "kernels")]
pub mod check;
pub(crate) mod cpu;
#[cfg(feature = "kernels")]
pub mod cuda;
pub mod op;

use rtune_backend::Precision;

/// A gate's activation, in f32.
pub trait Activation: Copy + Send + Sync + 'static {
    /// The forward op's name (`swiglu`); the backward's is `{NAME}_bwd`.
    const NAME: &'static str;
    /// The backward op's name.
    const BWD_NAME: &'static str;
    /// Whether `du` multiplies `dh` by the gate rounded to `T` (GeGLU: the plain formulation keeps
    /// `act(g)` as a `T` tensor) or by its f32 value (SwiGLU).
    const ROUND_GATE_IN_BWD: bool;
    /// `act(x)` as the forward computes it.
    fn fwd(x: f32) -> f32;
    /// `(act(x), act'(x))` as the backward computes them.
    fn bwd(x: f32) -> (f32, f32);
    /// The kernels' slice reference, forward: `(g, u) → h` rounded to `p` where the kernels round
    /// (the op's `reference.rs`).
    fn reference_fwd(g: &[f32], u: &[f32], p: Precision) -> Vec<f32>;
    /// The kernels' slice reference, backward: `(dh, g, u) → [dg; du]`.
    fn reference_bwd(dh: &[f32], g: &[f32], u: &[f32], p: Precision) -> Vec<f32>;
    /// The kernels and check ops of this activation.
    #[cfg(feature = "kernels")]
    const KERNELS: cuda::Kernels;
}
