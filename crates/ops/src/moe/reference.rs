//! The plain mixture of experts: every expert on every token, each token's outputs summed with a
//! dense `(T, E)` combine matrix (its routing weight at a chosen expert, 0 elsewhere), the LoRA
//! delta formed as PEFT's `ParamWrapper.get_delta_weight` forms it
//! (`einsum("o r e, e r i -> e o i", B, A) · s`) and added to the weight. Chains of candle ops
//! only, any float dtype (f64 in the tests), so candle's autograd differentiates it.

use candle_core::{DType, Device, Result, Tensor};

/// The dense `(T, E)` combine matrix of `T × k` expert ids and weights.
pub fn combine_matrix(
    experts: &[u32],
    weights: &[f32],
    k: usize,
    e: usize,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let t = experts.len() / k;
    let mut c = vec![0f32; t * e];
    for (slot, (&x, &w)) in experts.iter().zip(weights).enumerate() {
        c[(slot / k) * e + x as usize] += w;
    }
    Tensor::from_vec(c, (t, e), dev)?.to_dtype(dtype)
}

/// PEFT's `ΔW: (E, out, in)` of `a: (E·r, in)`, `b: (out, r·E)`, scale `s`.
pub fn peft_delta(a: &Tensor, b: &Tensor, e: usize, s: f64) -> Result<Tensor> {
    let (er, inp) = a.dims2()?;
    let out = b.dim(0)?;
    let a = a.reshape((e, er / e, inp))?; // (E, r, in)
    let b = b
        .reshape((out, er / e, e))?
        .permute((2, 0, 1))?
        .contiguous()?; // (E, out, r)
    b.matmul(&a)? * s
}

/// `x: (T, H)`, `combine: (T, E)`, `gate_up: (E, 2I, H)`, `down: (E, H, I)`, LoRA pairs
/// `(a, b, s)` in PEFT's layout → `(T, H)`.
pub fn moe_reference(
    x: &Tensor,
    combine: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    lora_gate_up: Option<(&Tensor, &Tensor, f64)>,
    lora_down: Option<(&Tensor, &Tensor, f64)>,
) -> Result<Tensor> {
    let (e, i2, _) = gate_up.dims3()?;
    let i = i2 / 2;
    let with = |w: &Tensor, l: Option<(&Tensor, &Tensor, f64)>| -> Result<Tensor> {
        match l {
            Some((a, b, s)) => w + peft_delta(a, b, e, s)?,
            None => Ok(w.clone()),
        }
    };
    let gate_up = with(gate_up, lora_gate_up)?;
    let down = with(down, lora_down)?;
    let mut y = x.zeros_like()?;
    for ex in 0..e {
        let gu = x.matmul(&gate_up.get(ex)?.t()?)?; // (T, 2I)
        let m = (gu.narrow(1, 0, i)?.silu()? * gu.narrow(1, i, i)?)?;
        let d = m.matmul(&down.get(ex)?.t()?)?; // (T, H)
        y = (y + d.broadcast_mul(&combine.narrow(1, ex, 1)?)?)?;
    }
    Ok(y)
}
