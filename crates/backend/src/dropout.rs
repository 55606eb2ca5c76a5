//! LoRA dropout masks from a counter-based generator: Philox4x32-10 (Salmon, Moraes, Dror, Shaw,
//! "Parallel random numbers: as easy as 1, 2, 3", SC 2011; Random123's `philox4x32`).
//!
//! Element `i` of a module's input is kept iff `u(i) ≥ p`, and then scaled by `1/(1−p)` (inverted
//! dropout, as `torch.nn.Dropout`), where `u(i)` is a 24-bit uniform in `[0, 1)` read from one
//! word of one Philox block:
//!
//! - key `(k₀, k₁)` = the micro-batch seed ([`crate::LoraCtx::seed`], which the trainer derives
//!   from the run seed, the step and the micro-batch), low word first;
//! - counter `(i/4 low, i/4 high, salt low, salt high)`, the salt naming the layer and module;
//! - `u(i) = (word[i mod 4] >> 8) · 2⁻²⁴`, so `keep ⇔ word >> 8 ≥ ⌈p·2²⁴⌉` in integers, which
//!   any device evaluates the same way.
//!
//! A mask is a pure function of `(seed, salt, i)`: elements are generated in any order and in
//! parallel, the same function serves every device, and the backward (or a recomputed forward
//! under gradient checkpointing) regenerates the mask rather than keeping it. [`apply`] fuses
//! the cast to f32, the mask and the scale into one pass over the input: rayon tasks on the CPU,
//! `kernels/dropout.cu` on CUDA (`dropout::cuda`), the same bits on both. On the CPU the
//! blocks are generated 32 at a time in struct-of-arrays form, and the passes are the fused ops'
//! `Kernel`s ([`crate::cpu`]), built for AVX-512F/AVX2 when the CPU has them, so the rounds
//! vectorize. For a group of modules reading one input ([`crate::group`]), [`apply_each`] makes
//! every member's dropped input in one pass and [`add_each`] adds the members' masked input
//! gradients into `dx` in one pass.

#[cfg(feature = "kernels")]
pub mod cuda;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Philox4x32 round multipliers and Weyl key increments (Random123's `PHILOX_M4x32_*`,
/// `PHILOX_W32_*`).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds: one 128-bit block of output for a 128-bit counter and 64-bit key.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// What regenerates one module's mask: never the mask itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutKey {
    /// Drop probability, `0 < p < 1`.
    pub p: f64,
    /// The micro-batch seed ([`crate::LoraCtx::seed`]).
    pub seed: u64,
    /// The layer and module.
    pub salt: u64,
}

impl DropoutKey {
    /// Kept iff `word >> 8 ≥ threshold`: `⌈p·2²⁴⌉`, so that `P(keep) = 1 − p` up to 2⁻²⁴.
    pub fn threshold(&self) -> u32 {
        (self.p * 16_777_216.0).ceil().clamp(0.0, 16_777_216.0) as u32
    }

    /// `1/(1−p)` in f32, the kept elements' factor.
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.p)) as f32
    }

    /// The Philox block that holds elements `4·block .. 4·block + 4`.
    fn block(&self, block: u64) -> [u32; 4] {
        philox4x32_10(
            [
                block as u32,
                (block >> 32) as u32,
                self.salt as u32,
                (self.salt >> 32) as u32,
            ],
            [self.seed as u32, (self.seed >> 32) as u32],
        )
    }

    /// Element `i`'s factor, one at a time: `0` or [`DropoutKey::scale`] (the reference).
    pub fn factor(&self, i: u64) -> f32 {
        let word = self.block(i / 4)[(i % 4) as usize];
        if word >> 8 >= self.threshold() {
            self.scale()
        } else {
            0.0
        }
    }

    /// Factors of the `4·LANES` elements from block `first` on, into `out`: [`LANES`] Philox
    /// blocks at once, their words kept as struct-of-arrays so that the rounds vectorize
    /// (on AVX-512 the high words are `vpmuludq` on even and odd lanes, the low ones `vpmulld`).
    #[inline(always)]
    // Lanes index four arrays at once (the struct-of-arrays layout the vectorizer wants).
    #[allow(clippy::needless_range_loop)]
    fn factors(&self, first: u64, thr: u32, scale: f32, out: &mut [f32; 4 * LANES]) {
        let mut c = [[0u32; LANES]; 4];
        for l in 0..LANES {
            let b = first + l as u64;
            c[0][l] = b as u32;
            c[1][l] = (b >> 32) as u32;
            c[2][l] = self.salt as u32;
            c[3][l] = (self.salt >> 32) as u32;
        }
        let mut k = [self.seed as u32, (self.seed >> 32) as u32];
        for round in 0..10 {
            if round > 0 {
                k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
            }
            for l in 0..LANES {
                // The products' high words as u64 products shifted, their low words as 32-bit
                // wrapping products: written so, the vectorizer emits `vpmuludq` on even and odd
                // lanes for the high words and `vpmulld` for the low ones, with no widening of the
                // lanes to 64 bits and back.
                let hi0 = ((u64::from(M0) * u64::from(c[0][l])) >> 32) as u32;
                let hi1 = ((u64::from(M1) * u64::from(c[2][l])) >> 32) as u32;
                let (lo0, lo1) = (M0.wrapping_mul(c[0][l]), M1.wrapping_mul(c[2][l]));
                let n0 = hi1 ^ c[1][l] ^ k[0];
                let n2 = hi0 ^ c[3][l] ^ k[1];
                (c[0][l], c[1][l], c[2][l], c[3][l]) = (n0, lo1, n2, lo0);
            }
        }
        for l in 0..LANES {
            for w in 0..4 {
                out[4 * l + w] = if c[w][l] >> 8 >= thr { scale } else { 0.0 };
            }
        }
    }

    /// `out = f32(src) · factor` for elements `start .. start + out.len()` (every one written),
    /// `start` a multiple of 4.
    fn fill<T: Copy + Sync>(
        &self,
        start: u64,
        src: &[T],
        out: &mut [MaybeUninit<f32>],
        f32_of: impl Fn(T) -> f32 + Sync,
    ) {
        crate::cpu::dispatch(
            &Fill {
                key: self,
                start,
                src,
                f32_of,
            },
            0,
            out,
        )
    }

    /// `acc = round(acc + round(d · factor))` for elements `start .. start + acc.len()`, `start`
    /// a multiple of 4: one masked term added as candle adds `acc + dropout(d).to_dtype(..)`.
    fn add_into(&self, start: u64, d: &[f32], acc: &mut [f32], round: impl Fn(f32) -> f32 + Sync) {
        crate::cpu::dispatch(
            &AddInto {
                key: self,
                start,
                d,
                round,
            },
            0,
            acc,
        )
    }
}

/// [`DropoutKey::fill`]'s loop as a [`crate::cpu::Kernel`]: its `run` is inlined into the
/// dispatcher's AVX-512F and AVX2 copies, Philox rounds included (as a closure it was compiled
/// once, out of line, for the SSE2 baseline: 11% of a SmolLM2 recipe step).
struct Fill<'a, T, F> {
    key: &'a DropoutKey,
    start: u64,
    src: &'a [T],
    f32_of: F,
}

impl<T: Copy + Sync, F: Fn(T) -> f32 + Sync> crate::cpu::Kernel for Fill<'_, T, F> {
    type Out<'o> = &'o mut [MaybeUninit<f32>];
    #[inline(always)]
    fn run(&self, _: usize, out: Self::Out<'_>) {
        let k = self.key;
        debug_assert_eq!(self.start % 4, 0);
        let (thr, scale) = (k.threshold(), k.scale());
        let mut m = [0f32; 4 * LANES];
        for j in (0..out.len()).step_by(4 * LANES) {
            k.factors((self.start + j as u64) / 4, thr, scale, &mut m);
            let n = (out.len() - j).min(4 * LANES);
            for ((o, &x), &m) in out[j..j + n]
                .iter_mut()
                .zip(&self.src[j..j + n])
                .zip(&m[..n])
            {
                o.write((self.f32_of)(x) * m);
            }
        }
    }
}

/// [`DropoutKey::add_into`]'s loop as a [`crate::cpu::Kernel`] (see [`Fill`]).
struct AddInto<'a, F> {
    key: &'a DropoutKey,
    start: u64,
    d: &'a [f32],
    round: F,
}

impl<F: Fn(f32) -> f32 + Sync> crate::cpu::Kernel for AddInto<'_, F> {
    type Out<'o> = &'o mut [f32];
    #[inline(always)]
    fn run(&self, _: usize, acc: Self::Out<'_>) {
        let k = self.key;
        debug_assert_eq!(self.start % 4, 0);
        let (thr, scale) = (k.threshold(), k.scale());
        let mut m = [0f32; 4 * LANES];
        for j in (0..acc.len()).step_by(4 * LANES) {
            k.factors((self.start + j as u64) / 4, thr, scale, &mut m);
            let n = (acc.len() - j).min(4 * LANES);
            for ((a, &x), &m) in acc[j..j + n].iter_mut().zip(&self.d[j..j + n]).zip(&m[..n]) {
                *a = (self.round)(*a + (self.round)(x * m));
            }
        }
    }
}

/// Philox blocks generated together (see [`DropoutKey::factors`]): two AVX-512 registers a word,
/// so each round's two independent chains hide its multiplies' latency (a round's chain is
/// `vpmuludq → vpermt2d → vpternlogd`, ~10 cycles, against ~8 cycles of multiplies per 16
/// blocks). `mask_rate`, 2²² elements on 2 threads, best of 20 (2026-12-03, Xeon with AVX-512):
/// 16 → 32 blocks 0.61 → 0.29 ns an element (AVX-512F build), 0.60 → 0.45 (AVX2), 0.93 → 0.99
/// (baseline); 64 blocks 0.32 (AVX-512F).
const LANES: usize = 32;

/// Elements a rayon task handles: a multiple of `4·LANES` (whole batches of Philox blocks), large
/// enough that a task's work dwarfs its scheduling.
const TASK: usize = 1 << 14;

fn masked<T: Copy + Sync>(
    key: &DropoutKey,
    src: &[T],
    f32_of: impl Fn(T) -> f32 + Sync,
) -> Vec<f32> {
    crate::cpu::filled(src.len(), |out| {
        out.par_chunks_mut(TASK)
            .zip(src.par_chunks(TASK))
            .enumerate()
            .for_each(|(t, (o, s))| key.fill((t * TASK) as u64, s, o, &f32_of))
    })
}

/// Every key's mask over the same `src`, member after member: `(G·n)` f32 (see [`apply_each`]).
fn masked_each<T: Copy + Sync>(
    keys: &[DropoutKey],
    src: &[T],
    f32_of: impl Fn(T) -> f32 + Sync,
) -> Vec<f32> {
    let n = src.len();
    crate::cpu::filled(keys.len() * n, |out| {
        if n == 0 {
            return;
        }
        out.par_chunks_mut(n).zip(keys).for_each(|(o, key)| {
            o.par_chunks_mut(TASK)
                .zip(src.par_chunks(TASK))
                .enumerate()
                .for_each(|(t, (o, s))| key.fill((t * TASK) as u64, s, o, &f32_of))
        })
    })
}

/// `acc + Σ_g dropout_g(d[g])`, added member after member with `round` after each addition
/// (see [`add_each`]); `d` is `G` blocks of `acc.len()`.
fn add_masked<T: Copy + Send + Sync>(
    keys: &[DropoutKey],
    acc: &[T],
    d: &[f32],
    to_f32: impl Fn(T) -> f32 + Sync,
    from_f32: impl Fn(f32) -> T + Sync,
    round: impl Fn(f32) -> f32 + Sync + Copy,
) -> Vec<T> {
    let n = acc.len();
    let mut out = acc.to_vec();
    out.par_chunks_mut(TASK).enumerate().for_each(|(t, o)| {
        let start = t * TASK;
        let mut a: Vec<f32> = o.iter().map(|&v| to_f32(v)).collect();
        for (g, key) in keys.iter().enumerate() {
            let dg = &d[g * n + start..g * n + start + o.len()];
            key.add_into(start as u64, dg, &mut a, round);
        }
        for (o, v) in o.iter_mut().zip(a) {
            *o = from_f32(v);
        }
    });
    out
}

/// The CPU op of [`apply_each`].
struct DropoutEach(Vec<DropoutKey>);

impl CustomOp1 for DropoutEach {
    fn name(&self) -> &'static str {
        "lora-dropout-each"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = crate::storage::contiguous("lora-dropout-each", "x", l)?;
        let keys = &self.0;
        let out = match s {
            CpuStorage::F32(v) => masked_each(keys, &v[a..b], |x| x),
            CpuStorage::BF16(v) => masked_each(keys, &v[a..b], bf16::to_f32),
            CpuStorage::F16(v) => masked_each(keys, &v[a..b], f16::to_f32),
            other => candle_core::bail!(
                "lora-dropout-each: x must be f32, bf16 or f16, got {:?} of shape {:?}",
                other.dtype(),
                l.dims()
            ),
        };
        let mut dims = vec![keys.len()];
        dims.extend_from_slice(l.dims());
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

/// The CPU op of [`add_each`]: `acc` is the first operand, the stacked terms the second.
struct AddEach(Vec<DropoutKey>);

impl CustomOp2 for AddEach {
    fn name(&self) -> &'static str {
        "lora-dropout-add-each"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = "lora-dropout-add-each";
        let (a0, a1) = crate::storage::contiguous(op, "acc", l1)?;
        let (d0, d1) = crate::storage::contiguous(op, "d", l2)?;
        let CpuStorage::F32(d) = s2 else {
            candle_core::bail!(
                "{op}: d must be f32, got {:?} of shape {:?}",
                s2.dtype(),
                l2.dims()
            );
        };
        let keys = &self.0;
        let d = &d[d0..d1];
        if d.len() != keys.len() * (a1 - a0) {
            candle_core::bail!(
                "{op}: d {:?} is not {} blocks of acc {:?}",
                l2.dims(),
                keys.len(),
                l1.dims()
            );
        }
        let out = match s1 {
            CpuStorage::F32(v) => {
                CpuStorage::F32(add_masked(keys, &v[a0..a1], d, |x| x, |x| x, |x| x))
            }
            CpuStorage::BF16(v) => CpuStorage::BF16(add_masked(
                keys,
                &v[a0..a1],
                d,
                bf16::to_f32,
                bf16::from_f32,
                |x| bf16::from_f32(x).to_f32(),
            )),
            CpuStorage::F16(v) => CpuStorage::F16(add_masked(
                keys,
                &v[a0..a1],
                d,
                f16::to_f32,
                f16::from_f32,
                |x| f16::from_f32(x).to_f32(),
            )),
            other => candle_core::bail!(
                "{op}: acc must be f32, bf16 or f16, got {:?} of shape {:?}",
                other.dtype(),
                l1.dims()
            ),
        };
        Ok((out, l1.shape().clone()))
    }
}

struct Dropout(DropoutKey);

impl CustomOp1 for Dropout {
    fn name(&self) -> &'static str {
        "lora-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = crate::storage::contiguous("lora-dropout", "x", l)?;
        let out = match s {
            CpuStorage::F32(v) => masked(&self.0, &v[a..b], |x| x),
            CpuStorage::BF16(v) => masked(&self.0, &v[a..b], bf16::to_f32),
            CpuStorage::F16(v) => masked(&self.0, &v[a..b], f16::to_f32),
            other => candle_core::bail!(
                "lora-dropout: x must be f32, bf16 or f16, got {:?} of shape {:?}",
                other.dtype(),
                l.dims()
            ),
        };
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::dropout::cuda::lora_dropout;
        use crate::FusedFloat;
        use candle_core::cuda_backend::CudaDType;
        fn run<T: CudaDType + FusedFloat>(
            key: &DropoutKey,
            s: &candle_core::CudaStorage,
            (a, b): (usize, usize),
        ) -> Result<candle_core::CudaStorage> {
            let dev = &s.device;
            let n = b - a;
            // SAFETY: the kernel writes all n elements before anything reads them.
            let mut y = unsafe { dev.alloc::<f32>(n) }?;
            lora_dropout::<T>(
                &dev.cuda_stream(),
                &s.as_cuda_slice::<T>()?.slice(a..b),
                &mut y.as_view_mut(),
                n,
                key.seed,
                key.salt,
                key.threshold(),
                key.scale(),
            )
            .map_err(|e| candle_core::Error::Msg(format!("lora-dropout (cuda): {e}")).bt())?;
            Ok(candle_core::CudaStorage::wrap_cuda_slice(y, dev.clone()))
        }
        let range = crate::storage::contiguous("lora-dropout", "x", l)?;
        let y = match s.dtype() {
            DType::F32 => run::<f32>(&self.0, s, range)?,
            DType::BF16 => run::<bf16>(&self.0, s, range)?,
            DType::F16 => run::<f16>(&self.0, s, range)?,
            other => candle_core::bail!(
                "lora-dropout: x must be f32, bf16 or f16, got {other:?} of shape {:?}",
                l.dims()
            ),
        };
        Ok((y, l.shape().clone()))
    }
}

/// `dropout(x)` in f32: `x·1/(1−p)` where element `i` (row-major) is kept, `0·x` elsewhere;
/// `x` of any float dtype, any shape. One fused pass on the CPU and on CUDA; on another device
/// the same factors made on the host and uploaded.
pub fn apply(x: &Tensor, key: &DropoutKey) -> Result<Tensor> {
    if x.device().is_cpu() || (cfg!(feature = "cuda") && x.device().is_cuda()) {
        return x.contiguous()?.apply_op1_no_bwd(&Dropout(*key));
    }
    let ones = vec![1f32; x.elem_count()];
    let mask = masked(key, &ones, |x| x);
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?;
    x.to_dtype(DType::F32)? * mask
}

/// `(G, ...)` f32: `dropout(x)` under each of the `G` keys, stacked — the LoRA inputs of a group
/// of modules that read the same `x` and draw their own masks ([`crate::group`]). Element for
/// element `apply(x, &keys[g])`; one parallel pass on the CPU.
pub fn apply_each(x: &Tensor, keys: &[DropoutKey]) -> Result<Tensor> {
    if x.device().is_cpu() {
        return x
            .contiguous()?
            .apply_op1_no_bwd(&DropoutEach(keys.to_vec()));
    }
    let each = keys
        .iter()
        .map(|k| apply(x, k))
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&each, 0)
}

/// `acc + dropout₀(d[0]) + dropout₁(d[1]) + …` in `acc`'s dtype, `d: (G, acc's shape)` f32,
/// added left to right and rounded to `acc`'s dtype after each addition: bit for bit what
/// `acc + apply(d[g], k).to_dtype(acc.dtype())` does member after member, in one pass on the
/// CPU (the backward of a group's LoRA input, the masks regenerated).
pub fn add_each(acc: &Tensor, d: &Tensor, keys: &[DropoutKey]) -> Result<Tensor> {
    if acc.device().is_cpu() {
        return acc
            .contiguous()?
            .apply_op2_no_bwd(&d.contiguous()?, &AddEach(keys.to_vec()));
    }
    let mut acc = acc.clone();
    for (g, k) in keys.iter().enumerate() {
        acc = (&acc + apply(&d.get(g)?, k)?.to_dtype(acc.dtype())?)?;
    }
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ISA_CAP;
    use candle_core::Device;
    use std::sync::atomic::Ordering;

    /// Random123's known-answer vectors (`tests/kat_vectors`, philox4x32 10 rounds): counter
    /// words, key words, output words.
    #[test]
    fn philox_matches_random123_known_answers() {
        let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
            (
                [0, 0, 0, 0],
                [0, 0],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ];
        for (ctr, key, want) in kat {
            assert_eq!(philox4x32_10(ctr, key), want, "ctr {ctr:x?} key {key:x?}");
        }
    }

    /// The definition pinned: seed 1, salt 0, p 0.3 keeps elements 0..10 but element 8 (the same
    /// ten factors came out of `kernels/dropout.cu`'s body compiled for the host).
    #[test]
    fn known_mask() {
        let key = DropoutKey {
            p: 0.3,
            seed: 1,
            salt: 0,
        };
        assert_eq!(key.threshold(), 5_033_165);
        let kept: Vec<bool> = (0..10).map(|i| key.factor(i) != 0.0).collect();
        let want: Vec<bool> = (0..10).map(|i| i != 8).collect();
        assert_eq!(kept, want);
    }

    /// The fused parallel op equals the element-by-element reference exactly (the same f32
    /// product), over several tasks and a tail that is not a whole block, in f32 and bf16.
    #[test]
    fn apply_equals_reference_factors() -> Result<()> {
        let key = DropoutKey {
            p: 0.3,
            seed: 0x1234_5678_9abc_def0,
            salt: 77,
        };
        let n = 2 * TASK + 7;
        let x = Tensor::randn(0f32, 1.0, (n / 7, 7), &Device::Cpu)?;
        // Every instruction-set build of the mask loop (AVX-512F, AVX2, baseline).
        for cap in [2, 1, 0] {
            ISA_CAP.store(cap, Ordering::Relaxed);
            for xt in [x.clone(), x.to_dtype(DType::BF16)?] {
                let got = apply(&xt, &key)?.flatten_all()?.to_vec1::<f32>()?;
                let xs = xt.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                for (i, (g, v)) in got.iter().zip(&xs).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        (v * key.factor(i as u64)).to_bits(),
                        "element {i}, ISA cap {cap}"
                    );
                }
            }
        }
        ISA_CAP.store(2, Ordering::Relaxed);
        Ok(())
    }

    /// The CUDA kernel draws the CPU's masks: the same f32 bits for every element, f32 and bf16
    /// inputs, a length that is not a whole Philox block. Skips where there is no GPU.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_equals_cpu_bit_for_bit() -> Result<()> {
        let Ok(gpu) = Device::new_cuda(0) else {
            eprintln!("no CUDA device; skipped");
            return Ok(());
        };
        let key = DropoutKey {
            p: 0.1,
            seed: 99,
            salt: u64::MAX - 5,
        };
        let x = Tensor::randn(0f32, 1.0, (333, 77), &Device::Cpu)?;
        for xt in [x.clone(), x.to_dtype(DType::BF16)?] {
            let want = apply(&xt, &key)?.flatten_all()?.to_vec1::<f32>()?;
            let got = apply(&xt.to_device(&gpu)?, &key)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want));
        }
        Ok(())
    }

    /// The kept fraction is 1 − p within 4 standard deviations of a binomial over 10⁶ draws
    /// (σ = √(p(1−p)/n) ≈ 4.6e-4), for each of a few keys; different seeds and salts give
    /// different masks (agreement near p² + (1−p)², not 1).
    #[test]
    fn masks_keep_one_minus_p_and_differ_by_key() {
        let n = 1_000_000u64;
        let p = 0.3;
        let ones = vec![1f32; n as usize];
        let keys = [(1u64, 0u64), (1, 1), (2, 0), (u64::MAX, 123)];
        let masks: Vec<Vec<f32>> = keys
            .iter()
            .map(|&(seed, salt)| masked(&DropoutKey { p, seed, salt }, &ones, |x| x))
            .collect();
        for m in &masks {
            let kept = m.iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
            assert!((kept - (1.0 - p)).abs() < 4.0 * 4.6e-4, "kept {kept}");
            assert!(m.iter().all(|&v| v == 0.0 || v == (1.0 / (1.0 - p)) as f32));
        }
        for i in 0..masks.len() {
            for j in i + 1..masks.len() {
                let same = masks[i]
                    .iter()
                    .zip(&masks[j])
                    .filter(|(a, b)| a == b)
                    .count() as f64
                    / n as f64;
                assert!((same - 0.58).abs() < 0.01, "keys {i}, {j} agree on {same}");
            }
        }
    }

    /// [`apply_each`] is [`apply`] under each key, and [`add_each`] is the member-after-member
    /// sum `acc + apply(d[g], k).to_dtype(..)` as candle computes it — bit for bit, in f32 and
    /// bf16 (rounded after each addition), over several tasks and a tail that is not a whole block.
    #[test]
    fn each_equals_one_key_at_a_time() -> Result<()> {
        let keys: Vec<DropoutKey> = (0..3)
            .map(|salt| DropoutKey {
                p: 0.25,
                seed: 7,
                salt,
            })
            .collect();
        let n = TASK + 4 * LANES + 5;
        let x = Tensor::randn(0f32, 1.0, (n / 5, 5), &Device::Cpu)?;
        let d = Tensor::randn(0f32, 1.0, (3, n / 5, 5), &Device::Cpu)?;
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            Ok(v.iter().map(|x| x.to_bits()).collect())
        };
        for (cap, xt) in [(2, &x), (1, &x), (0, &x), (2, &x.to_dtype(DType::BF16)?)] {
            // Every instruction-set build of the mask loops, f32; bf16 on the widest.
            ISA_CAP.store(cap, Ordering::Relaxed);
            let xt = xt.clone();
            let got = apply_each(&xt, &keys)?;
            assert_eq!(got.dims(), &[3, n / 5, 5]);
            for (g, k) in keys.iter().enumerate() {
                assert_eq!(bits(&got.get(g)?)?, bits(&apply(&xt, k)?)?, "member {g}");
            }
            let got = add_each(&xt, &d, &keys)?;
            let mut want = xt.clone();
            for (g, k) in keys.iter().enumerate() {
                want = (&want + apply(&d.get(g)?, k)?.to_dtype(xt.dtype())?)?;
            }
            assert_eq!(got.dtype(), xt.dtype());
            assert_eq!(bits(&got)?, bits(&want)?, "ISA cap {cap}");
        }
        ISA_CAP.store(2, Ordering::Relaxed);
        Ok(())
    }

    /// Mask throughput (`cargo test -p rtune-model --release mask_rate -- --ignored --nocapture`):
    /// the batched, vectorized generator against one Philox block at a time.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn mask_rate() {
        let key = DropoutKey {
            p: 0.05,
            seed: 3,
            salt: 9,
        };
        let n = 1usize << 22;
        let ones = vec![1f32; n];
        // Each instruction-set build, best of 20: the first pass also faults the output's pages in.
        let (mut fast, mut fast_s) = (Vec::new(), f64::INFINITY);
        for cap in [0, 1, 2] {
            ISA_CAP.store(cap, Ordering::Relaxed);
            let mut best = f64::INFINITY;
            for _ in 0..20 {
                let t = std::time::Instant::now();
                fast = masked(&key, &ones, |x| x);
                best = best.min(t.elapsed().as_secs_f64());
            }
            eprintln!("ISA cap {cap}: {:.2} ns/elem", best * 1e9 / n as f64);
            fast_s = best;
        }
        let t = std::time::Instant::now();
        let slow: Vec<f32> = (0..n as u64).map(|i| key.factor(i)).collect();
        let slow_s = t.elapsed().as_secs_f64();
        assert_eq!(fast, slow);
        eprintln!(
            "{n} elements: batched+parallel {:.2} ns/elem, one block at a time (1 thread) {:.2} ns/elem",
            fast_s * 1e9 / n as f64,
            slow_s * 1e9 / n as f64
        );
    }
}
