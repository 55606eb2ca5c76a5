//! The element precision of a fused kernel (f32, bf16, f16): how each op's `reference.rs` rounds its
//! intermediates and outputs, and how a comparison measures ulps. A leaf: the launchers
//! ([`crate::FusedFloat::PRECISION`]), the references and the checks all name it.

use half::{bf16, f16};

/// The element type a kernel runs in; the reference rounds its intermediates and outputs to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    /// `x` rounded to this type (to nearest even), as f32.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::F32 => x,
            Precision::Bf16 => bf16::from_f32(x).to_f32(),
            Precision::F16 => f16::from_f32(x).to_f32(),
        }
    }

    /// The spacing of this type's values at `|x|` (one unit in the last place); subnormal spacing
    /// below the smallest normal.
    pub fn ulp(self, x: f32) -> f32 {
        let (mantissa, min_exp) = match self {
            Precision::F32 => (23, -126),
            Precision::Bf16 => (7, -126),
            Precision::F16 => (10, -14),
        };
        let biased = ((x.to_bits() >> 23) & 0xff) as i32;
        let exp = if biased == 0 { -126 } else { biased - 127 }.max(min_exp);
        2f32.powi(exp - mantissa)
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }
}
