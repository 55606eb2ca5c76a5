//! The fused kernels (`fused.cu` through [`crate::fused`], `attn.cu` through [`crate::attn`])
//! against [`crate::fused_ref`] on fresh random inputs: one `check_*` per op pair (forward and
//! backward), shared by `tests/fused_cuda.rs` (many shapes) and [`self_test`] (one pass over every
//! kernel, for `rtune selftest` and the GPU benchmark script). The checks call the launchers; the
//! launchers never call the checks.
//!
//! Inputs are drawn in f32, rounded to the kernel's type, and the reference runs on the rounded
//! values in that type's [`Precision`]; tolerances are [`fused_ref::tolerance`]'s. `offset` places
//! every buffer `offset` elements into its allocation, so an odd offset takes the kernels' unaligned
//! (scalar) path.

use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

use crate::fused_ref::{self, Comparison, Op, Rng};
use crate::launch::FusedFloat;
use crate::precision::Precision;
use crate::{attn, drv, fused, Result};

/// One kernel's comparison with its reference.
#[derive(Debug, Clone)]
pub struct CheckResult {
    /// `<op>_<type> <shape>`, e.g. `rms_norm_fwd_bf16 (64, 4096)`.
    pub name: String,
    pub cmp: Comparison,
}

impl CheckResult {
    fn new<T: FusedFloat>(op: Op, shape: String, got: &[f32], want: &[f32]) -> Self {
        let p = if op.f32_output() {
            Precision::F32
        } else {
            T::PRECISION
        };
        let tol = fused_ref::tolerance(op, T::PRECISION);
        CheckResult {
            name: format!("{}_{} {shape}", op.name(), T::SUFFIX),
            cmp: fused_ref::compare(got, want, p, tol),
        }
    }

    /// One line: name, max relative error, PASS/FAIL and the worst element.
    pub fn line(&self) -> String {
        let c = &self.cmp;
        format!(
            "{:<40} max rel err {:.3e}  {}  (worst [{}]: got {:e}, want {:e})",
            self.name,
            c.max_rel_err,
            if c.pass { "PASS" } else { "FAIL" },
            c.worst,
            c.got,
            c.want
        )
    }
}

/// `v` as `T` on the GPU, `offset` zeros first.
fn up<T: FusedFloat>(s: &Arc<CudaStream>, v: &[f32], offset: usize) -> Result<CudaSlice<T>> {
    let host: Vec<T> = std::iter::repeat_n(0.0, offset)
        .chain(v.iter().copied())
        .map(T::from_f32)
        .collect();
    s.clone_htod(&host).map_err(drv("check upload"))
}

/// A zeroed output of `n` elements after `offset`.
fn out<T: FusedFloat>(s: &Arc<CudaStream>, n: usize, offset: usize) -> Result<CudaSlice<T>> {
    s.alloc_zeros::<T>(offset + n).map_err(drv("check alloc"))
}

/// Elements `offset..` of `buf`, as f32 (synchronizes the stream).
fn down<T: FusedFloat>(s: &Arc<CudaStream>, buf: &CudaSlice<T>, offset: usize) -> Result<Vec<f32>> {
    let v = s
        .clone_dtoh(&buf.slice(offset..))
        .map_err(drv("check download"))?;
    Ok(v.into_iter().map(T::to_f32).collect())
}

/// rms_norm_fwd and rms_norm_bwd on `(rows, dim)`: x with a different scale per row (0.03 to 30),
/// w around 1, eps 1e-5.
pub fn check_rms_norm<T: FusedFloat>(
    s: &Arc<CudaStream>,
    rows: usize,
    dim: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, eps, mut rng) = (T::PRECISION, 1e-5f32, Rng::new(seed));
    let mut x = Vec::with_capacity(rows * dim);
    for _ in 0..rows {
        let scale = 10f32.powf(3.0 * rng.uniform() - 1.5);
        x.extend(rng.normals(dim, scale, p));
    }
    let w: Vec<f32> = (0..dim)
        .map(|_| p.round(1.0 + 0.2 * rng.normal()))
        .collect();
    let dy = rng.normals(rows * dim, 1.0, p);
    let (dx_, dw, ddy) = (
        up::<T>(s, &x, offset)?,
        up::<T>(s, &w, offset)?,
        up::<T>(s, &dy, offset)?,
    );
    let (xv, wv, dyv) = (dx_.slice(offset..), dw.slice(offset..), ddy.slice(offset..));
    let mut y = out::<T>(s, rows * dim, offset)?;
    fused::rms_norm_fwd(s, &xv, &wv, &mut y.slice_mut(offset..), rows, dim, eps)?;
    let mut dx = out::<T>(s, rows * dim, offset)?;
    fused::rms_norm_bwd(
        s,
        &dyv,
        &xv,
        &wv,
        &mut dx.slice_mut(offset..),
        rows,
        dim,
        eps,
    )?;
    let shape = format!("({rows}, {dim}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::RmsNormFwd,
            shape.clone(),
            &down(s, &y, offset)?,
            &fused_ref::rms_norm_fwd(&x, &w, rows, dim, eps, p),
        ),
        CheckResult::new::<T>(
            Op::RmsNormBwd,
            shape,
            &down(s, &dx, offset)?,
            &fused_ref::rms_norm_bwd(&dy, &x, &w, rows, dim, eps, p),
        ),
    ])
}

fn at(offset: usize) -> String {
    if offset == 0 {
        String::new()
    } else {
        format!(" +{offset}")
    }
}

/// swiglu_fwd and swiglu_bwd on `(n)`: g ~ 4·N(0, 1) (both tails of silu), u, dh ~ N(0, 1).
pub fn check_swiglu<T: FusedFloat>(
    s: &Arc<CudaStream>,
    n: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng) = (T::PRECISION, Rng::new(seed));
    let (g, u, dh) = (
        rng.normals(n, 4.0, p),
        rng.normals(n, 1.0, p),
        rng.normals(n, 1.0, p),
    );
    let (gd, ud, dhd) = (
        up::<T>(s, &g, offset)?,
        up::<T>(s, &u, offset)?,
        up::<T>(s, &dh, offset)?,
    );
    let (gv, uv, dhv) = (gd.slice(offset..), ud.slice(offset..), dhd.slice(offset..));
    let mut h = out::<T>(s, n, offset)?;
    fused::swiglu_fwd(s, &gv, &uv, &mut h.slice_mut(offset..), n)?;
    let mut o = out::<T>(s, 2 * n, offset)?;
    fused::swiglu_bwd(s, &dhv, &gv, &uv, &mut o.slice_mut(offset..), n)?;
    let shape = format!("({n}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::SwigluFwd,
            shape.clone(),
            &down(s, &h, offset)?,
            &fused_ref::swiglu_fwd(&g, &u, p),
        ),
        CheckResult::new::<T>(
            Op::SwigluBwd,
            shape,
            &down(s, &o, offset)?,
            &fused_ref::swiglu_bwd(&dh, &g, &u, p),
        ),
    ])
}

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
    fused::widen(s, &xd.slice(offset..), &mut y.slice_mut(offset..), n)?;
    Ok(vec![CheckResult::new::<T>(
        Op::Widen,
        format!("({n}){}", at(offset)),
        &down(s, &y, offset)?,
        &fused_ref::widen(&x),
    )])
}

/// rope_fwd and rope_bwd on `(b, h, t, dh)`: real cos/sin tables (random positions per batch row,
/// Llama's frequencies, rounded to T as rope.rs's tables are), x, dy ~ N(0, 1).
pub fn check_rope<T: FusedFloat>(
    s: &Arc<CudaStream>,
    (b, h, t, dh): (usize, usize, usize, usize),
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng) = (T::PRECISION, Rng::new(seed));
    let half = dh / 2;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for _ in 0..b {
        let start = rng.below(8192);
        for ti in 0..t {
            for d in 0..dh {
                let f = 1.0 / 500000f32.powf((2 * (d % half)) as f32 / dh as f32);
                let a = (start + ti as u32) as f32 * f;
                cos.push(p.round(a.cos()));
                sin.push(p.round(a.sin()));
            }
        }
    }
    let n = b * h * t * dh;
    let (x, dy) = (rng.normals(n, 1.0, p), rng.normals(n, 1.0, p));
    let (xd, dyd) = (up::<T>(s, &x, offset)?, up::<T>(s, &dy, offset)?);
    let (cd, sd) = (up::<T>(s, &cos, offset)?, up::<T>(s, &sin, offset)?);
    let (cv, sv) = (cd.slice(offset..), sd.slice(offset..));
    let mut y = out::<T>(s, n, offset)?;
    let mut dx = out::<T>(s, n, offset)?;
    let ys = &mut y.slice_mut(offset..);
    fused::rope_fwd(s, &xd.slice(offset..), &cv, &sv, ys, b, h, t, dh)?;
    let dxs = &mut dx.slice_mut(offset..);
    fused::rope_bwd(s, &dyd.slice(offset..), &cv, &sv, dxs, b, h, t, dh)?;
    let shape4 = (b, h, t, dh);
    let shape = format!("({b}, {h}, {t}, {dh}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::RopeFwd,
            shape.clone(),
            &down(s, &y, offset)?,
            &fused_ref::rope_fwd(&x, &cos, &sin, shape4, p),
        ),
        CheckResult::new::<T>(
            Op::RopeBwd,
            shape,
            &down(s, &dx, offset)?,
            &fused_ref::rope_bwd(&dy, &cos, &sin, shape4, p),
        ),
    ])
}

/// ce_fwd and ce_bwd on `(n, v)`: logits ~ 3·N(0, 1) with one row in four given a dominant
/// logit at its target (loss near 0, softmax near one-hot), scale 1/n. ce_bwd gets the
/// reference's lse, so it is checked on its own.
pub fn check_ce<T: FusedFloat>(
    s: &Arc<CudaStream>,
    n: usize,
    v: usize,
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng) = (T::PRECISION, Rng::new(seed));
    let mut logits = rng.normals(n * v, 3.0, p);
    let targets: Vec<u32> = (0..n).map(|_| rng.below(v as u32)).collect();
    for (i, &tg) in targets.iter().enumerate().step_by(4) {
        logits[i * v + tg as usize] = p.round(30.0);
    }
    let scale = 1.0 / n.max(1) as f32;
    let want_fwd = fused_ref::ce_fwd(&logits, &targets, n, v);
    let lse: Vec<f32> = want_fwd.iter().step_by(2).copied().collect();
    let want_bwd = fused_ref::ce_bwd(&logits, &targets, &lse, scale, n, v, p);

    let ld = up::<T>(s, &logits, offset)?;
    let lv = ld.slice(offset..);
    let td = s.clone_htod(&targets).map_err(drv("check upload"))?;
    let lse_d = s.clone_htod(&lse).map_err(drv("check upload"))?;
    let mut o = out::<f32>(s, 2 * n, offset)?;
    fused::ce_fwd(s, &lv, &td.as_view(), &mut o.slice_mut(offset..), n, v)?;
    let mut d = out::<T>(s, n * v, offset)?;
    let ds = &mut d.slice_mut(offset..);
    fused::ce_bwd(s, &lv, &td.as_view(), &lse_d.as_view(), scale, ds, n, v)?;
    let shape = format!("({n}, {v}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(Op::CeFwd, shape.clone(), &down(s, &o, offset)?, &want_fwd),
        CheckResult::new::<T>(Op::CeBwd, shape, &down(s, &d, offset)?, &want_bwd),
    ])
}

/// attn_softmax_fwd and attn_softmax_bwd on scores `(heads·tq, tk)` (`heads` = Hkv·G stacked
/// blocks of `tq` query rows) and a `(tq, tk)` mask: causal, query i at position `tk − tq + i`,
/// plus row `tq / 2` fully masked when `tq >= 3` (NaN probabilities, as the CPU op). Raw scores
/// ~ 16·N(0, 1) at scale 1/8 (scaled std 2), dp ~ N(0, 1). attn_softmax_bwd gets the reference's
/// probabilities, so it is checked on its own.
pub fn check_attn_softmax<T: FusedFloat>(
    s: &Arc<CudaStream>,
    (heads, tq, tk): (usize, usize, usize),
    offset: usize,
    seed: u64,
) -> Result<Vec<CheckResult>> {
    let (p, mut rng, scale) = (T::PRECISION, Rng::new(seed), 0.125f32);
    let rows = heads * tq;
    let mut mask = vec![0f32; tq * tk];
    for i in 0..tq {
        let pos = (tk + i).saturating_sub(tq);
        for (j, m) in mask[i * tk..(i + 1) * tk].iter_mut().enumerate() {
            if j > pos || (tq >= 3 && i == tq / 2) {
                *m = f32::NEG_INFINITY;
            }
        }
    }
    let raw = rng.normals(rows * tk, 16.0, p);
    let dp = rng.normals(rows * tk, 1.0, p);
    let want_fwd = fused_ref::attn_softmax_fwd(&raw, &mask, tk, scale, p);
    let want_bwd = fused_ref::attn_softmax_bwd(&want_fwd, &dp, tk, scale, p);

    let (rd, dpd) = (up::<T>(s, &raw, offset)?, up::<T>(s, &dp, offset)?);
    let (md, pd) = (
        up::<f32>(s, &mask, offset)?,
        up::<f32>(s, &want_fwd, offset)?,
    );
    let mut o = out::<f32>(s, rows * tk, offset)?;
    let (rv, mv) = (rd.slice(offset..), md.slice(offset..));
    let os = &mut o.slice_mut(offset..);
    attn::attn_softmax_fwd(s, &rv, &mv, os, rows, tk, tq, scale)?;
    let mut d = out::<T>(s, rows * tk, offset)?;
    let ds = &mut d.slice_mut(offset..);
    attn::attn_softmax_bwd(
        s,
        &pd.slice(offset..),
        &dpd.slice(offset..),
        ds,
        rows,
        tk,
        scale,
    )?;
    let shape = format!("({heads}·{tq}, {tk}){}", at(offset));
    Ok(vec![
        CheckResult::new::<T>(
            Op::AttnSoftmaxFwd,
            shape.clone(),
            &down(s, &o, offset)?,
            &want_fwd,
        ),
        CheckResult::new::<T>(Op::AttnSoftmaxBwd, shape, &down(s, &d, offset)?, &want_bwd),
    ])
}

/// One group of [`self_test_seeded`]: its label and what it measured, or the error that stopped it.
pub type SelfTestGroup = (String, Result<Vec<(String, f64, bool)>>);

/// Every kernel once per type (f32, bf16, f16) on fresh random inputs against the reference:
/// `(name, max relative error, pass)` per kernel, seeded from the clock (see [`self_test_seeded`]
/// for the shapes). A few hundred ms on an H100, most of it the CPU reference.
pub fn self_test(stream: &Arc<CudaStream>) -> Result<Vec<(String, f64, bool)>> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut all = Vec::new();
    for (_, group) in self_test_seeded(stream, seed) {
        all.extend(group?);
    }
    Ok(all)
}

/// [`self_test`] under a given seed, one result per group (an op pair on one shape and type), so
/// a failing launch loses only its own group. Shapes: RMSNorm (64, 4096), (7, 4097) at offset 1
/// and (3, 97) at offset 3; SwiGLU 2^20 + 3 and 1001 at offset 5; RoPE (2, 8, 65, 128) and
/// (1, 3, 33, 64) at offset 1; cross-entropy (16, 32000), (4, 128256) and (5, 1001) at offset 3;
/// attention softmax (32·128, 128), (2·3, 16384) (rows too long for shared memory) and (3·7, 333)
/// at offset 1; the widening cast 2^20 + 5 and 1001 at offset 3. The odd sizes are multiples of
/// none of 4, 32, 64; the odd offsets take the kernels' unaligned paths.
pub fn self_test_seeded(stream: &Arc<CudaStream>, seed: u64) -> Vec<SelfTestGroup> {
    let mut all = self_test_type::<f32>(stream, seed);
    all.extend(self_test_type::<half::bf16>(stream, seed));
    all.extend(self_test_type::<half::f16>(stream, seed));
    all
}

fn self_test_type<T: FusedFloat>(s: &Arc<CudaStream>, seed: u64) -> Vec<SelfTestGroup> {
    let t = T::SUFFIX;
    let groups: Vec<(String, Result<Vec<CheckResult>>)> = vec![
        (
            format!("rms_norm_{t} (64, 4096)"),
            check_rms_norm::<T>(s, 64, 4096, 0, seed),
        ),
        (
            format!("rms_norm_{t} (7, 4097)+1"),
            check_rms_norm::<T>(s, 7, 4097, 1, seed + 1),
        ),
        (
            format!("rms_norm_{t} (3, 97)+3"),
            check_rms_norm::<T>(s, 3, 97, 3, seed + 8),
        ),
        (
            format!("swiglu_{t} (2^20+3)"),
            check_swiglu::<T>(s, (1 << 20) + 3, 0, seed + 2),
        ),
        (
            format!("swiglu_{t} (1001)+5"),
            check_swiglu::<T>(s, 1001, 5, seed + 9),
        ),
        (
            format!("widen_{t} (2^20+5)"),
            check_widen::<T>(s, (1 << 20) + 5, 0, seed + 13),
        ),
        (
            format!("widen_{t} (1001)+3"),
            check_widen::<T>(s, 1001, 3, seed + 14),
        ),
        (
            format!("rope_{t} (2, 8, 65, 128)"),
            check_rope::<T>(s, (2, 8, 65, 128), 0, seed + 3),
        ),
        (
            format!("rope_{t} (1, 3, 33, 64)+1"),
            check_rope::<T>(s, (1, 3, 33, 64), 1, seed + 10),
        ),
        (
            format!("ce_{t} (16, 32000)"),
            check_ce::<T>(s, 16, 32000, 0, seed + 4),
        ),
        (
            format!("ce_{t} (4, 128256)"),
            check_ce::<T>(s, 4, 128256, 0, seed + 5),
        ),
        (
            format!("ce_{t} (5, 1001)+3"),
            check_ce::<T>(s, 5, 1001, 3, seed + 11),
        ),
        (
            format!("attn_softmax_{t} (32·128, 128)"),
            check_attn_softmax::<T>(s, (32, 128, 128), 0, seed + 6),
        ),
        (
            format!("attn_softmax_{t} (2·3, 16384)"),
            check_attn_softmax::<T>(s, (2, 3, 16384), 0, seed + 7),
        ),
        (
            format!("attn_softmax_{t} (3·7, 333)+1"),
            check_attn_softmax::<T>(s, (3, 7, 333), 1, seed + 12),
        ),
    ];
    groups
        .into_iter()
        .map(|(label, r)| {
            let r = r.map(|v| {
                v.into_iter()
                    .map(|c| (c.name, c.cmp.max_rel_err, c.cmp.pass))
                    .collect()
            });
            (label, r)
        })
        .collect()
}
