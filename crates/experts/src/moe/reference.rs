//! The plain mixture of experts: every expert on every token, each token's outputs summed with a
//! dense `(T, E)` combine matrix (its routing weight at a chosen expert, 0 elsewhere), the LoRA
//! delta formed as PEFT's `ParamWrapper.get_delta_weight` forms it
//! (`einsum("o r e, e r i -> e o i", B, A) · s`) and added to the weight. Chains of candle ops
//! only, any float dtype (f64 in the tests), so candle's autograd differentiates it.

use candle_core::{DType, Device, Result, Tensor};

use super::ExpertAct;

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
/// `(a, b, s)` in PEFT's layout → `(T, H)`; SwiGLU, no biases.
pub fn moe_reference(
    x: &Tensor,
    combine: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    lora_gate_up: Option<(&Tensor, &Tensor, f64)>,
    lora_down: Option<(&Tensor, &Tensor, f64)>,
) -> Result<Tensor> {
    let ex = RefExperts {
        gate_up,
        down,
        biases: None,
        act: ExpertAct::SwiGlu,
    };
    moe_reference_with(x, combine, &ex, lora_gate_up, lora_down)
}

/// The frozen part of [`moe_reference_with`]: the stacks, gpt-oss's biases `(E, 2I)`, `(E, H)`
/// and the gate.
pub struct RefExperts<'a> {
    pub gate_up: &'a Tensor,
    pub down: &'a Tensor,
    pub biases: Option<(&'a Tensor, &'a Tensor)>,
    pub act: ExpertAct,
}

/// The gate as transformers writes it: gpt-oss's `_apply_gate` on `gate_up[..., ::2]` and
/// `[..., 1::2]` (taken here by index), `silu(g)·u` on the halves otherwise. `gu: (T, 2I)`.
fn gate(gu: &Tensor, act: ExpertAct) -> Result<Tensor> {
    let i = gu.dim(1)? / 2;
    match act {
        ExpertAct::SwiGlu => gu.narrow(1, 0, i)?.silu()? * gu.narrow(1, i, i)?,
        ExpertAct::Clamped { alpha, limit } => {
            let dev = gu.device();
            let even: Vec<u32> = (0..i as u32).map(|j| 2 * j).collect();
            let odd: Vec<u32> = (0..i as u32).map(|j| 2 * j + 1).collect();
            let g = gu.index_select(&Tensor::new(even.as_slice(), dev)?, 1)?;
            let u = gu.index_select(&Tensor::new(odd.as_slice(), dev)?, 1)?;
            let g = g.clamp(f64::NEG_INFINITY, limit)?;
            let u = u.clamp(-limit, limit)?;
            let sig = ((&g * -alpha)?.exp()? + 1.0)?.recip()?;
            (u + 1.0)? * (g * sig)?
        }
    }
}

/// [`moe_reference`] with biases and the gate given.
pub fn moe_reference_with(
    x: &Tensor,
    combine: &Tensor,
    ex: &RefExperts,
    lora_gate_up: Option<(&Tensor, &Tensor, f64)>,
    lora_down: Option<(&Tensor, &Tensor, f64)>,
) -> Result<Tensor> {
    let (gate_up, down) = (ex.gate_up, ex.down);
    let e = gate_up.dim(0)?;
    let with = |w: &Tensor, l: Option<(&Tensor, &Tensor, f64)>| -> Result<Tensor> {
        match l {
            Some((a, b, s)) => w + peft_delta(a, b, e, s)?,
            None => Ok(w.clone()),
        }
    };
    let gate_up = with(gate_up, lora_gate_up)?;
    let down = with(down, lora_down)?;
    let mut y = x.zeros_like()?;
    for n in 0..e {
        let mut gu = x.matmul(&gate_up.get(n)?.t()?)?; // (T, 2I)
        if let Some((bg, _)) = ex.biases {
            gu = gu.broadcast_add(&bg.get(n)?)?;
        }
        let m = gate(&gu, ex.act)?;
        let mut d = m.matmul(&down.get(n)?.t()?)?; // (T, H)
        if let Some((_, bd)) = ex.biases {
            d = d.broadcast_add(&bd.get(n)?)?;
        }
        y = (y + d.broadcast_mul(&combine.narrow(1, n, 1)?)?)?;
    }
    Ok(y)
}
