//! `kernels/adamw.cu` against its CPU reference ([`super`]) on odd sizes: [`check_multi_tensor`]
//! runs a few optimizer steps on the GPU and on the CPU from the same random state and compares
//! the norm, the master weights, both moments and the out tensors after each; [`self_test`] is the
//! one pass `rtune selftest` calls.
//!
//! The tensor sizes are not multiples of 4, 32 or 64 (and straddle the 2048-element chunks), one
//! tensor is empty and one has no gradient (zeros). The steps: clipping active (`max_norm` a
//! fraction of the norm), a loss-scaled step (gradients ×1024, unscale 1/1024), clipping off, and a
//! step with an infinite gradient that must change nothing. Expected difference: none (the kernels
//! and the reference perform the same IEEE-rounded operations in the same order); the tolerance,
//! 1e-6 relative, lets a stray last-ulp difference show as a figure rather than a FAIL.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

use super::{check_step, chunk_table, offsets, CHECK_STEPS};
use rtune_backend::check::Rng;
use rtune_backend::Precision;
use rtune_backend::{drv, Result};

/// Tolerance of every comparison (see the overview: 0 expected).
pub const TOLERANCE: f64 = 1e-6;

/// Largest [`rel`] over the elements.
fn max_rel(got: &[f32], want: &[f32]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(&g, &w)| rel(g as f64, w as f64))
        .fold(0.0, f64::max)
}

/// `|got − want| / max(|want|, 1e-300)`: 0 when equal (NaN-equal included), infinite when only one
/// is finite.
fn rel(got: f64, want: f64) -> f64 {
    if got == want || (got.is_nan() && want.is_nan()) {
        0.0
    } else if !(got.is_finite() && want.is_finite()) {
        f64::INFINITY
    } else {
        (got - want).abs() / want.abs().max(1e-300)
    }
}

/// The step sizes of the check: odd, around the chunk size, one empty.
pub fn odd_sizes(rng: &mut Rng) -> Vec<usize> {
    let mut sizes = vec![1, 3, 0, 31, 33, 63, 65, 127, 2047, 2049, 4097, 6151, 10007];
    sizes.extend((0..24).map(|_| 2 * rng.below(3000) as usize + 1));
    sizes
}

/// `steps` steps on `sizes` (tensor 1 without a gradient) on the GPU and the CPU: one
/// `(name, max relative difference, pass)` per step and quantity.
pub fn check_multi_tensor(
    s: &Arc<CudaStream>,
    sizes: &[usize],
    seed: u64,
) -> Result<Vec<(String, f64, bool)>> {
    let mut rng = Rng::new(seed);
    let (off, total) = offsets(sizes);
    let chunks = chunk_table(sizes);
    let n_chunks = chunks.len() / 2;
    let mut master = rng.normals(total, 0.05, Precision::F32);
    let (mut m, mut v) = (vec![0f32; total], vec![0f32; total]);
    let mut d_master = s.clone_htod(&master).map_err(drv("adamw check upload"))?;
    let mut d_m = s
        .alloc_zeros::<f32>(total.max(1))
        .map_err(drv("adamw check alloc"))?;
    let mut d_v = s
        .alloc_zeros::<f32>(total.max(1))
        .map_err(drv("adamw check alloc"))?;
    let d_chunks = s
        .clone_htod(&chunks_or_pad(&chunks))
        .map_err(drv("adamw check upload"))?;
    let mut partials = s
        .alloc_zeros::<f64>(n_chunks.max(1))
        .map_err(drv("adamw check alloc"))?;
    let mut norm_coef = s.alloc_zeros::<f64>(2).map_err(drv("adamw check alloc"))?;
    let mut results = Vec::new();
    let mut step = 0u64;
    for (i, (name, ..)) in CHECK_STEPS.iter().enumerate() {
        let c = check_step(&mut rng, sizes, i, &mut step, (&mut master, &mut m, &mut v));
        let (host, max_norm, norm, coef, sc) = (c.host(), c.max_norm, c.norm, c.coef, c.scalars);
        let (unscale, want) = (c.unscale, &c.written);

        let d_grads: Vec<Option<CudaSlice<f32>>> = host
            .iter()
            .enumerate()
            .map(|(k, g)| {
                let lead = usize::from(k == 3);
                g.filter(|g| !g.is_empty())
                    .map(|g| s.clone_htod(&[&vec![0.0; lead][..], g].concat()))
                    .transpose()
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(drv("adamw check upload"))?;
        let d_outs: Vec<Option<CudaSlice<f32>>> = sizes
            .iter()
            .map(|&n| (n > 0).then(|| s.alloc_zeros::<f32>(n)).transpose())
            .collect::<std::result::Result<_, _>>()
            .map_err(drv("adamw check alloc"))?;
        let mut table = Vec::with_capacity(4 * sizes.len());
        for k in 0..sizes.len() {
            let ptr = |x: &Option<CudaSlice<f32>>| x.as_ref().map_or(0, |x| x.device_ptr(s).0);
            let g = ptr(&d_grads[k]);
            // f32 elements are 4 bytes: tensor 3's gradient begins at its second element.
            let g = if k == 3 && g != 0 { g + 4 } else { g };
            table.extend([g, ptr(&d_outs[k]), off[k] as u64, sizes[k] as u64]);
        }
        let d_table = s.clone_htod(&table).map_err(drv("adamw check upload"))?;
        // SAFETY: the table's pointers are d_grads' and d_outs' (sizes[k] elements each), alive
        // until the downloads below synchronize the stream; offsets are prefix sums (≤ total).
        unsafe {
            super::mt_sq_norm(
                s,
                &d_table,
                &d_chunks,
                n_chunks,
                unscale,
                max_norm,
                &mut partials,
                &mut norm_coef,
            )?;
            super::mt_adamw(
                s,
                &d_table,
                &d_chunks,
                n_chunks,
                &norm_coef,
                (&mut d_master, &mut d_m, &mut d_v),
                total,
                &sc,
            )?;
        }
        let nc = s
            .clone_dtoh(&norm_coef)
            .map_err(drv("adamw check download"))?;
        let down = |x: &CudaSlice<f32>| s.clone_dtoh(x).map_err(drv("adamw check download"));
        let label = |what: &str| format!("adamw {what} {name} ({} tensors)", sizes.len());
        let e = rel(nc[0], norm).max(rel(nc[1], coef));
        results.push((label("norm+coef"), e, e <= TOLERANCE));
        let mut e = max_rel(&down(&d_master)?[..total], &master)
            .max(max_rel(&down(&d_m)?[..total], &m))
            .max(max_rel(&down(&d_v)?[..total], &v));
        if let Some(want) = want {
            for (d, w) in d_outs.iter().zip(want) {
                if let Some(d) = d {
                    e = e.max(max_rel(&down(d)?, w));
                }
            }
        }
        results.push((label("update"), e, e <= TOLERANCE));
    }
    Ok(results)
}

/// The chunk table, or one dummy entry when there are no chunks (no zero-length allocation).
fn chunks_or_pad(chunks: &[u64]) -> Vec<u64> {
    if chunks.is_empty() {
        vec![0, 0]
    } else {
        chunks.to_vec()
    }
}

/// The multi-tensor optimizer kernels once on [`odd_sizes`] (a time-derived seed, printed in each
/// name): `(name, max relative difference, pass)` per step and quantity. Milliseconds on a GPU.
pub fn self_test(stream: &Arc<CudaStream>) -> Result<Vec<(String, f64, bool)>> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    self_test_seeded(stream, seed)
}

/// [`self_test`] with a given seed (`rtune selftest --seed`).
pub fn self_test_seeded(stream: &Arc<CudaStream>, seed: u64) -> Result<Vec<(String, f64, bool)>> {
    let mut rng = Rng::new(seed);
    let sizes = odd_sizes(&mut rng);
    let mut r = check_multi_tensor(stream, &sizes, seed)?;
    for x in &mut r {
        x.0 = format!("{} seed {seed}", x.0);
    }
    Ok(r)
}
