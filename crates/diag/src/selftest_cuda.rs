//! The kernel half of `rtune selftest` (feature `cuda`): every kernel file loads (as the cubin for
//! the GPU, or its PTX: which is reported), the fused kernels and the tiled attention (forward and
//! backward) against their CPU references, NF4 dequantization against the CPU bit for bit, and NF4
//! bandwidth against the card's copy bandwidth. Each kernel group, each NF4 variant and the
//! bandwidth are one attempt of the [`Runner`]: a failing launch fails that check only. NF4 is
//! checked on the Llama-8B MLP shape
//! and on an odd element count (not a multiple of the 64-element block nor even, so a half-filled
//! last byte and a short last block). After the kernel checks and after the training steps, the
//! driver errors cudarc recorded in a `Drop` are read: none may have been. [`nccl`]: a one-GPU
//! NCCL all-reduce (world of 1) of a known buffer through the trainer's own NCCL path
//! (`rtune_dist::nccl`), the sharded base's all-gather (world of 1) by both of its plans, and a
//! sharded base's layer gathered on the device through it against the whole model's.

use candle_core::Device;
use half::bf16;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream};
use rtune_ops::nf4::{nf4_dequant_cuda_into, DeviceAbsmax, Nf4Kernels, Nf4WeightCuda};

use crate::selftest::runner::Runner;
use crate::{Check, DiagError};

fn kerr(op: &'static str) -> impl Fn(rtune_backend::KernelError) -> DiagError {
    move |source| DiagError::Kernel { op, source }
}

fn derr(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> DiagError {
    move |source| DiagError::Driver { op, source }
}

fn qerr(op: &'static str) -> impl Fn(rtune_quant::QuantError) -> DiagError {
    move |source| DiagError::Quant { op, source }
}

/// Seconds per call of `f`, averaged over `iters` after one warm-up call.
fn time(
    s: &Arc<CudaStream>,
    iters: usize,
    mut f: impl FnMut() -> Result<(), DiagError>,
) -> Result<f64, DiagError> {
    f()?;
    s.synchronize().map_err(derr("synchronize"))?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    s.synchronize().map_err(derr("synchronize"))?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

/// `n` near-normal values under `seed`: sums of uniforms, with the long-ish tails that exercise
/// every NF4 code.
fn values(seed: u64, n: usize) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| 0.02 * (0..4).map(|_| rng.random_range(-1.0..1.0f32)).sum::<f32>())
        .collect()
}

/// NF4 (double-quant or not) of `x` as `shape`, dequantized on the GPU and on the CPU: the
/// fraction of elements whose bf16 bits differ (0 to pass).
fn nf4_mismatch(
    s: &Arc<CudaStream>,
    k: &Nf4Kernels,
    x: &[f32],
    shape: &[usize],
    dq: bool,
) -> Result<(f64, Nf4WeightCuda, CudaSlice<bf16>), DiagError> {
    let w = rtune_quant::quantize_nf4(x, shape, dq).map_err(qerr("quantize nf4"))?;
    let dw = Nf4WeightCuda::upload(s, &w).map_err(kerr("upload nf4 weight"))?;
    let n = w.numel();
    let mut out = s.alloc_zeros::<bf16>(n).map_err(derr("alloc"))?;
    nf4_dequant_cuda_into(k, s, &dw, &mut out).map_err(kerr("nf4 dequant"))?;
    let got = s.clone_dtoh(&out).map_err(derr("copy to host"))?;
    let mut want = vec![bf16::ZERO; n];
    w.dequantize_into_bf16(&mut want)
        .map_err(qerr("dequantize nf4 on the cpu"))?;
    let mismatched = got
        .iter()
        .zip(&want)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    Ok((mismatched as f64 / n as f64, dw, out))
}

/// The kernel checks on `dev` (nothing on a non-CUDA device), under the runner's seed.
pub fn kernels(dev: &Device, runner: &mut Runner) {
    kernels_on(dev, runner);
    deferred(dev, runner, "the kernel checks");
}

/// The driver errors cudarc recorded where it could not return them (frees, stream and event
/// destruction in `Drop`; `rtune_backend::cuda::deferred_error`): none after `after`.
pub fn deferred(dev: &Device, runner: &mut Runner, after: &str) {
    let name = format!("no deferred driver errors after {after}");
    runner.attempt(&name.clone(), || {
        let r = rtune_backend::cuda::deferred_error(dev);
        Ok(vec![Check::new(
            name,
            r.is_ok(),
            match r {
                Ok(()) => "none recorded".to_string(),
                Err(e) => format!("cudarc recorded: {e}"),
            },
        )])
    });
}

fn kernels_on(dev: &Device, runner: &mut Runner) {
    let Device::Cuda(cd) = dev else {
        return;
    };
    let seed = runner.report.seed;
    let s = cd.cuda_stream();
    // Every kernel file loads, as the cubin for this GPU (no JIT) or else its PTX.
    runner.attempt("kernel modules load", || {
        let cc = s
            .context()
            .compute_capability()
            .map_err(derr("compute capability"))?;
        let t = Instant::now();
        for image in rtune_backend::image::ALL {
            rtune_backend::image::load(s.context(), image).map_err(kerr(image.name))?;
        }
        Ok(vec![Check::new(
            "kernel modules load",
            true,
            format!(
                "{} modules as {} in {:.0} ms",
                rtune_backend::image::ALL.len(),
                rtune_backend::image::describe_choice(cc),
                t.elapsed().as_secs_f64() * 1e3
            ),
        )])
    });
    for (label, group) in rtune_ops::selftest::self_test_seeded(&s, seed) {
        runner.attempt(&format!("kernel {label}"), || {
            let group = group.map_err(kerr("fused kernels self-test"))?;
            Ok(group
                .into_iter()
                .map(|(name, err, pass)| Check::measured(format!("kernel {name}"), err, pass))
                .collect())
        });
    }
    // The tiled attention (kernels/flash_attn.cu), forward and backward, against its CPU
    // reference with the same tiling (rtune_ops::attention::flash_ref): odd T, GQA/MQA, sliding window,
    // packed rows, head dims 64/96/128, an unaligned offset; f32, bf16, f16.
    for (label, group) in rtune_ops::attention::flash_check::self_test_seeded(&s, seed) {
        runner.attempt(&format!("kernel {label}"), || {
            let group = group.map_err(kerr("flash attention self-test"))?;
            Ok(group
                .into_iter()
                .map(|(name, err, pass)| Check::measured(format!("kernel {name}"), err, pass))
                .collect())
        });
    }
    // cuDNN's fused attention (kernels/cudnn_sdpa.cpp, loaded at run time), forward and backward,
    // against the same CPU reference: causal GQA/MQA, a sliding window, Dh 64/96/128; bf16, f16.
    // A group fails with the reason when cuDNN did not load or refused a graph.
    for (label, group) in rtune_ops::attention::cudnn_check::self_test_seeded(&s, seed) {
        runner.attempt(&format!("kernel {label}"), || {
            let group = group.map_err(kerr("cudnn attention self-test"))?;
            Ok(group
                .into_iter()
                .map(|(name, err, pass)| Check::measured(format!("kernel {name}"), err, pass))
                .collect())
        });
    }
    // The device optimizer (multi-tensor norm, clip, AdamW) against its CPU reference, on 37
    // odd-sized tensors (one empty, one without a gradient, one at an offset).
    runner.attempt("kernel adamw (multi-tensor norm, clip, update)", || {
        let results = rtune_ops::adamw::check::self_test_seeded(&s, seed)
            .map_err(kerr("adamw kernels self-test"))?;
        Ok(results
            .into_iter()
            .map(|(name, err, pass)| Check::measured(format!("kernel {name}"), err, pass))
            .collect())
    });
    // The grouped NF4 kernel (a layer's q/k/v in one launch) against the per-tensor CPU
    // dequantization at each offset, bit for bit (selftest_nf4.rs).
    runner.attempt("kernel nf4 grouped dequant", || {
        let results = crate::selftest_nf4::self_test_seeded(&s, seed)
            .map_err(kerr("nf4 grouped self-test"))?;
        Ok(results
            .into_iter()
            .map(|(name, err, pass)| Check::measured(format!("kernel {name}"), err, pass))
            .collect())
    });
    let k = match Nf4Kernels::load(s.context()) {
        Ok(k) => k,
        Err(e) => {
            runner.attempt("nf4 kernels", || Err(kerr("load nf4 kernels")(e)));
            return;
        }
    };
    // The NF4 / FP4-shaped weight of a Llama-8B MLP projection, and an odd element count.
    let shapes: [&[usize]; 2] = [&[4096, 14336], &[37, 101]];
    let mut nf4_gb_s = None;
    for shape in shapes {
        let n: usize = shape.iter().product();
        let x = values(seed ^ n as u64, n);
        for dq in [false, true] {
            let label = if dq { "nf4 double quant" } else { "nf4" };
            let dims = shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("x");
            let name = format!("{label} dequant → bf16 {dims}: bit-identical to the CPU");
            let timed = dq && n > 1 << 20;
            runner.attempt(&name.clone(), || {
                let (frac, dw, mut out) = nf4_mismatch(&s, &k, &x, shape, dq)?;
                if timed {
                    let t = time(&s, 30, || {
                        nf4_dequant_cuda_into(&k, &s, &dw, &mut out).map_err(kerr("nf4 dequant"))
                    })?;
                    let scales = match dw.absmax {
                        DeviceAbsmax::Plain(_) => 4 * n / 64,
                        DeviceAbsmax::Double { .. } => n / 64,
                    };
                    let moved = (n / 2 + scales + 2 * n) as f64;
                    nf4_gb_s = Some(moved / t / 1e9);
                }
                Ok(vec![Check::measured(name, frac, frac == 0.0)])
            });
        }
    }
    runner.report.nf4_dequant_gb_s = nf4_gb_s;
    let mut copy = None;
    runner.attempt("device copy bandwidth", || {
        let bytes = 1usize << 30;
        let src = s.alloc_zeros::<u8>(bytes).map_err(derr("alloc"))?;
        let mut dst = s.alloc_zeros::<u8>(bytes).map_err(derr("alloc"))?;
        let t = time(&s, 20, || {
            s.memcpy_dtod(&src, &mut dst).map_err(derr("copy"))
        })?;
        let gb_s = 2.0 * bytes as f64 / t / 1e9;
        copy = Some(gb_s);
        let ratio = nf4_gb_s.map(|n| n / gb_s);
        Ok(vec![Check::new(
            "nf4 dequant bandwidth vs device copy",
            true,
            format!(
                "copy {gb_s:.0} GB/s, nf4 dequant {}: {} of copy (goal ≥ 85%, not a pass/fail)",
                nf4_gb_s.map_or("-".into(), |g| format!("{g:.0} GB/s")),
                ratio.map_or("-".into(), |r| format!("{:.1}%", 100.0 * r))
            ),
        )])
    });
    runner.report.copy_gb_s = copy;
    runner.report.nf4_vs_copy = nf4_gb_s.zip(copy).map(|(n, c)| n / c);
}

/// NCCL as a data-parallel CUDA run uses it (`rtune_dist::nccl`: the communicator made from a
/// unique id, the in-place sum all-reduce of a candle tensor on the second stream), in a world of
/// one rank: the sum over one rank is the buffer itself, so 2^20 + 3 known f32 (not a multiple of
/// NCCL's chunk sizes) must come back bit for bit. Catches a missing or mismatched libnccl, a
/// communicator that will not form on this GPU, and a wrong pointer, length or stream order.
pub fn nccl(dev: &Device, runner: &mut Runner) {
    let Device::Cuda(cuda) = dev else {
        return;
    };
    runner.attempt("nccl all-reduce (world of 1)", || {
        let cerr = |op: &'static str| {
            move |e: candle_core::Error| DiagError::from(rtune_model::ModelError::candle(op, e))
        };
        let world = rtune_dist::World::single();
        let comm = rtune_dist::nccl::Nccl::init(&world, cuda)?;
        let n = (1usize << 20) + 3;
        let want: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.25 - 100.0).collect();
        let t = candle_core::Tensor::from_vec(want.clone(), n, dev).map_err(cerr("upload"))?;
        let t0 = Instant::now();
        comm.all_reduce_sum(&t).map_err(cerr("ncclAllReduce"))?;
        comm.synchronize()?;
        let took = t0.elapsed().as_secs_f64();
        let got = t.to_vec1::<f32>().map_err(cerr("download"))?;
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| g.to_bits() != w.to_bits())
            .count();
        let version = rtune_dist::nccl::Nccl::version().unwrap_or(0);
        Ok(vec![Check::new(
            "nccl all-reduce (world of 1)",
            differ == 0,
            format!(
                "NCCL {version}: {n} f32 all-reduced in place on a second stream, {differ} differ \
                 ({:.2} ms, first call)",
                took * 1e3
            ),
        )])
    });
    runner.attempt(NCCL_ALL_GATHER, || {
        let world = rtune_dist::World::single();
        let comm = rtune_dist::nccl::Nccl::init(&world, cuda)?;
        Ok(vec![all_gather(dev, &comm)?])
    });
    runner.attempt(NCCL_SHARDED_LAYER, || {
        let world = rtune_dist::World::single();
        let comm = std::rc::Rc::new(rtune_dist::nccl::Nccl::init(&world, cuda)?);
        Ok(vec![sharded_layer(dev, comm)?])
    });
}

/// The name of [`nccl`]'s sharded-base check.
pub const NCCL_SHARDED_LAYER: &str = "nccl sharded-base layer (world of 1)";

/// A sharded base on this GPU as a CUDA rank runs it (`Model::set_device_gather`: the shards
/// uploaded, every gather between device buffers through the NCCL communicator,
/// `rtune_dist::nccl::NcclGather`), in a world of one: the selftest's Llama built whole and
/// sharded from the same seeded weights, bf16 and NF4 with double quantization, and layer 0
/// gathered. Every linear's weight as the layer uses it (dense, or dequantized by the GPU kernel
/// from the codes and scales gathered on the device) must be the whole model's bit for bit.
fn sharded_layer(
    dev: &Device,
    comm: std::rc::Rc<rtune_dist::nccl::Nccl>,
) -> Result<Check, DiagError> {
    use crate::weights::{Draw, RandomWeights};
    use candle_core::DType;
    use rtune_model::{Model, Quantize};
    let cerr = |op: &'static str| {
        move |e: candle_core::Error| DiagError::from(rtune_model::ModelError::candle(op, e))
    };
    let bits = |t: &candle_core::Tensor| -> Result<Vec<u32>, DiagError> {
        let v = t
            .flatten_all()
            .and_then(|t| t.to_dtype(DType::F32)?.to_vec1::<f32>());
        Ok(v.map_err(cerr("download"))?
            .into_iter()
            .map(f32::to_bits)
            .collect())
    };
    let cfg = crate::selftest::families::Family::Llama.config()?;
    let mut details = Vec::new();
    let mut differ_all = 0usize;
    for (label, quantize) in [
        ("bf16", Quantize::None),
        ("NF4 double quant", Quantize::linears(true)),
    ] {
        let src = RandomWeights::new(dev, DType::BF16, quantize, Draw::Seeded(5));
        let whole = Model::build_with(cfg.clone(), &src, DType::BF16, dev, quantize)?;
        let world: std::rc::Rc<dyn rtune_model::Gather> =
            std::rc::Rc::new(rtune_dist::World::single());
        let mut sharded =
            Model::build_sharded(cfg.clone(), &src, DType::BF16, dev, quantize, world)?;
        let transport = std::rc::Rc::new(rtune_dist::nccl::NcclGather(comm.clone()));
        sharded
            .set_device_gather(transport)
            .map_err(cerr("uploading the shards"))?;
        let t0 = Instant::now();
        let got = sharded
            .gathered_layer(0)
            .map_err(cerr("gathering layer 0"))?
            .ok_or_else(|| cerr("gathering layer 0")(candle_core::Error::Msg("no layer".into())))?;
        let want = whole
            .layer(0)
            .ok_or_else(|| cerr("layer 0")(candle_core::Error::Msg("no layer".into())))?;
        let (mut n, mut differ) = (0usize, 0usize);
        for (g, w) in got.linears().into_iter().zip(want.linears()) {
            let (g, w) = (
                bits(g.w.dense().map_err(cerr("the gathered weight"))?.as_ref())?,
                bits(w.w.dense().map_err(cerr("the whole weight"))?.as_ref())?,
            );
            n += w.len();
            differ += g.len().abs_diff(w.len());
            differ += g.iter().zip(&w).filter(|(a, b)| a != b).count();
        }
        differ_all += differ;
        details.push(format!(
            "{label}: {n} weights, {differ} differ ({:.2} ms with the copy back)",
            t0.elapsed().as_secs_f64() * 1e3
        ));
    }
    Ok(Check::new(
        NCCL_SHARDED_LAYER,
        differ_all == 0,
        format!(
            "layer 0 of a sharded base gathered on the device through NCCL against the whole \
             model's; {}",
            details.join("; ")
        ),
    ))
}

/// The name of [`nccl`]'s all-gather check.
pub const NCCL_ALL_GATHER: &str = "nccl all-gather (world of 1)";

/// A sharded base's gather on a CUDA rank (`Nccl::all_gather_into`), in a world of one, by both
/// plans of `rtune_dist::gather_plan`: the all-gather (what equal shards take) and the grouped
/// broadcasts (unequal shards), each of 2^20 + 3 known bf16 read from 5 elements into one buffer
/// and written 7 elements into another, so the byte offsets of both tensors are exercised. The
/// gathered elements must be the shard's bit for bit and the elements around them untouched (a
/// wrong offset or length moves or spills them); the buffer is read on the compute stream, which
/// must wait for the side stream's write.
fn all_gather(dev: &Device, comm: &rtune_dist::nccl::Nccl) -> Result<Check, DiagError> {
    use candle_core::Tensor;
    use rtune_dist::gather_plan;
    let cerr = |op: &'static str| {
        move |e: candle_core::Error| DiagError::from(rtune_model::ModelError::candle(op, e))
    };
    let n = (1usize << 20) + 3;
    let (pad_in, pad_out) = (5, 7);
    let src: Vec<bf16> = (0..n + pad_in)
        .map(|i| bf16::from_f32((i % 4093) as f32 * 0.125 - 250.0))
        .collect();
    let big_in = Tensor::from_vec(src.clone(), n + pad_in, dev).map_err(cerr("upload"))?;
    let mine = big_in.narrow(0, pad_in, n).map_err(cerr("narrow"))?;
    let fill = bf16::from_f32(-7.5);
    let mut details = Vec::new();
    let mut differ_all = 0;
    let bytes = [n * 2];
    for (label, plan) in [
        ("all-gather", gather_plan::plan(&bytes)),
        ("grouped broadcasts", gather_plan::broadcasts(&bytes)),
    ] {
        let big_out = Tensor::full(fill, n + 2 * pad_out, dev).map_err(cerr("alloc"))?;
        let out = big_out.narrow(0, pad_out, n).map_err(cerr("narrow"))?;
        let t0 = Instant::now();
        comm.all_gather_planned(&plan, &mine, &out)
            .map_err(cerr("NCCL all-gather"))?;
        // Read on the compute stream: waits on the side stream's write event, not on the host.
        let got = big_out.to_vec1::<bf16>().map_err(cerr("download"))?;
        let took = t0.elapsed().as_secs_f64();
        let differ = got
            .iter()
            .enumerate()
            .filter(|&(i, g)| {
                let want = match i.checked_sub(pad_out).filter(|&j| j < n) {
                    Some(j) => src[pad_in + j],
                    None => fill,
                };
                g.to_bits() != want.to_bits()
            })
            .count();
        differ_all += differ;
        details.push(format!(
            "{label}: {differ} differ ({:.2} ms with the copy back)",
            took * 1e3
        ));
    }
    Ok(Check::new(
        NCCL_ALL_GATHER,
        differ_all == 0,
        format!(
            "{n} bf16 at element offsets {pad_in} → {pad_out} on a second stream; {}",
            details.join("; ")
        ),
    ))
}
