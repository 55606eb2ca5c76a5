//! Reading a sparse layer's expert stacks from the checkpoint as the op takes them,
//! `(n, 2I, H)` and `(n, H, I)` for experts `experts = e0..e1` (`n = e1 − e0`; all `E` unsharded,
//! a rank's own with a sharded base, `crate::shard`): only those experts' bytes are read.
//!
//! - transformers 5's fused 3-D stacks `<layer>.mlp.experts.{gate_up_proj,down_proj}`: a slice
//!   of their leading expert axis, contiguous in the file ([`TensorSource::piece`]); gpt-oss's
//!   stored `(E, in, out)` and transposed here expert by expert; or in MXFP4 as its release
//!   keeps them (`<name>_blocks` `(E, out, G, 16)`, `<name>_scales` `(E, out, G)`, likewise
//!   sliced), dequantized as transformers does straight into `(E, out, in)`;
//! - else the family's released per-expert layout ([`Released`]: Qwen3-MoE's
//!   `mlp.experts.N.{gate,up,down}_proj`, Mixtral's `block_sparse_moe.experts.N.{w1,w3,w2}`):
//!   only experts `e0..e1`'s tensors, stacked.

use std::ops::Range;

use candle_core::Tensor;

use crate::config::moe::{MoeConfig, Released};
use crate::weights::TensorSource;
use crate::{ModelError, Result};

/// Which of a sparse layer's two stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stack {
    /// `(n, 2I, H)`, transformers 5's `gate_up_proj`.
    GateUp,
    /// `(n, H, I)`, `down_proj`.
    Down,
}

impl Stack {
    /// transformers 5's parameter name under `<layer>.mlp.experts`.
    pub(crate) fn param(self) -> &'static str {
        match self {
            Stack::GateUp => "gate_up_proj",
            Stack::Down => "down_proj",
        }
    }
}

/// Experts `experts`' stacks of layer `layer` (`h`: the hidden width), in the dtype and on the
/// device of `like` (the router, for MXFP4's dequantization), each handed to `take` as soon as
/// it is read and before the next is: gate/up, then down. With NF4 experts `take` quantizes it,
/// so one dense stack is alive at a time, not both.
pub(crate) fn read<S>(
    w: &dyn TensorSource,
    layer: &str,
    mc: &MoeConfig,
    h: usize,
    like: &Tensor,
    experts: Range<usize>,
    mut take: impl FnMut(Stack, Tensor) -> Result<S>,
) -> Result<(S, S)> {
    let prefix = format!("{layer}.mlp");
    if let Some(stacks) = fused(w, &prefix, mc, h, like, &experts, &mut take)? {
        return Ok(stacks);
    }
    let Some(released) = mc.released else {
        return Err(ModelError::MissingTensor {
            path: std::path::PathBuf::from(&prefix),
            name: format!("{prefix}.experts.gate_up_proj"),
        });
    };
    per_expert(
        w,
        layer,
        &released,
        (mc.intermediate, h),
        like,
        experts,
        take,
    )
}

/// Experts `experts` of the 3-D tensor `name` of `shape = (E, a, b)`, `(n, a, b)`: the whole
/// tensor read when they are all, else only their slice of the leading axis (`stored`: in the
/// dtype the tensor is stored in, not the compute dtype).
fn slab(
    w: &dyn TensorSource,
    name: &str,
    shape: &[usize],
    experts: &Range<usize>,
    stored: bool,
) -> Result<Tensor> {
    if *experts == (0..shape[0]) {
        return match stored {
            true => w.stored(name, shape),
            false => w.tensor(name, shape),
        };
    }
    let per: usize = shape[1..].iter().product();
    let span = experts.start * per..experts.end * per;
    let t = match stored {
        true => w.stored_piece(name, shape, span)?,
        false => w.piece(name, shape, span)?,
    };
    let mut dims = shape.to_vec();
    dims[0] = experts.len();
    t.reshape(dims)
        .map_err(|e| ModelError::candle(format!("{name}: experts {experts:?}"), e))
}

/// transformers 5's fused stacks under `prefix` (experts `experts`) as `take` makes them, or
/// `None` when the checkpoint has neither them nor their MXFP4 blocks.
fn fused<S>(
    w: &dyn TensorSource,
    prefix: &str,
    mc: &MoeConfig,
    h: usize,
    like: &Tensor,
    experts: &Range<usize>,
    take: &mut impl FnMut(Stack, Tensor) -> Result<S>,
) -> Result<Option<(S, S)>> {
    let (e, i) = (mc.experts, mc.intermediate);
    let gu_name = format!("{prefix}.experts.gate_up_proj");
    let dn_name = format!("{prefix}.experts.down_proj");
    // (n, out, in) as the op takes it; stored (E, in, out) when `transposed`, or in MXFP4
    // (dequantized straight into (n, out, in)).
    let load = |name: &str, out: usize, inp: usize| -> Result<Tensor> {
        match (mc.transposed, mc.mxfp4 && !w.has(name)) {
            (false, _) => slab(w, name, &[e, out, inp], experts, false),
            (true, true) => mxfp4(w, name, [e, inp, out], like, experts),
            (true, false) => transposed(w, name, [e, inp, out], like, experts),
        }
    };
    match load(&gu_name, 2 * i, h) {
        Ok(gu) => {
            let gu = take(Stack::GateUp, gu)?;
            Ok(Some((gu, take(Stack::Down, load(&dn_name, h, i)?)?)))
        }
        Err(ModelError::MissingTensor { .. }) => Ok(None),
        Err(other) => Err(other),
    }
}

/// Experts `experts` of `name`, stored `(E, in, out)`, as `(n, out, in)`: each expert's piece
/// read and transposed into the stack in turn, so that besides the stack only one expert's
/// matrices exist (the whole slab and its transpose were two copies of the stack at once).
fn transposed(
    w: &dyn TensorSource,
    name: &str,
    shape: [usize; 3],
    like: &Tensor,
    experts: &Range<usize>,
) -> Result<Tensor> {
    let [_, inp, out] = shape;
    let n = experts.len();
    if n == 0 {
        // No expert (a rank past the last): the tensor checked (present, its shape), no bytes.
        slab(w, name, &shape, experts, false)?;
    }
    let err = |what: String| move |source| ModelError::candle(format!("{name}: {what}"), source);
    let stack = Tensor::zeros((n * out, inp), like.dtype(), like.device()).map_err(err(
        format!("({}, {inp}) stack of experts {experts:?}", n * out),
    ))?;
    for (j, x) in experts.clone().enumerate() {
        // (in, out) → (out, in), into rows j·out.. of the stack.
        let t = slab(w, name, &shape, &(x..x + 1), false)?
            .reshape((inp, out))
            .and_then(|t| t.t())
            .and_then(|t| t.contiguous())
            .map_err(err(format!("expert {x} (in, out) to (out, in)")))?;
        stack
            .slice_set(&t, 0, j * out)
            .map_err(err(format!("expert {x} into its stack")))?;
    }
    stack
        .reshape((n, out, inp))
        .map_err(err(format!("(n, out, in) stack of experts {experts:?}")))
}

/// The released per-expert layout, experts `experts` stacked: `(n, 2I, H)` (gate rows then up),
/// handed to `take`, then `(n, H, I)`. Each expert's matrices are copied into the stack as they
/// are read, so only one expert's tensors exist besides it: joining and stacking per-expert
/// tensors (`Tensor::cat`, `Tensor::stack`) held every expert's gate/up and down besides the
/// gate/up stack, 2.5 times the gate/up stack at once (benches/moe_vs_peft.sh's model: 251 MB
/// more than the stacks' 151 MB at each layer, its peak RSS loading), and left their 151 MB in
/// the heap for the rest of the run.
fn per_expert<S>(
    w: &dyn TensorSource,
    layer: &str,
    released: &Released,
    (i, h): (usize, usize),
    like: &Tensor,
    experts: Range<usize>,
    mut take: impl FnMut(Stack, Tensor) -> Result<S>,
) -> Result<(S, S)> {
    let module = format!("{layer}.{}", released.module);
    let [gate, up, down] = released.names;
    let n = experts.len();
    let module = module.as_str();
    let err = |what: String| move |e| ModelError::candle(format!("{module}: {what}"), e);
    // `parts` of each expert (name, rows, shape) into a (n·rows, cols) stack, row-major as
    // (n, rows, cols): expert j's part at row rows·j + its offset. No expert (a rank past the
    // last): an empty stack of the right trailing shape.
    let stack = |parts: &[(&str, usize, [usize; 2])], rows: usize, cols: usize| {
        let what = format!("({}, {cols}) stack of experts {experts:?}", n * rows);
        let s = Tensor::zeros((n * rows, cols), like.dtype(), like.device())
            .map_err(err(what.clone()))?;
        for (j, e) in experts.clone().enumerate() {
            for &(p, at, shape) in parts {
                let name = format!("{module}.experts.{e}.{p}.weight");
                let t = w.tensor(&name, &shape)?;
                let row = rows * j + at;
                s.slice_set(&t, 0, row)
                    .map_err(err(format!("{name} {shape:?} into its stack at row {row}")))?;
            }
        }
        s.reshape((n, rows, cols)).map_err(err(what))
    };
    let gu = stack(&[(gate, 0, [i, h]), (up, i, [i, h])], 2 * i, h)?;
    let gu = take(Stack::GateUp, gu)?;
    let dn = stack(&[(down, 0, [h, i])], h, i)?;
    Ok((gu, take(Stack::Down, dn)?))
}

/// An MXFP4 stack `name` (`<name>_blocks`, `<name>_scales`, stored rows `out` of `in` values),
/// experts `experts`, dequantized as transformers does ([`rtune_quant::mxfp4`]) straight into
/// the op's `(n, out, in)` (the stored rows; transformers' own layout is their transpose) in
/// `like`'s dtype and device: one copy of the stack besides the codes.
fn mxfp4(
    w: &dyn TensorSource,
    name: &str,
    shape: [usize; 3],
    like: &Tensor,
    experts: &Range<usize>,
) -> Result<Tensor> {
    let [e, inp, out] = shape;
    let block = rtune_quant::mxfp4::BLOCK;
    if !inp.is_multiple_of(block) {
        return Err(ModelError::TensorShape {
            path: std::path::PathBuf::from(name),
            name: format!("{name}_blocks"),
            got: vec![e, out, inp],
            want: vec![e, out, inp.next_multiple_of(block)],
        });
    }
    let g = inp / block;
    let blocks = slab(
        w,
        &format!("{name}_blocks"),
        &[e, out, g, 16],
        experts,
        true,
    )?;
    let scales = slab(w, &format!("{name}_scales"), &[e, out, g], experts, true)?;
    let rows = rtune_quant::mxfp4::Layout::Rows;
    rtune_quant::mxfp4::dequantize(name, &blocks, &scales, rows, like.dtype(), like.device())
        .map_err(|source| ModelError::Quant {
            path: std::path::PathBuf::from(name),
            source,
        })
}
