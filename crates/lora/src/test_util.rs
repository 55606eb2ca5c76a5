//! Helpers the crate's unit tests share.

use candle_core::Tensor;

use crate::{LoraSpec, ModuleShape};

/// One `q_proj` (6 in, 5 out) and a rank-4 spec (alpha 8, no dropout) that targets it.
pub(crate) fn one_q_proj() -> (LoraSpec, Vec<ModuleShape>) {
    let spec = LoraSpec::new(4, 8.0, 0.0, false, &["q_proj".into()]).unwrap();
    let mods = vec![ModuleShape {
        name: "model.layers.0.self_attn.q_proj".into(),
        in_features: 6,
        out_features: 5,
        experts: 1,
    }];
    (spec, mods)
}

/// `max |a − b|` over every element (f32 tensors of one shape).
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}
