//! [`DataParallel`]: data parallelism as the trainer sees it (issue 16) — what the ranks of a run
//! agree on at start, the one reduction of a step, and the world size as a checkpoint setting.
//!
//! **One big batch.** Step s of a run with W ranks and accumulation A is the step of one process
//! with accumulation W·A: every rank draws the step's W·A micro-batches from its own copy of the
//! batcher (same rows, same order, same cursor everywhere) and computes micro-batches k ≡ rank
//! (mod W). Since every rank sees every row of the step, the step's global target-token count —
//! the loss's denominator — is known on every rank before the backward without any message. The
//! dropout seed of micro-batch k is the single process's. After the backward, the gradients (one
//! flat f32 buffer: lora_A then lora_B of each module, in adapter order) and the loss sum (f64) are
//! summed over the ranks ([`DataParallel::all_reduce`]); clipping, the NaN/Inf skip and the f16
//! loss scale then decide on the same numbers on every rank, and every rank applies the same
//! update. On a CUDA rank the gradients go through NCCL instead, bucketed by layer and launched
//! during the backward of the step's last micro-batch ([`DataParallel::launch_layer`], see
//! `buckets.rs`).
//!
//! Bitwise: with W = 2 and A = 1 each rank holds one micro-batch's gradient and the all-reduce
//! adds the two, which is the single process's `g0 + g1` (f32 addition commutes), so the adapter
//! equals the single process's bit for bit. With more terms per element the sum is re-associated
//! (`(g0 + g2) + (g1 + g3)` against `((g0 + g1) + g2) + g3`): equal up to f32 rounding.
//!
//! **Agreement.** At start every rank's settings (those a resume checks: the config less output
//! and evaluation keys, the checksums of config.json and the data files) plus the model files'
//! names and sizes must equal rank 0's ([`DataParallel::join`]); a difference is refused on every
//! rank naming the rank and the setting. **Resume** with another world size is accepted when the
//! global batch (micro_batch_size × grad_accum × world size) is unchanged, refused naming the
//! numbers otherwise ([`DataParallel::resume_diff`]).

use candle_core::Tensor;
use std::collections::BTreeMap;

use rtune_lora::Adapter;
use rtune_model::Grads;

use crate::{DistError, World};

/// The settings key holding the world size (only present when it is above 1, so single-process
/// checkpoints are unchanged).
pub const WORLD_SIZE: &str = "dist.world_size";

/// One rank's host and device, for run.json.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RankInfo {
    pub rank: usize,
    pub host: String,
    pub device: String,
}

/// The data-parallel side of one training run, held by the trainer: the [`World`] (whose
/// collectives and pace the training loop also uses directly), every rank's host and device once
/// they agreed, and on a CUDA rank the NCCL communicator with its gradient buckets. In a single
/// process every call is free and changes nothing.
pub struct DataParallel {
    pub world: World,
    ranks: Vec<RankInfo>,
    /// A data-parallel CUDA rank's NCCL communicator and gradient buckets (see `buckets.rs`).
    #[cfg(feature = "cuda")]
    nccl: Option<crate::buckets::LayerBuckets>,
    /// The same communicator, for a sharded base's gathers ([`DataParallel::device_gather`]).
    #[cfg(feature = "cuda")]
    gather: Option<std::rc::Rc<crate::nccl::Nccl>>,
}

impl DataParallel {
    pub fn new(world: World) -> Self {
        Self {
            world,
            ranks: Vec::new(),
            #[cfg(feature = "cuda")]
            nccl: None,
            #[cfg(feature = "cuda")]
            gather: None,
        }
    }

    /// The GPU this rank opens when the config says `cuda:configured`: a data-parallel CUDA rank
    /// takes GPU `local_rank` (its place among the ranks of its host), or GPU 0 when the launcher
    /// gave it one visible GPU (`CUDA_VISIBLE_DEVICES=3`, as Slurm's `--gpus-per-task=1` does); a
    /// single process the configured one.
    pub fn gpu(&self, configured: usize) -> usize {
        if !self.world.is_distributed() {
            return configured;
        }
        let visible = std::env::var("CUDA_VISIBLE_DEVICES")
            .map(|v| v.split(',').filter(|s| !s.trim().is_empty()).count())
            .ok();
        if visible == Some(1) {
            0
        } else {
            self.world.local_rank
        }
    }

    /// Adds the world size to the settings a resume checks (nothing for a single process).
    pub fn add_settings(&self, settings: &mut BTreeMap<String, String>) {
        if self.world.is_distributed() {
            settings.insert(WORLD_SIZE.into(), self.world.size.to_string());
        }
    }

    /// Every rank's `settings` (those a resume checks, with the model files' sizes) equal rank
    /// 0's, or the same refusal on every rank; gathers each rank's host and device for run.json;
    /// a CUDA rank (`dev`) joins the NCCL communicator. Collective: every rank calls it; a no-op
    /// in a single process.
    pub fn join(
        &mut self,
        settings: &BTreeMap<String, String>,
        dev: &candle_core::Device,
    ) -> Result<(), DistError> {
        if !self.world.is_distributed() {
            return Ok(());
        }
        crate::check_agreement(&self.world, settings).map_err(|e| DistError::Ranks(Box::new(e)))?;
        let me = format!("{}\u{1f}{}", self.world.host, device_name(dev));
        self.ranks = self
            .world
            .all_gather("the rank list", me.as_bytes())
            .iter()
            .enumerate()
            .map(|(rank, b)| {
                let s = String::from_utf8_lossy(b);
                let (host, device) = s.split_once('\u{1f}').unwrap_or((&s, ""));
                RankInfo {
                    rank,
                    host: host.into(),
                    device: device.into(),
                }
            })
            .collect();
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(d) = dev {
            // One communicator: the gradient buckets' all-reduces and a sharded base's gathers
            // ([`device_gather`](Self::device_gather)) run on its one stream, in program order.
            let nccl = std::rc::Rc::new(crate::nccl::Nccl::init(&self.world, d)?);
            self.gather = Some(nccl.clone());
            self.nccl = Some(crate::buckets::LayerBuckets::new(nccl));
        }
        Ok(())
    }

    /// The transport a sharded base gathers its device-resident shards through on a CUDA rank
    /// (`rtune_model::Model::set_device_gather`): the communicator [`join`](Self::join) made,
    /// the gradient buckets' own. `None` before `join`, on a CPU rank and in one process (whose
    /// sharded base, a world of one, keeps its host gathers: copies).
    pub fn device_gather(&self) -> Option<std::rc::Rc<dyn rtune_model::DeviceGather>> {
        #[cfg(feature = "cuda")]
        if let Some(n) = &self.gather {
            return Some(std::rc::Rc::new(crate::nccl::NcclGather(n.clone())));
        }
        None
    }

    /// Every rank's host and device, in rank order, once [`join`](Self::join)ed (empty for a
    /// single process).
    pub fn ranks(&self) -> &[RankInfo] {
        &self.ranks
    }

    /// True when the step's last micro-batch reduces each layer's gradients as soon as its
    /// backward has added them ([`launch_layer`](Self::launch_layer)): a CUDA rank with NCCL.
    pub fn overlaps_backward(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.nccl.is_some() {
            return true;
        }
        false
    }

    /// Launches the all-reduce of adapter pairs `pairs`' gradients (one decoder layer's, just
    /// completed by the backward of the step's last micro-batch) without waiting; a no-op unless
    /// [`overlaps_backward`](Self::overlaps_backward).
    pub fn launch_layer(
        &self,
        adapter: &Adapter,
        grads: &Grads,
        pairs: &[usize],
    ) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(b) = &self.nccl {
            return b.launch(adapter, grads, pairs);
        }
        let _ = (adapter, grads, pairs);
        Ok(())
    }

    /// Sums this rank's gradients and loss sum over the ranks, after step `step`'s backward (1-based,
    /// for the watchdog's messages); the identity in one process.
    pub fn all_reduce(
        &self,
        step: usize,
        adapter: &Adapter,
        grads: Grads,
        loss_sum: f64,
    ) -> Result<(Grads, f64), DistError> {
        if !self.world.is_distributed() {
            return Ok((grads, loss_sum));
        }
        #[cfg(feature = "cuda")]
        if let Some(b) = &self.nccl {
            let what = format!("step {step}'s NCCL gradient all-reduce");
            let grads = b.finish(&self.world, &what, adapter, grads)?;
            let mut loss = [loss_sum];
            self.world
                .all_reduce_sum_f64(&format!("step {step}'s loss all-reduce"), &mut loss);
            return Ok((grads, loss[0]));
        }
        // Every trainable tensor in `Adapter::trainable`'s order: (which, pair, shape) with which
        // = 0 for A, 1 for B, 2 for a DoRA magnitude, 3 for the trainable token rows (pair 0). A
        // missing gradient travels as zeros so every rank's buffer has the same layout.
        let pairs = &adapter.pairs;
        let mut slots: Vec<(usize, usize, Vec<usize>)> = Vec::with_capacity(pairs.len() * 3);
        for (i, p) in pairs.iter().enumerate() {
            slots.push((0, i, p.a.dims().to_vec()));
            slots.push((1, i, p.b.dims().to_vec()));
        }
        for (i, p) in pairs.iter().enumerate() {
            if let Some(m) = &p.m {
                slots.push((2, i, m.dims().to_vec()));
            }
        }
        if let Some(t) = &adapter.tokens {
            slots.push((3, 0, t.rows.dims().to_vec()));
        }
        let pick = |g: &Grads, which: usize, i: usize| match which {
            0 => g.a[i].clone(),
            1 => g.b[i].clone(),
            2 => g.m[i].clone(),
            _ => g.tokens.clone(),
        };
        let mut flat: Vec<f32> = Vec::new();
        for (which, i, shape) in &slots {
            match pick(&grads, *which, *i) {
                Some(t) => flat.extend(to_host(&t)?),
                None => flat.resize(flat.len() + shape.iter().product::<usize>(), 0.0),
            }
        }
        drop(grads);
        let t0 = std::time::Instant::now();
        self.world
            .all_reduce_sum_f32(&format!("step {step}'s gradient all-reduce"), &mut flat);
        let mut loss = [loss_sum];
        self.world
            .all_reduce_sum_f64(&format!("step {step}'s loss all-reduce"), &mut loss);
        // The figure the README quotes (RTUNE_LOG=debug): the whole per-step reduction, waiting
        // for the slowest rank included.
        tracing::debug!(
            "step {step}: all-reduce of {} gradient floats + the loss: {:.1} µs",
            flat.len(),
            t0.elapsed().as_secs_f64() * 1e6
        );
        let mut out = Grads::new(pairs.len());
        let mut at = 0;
        for (which, i, shape) in &slots {
            let n: usize = shape.iter().product();
            let t = Tensor::from_slice(&flat[at..at + n], shape.as_slice(), pairs[*i].a.device())
                .map_err(DistError::candle("reduced gradient to device"))?;
            let slot = match which {
                0 => &mut out.a[*i],
                1 => &mut out.b[*i],
                2 => &mut out.m[*i],
                _ => &mut out.tokens,
            };
            *slot = Some(t);
            at += n;
        }
        Ok((out, loss[0]))
    }

    /// Test hook: `RTUNE_FAULT_SLOW_ROOT_PHASE_S=<s>` makes rank 0 sleep that long before each
    /// evaluation and checkpoint (long phases the other ranks wait for; tests/integration/dist.rs).
    pub fn fault_slow_root_phase(&self) {
        let secs = std::env::var("RTUNE_FAULT_SLOW_ROOT_PHASE_S")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0);
        if let (Some(s), true) = (secs, self.world.is_root() && self.world.is_distributed()) {
            std::thread::sleep(std::time::Duration::from_secs_f64(s));
        }
    }

    /// The settings diff of a resume, with a change of world size judged by the global batch: when
    /// the checkpoint's and this run's world sizes differ, the entries for `micro_batch_size`,
    /// `grad_accum` and the world size are replaced by nothing (same global batch) or by one entry
    /// naming both products.
    pub fn resume_diff(
        saved: &BTreeMap<String, String>,
        now: &BTreeMap<String, String>,
        diff: Vec<String>,
    ) -> Vec<String> {
        let num = |m: &BTreeMap<String, String>, k: &str, default: usize| {
            m.get(k)
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(default)
        };
        let (w0, w1) = (num(saved, WORLD_SIZE, 1), num(now, WORLD_SIZE, 1));
        if w0 == w1 {
            return diff;
        }
        let batch = |m| {
            let (mb, ga) = (
                num(m, "train.micro_batch_size", 1),
                num(m, "train.grad_accum", 1),
            );
            (mb, ga, mb * ga)
        };
        let ((m0, a0, p0), (m1, a1, p1)) = (batch(saved), batch(now));
        let shape_keys = [
            "train.micro_batch_size ",
            "train.grad_accum ",
            "dist.world_size ",
        ];
        let mut out: Vec<String> = diff
            .into_iter()
            .filter(|d| !shape_keys.iter().any(|k| d.starts_with(k)))
            .collect();
        if p0 * w0 != p1 * w1 {
            out.push(format!(
                "global batch (micro_batch_size × grad_accum × world size) was {m0} × {a0} × {w0} = {}, \
                 is now {m1} × {a1} × {w1} = {} (a different world size needs the same global batch)",
                p0 * w0,
                p1 * w1
            ));
        }
        out
    }
}

fn to_host(t: &Tensor) -> Result<Vec<f32>, DistError> {
    t.to_dtype(candle_core::DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(DistError::candle("gradient to host"))
}

/// The device as run.json names it (`cpu`, `cuda:0`).
fn device_name(dev: &candle_core::Device) -> String {
    match dev.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A single process: joining is free and gathers nothing, the configured GPU is kept, the
    /// settings gain no world size, the backward is not hooked.
    #[test]
    fn a_single_process_is_left_as_it_is() {
        let mut dp = DataParallel::new(World::single());
        let mut settings = BTreeMap::from([("train.lr".to_string(), "0.1".to_string())]);
        let before = settings.clone();
        dp.add_settings(&mut settings);
        assert_eq!(settings, before);
        dp.join(&settings, &candle_core::Device::Cpu).unwrap();
        assert!(dp.ranks().is_empty());
        assert_eq!(dp.gpu(3), 3);
        assert!(!dp.overlaps_backward());
        assert_eq!(device_name(&candle_core::Device::Cpu), "cpu");
    }
}
