//! Fused ops of the training step: RMSNorm, SwiGLU, rotate-half RoPE, the cross-entropy of a
//! chunk of rows and (in `fused_attn`) the attention softmax, each forward and backward
//! as one candle custom op.
//!
//! The plain formulation of each (a chain of candle elementwise ops: one allocation and one memory
//! pass per step) stays beside its call site as the reference — [`crate::ops::rms_norm_reference`],
//! [`crate::ops::swiglu_reference`], [`crate::rope::apply_reference`], ... — and `fused_tests`
//! compares every op here with it on fresh random inputs, f32 and bf16.
//!
//! The ops carry no autograd (`apply_op*_no_bwd`): the model has its own backward, so each backward
//! is a separate op. CPU kernels are in `fused_cpu` (and `fused_attn`); with the `cuda` feature
//! each op also runs `rtune_kernels::fused`'s kernels (`fused_cuda`).
//! Storage may be f32, bf16 or f16 (all tensors of an op the same, except the u32 targets and the
//! f32 log-sum-exp); arithmetic is f32.
//! The ops require contiguous inputs (an offset into a larger buffer is fine): the functions below
//! make their inputs contiguous, and the raw ops return an error naming the op and the layout.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Error, Layout, Result, Shape, Tensor, WithDType,
};

use crate::fused_cpu as cpu;

pub use crate::fused_attn::{attn_softmax, attn_softmax_bwd};

/// `x: (..., D)`, `w: (D)` → `T(T(x·r)·w)` with `r = 1/sqrt(mean(x²) + eps)` per row, in f32
/// (transformers' `LlamaRMSNorm`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &RmsNorm { eps })
}

/// [`rms_norm`]'s `dx = r·g − (x·r³)·mean(g·x)` with `g = T(dy·w)`, `r` recomputed from `x`.
/// `dy, x: (..., D)`, `w: (D)`.
pub fn rms_norm_bwd(dy: &Tensor, x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    dy.contiguous()?
        .apply_op3_no_bwd(&x.contiguous()?, &w.contiguous()?, &RmsNormBwd { eps })
}

/// SwiGLU `T(T(silu(g))·u)`, `g, u` of one shape.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    g.contiguous()?.apply_op2_no_bwd(&u.contiguous()?, &Swiglu)
}

/// [`swiglu`]'s `(dg, du)`: `dg = dh·u·silu'(g)`, `du = dh·silu(g)`, computed in f32 and rounded
/// once. Both are views into one `(2, ...)` buffer (contiguous, at offsets 0 and n).
pub fn swiglu_bwd(dh: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    let both = dh
        .contiguous()?
        .apply_op3_no_bwd(&g.contiguous()?, &u.contiguous()?, &SwigluBwd)?;
    Ok((both.get(0)?, both.get(1)?))
}

/// Rotate-half RoPE: `x: (B, H, T, Dh)`, `cos, sin: (B or 1, 1, T, Dh)` →
/// `x·cos + rotate_half(x)·sin`, each product rounded to the storage type as the plain chain does.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (table(x, cos)?, table(x, sin)?);
    x.contiguous()?
        .apply_op3_no_bwd(&cos, &sin, &Rope { bwd: false })
}

/// [`rope`]'s backward (the rotation's transpose): `dx = dy·cos + rotate_halfᵀ(dy·sin)`.
pub fn rope_bwd(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (table(dy, cos)?, table(dy, sin)?);
    dy.contiguous()?
        .apply_op3_no_bwd(&cos, &sin, &Rope { bwd: true })
}

/// A RoPE table, contiguous; on CUDA a batch of 1 is broadcast to `x`'s batch (the kernels index
/// the table by x's batch; the CPU kernel reads a batch of 1 for every row).
fn table(x: &Tensor, c: &Tensor) -> Result<Tensor> {
    match (x.dims().first(), c.dims()) {
        (Some(&b), &[1, a, t, d]) if b != 1 && x.device().is_cuda() => {
            c.broadcast_as((b, a, t, d))?.contiguous()
        }
        _ => c.contiguous(),
    }
}

/// Cross-entropy statistics of `logits: (n, V)` against `targets: (n)` u32: `(n, 2)` f32
/// `[lse, lse − logit[target]]` (the second column is each row's loss).
pub fn ce_fwd(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2_no_bwd(&targets.contiguous()?, &CeFwd)
}

/// `dlogits = (softmax(logits) − onehot(targets))·scale` in the logits' dtype, from
/// `lse: (n)` f32 ([`ce_fwd`]'s first column).
pub fn ce_bwd(logits: &Tensor, targets: &Tensor, lse: &Tensor, scale: f64) -> Result<Tensor> {
    logits.contiguous()?.apply_op3_no_bwd(
        &targets.contiguous()?,
        &lse.contiguous()?,
        &CeBwd {
            scale: scale as f32,
        },
    )
}

/// `(start, end)` of a contiguous layout in its storage, or an error naming the op and the layout.
pub(crate) fn contiguous(op: &str, what: &str, l: &Layout) -> Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| {
        Error::Msg(format!(
            "{op}: `{what}` must be contiguous, got shape {:?} with strides {:?} \
             (call .contiguous() first)",
            l.dims(),
            l.stride()
        ))
        .bt()
    })
}

/// The contiguous elements of `l` in `s`.
pub(crate) fn slice<'a, T: WithDType>(
    op: &str,
    what: &str,
    s: &'a CpuStorage,
    l: &Layout,
) -> Result<&'a [T]> {
    let (a, b) = contiguous(op, what, l)?;
    Ok(&s.as_slice::<T>()?[a..b])
}

/// The one float dtype of an op's tensors (f32, bf16 or f16).
pub(crate) fn float_dtype(op: &str, dts: &[(&str, DType)]) -> Result<DType> {
    let dt = dts[0].1;
    if let Some((name, other)) = dts.iter().find(|(_, d)| *d != dt) {
        bail!("{op}: `{name}` is {other:?} but `{}` is {dt:?}", dts[0].0);
    }
    if !matches!(dt, DType::F32 | DType::BF16 | DType::F16) {
        bail!("{op}: {dt:?} is not supported (f32, bf16, f16)");
    }
    Ok(dt)
}

/// Evaluates `$body` with `$T` the Rust type of `$dt` (f32, bf16 or f16).
macro_rules! by_dtype {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            dt => unreachable!("float_dtype let {dt:?} through"),
        }
    };
}
pub(crate) use by_dtype;

fn check_shape(op: &str, what: &str, got: &Layout, want: &Shape) -> Result<()> {
    if got.shape() != want {
        bail!(
            "{op}: `{what}` has shape {:?}, expected {want:?}",
            got.dims()
        );
    }
    Ok(())
}

/// `(rows, D)` of RMSNorm's `x: (..., D)` against `w: (D)`.
fn norm_dims(op: &str, x: &Layout, w: &Layout) -> Result<(usize, usize)> {
    let d = x.dims().last().copied().unwrap_or(1);
    check_shape(op, "w", w, &Shape::from(d))?;
    Ok((x.shape().elem_count() / d.max(1), d))
}

/// `(b, h, t, dh)` of RoPE's `x` against `cos, sin: (b or 1, 1, t, dh)`.
fn rope_dims(op: &str, x: &Layout, c: &Layout, s: &Layout) -> Result<[usize; 4]> {
    let &[b, h, t, dh] = x.dims() else {
        bail!("{op}: `x` must be (B, H, T, Dh), got {:?}", x.dims());
    };
    if dh % 2 != 0 {
        bail!("{op}: head dim {dh} is odd");
    }
    let cb = c.dims().first().copied().unwrap_or(0);
    let cb = if cb == 1 { 1 } else { b };
    check_shape(op, "cos", c, &Shape::from((cb, 1, t, dh)))?;
    check_shape(op, "sin", s, &Shape::from((cb, 1, t, dh)))?;
    Ok([b, h, t, dh])
}

/// `(n, V)` of the cross-entropy's `logits: (n, V)` against `targets: (n)` u32.
fn ce_dims(op: &str, logits: &Layout, tgt: &Layout, dt: DType) -> Result<(usize, usize)> {
    let &[n, v] = logits.dims() else {
        bail!("{op}: `logits` must be (n, V), got {:?}", logits.dims());
    };
    if v == 0 {
        bail!("{op}: vocabulary of 0");
    }
    check_shape(op, "targets", tgt, &Shape::from(n))?;
    if dt != DType::U32 {
        bail!("{op}: `targets` must be u32, got {dt:?}");
    }
    Ok((n, v))
}

/// Every target `< v`, else an error naming the row (the kernels index by it).
fn check_targets(op: &str, targets: &[u32], v: usize) -> Result<()> {
    match targets.iter().position(|&t| t as usize >= v) {
        Some(i) => bail!(
            "{op}: target {} of row {i} is outside the vocabulary of {v}",
            targets[i]
        ),
        None => Ok(()),
    }
}

/// `apply_op3`'s CUDA hook, forwarding to `fused_cuda` (`$f(self, s1, l1, s2, l2, s3, l3)`).
macro_rules! cuda_fwd3 {
    ($f:path) => {
        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
            s3: &candle_core::CudaStorage,
            l3: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            $f(self, s1, l1, s2, l2, s3, l3)
        }
    };
}

macro_rules! cuda_fwd2 {
    ($f:path) => {
        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s1: &candle_core::CudaStorage,
            l1: &Layout,
            s2: &candle_core::CudaStorage,
            l2: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            $f(self, s1, l1, s2, l2)
        }
    };
}
pub(crate) use cuda_fwd2;

pub(crate) struct RmsNorm {
    pub(crate) eps: f64,
}

impl RmsNorm {
    /// `(rows, D, dtype)`.
    pub(crate) fn check(
        &self,
        x: (DType, &Layout),
        w: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let dt = float_dtype("rms_norm", &[("x", x.0), ("w", w.0)])?;
        let (n, d) = norm_dims("rms_norm", x.1, w.1)?;
        Ok((n, d, dt))
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, dt) = self.check((sx.dtype(), lx), (sw.dtype(), lw))?;
        let n = self.name();
        let y = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::rms_norm::<T>(
            slice(n, "x", sx, lx)?,
            slice(n, "w", sw, lw)?,
            self.eps as f32,
        )));
        Ok((y, lx.shape().clone()))
    }

    cuda_fwd2!(crate::fused_cuda::rms_norm);
}

pub(crate) struct RmsNormBwd {
    pub(crate) eps: f64,
}

impl RmsNormBwd {
    /// `(rows, D, dtype)`.
    pub(crate) fn check(
        &self,
        dy: (DType, &Layout),
        x: (DType, &Layout),
        w: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let op = "rms_norm_bwd";
        let dt = float_dtype(op, &[("dy", dy.0), ("x", x.0), ("w", w.0)])?;
        check_shape(op, "x", x.1, dy.1.shape())?;
        let (n, d) = norm_dims(op, x.1, w.1)?;
        Ok((n, d, dt))
    }
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "rms_norm_bwd"
    }

    fn cpu_fwd(
        &self,
        sdy: &CpuStorage,
        ldy: &Layout,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, dt) = self.check((sdy.dtype(), ldy), (sx.dtype(), lx), (sw.dtype(), lw))?;
        let n = self.name();
        let dx = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::rms_norm_bwd::<T>(
            slice(n, "dy", sdy, ldy)?,
            slice(n, "x", sx, lx)?,
            slice(n, "w", sw, lw)?,
            self.eps as f32,
        )));
        Ok((dx, lx.shape().clone()))
    }

    cuda_fwd3!(crate::fused_cuda::rms_norm_bwd);
}

pub(crate) struct Swiglu;

impl Swiglu {
    pub(crate) fn check(&self, g: (DType, &Layout), u: (DType, &Layout)) -> Result<DType> {
        check_shape("swiglu", "u", u.1, g.1.shape())?;
        float_dtype("swiglu", &[("g", g.0), ("u", u.0)])
    }
}

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dt = self.check((sg.dtype(), lg), (su.dtype(), lu))?;
        let n = self.name();
        let h = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::swiglu::<T>(
            slice(n, "g", sg, lg)?,
            slice(n, "u", su, lu)?,
        )));
        Ok((h, lg.shape().clone()))
    }

    cuda_fwd2!(crate::fused_cuda::swiglu);
}

pub(crate) struct SwigluBwd;

impl SwigluBwd {
    /// `(dtype, output shape (2, ...))`.
    pub(crate) fn check(
        &self,
        dh: (DType, &Layout),
        g: (DType, &Layout),
        u: (DType, &Layout),
    ) -> Result<(DType, Shape)> {
        let op = "swiglu_bwd";
        check_shape(op, "g", g.1, dh.1.shape())?;
        check_shape(op, "u", u.1, dh.1.shape())?;
        let dt = float_dtype(op, &[("dh", dh.0), ("g", g.0), ("u", u.0)])?;
        let mut dims = vec![2];
        dims.extend_from_slice(g.1.dims());
        Ok((dt, Shape::from(dims)))
    }
}

impl CustomOp3 for SwigluBwd {
    fn name(&self) -> &'static str {
        "swiglu_bwd"
    }

    fn cpu_fwd(
        &self,
        sdh: &CpuStorage,
        ldh: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (dt, shape) = self.check((sdh.dtype(), ldh), (sg.dtype(), lg), (su.dtype(), lu))?;
        let n = self.name();
        let out = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::swiglu_bwd::<T>(
            slice(n, "dh", sdh, ldh)?,
            slice(n, "g", sg, lg)?,
            slice(n, "u", su, lu)?,
        )));
        Ok((out, shape))
    }

    cuda_fwd3!(crate::fused_cuda::swiglu_bwd);
}

pub(crate) struct Rope {
    /// The backward (transposed rotation) instead of the forward.
    pub(crate) bwd: bool,
}

impl Rope {
    /// `([b, h, t, dh], dtype)`.
    pub(crate) fn check(
        &self,
        x: (DType, &Layout),
        c: (DType, &Layout),
        s: (DType, &Layout),
    ) -> Result<([usize; 4], DType)> {
        let op = self.op_name();
        let dt = float_dtype(op, &[("x", x.0), ("cos", c.0), ("sin", s.0)])?;
        Ok((rope_dims(op, x.1, c.1, s.1)?, dt))
    }

    pub(crate) fn op_name(&self) -> &'static str {
        if self.bwd {
            "rope_bwd"
        } else {
            "rope"
        }
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        self.op_name()
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sc: &CpuStorage,
        lc: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let ([_, h, t, dh], dt) =
            self.check((sx.dtype(), lx), (sc.dtype(), lc), (ss.dtype(), ls))?;
        let n = self.name();
        let y = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::rope::<T>(
            slice(n, "x", sx, lx)?,
            slice(n, "cos", sc, lc)?,
            slice(n, "sin", ss, ls)?,
            (h, t, dh),
            self.bwd,
        )));
        Ok((y, lx.shape().clone()))
    }

    cuda_fwd3!(crate::fused_cuda::rope);
}

pub(crate) struct CeFwd;

impl CeFwd {
    /// `(n, V, logits dtype)`.
    pub(crate) fn check(
        &self,
        l: (DType, &Layout),
        t: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let dt = float_dtype("ce_fwd", &[("logits", l.0)])?;
        let (n, v) = ce_dims("ce_fwd", l.1, t.1, t.0)?;
        Ok((n, v, dt))
    }
}

impl CustomOp2 for CeFwd {
    fn name(&self) -> &'static str {
        "ce_fwd"
    }

    fn cpu_fwd(
        &self,
        sl: &CpuStorage,
        ll: &Layout,
        st: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v, dt) = self.check((sl.dtype(), ll), (st.dtype(), lt))?;
        let op = self.name();
        let targets = slice::<u32>(op, "targets", st, lt)?;
        check_targets(op, targets, v)?;
        let out = by_dtype!(dt, T => cpu::ce_fwd::<T>(slice(op, "logits", sl, ll)?, targets, v));
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    cuda_fwd2!(crate::fused_cuda::ce_fwd);
}

pub(crate) struct CeBwd {
    pub(crate) scale: f32,
}

impl CeBwd {
    /// `(n, V, logits dtype)`.
    pub(crate) fn check(
        &self,
        l: (DType, &Layout),
        t: (DType, &Layout),
        lse: (DType, &Layout),
    ) -> Result<(usize, usize, DType)> {
        let op = "ce_bwd";
        let dt = float_dtype(op, &[("logits", l.0)])?;
        let (n, v) = ce_dims(op, l.1, t.1, t.0)?;
        check_shape(op, "lse", lse.1, &Shape::from(n))?;
        if lse.0 != DType::F32 {
            bail!("{op}: `lse` must be f32, got {:?}", lse.0);
        }
        Ok((n, v, dt))
    }
}

impl CustomOp3 for CeBwd {
    fn name(&self) -> &'static str {
        "ce_bwd"
    }

    fn cpu_fwd(
        &self,
        sl: &CpuStorage,
        ll: &Layout,
        st: &CpuStorage,
        lt: &Layout,
        slse: &CpuStorage,
        llse: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, v, dt) = self.check((sl.dtype(), ll), (st.dtype(), lt), (slse.dtype(), llse))?;
        let op = self.name();
        let targets = slice::<u32>(op, "targets", st, lt)?;
        check_targets(op, targets, v)?;
        let lse = slice::<f32>(op, "lse", slse, llse)?;
        let d = by_dtype!(dt, T => T::to_cpu_storage_owned(cpu::ce_bwd::<T>(
            slice(op, "logits", sl, ll)?,
            targets,
            lse,
            self.scale,
            v,
        )));
        Ok((d, ll.shape().clone()))
    }

    cuda_fwd3!(crate::fused_cuda::ce_bwd);
}

#[cfg(test)]
#[path = "fused_tests.rs"]
mod tests;
