//! The mixture-of-experts MLP (issue 45), forward and hand-written backward, as transformers 5.24's
//! `Qwen3MoeExperts` computes it (`modeling_qwen3_moe.py`): for each token `t` and each of its
//! `k` chosen experts `e` (from [`crate::route`]) with weight `w`,
//! `y_t += w · down_e(silu(g)·u)`, `[g; u] = gate_up_e(x_t)`, the experts' weights fused per layer:
//! `gate_up: (E, 2I, H)` (rows gate then up) and `down: (E, H, I)`, each `(out, in)` as a linear
//! weight. gpt-oss's experts (`GptOssExperts`) are the same with biases on both projections and
//! their clamped SwiGLU on interleaved gate/up rows ([`act`], [`ExpertAct::Clamped`]).
//!
//! Tokens are grouped by expert ([`Groups`]: each expert's `(token, slot)` pairs) and each expert
//! runs one GEMM over its own rows only — a grouped GEMM, `T·k` rows in all, not every expert on
//! every token; the outputs are scaled by their routing weight and scatter-added back.
//!
//! LoRA on an expert stack is PEFT 0.21's `ParamWrapper` (`target_parameters`): one pair per 3-D
//! parameter, rank `r` per expert, `lora_A: (E·r, in)` with expert `e`'s rows `e·r..(e+1)·r`, and
//! `lora_B: (out, r·E)` whose column `j·E + e` is rank `j` of expert `e` (PEFT reshapes it to
//! `(out, r, E)`); `ΔW_e = s · B_e A_e`. PEFT folds `ΔW_e` into the weight; here the low-rank
//! product `x W_eᵀ + s (x A_eᵀ) B_eᵀ` is formed instead in f32 (the same sum in another order: f32
//! rounding apart); in bf16/f16 each expert with tokens is folded as PEFT folds it (`folded`:
//! another rounding of the weight is not within bf16's tolerance for gpt-oss's clamp). PEFT
//! refuses dropout on a `ParamWrapper`, so there is none.
//!
//! The backward returns `∂L/∂x`, `∂L/∂w` (`T × k`, what [`crate::route::route_backward`] takes)
//! and the LoRA factors' gradients in PEFT's layouts; the expert weights are frozen. They may be
//! held in NF4 ([`stack`]): each expert with tokens is then dequantized for its products only.

pub mod act;
mod grouped;
pub mod panels;
pub mod reference;
pub mod stack;
#[cfg(test)]
mod tests;
mod transpose;
mod view;

pub use act::ExpertAct;
pub use stack::{Nf4Stack, Stack, StackWeights};

use candle_core::{bail, DType, Device, Result, Tensor, D};

/// One LoRA pair on an expert stack (PEFT's `ParamWrapper`): `a: (E·r, in)`, `b: (out, r·E)`,
/// `scale = alpha / r` (or `/ √r`), in the compute dtype.
#[derive(Debug, Clone, Copy)]
pub struct ExpertLora<'a> {
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub scale: f64,
}

/// The experts of one layer: frozen weights (and biases: gpt-oss) and the LoRA pairs on them, if
/// any.
#[derive(Debug, Clone, Copy)]
pub struct Experts<'a> {
    /// `(E, 2I, H)`: rows gate and up as `act` lays them out (in the compute dtype or NF4).
    pub gate_up: Stack<'a>,
    /// `(E, H, I)`.
    pub down: Stack<'a>,
    /// `(E, 2I)` and `(E, H)`, added to each expert's projections (gpt-oss's
    /// `gate_up_proj_bias`, `down_proj_bias`).
    pub gate_up_bias: Option<&'a Tensor>,
    pub down_bias: Option<&'a Tensor>,
    pub act: ExpertAct,
    pub lora_gate_up: Option<ExpertLora<'a>>,
    pub lora_down: Option<ExpertLora<'a>>,
    /// In a 16-bit dtype, scale each expert's output by its routing weight in f32 and sum a
    /// token's `k` outputs in f32, rounding once (Mixtral: its router keeps the weights in f32,
    /// so torch promotes the product); else the product and the sum round in the dtype (the
    /// weights rounded to it first: Qwen3-MoE, gpt-oss). No effect in f32.
    pub combine_f32: bool,
}

/// Each expert's rows: the tokens it serves and the slot (`t·k + j`) their weight is at.
#[derive(Debug, Clone, PartialEq)]
pub struct Groups {
    pub k: usize,
    /// Per expert, the token indices, ascending by slot.
    pub tokens: Vec<Vec<u32>>,
    /// Per expert, the slots paired with `tokens`.
    pub slots: Vec<Vec<usize>>,
}

impl Groups {
    /// Groups `n × k` expert ids (`experts[t·k + j]`) over `e` experts; an id out of range is
    /// an error naming it.
    pub fn new(experts: &[u32], k: usize, e: usize) -> Result<Groups> {
        if k == 0 || !experts.len().is_multiple_of(k) {
            bail!(
                "moe: {} expert ids are not n × k with k = {k}",
                experts.len()
            );
        }
        let mut g = Groups {
            k,
            tokens: vec![Vec::new(); e],
            slots: vec![Vec::new(); e],
        };
        for (slot, &x) in experts.iter().enumerate() {
            let Some(tokens) = g.tokens.get_mut(x as usize) else {
                bail!("moe: expert id {x} at slot {slot} is not below the {e} experts");
            };
            tokens.push((slot / k) as u32);
            g.slots[x as usize].push(slot);
        }
        Ok(g)
    }

    /// Rows over all experts: `n·k`.
    pub fn rows(&self) -> usize {
        self.tokens.iter().map(Vec::len).sum()
    }
}

/// What [`moe_backward`] needs of one expert's forward (rows `n_e`).
#[derive(Debug)]
struct ExpertCache {
    /// The gathered inputs `(n_e, H)`, the gate/up outputs `(n_e, 2I)`, the down projection's
    /// output before its routing weight `(n_e, H)` (`∂L/∂w` is `⟨dy, d⟩`).
    x: Tensor,
    gu: Tensor,
    d: Tensor,
    /// The LoRA inputs' down-projections `x A_eᵀ` `(n_e, r)` for gate/up and down, if adapted.
    xa_gate_up: Option<Tensor>,
    xa_down: Option<Tensor>,
}

/// The forward's cache: the groups and what the path that ran keeps for its backward.
#[derive(Debug)]
pub struct MoeCache {
    pub groups: Groups,
    kept: Kept,
}

#[derive(Debug)]
enum Kept {
    /// The per-expert path: per expert with rows, its `ExpertCache`.
    PerExpert(Vec<Option<ExpertCache>>),
    /// The fast CPU f32 path ([`grouped`]).
    Grouped(grouped::Cache),
}

/// [`moe_backward`]'s result. The LoRA gradients are in PEFT's layouts (`a: (E·r, in)`,
/// `b: (out, r·E)`), present for the pairs given.
#[derive(Debug)]
pub struct MoeGrads {
    /// `(T, H)`.
    pub dx: Tensor,
    /// `T × k`, paired with the expert ids (f32).
    pub dweights: Vec<f32>,
    pub gate_up: Option<(Tensor, Tensor)>,
    pub down: Option<(Tensor, Tensor)>,
}

/// Shapes of one layer's experts: `(E, I, H)`, checked against the LoRA pairs and `x: (T, H)`.
fn dims(x: &Tensor, ex: &Experts) -> Result<(usize, usize, usize)> {
    let (_, h) = x.dims2()?;
    let (e, i2, hg) = ex.gate_up.dims3()?;
    let (ed, hd, id) = ex.down.dims3()?;
    if hg != h || i2 % 2 != 0 || ed != e || hd != h || id != i2 / 2 {
        bail!(
            "moe: experts gate_up {:?} and down {:?} do not fit x {:?} \
             (want (E, 2I, H) and (E, H, I))",
            ex.gate_up.dims(),
            ex.down.dims(),
            x.dims()
        );
    }
    let check = |name: &str, l: &Option<ExpertLora>, out: usize, inp: usize| -> Result<()> {
        let Some(l) = l else { return Ok(()) };
        let (ra, ia) = l.a.dims2()?;
        let (ob, rb) = l.b.dims2()?;
        if ra != rb || ra % e != 0 || ra == 0 || ia != inp || ob != out {
            bail!(
                "moe: LoRA on {name}: lora_A {:?} and lora_B {:?} do not fit {e} experts of \
                 ({out}, {inp}) (want (E·r, {inp}) and ({out}, r·E))",
                l.a.dims(),
                l.b.dims()
            );
        }
        Ok(())
    };
    for (name, b, want) in [
        ("gate_up_proj_bias", ex.gate_up_bias, [e, i2]),
        ("down_proj_bias", ex.down_bias, [e, h]),
    ] {
        if let Some(b) = b {
            if b.dims() != want {
                bail!("moe: {name} is {:?}, want {want:?}", b.dims());
            }
        }
    }
    if matches!(ex.act, ExpertAct::Clamped { .. }) && i2 % 2 != 0 {
        bail!("moe: interleaved gate/up of odd width {i2}");
    }
    check("gate_up_proj", &ex.lora_gate_up, i2, h)?;
    check("down_proj", &ex.lora_down, h, i2 / 2)?;
    Ok((e, i2 / 2, h))
}

/// Expert `e`'s `(A_e: (r, in), B_e: (out, r))` of a PEFT `ParamWrapper` pair.
pub fn expert_factors(l: &ExpertLora, e: usize, experts: usize) -> Result<(Tensor, Tensor)> {
    let r = l.a.dim(0)? / experts;
    let a = l.a.narrow(0, e * r, r)?;
    let out = l.b.dim(0)?;
    // (out, r·E) -> (out, r, E): column j·E + e is rank j of expert e.
    let b =
        l.b.reshape((out, r, experts))?
            .narrow(2, e, 1)?
            .squeeze(2)?;
    Ok((a, b.contiguous()?))
}

/// Expert `e`'s factors and scale of an optional pair.
fn factors(
    l: Option<ExpertLora>,
    e: usize,
    experts: usize,
) -> Result<Option<(Tensor, Tensor, f64)>> {
    l.map(|l| expert_factors(&l, e, experts).map(|(a, b)| (a, b, l.scale)))
        .transpose()
}

/// `a·b` by an expert's frozen stack slice: in a 16-bit dtype through the dense layers' GEMM route
/// (`rtune_backend::blas::matmul`: oneDNN's bf16 kernels where the CPU has them), in f32 candle's
/// (the grouped path's reference, compared bit for bit with its gemm engine). Measured on
/// `moe_timing`'s shape in bf16, forward and backward, load ~6: unadapted experts 33.6 s with
/// candle's product on the stack's slices, 5.6 s through this route; a folded weight (a fresh
/// tensor) is faster through candle's (3.9 s against 9.7 s), so [`folded`] products stay there.
fn mm(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    match a.dtype() {
        DType::F32 => a.matmul(b),
        _ => rtune_backend::blas::matmul(a, b),
    }
}

/// `x W_eᵀ (+ s (x A_eᵀ) B_eᵀ)`: `x: (n, in)`, `w: (out, in)`; the LoRA input product `(n, r)`.
/// In a 16-bit dtype the update is folded into the weight first ([`folded`]), as PEFT computes.
fn expert_linear(
    x: &Tensor,
    w: &Tensor,
    lora: Option<(&Tensor, &Tensor, f64)>,
) -> Result<(Tensor, Option<Tensor>)> {
    let Some((a, b, s)) = lora else {
        return Ok((mm(x, &w.t()?)?, None));
    };
    let xa = x.matmul(&a.t()?)?;
    if w.dtype() != DType::F32 {
        return Ok((x.matmul(&folded(w, a, b, s)?.t()?)?, Some(xa)));
    }
    let y = (mm(x, &w.t()?)? + (xa.matmul(&b.t()?)? * s)?)?;
    Ok((y, Some(xa)))
}

/// `W_e + s B_e A_e` `(out, in)` summed in f32 and rounded once to `w`'s 16-bit dtype: what
/// PEFT's `ParamWrapper` multiplies by (`baddbmm(W, lhs, rhs, alpha = s)` in the weight's dtype,
/// the factors cast to it first, as `a`, `b` are here). In f32 the low-rank product is formed
/// apart instead (the same sum in another order). In bf16 the two differ by a rounding of the
/// weight, and gpt-oss's clamp makes that visible: it cuts the gradient of every gate value past
/// `limit`, and a one-ulp jitter of the folded stacks moves PEFT's own gate_up `lora_B` gradient
/// by 0.36 of its largest entry (measured on `tiny-gpt-oss` in bf16), so rtune rounds where PEFT
/// does. Only experts with tokens are folded, each for the time of its products.
fn folded(w: &Tensor, a: &Tensor, b: &Tensor, s: f64) -> Result<Tensor> {
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let dw = (f(b)?.matmul(&f(a)?)? * s)?; // (out, r)·(r, in)
    (f(w)? + dw)?.to_dtype(w.dtype())
}

/// `y: (n, out)` plus expert `e`'s row of `bias: (E, out)`, if any.
fn with_bias(y: Tensor, bias: Option<&Tensor>, e: usize) -> Result<Tensor> {
    match bias {
        Some(b) => y.broadcast_add(&b.get(e)?.unsqueeze(0)?),
        None => Ok(y),
    }
}

fn ids(v: &[u32], dev: &Device) -> Result<Tensor> {
    Tensor::from_slice(v, v.len(), dev)
}

/// `x: (T, H)`, `experts`/`weights`: `T × k` (from [`crate::route::route`]) → `(T, H)` and the
/// cache for [`moe_backward`].
pub fn moe_forward(
    x: &Tensor,
    experts: &[u32],
    weights: &[f32],
    k: usize,
    ex: &Experts,
) -> Result<(Tensor, MoeCache)> {
    let (e_n, _, _) = dims(x, ex)?;
    let t = x.dim(0)?;
    if experts.len() != t * k || weights.len() != t * k {
        bail!(
            "moe: {} expert ids and {} weights for {t} tokens × top-{k}",
            experts.len(),
            weights.len()
        );
    }
    let groups = Groups::new(experts, k, e_n)?;
    let (out, kept) = if grouped::applies(x, ex) {
        let (y, c) = grouped::forward(grouped::Engine::detect(), x, &groups, weights, ex)?;
        (y, Kept::Grouped(c))
    } else {
        let (y, c) = per_expert_forward(x, &groups, weights, ex)?;
        (y, Kept::PerExpert(c))
    };
    Ok((out, MoeCache { groups, kept }))
}

/// The per-expert path (any dtype and device): one candle product per expert and projection.
fn per_expert_forward(
    x: &Tensor,
    groups: &Groups,
    weights: &[f32],
    ex: &Experts,
) -> Result<(Tensor, Vec<Option<ExpertCache>>)> {
    let e_n = groups.tokens.len();
    let (dev, dt) = (x.device(), x.dtype());
    let x = x.contiguous()?;
    let combine = ex.combine_f32 && dt != DType::F32;
    // Every expert's weighted rows, in expert order, scatter-added once at the end (each token's
    // sum in expert order, as one `index_add` per expert would make it, without E copies of the
    // `(T, H)` output).
    let mut rows = Vec::with_capacity(e_n);
    let mut caches = Vec::with_capacity(e_n);
    for e in 0..e_n {
        let tokens = &groups.tokens[e];
        if tokens.is_empty() {
            caches.push(None);
            continue;
        }
        let tok = ids(tokens, dev)?;
        let xe = x.index_select(&tok, 0)?; // (n_e, H)
        let lgu = factors(ex.lora_gate_up, e, e_n)?;
        let ld = factors(ex.lora_down, e, e_n)?;
        // An NF4 expert is dequantized here and dropped at the end of this iteration.
        let (gu, xa_gate_up) = expert_linear(
            &xe,
            &ex.gate_up.expert(e, dt, dev)?,
            lgu.as_ref().map(|(a, b, s)| (a, b, *s)),
        )?;
        let gu = with_bias(gu, ex.gate_up_bias, e)?; // (n_e, 2I)
        let m = act::act_forward(&gu, ex.act)?; // (n_e, I)
        let (d, xa_down) = expert_linear(
            &m,
            &ex.down.expert(e, dt, dev)?,
            ld.as_ref().map(|(a, b, s)| (a, b, *s)),
        )?;
        let d = with_bias(d, ex.down_bias, e)?; // (n_e, H)
        let w: Vec<f32> = groups.slots[e].iter().map(|&s| weights[s]).collect();
        let w = Tensor::from_vec(w, (tokens.len(), 1), dev)?;
        rows.push(match combine {
            true => d.to_dtype(DType::F32)?.broadcast_mul(&w)?,
            false => d.broadcast_mul(&w.to_dtype(dt)?)?,
        });
        caches.push(Some(ExpertCache {
            x: xe,
            gu,
            d,
            xa_gate_up,
            xa_down,
        }));
    }
    let y = match combine {
        true => scatter_add(&x.to_dtype(DType::F32)?, &rows, groups)?.to_dtype(dt)?,
        false => scatter_add(&x, &rows, groups)?,
    };
    Ok((y, caches))
}

/// [`moe_forward`]'s backward from `dy: (T, H)`; `weights` as given to the forward.
pub fn moe_backward(
    dy: &Tensor,
    weights: &[f32],
    ex: &Experts,
    cache: &MoeCache,
) -> Result<MoeGrads> {
    let (e_n, _, _) = dims(dy, ex)?;
    let g = &cache.groups;
    if weights.len() != g.rows() || g.tokens.len() != e_n {
        bail!(
            "moe backward: {} weights and groups of {} experts for {} rows of {e_n} experts",
            weights.len(),
            g.tokens.len(),
            g.rows()
        );
    }
    match &cache.kept {
        Kept::Grouped(c) => {
            let (dx, dweights, gate_up, down) =
                grouped::backward(grouped::Engine::detect(), dy, weights, ex, c, g.k)?;
            Ok(MoeGrads {
                dx,
                dweights,
                gate_up,
                down,
            })
        }
        Kept::PerExpert(experts) => per_expert_backward(dy, weights, ex, g, experts),
    }
}

/// The per-expert path's backward.
fn per_expert_backward(
    dy: &Tensor,
    weights: &[f32],
    ex: &Experts,
    g: &Groups,
    experts: &[Option<ExpertCache>],
) -> Result<MoeGrads> {
    let (e_n, _, h) = dims(dy, ex)?;
    if experts.len() != e_n {
        bail!(
            "moe backward: {} expert caches for {e_n} experts",
            experts.len()
        );
    }
    let (dev, dt) = (dy.device(), dy.dtype());
    let dy = dy.contiguous()?;
    let mut dx_rows = Vec::with_capacity(e_n);
    let mut dweights = vec![0f32; g.rows()];
    // Per expert (E entries), the LoRA factors' gradients `(dA_e: (r, in), dB_e: (out, r))`.
    let mut gu_grads: Vec<(Tensor, Tensor)> = Vec::new();
    let mut down_grads: Vec<(Tensor, Tensor)> = Vec::new();
    for (e, c) in experts.iter().enumerate() {
        let lgu = factors(ex.lora_gate_up, e, e_n)?;
        let ld = factors(ex.lora_down, e, e_n)?;
        let Some(c) = c else {
            // No token chose this expert: its LoRA gradients are zero.
            if let Some((a, b, _)) = &lgu {
                gu_grads.push((a.zeros_like()?, b.zeros_like()?));
            }
            if let Some((a, b, _)) = &ld {
                down_grads.push((a.zeros_like()?, b.zeros_like()?));
            }
            continue;
        };
        let tok = ids(&g.tokens[e], dev)?;
        let n = g.tokens[e].len();
        let dye = dy.index_select(&tok, 0)?; // (n_e, H)
        let dw = weight_grads(&dye, &c.d, !ex.combine_f32)?;
        for (&s, v) in g.slots[e].iter().zip(dw) {
            dweights[s] = v;
        }
        let w: Vec<f32> = g.slots[e].iter().map(|&s| weights[s]).collect();
        let w = Tensor::from_vec(w, (n, 1), dev)?;
        let dd = match ex.combine_f32 && dt != DType::F32 {
            true => dye.to_dtype(DType::F32)?.broadcast_mul(&w)?.to_dtype(dt)?,
            false => dye.broadcast_mul(&w.to_dtype(dt)?)?,
        }; // (n_e, H)
        let m = act::act_forward(&c.gu, ex.act)?;
        let dm = linear_backward(
            &dd,
            &m,
            &ex.down.expert(e, dt, dev)?,
            ld.as_ref().map(|(a, b, s)| (a, b, *s)),
            c.xa_down.as_ref(),
            &mut down_grads,
        )?; // (n_e, I)
        let dgu = act::act_backward(&dm, &c.gu, ex.act)?; // (n_e, 2I)
        let dxe = linear_backward(
            &dgu,
            &c.x,
            &ex.gate_up.expert(e, dt, dev)?,
            lgu.as_ref().map(|(a, b, s)| (a, b, *s)),
            c.xa_gate_up.as_ref(),
            &mut gu_grads,
        )?; // (n_e, H)
        debug_assert_eq!(dxe.dims(), &[n, h]);
        dx_rows.push(dxe);
    }
    Ok(MoeGrads {
        dx: scatter_add(&dy, &dx_rows, g)?,
        dweights,
        gate_up: peft_layout(gu_grads)?,
        down: peft_layout(down_grads)?,
    })
}

/// `∂L/∂w` of each row `(n,)` from `dy`, `d: (n, H)` (`y += w·d`): `⟨dy_t, d_t⟩`. In a 16-bit
/// dtype with the weights rounded to it (`rounded`, not [`Experts::combine_f32`]) as torch's
/// `mul` backward forms it: each product `dy·d` rounded to the dtype, the row summed in f32 and
/// rounded (measured on `tiny-gpt-oss` bf16: layer 1's 64 weight gradients bit-equal, against 48
/// off by up to 2.7e-3 summed in f32); in f32, or with f32 weights, the f32 sum.
fn weight_grads(dy: &Tensor, d: &Tensor, rounded: bool) -> Result<Vec<f32>> {
    let dt = dy.dtype();
    if rounded && dt != DType::F32 {
        return (dy * d)?
            .to_dtype(DType::F32)?
            .sum(D::Minus1)?
            .to_dtype(dt)?
            .to_dtype(DType::F32)?
            .to_vec1();
    }
    (dy.to_dtype(DType::F32)? * d.to_dtype(DType::F32)?)?
        .sum(D::Minus1)?
        .to_vec1()
}

/// `(T, H)` zeros like `like` plus each expert's rows (`rows[j]`: the `j`-th expert with tokens,
/// in expert order) added at its tokens, in one `index_add`.
fn scatter_add(like: &Tensor, rows: &[Tensor], g: &Groups) -> Result<Tensor> {
    let out = like.zeros_like()?;
    if rows.is_empty() {
        return Ok(out);
    }
    let tokens: Vec<u32> = g.tokens.iter().flatten().copied().collect();
    out.index_add(&ids(&tokens, like.device())?, &Tensor::cat(rows, 0)?, 0)
}

/// The backward of `y = x W_eᵀ + s (x A_eᵀ) B_eᵀ`: returns `dx`, pushes `(dA_e, dB_e)` with
/// `dB_e = s · dyᵀ (x A_eᵀ)` `(out, r)` and `dA_e = s · (dy B_e)ᵀ x` `(r, in)`. In a 16-bit dtype
/// `dx = dy (W_e + s B_e A_e)` through the folded weight, as the forward ([`folded`]).
fn linear_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    lora: Option<(&Tensor, &Tensor, f64)>,
    xa: Option<&Tensor>,
    grads: &mut Vec<(Tensor, Tensor)>,
) -> Result<Tensor> {
    let (Some((a, b, s)), Some(xa)) = (lora, xa) else {
        return mm(dy, w);
    };
    let dyb = (dy.matmul(b)? * s)?; // (n, r)
    let db = (dy.t()?.matmul(xa)? * s)?;
    let da = dyb.t()?.matmul(x)?;
    grads.push((da, db));
    if w.dtype() != DType::F32 {
        return dy.matmul(&folded(w, a, b, s)?);
    }
    mm(dy, w)? + dyb.matmul(a)?
}

/// Per-expert `(dA_e: (r, in), dB_e: (out, r))` → PEFT's `(E·r, in)` and `(out, r·E)`.
fn peft_layout(per_expert: Vec<(Tensor, Tensor)>) -> Result<Option<(Tensor, Tensor)>> {
    if per_expert.is_empty() {
        return Ok(None);
    }
    let (a, b): (Vec<Tensor>, Vec<Tensor>) = per_expert.into_iter().unzip();
    let da = Tensor::cat(&a, 0)?;
    // (E, out, r) -> (out, r, E) -> (out, r·E).
    let (out, r) = b[0].dims2()?;
    let db = Tensor::stack(&b, 0)?
        .permute((1, 2, 0))?
        .reshape((out, r * b.len()))?;
    Ok(Some((da, db)))
}
