//! Linear layers that read the same input, computed together: q/k/v (input `rms_norm(x)`) and
//! gate/up (input `rms_norm(h)`).
//!
//! - Frozen weights: one GEMM `x·[W₁; W₂; …]ᵀ` instead of one per layer. [`fuse`] concatenates the
//!   dense weights once at load time and leaves each layer's `w` a row view of the block, so no
//!   memory is duplicated. In the backward, `dx = [dy₁, dy₂, …]·[W₁; W₂; …]` is again one GEMM.
//! - LoRA without dropout: the A matrices of the group are stacked, so `x·[A₁; A₂; …]ᵀ` (N, Σr) is
//!   one GEMM, and so are `dA = dXAᵀ·x` and the LoRA part of `dx = dXA·[A₁; A₂; …]`. Each member
//!   gets its `(N, r)` columns as a contiguous copy: a column view of the `(N, Σr)` product has
//!   leading dimension Σr, which candle's CUDA GEMM refuses (see [`rtune_backend::blas::cuda_gemm_ok`]).
//! - LoRA with dropout: each member draws its own mask ([`rtune_backend::dropout`]), so the inputs differ;
//!   they are made in one parallel pass as `(G, N, in)` ([`dropout::apply_each`]) and multiplied
//!   by the `(G, in, r)` stack of the Aᵀ in one batched GEMM call (members of one rank). The
//!   backward regenerates them the same way for `dA = dXAᵀ·dropout(x)` (batched), and adds the
//!   masked `dXA·A` terms into `dx` in one pass ([`dropout::add_each`]). No mask is kept; the
//!   results are those of each member on its own bit for bit (the same GEMM per member).
//!
//! - QLoRA (NF4 members, which [`fuse`] leaves alone): the members' weights dequantized by one
//!   launch into one of two reused buffers at each use, the next group's ahead of time (`nf4.rs`),
//!   the buffer being the group's block when its rows are back to back.
//!
//! Small GEMMs run far below the BLAS's peak (bench-small's k/v projections, 2048×512·512×128, at a
//! quarter of the rate of the fused 2048×512·512×768), and rank-16 LoRA GEMMs even more so. The
//! results equal the per-layer computation up to f32 summation order; `tests` checks both paths.

use candle_core::{DType, Result, Tensor};

use crate::linear::{Frozen, Grads, Linear, LinearCache, LoraCtx};
use rtune_backend::blas::matmul as mm;
use rtune_backend::cast::cast;
use rtune_backend::dropout::{self, DropoutKey};
use rtune_ops::lora::acc;
use rtune_ops::lora_up;

/// Concatenates the members' dense weights into one `(Σout, in)` block and makes each member's
/// weight a row view of it. Returns the block, or `None` (nothing changed) when there are fewer
/// than two members (a fused checkpoint's one weight is the block already), a member is 4-bit, or
/// the weights differ in dtype, device or input size.
pub fn fuse(members: &mut [&mut Linear]) -> Result<Option<Tensor>> {
    if members.len() < 2 {
        return Ok(None);
    }
    let mut ws = Vec::with_capacity(members.len());
    for m in members.iter() {
        match &m.w {
            Frozen::Dense(t) => ws.push(t.clone()),
            _ => return Ok(None),
        }
    }
    let first = &ws[0];
    if ws.iter().any(|w| {
        w.dtype() != first.dtype()
            || !w.device().same_device(first.device())
            || w.dim(1).ok() != first.dim(1).ok()
    }) {
        return Ok(None);
    }
    let block = Tensor::cat(&ws, 0)?.contiguous()?;
    drop(ws);
    let mut row = 0;
    for m in members.iter_mut() {
        let out = m.out_features();
        m.w = Frozen::Dense(block.narrow(0, row, out)?);
        row += out;
    }
    Ok(Some(block))
}

/// The parts of a group's output: the members' outputs as they are when there is one a part (q,
/// k, v), or one member's `(N, Σ widths)` output split by columns into `widths` (Phi-3's
/// `qkv_proj`: q, k, v as column views, as the dense block's are).
pub fn split_outputs(outs: Vec<Tensor>, widths: &[usize]) -> Result<Vec<Tensor>> {
    if outs.len() == widths.len() {
        return Ok(outs);
    }
    let [y] = <[Tensor; 1]>::try_from(outs).map_err(|o| {
        candle_core::Error::Msg(format!(
            "{} outputs for {} parts: a group splits only one fused output",
            o.len(),
            widths.len()
        ))
    })?;
    let total: usize = widths.iter().sum();
    if y.dim(1)? != total {
        candle_core::bail!(
            "fused output {:?} does not split into widths {widths:?}",
            y.dims()
        );
    }
    let mut col = 0;
    let mut parts = Vec::with_capacity(widths.len());
    for &w in widths {
        parts.push(y.narrow(1, col, w)?);
        col += w;
    }
    Ok(parts)
}

/// The members' output gradients from the parts': as they are when each member is one part, the
/// parts joined by columns (`(N, Σ widths)`, contiguous) for one fused member.
pub fn join_grads(dys: Vec<Tensor>, members: &[&Linear]) -> Result<Vec<Tensor>> {
    if members.len() == dys.len() {
        return Ok(dys);
    }
    Ok(vec![Tensor::cat(&dys, 1)?])
}

/// Whether the group's LoRA matmuls can be stacked: every member adapted; with dropout also of
/// one rank (the batched GEMM's `(G, N, r)`) and no DoRA member (DoRA with dropout recomputes the
/// base product on each member's dropped-out input: [`crate::dora`], per member).
fn stacked_lora<'a>(members: &[&Linear], lora: Option<&'a LoraCtx<'a>>) -> Option<&'a LoraCtx<'a>> {
    let ctx = lora?;
    if !members.iter().all(|m| m.lora.is_some()) {
        return None;
    }
    let pair = |m: &&Linear| &ctx.adapter.pairs[m.lora.expect("checked")];
    let one_rank = members
        .iter()
        .all(|m| pair(m).a.dims()[0] == pair(&members[0]).a.dims()[0]);
    let dora = members.iter().any(|m| pair(m).m.is_some());
    (ctx.dropout == 0.0 || (one_rank && !dora)).then_some(ctx)
}

/// The dropout keys of the members' LoRA inputs: `(p, seed, salt)` as [`Linear::finish`] makes them.
fn dropout_keys(ctx: &LoraCtx, salts: &[u64]) -> Vec<DropoutKey> {
    salts
        .iter()
        .map(|&salt| DropoutKey {
            p: ctx.dropout,
            seed: ctx.seed,
            salt,
        })
        .collect()
}

/// `[A₁; A₂; …]` as `(G, r, in)`, members of one rank `r`.
fn batched_a(members: &[&Linear], ctx: &LoraCtx) -> Result<Tensor> {
    let a = stacked_a(members, ctx)?;
    let (rows, cols) = a.dims2()?;
    a.reshape((members.len(), rows / members.len(), cols))
}

/// `[A₁; A₂; …]`: `(Σr, in)` f32.
fn stacked_a(members: &[&Linear], ctx: &LoraCtx) -> Result<Tensor> {
    let a: Vec<&Tensor> = members
        .iter()
        .map(|m| &ctx.adapter.pairs[m.lora.expect("checked")].a)
        .collect();
    Tensor::cat(&a, 0)
}

/// Forward of every member on the shared input `x: (N, in)`; `block` is what [`fuse`] returned.
pub fn forward(
    members: &[&Linear],
    block: Option<&Tensor>,
    x: &Tensor,
    lora: Option<&LoraCtx>,
    salts: &[u64],
) -> Result<Vec<(Tensor, LinearCache)>> {
    // QLoRA: the members' NF4 weights dequantized together into a reused buffer (held until the
    // frozen GEMMs are issued), which is their block when its rows are back to back.
    let nf4 = match block {
        None => nf4::lease(members)?,
        Some(_) => None,
    };
    let block = block.or(nf4.as_ref().and_then(|l| l.block.as_ref()));
    let ctx = stacked_lora(members, lora);
    if block.is_none() && ctx.is_none() && nf4.is_none() {
        return members
            .iter()
            .zip(salts)
            .map(|(m, &s)| m.forward(x, lora, s))
            .collect();
    }
    // y: (N, Σout) — one GEMM for the frozen part.
    // Biased members in a 16-bit dtype: the f32 accumulator, each member's bias then added and
    // rounded once ([`crate::linear::product`]).
    let bias = match members.iter().all(|m| m.bias.is_some()) {
        true => members[0].bias.as_ref(),
        false => None,
    };
    let base: Vec<Tensor> = match block {
        Some(w) => {
            let y = crate::linear::product(x, &w.t()?, bias)?;
            let mut col = 0;
            let mut parts = Vec::with_capacity(members.len());
            for m in members {
                parts.push(y.narrow(1, col, m.out_features())?);
                col += m.out_features();
            }
            parts
        }
        None => members
            .iter()
            .enumerate()
            .map(|(i, m)| match &nf4 {
                Some(l) => mm(x, &l.weights[i].t()?),
                None => crate::linear::product(x, &m.w.dense()?.t()?, m.bias.as_ref()),
            })
            .collect::<Result<_>>()?,
    };
    drop(nf4);
    let Some(ctx) = ctx else {
        return members
            .iter()
            .zip(base)
            .zip(salts)
            .map(|((m, y), &s)| m.finish(x, y, lora, s))
            .collect();
    };
    if ctx.dropout > 0.0 {
        let keys = dropout_keys(ctx, salts);
        // xd: (G, N, in) f32, each member's dropped input; xa: (G, N, r) = xd·Aᵀ per member.
        let xd = dropout::apply_each(x, &keys)?;
        let xa = mm(&xd, &batched_a(members, ctx)?.t()?)?;
        drop(xd);
        let mut out = Vec::with_capacity(members.len());
        for (g, ((m, y), key)) in members.iter().zip(base).zip(keys).enumerate() {
            // (N, r), packed: a batch of the packed (G, N, r).
            let (y, mut cache) = m.finish_with_xa(y, xa.get(g)?, ctx)?;
            cache.dropout = Some(key);
            out.push((y, cache));
        }
        return Ok(out);
    }
    // xa: (N, Σr) f32 — one GEMM for the LoRA down-projections; in the compute dtype on the
    // half branch ([`crate::linear::half_branch`]), which each member's finish then takes.
    let dora = members
        .iter()
        .any(|m| ctx.adapter.pairs[m.lora.expect("checked")].m.is_some());
    let xa = if crate::linear::half_branch(x, ctx, dora)? {
        crate::linear::half_xa(x, &stacked_a(members, ctx)?)?
    } else {
        mm(&cast(x, DType::F32)?, &stacked_a(members, ctx)?.t()?)?
    };
    let mut col = 0;
    let mut out = Vec::with_capacity(members.len());
    for (m, y) in members.iter().zip(base) {
        let r = ctx.adapter.pairs[m.lora.expect("checked")].a.dim(0)?;
        // (N, r), packed: the GEMMs `xa·Bᵀ` and `dyᵀ·xa` take it.
        out.push(m.finish_with_xa(y, xa.narrow(1, col, r)?.contiguous()?, ctx)?);
        col += r;
    }
    Ok(out)
}

/// Backward of the group: accumulates every member's LoRA gradients and returns
/// `dx = Σ dxᵢ: (N, in)` when `need_dx`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    members: &[&Linear],
    block: Option<&Tensor>,
    dys: &[Tensor],
    x: &Tensor,
    caches: &[&LinearCache],
    lora: Option<&LoraCtx>,
    grads: &mut Grads,
    need_dx: bool,
) -> Result<Option<Tensor>> {
    // QLoRA: the members' weights for dx, dequantized together as in the forward.
    let nf4 = match (block, need_dx) {
        (None, true) => nf4::lease(members)?,
        _ => None,
    };
    let block = block.or(nf4.as_ref().and_then(|l| l.block.as_ref()));
    let ctx = stacked_lora(members, lora);
    if block.is_none() && ctx.is_none() && nf4.is_none() {
        let mut dx: Option<Tensor> = None;
        for ((m, dy), c) in members.iter().zip(dys).zip(caches) {
            if let Some(d) = m.backward(dy, x, c, lora, grads, need_dx)? {
                dx = Some(match dx {
                    Some(acc) => (acc + d)?,
                    None => d,
                });
            }
        }
        return Ok(dx);
    }
    // DoRA: dm, and each member's gradient as the rest of its backward takes it.
    let dys = &crate::linear::dora::prepare_all(members, dys, caches, grads)?;
    let mut dx = match (need_dx, block) {
        // dx: (N, in) = [dy₁, dy₂, …]·[W₁; W₂; …]
        (true, Some(w)) => Some(mm(&Tensor::cat(dys, 1)?, w)?),
        (true, None) => {
            let mut acc: Option<Tensor> = None;
            for (i, (m, dy)) in members.iter().zip(dys).enumerate() {
                let d = match &nf4 {
                    Some(l) => mm(dy, &l.weights[i])?,
                    None => mm(dy, &*m.w.dense()?)?,
                };
                acc = Some(match acc {
                    Some(a) => (a + d)?,
                    None => d,
                });
            }
            acc
        }
        (false, _) => None,
    };
    drop(nf4);
    let Some(ctx) = ctx else {
        for ((m, dy), c) in members.iter().zip(dys).zip(caches) {
            dx = m.lora_backward(dy, x, c, lora, grads, dx)?;
        }
        return Ok(dx);
    };
    // dxa: (N, Σr) f32, each member's `s·dyᵢ·Bᵢ` (dB accumulated on the way).
    let mut dxas = Vec::with_capacity(members.len());
    for ((m, dy), c) in members.iter().zip(dys).zip(caches) {
        dxas.push(m.lora_dxa(dy, c, ctx, grads)?);
    }
    if ctx.dropout > 0.0 {
        let keys: Vec<DropoutKey> = caches
            .iter()
            .map(|c| c.dropout.expect("the forward ran with dropout"))
            .collect();
        // dxa: (G, N, r); dA: (G, r, in) = dxaᵀ·dropout(x) per member, the masks regenerated.
        let dxa = Tensor::stack(&dxas, 0)?;
        let xd = dropout::apply_each(x, &keys)?;
        let da = mm(&dxa.t()?, &xd)?;
        drop(xd);
        for (g, m) in members.iter().enumerate() {
            Grads::add(&mut grads.a[m.lora.expect("checked")], da.get(g)?)?;
        }
        if let Some(d) = dx.as_mut() {
            // dx += Σ mask_g ⊙ (dxa_g·A_g): (G, N, in) f32 from one batched GEMM, one pass.
            let dl = mm(&dxa, &batched_a(members, ctx)?)?;
            *d = dropout::add_each(d, &dl, &keys)?;
        }
        return Ok(dx);
    }
    let dxa = Tensor::cat(&dxas, 1)?;
    if dxa.dtype() != DType::F32 {
        // The half branch: dA = dxaᵀ·x straight into f32, then dx += dxa·[A₁; A₂; …] in place
        // (cuBLAS, beta = 1).
        let da = acc::gemm(&dxa.t()?, &x.contiguous()?, 1.0, DType::F32)?;
        add_row_blocks(members, ctx, grads, &da)?;
        if let Some(d) = &dx {
            let a = stacked_a(members, ctx)?.to_dtype(dxa.dtype())?;
            acc::gemm_acc(d, &dxa, &a, 1.0)?;
        }
        return Ok(dx);
    }
    let xf = cast(x, DType::F32)?;
    // dA: (Σr, in) = dxaᵀ·x, split by rows into each member's (r, in).
    let da = mm(&dxa.t()?, &xf)?;
    add_row_blocks(members, ctx, grads, &da)?;
    // dx + T(dxa·[A₁; A₂; …]): the rank-Σr product and the add as one pass.
    dx.map(|d| lora_up(&d, &dxa, &stacked_a(members, ctx)?, None, true))
        .transpose()
}

/// Accumulates `da: (Σr, in)`, split by rows, into each member's `dA: (r, in)`.
fn add_row_blocks(
    members: &[&Linear],
    ctx: &LoraCtx,
    grads: &mut Grads,
    da: &Tensor,
) -> Result<()> {
    let mut row = 0;
    for m in members {
        let slot = m.lora.expect("checked");
        let r = ctx.adapter.pairs[slot].a.dim(0)?;
        Grads::add(&mut grads.a[slot], da.narrow(0, row, r)?)?;
        row += r;
    }
    Ok(())
}

mod nf4;
#[cfg(test)]
mod tests;

pub use nf4::{plan as nf4_plan, stats as nf4_stats, GroupPlan as Nf4GroupPlan, Ungrouped};
