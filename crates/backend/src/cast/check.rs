//! The widening cast's kernel against its reference ([`super::reference::widen`]), exactly.

use cudarc::driver::CudaStream;
use std::sync::Arc;

use super::cuda;
use super::reference;
use crate::check::{at, down, out, up, CheckResult, Op, Rng};
use crate::launch::FusedFloat;
use crate::Precision;
use crate::Result;

/// widen on `(n)`: x ~ N(0, 1) in `T`, then the values a cast must carry unchanged — ±0, ±∞, NaN,
/// the type's largest and smallest (subnormal) magnitudes — written over the first elements.
pub fn check_widen<T: FusedFloat>(
    s: &Arc<CudaStream>,
    n: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng) = (T::PRECISION, Rng::new(seed));
    let mut x = rng.normals(n, 1.0, p);
    let (max, tiny) = match p {
        Precision::Bf16 => (f32::from_bits(0x7f7f_0000), f32::from_bits(0x0001_0000)),
        Precision::F16 => (65504.0, 2f32.powi(-24)),
        Precision::F32 => (f32::MAX, f32::from_bits(1)),
    };
    let special = [
        0.0,
        -0.0,
        f32::INFINITY,
        -f32::INFINITY,
        f32::NAN,
        max,
        -max,
        tiny,
        -tiny,
    ];
    for (v, sp) in x.iter_mut().zip(special) {
        *v = sp;
    }
    let xd = up::<T>(s, &x, offset)?;
    let mut y = out::<f32>(s, n, offset)?;
    cuda::widen(s, &xd.slice(offset..), &mut y.slice_mut(offset..), n)?;
    Ok(vec![CheckResult::new::<T>(
        Op::exact("widen"),
        format!("({n}){}", at(offset)),
        &down(s, &y, offset)?,
        &reference::widen(&x),
    )])
}
