//! A sharded base (`rtune_model::shard`) computes exactly what the whole model computes: each of 1,
//! 2 and 3 ranks (threads here, gathering through shared memory as MPI would between processes)
//! holds only its shard of every frozen weight, and a training pass's loss and every LoRA
//! gradient, the inference logits and a cached decoding step are bit for bit the unsharded
//! model's — dense f32, NF4 and NF4 with double quantization (3 ranks split some weights into
//! unequal shards and leave one rank an empty one), bf16 autocast, a tied lm_head, DoRA and
//! gradient checkpointing. Each rank also holds about 1/world of the frozen bytes. Layers kept
//! gathered from the forward for the backward (`Model::set_keep_gathered`) change nothing but what
//! the backward gathers: exactly one layer's weights fewer for each kept layer. Prefetching
//! (`Model::set_prefetch`: each rank's next layer gathered by a second thread) changes nothing,
//! and a rank's two threads are never in a gather at once.
//!
//! The device path (`Model::set_device_gather`: the shards uploaded, every gather between device
//! buffers through a `DeviceGather`, here `ThroughHost` over the same threads, its tensors on the
//! CPU) computes the same bits for 1 to 4 ranks, moves every gathered byte itself, and holds
//! the same share; launched ahead (`prefetch`) it gathers the same bytes.
//!
//! A Qwen3-MoE (routers and expert stacks sharded and gathered with their layer, LoRA on the
//! stacks through `target_parameters`) computes the same bits over 1 to 4 ranks, checkpointed,
//! prefetched, under autocast and on the device path; so do its NF4 expert stacks
//! (`quantize_experts`, sharded by expert). Each rank reads only its experts' bytes of the
//! stacks at load.
//!
//! Tolerance: none. The gathered weights are the unsharded model's bits and the ops are the same.
//! The ranks are threads of one process sharing one OpenBLAS, whose thread count is the
//! process's: the grouped experts set it to 1 while they run ([`rtune_backend::blas::one_thread`]),
//! so a rank's dense product could run on 1 thread or on all depending on where another rank is,
//! and OpenBLAS 0.3.21's Zen kernels round some shapes differently on 1 and 2 threads (measured:
//! `sgemm` 5×512·512×128, 2 threads vs 1, differs by 3.4e-5). Each test therefore holds OpenBLAS
//! on one thread throughout ([`one_blas_thread`]), the whole model's run included, as MPI ranks
//! (processes) each have their own library and run the same products in the same order.

mod common;

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex};

use candle_core::{DType, Device, Tensor};
use rtune_lora::{Adapter, LoraSpec};
use rtune_model::config::ModelConfig;
use rtune_model::weights::TensorSource;
use rtune_model::{
    DeviceGather, Gather, Grads, Inputs, KvCache, LoraCtx, Model, ModelError, Quantize, ThroughHost,
};

/// Seeded values per tensor name (every rank reads the same checkpoint); norms near 1.
struct Seeded;

impl TensorSource for Seeded {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        use rand::{Rng, SeedableRng};
        let seed = name.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let norm = name.ends_with("norm.weight");
        let v: Vec<f32> = (0..n)
            .map(|_| {
                let x = rng.random_range(-1.0..1.0f32);
                if norm {
                    1.0 + 0.1 * x
                } else {
                    0.05 * x
                }
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).map_err(|e| ModelError::candle(name, e))
    }
}

/// [`Seeded`], counting the bytes of the expert stacks (`*.experts.*`) it hands out, at 4 bytes
/// an f32 element: a whole tensor's, or a piece's (a checkpoint reads only those bytes,
/// `Weights::get_piece`).
struct Counting {
    experts: AtomicUsize,
}

impl Counting {
    fn count(&self, name: &str, elements: usize) {
        if name.contains(".experts.") {
            self.experts.fetch_add(4 * elements, SeqCst);
        }
    }
}

impl TensorSource for Counting {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        self.count(name, shape.iter().product());
        Seeded.tensor(name, shape)
    }
    fn piece(
        &self,
        name: &str,
        shape: &[usize],
        span: std::ops::Range<usize>,
    ) -> Result<Tensor, ModelError> {
        self.count(name, span.len());
        Seeded.piece(name, shape, span)
    }
    fn stored_piece(
        &self,
        name: &str,
        shape: &[usize],
        span: std::ops::Range<usize>,
    ) -> Result<Tensor, ModelError> {
        self.count(name, span.len());
        Seeded.stored_piece(name, shape, span)
    }
}

/// Ranks as threads: each writes its bytes into its slot, all wait, each copies every slot.
/// With `prefetch`, a rank's background transport is a clone on another thread of that rank.
#[derive(Clone)]
struct Threads {
    rank: usize,
    size: usize,
    slots: Arc<Mutex<Vec<Vec<u8>>>>,
    barrier: Arc<Barrier>,
    /// Bytes gathered so far (this rank's `out`s), and of them by the background thread.
    gathered: Arc<AtomicUsize>,
    in_background: Arc<AtomicUsize>,
    /// This rank is in a gather (its two threads must never be at once).
    busy: Arc<AtomicBool>,
    prefetch: bool,
    background: bool,
}

impl Gather for Threads {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_gather_into(&self, what: &str, mine: &[u8], counts: &[usize], out: &mut [u8]) {
        assert!(!self.busy.swap(true, SeqCst), "{what}: two gathers at once");
        assert_eq!(mine.len(), counts[self.rank], "{what}: rank {}", self.rank);
        self.slots.lock().unwrap()[self.rank] = mine.to_vec();
        self.barrier.wait();
        {
            let slots = self.slots.lock().unwrap();
            let mut at = 0;
            for (r, n) in counts.iter().enumerate() {
                assert_eq!(slots[r].len(), *n, "{what}: rank {r}'s count");
                out[at..at + n].copy_from_slice(&slots[r]);
                at += n;
            }
            assert_eq!(at, out.len());
        }
        self.gathered.fetch_add(out.len(), SeqCst);
        if self.background {
            self.in_background.fetch_add(out.len(), SeqCst);
        }
        self.busy.store(false, SeqCst);
        self.barrier.wait();
    }

    fn background(&self) -> Option<Arc<dyn Gather + Send + Sync>> {
        let bg = Self {
            background: true,
            ..self.clone()
        };
        self.prefetch.then(|| Arc::new(bg) as _)
    }
}

/// The crate tests' Llama (GQA, q/k/v biases) widened so its weights are 2 to 6
/// double-quantization units (64·256 elements) each, so 3 ranks split some unevenly and give one
/// rank nothing of `k_proj`.
fn config(tied: bool) -> ModelConfig {
    ModelConfig {
        hidden_size: 256,
        intermediate_size: 384,
        head_dim: 64,
        vocab_size: 96,
        tie_word_embeddings: tied,
        ..common::config()
    }
}

#[derive(Debug, Clone, Copy)]
struct Case {
    quantize: Quantize,
    autocast: bool,
    tied: bool,
    dora: bool,
    checkpoint: bool,
    /// Layers kept gathered from the forward for the backward.
    keep: usize,
    /// The next layer gathered on another thread (with `device`: launched ahead).
    prefetch: bool,
    /// The shards on the device, gathered through a `DeviceGather`.
    device: bool,
    /// Qwen3-MoE ([`moe_config`]) with LoRA on the expert stacks too, instead of the Llama.
    moe: bool,
}

/// The tiny Qwen3-MoE of the parity tests (`tests/fixtures/tiny-qwen3-moe/config.json`: 3
/// layers, 0 and 2 sparse with 8 experts of width 32, top-2, the aux loss on), its weights
/// [`Seeded`]: routers, expert stacks and the dense layers sharded alike.
fn moe_config() -> ModelConfig {
    let (_, cfg) = common::fixture_config("tiny-qwen3-moe");
    assert_eq!(cfg.moe.as_ref().unwrap().sparse_layers, [true, false, true]);
    cfg
}

/// PEFT's `target_parameters` on both expert stacks.
const EXPERT_STACKS: [&str; 2] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

/// The device transport of the tests: [`ThroughHost`], counting the elements' bytes it moves.
struct Counted {
    inner: ThroughHost,
    bytes: Arc<AtomicUsize>,
}

impl DeviceGather for Counted {
    fn all_gather(
        &self,
        what: &str,
        mine: &Tensor,
        counts: &[usize],
        out: &Tensor,
        at: usize,
    ) -> candle_core::Result<()> {
        let n: usize = counts.iter().sum();
        self.bytes
            .fetch_add(n * mine.dtype().size_in_bytes(), SeqCst);
        self.inner.all_gather(what, mine, counts, out, at)
    }
}

/// What must be equal: the loss's and every gradient's bits, the logits', a decoding step's; and
/// the frozen bytes this rank holds.
#[derive(Debug, PartialEq)]
struct Outcome {
    loss: u64,
    grads: Vec<Vec<u32>>,
    logits: Vec<u32>,
    decoded: Vec<u32>,
}

fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
    t.to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// What a rank computed, the frozen bytes it holds, and the bytes it gathered for the training
/// pass.
fn run(case: Case, comm: Option<Rc<dyn Gather>>, gathered: Arc<AtomicUsize>) -> Ran {
    let dev = Device::Cpu;
    let cfg = match case.moe {
        true => moe_config(),
        false => config(case.tied),
    };
    let v = cfg.vocab_size;
    let comm_is_sharded = comm.is_some();
    let device_bytes = Arc::new(AtomicUsize::new(0));
    let transport = comm.clone().map(|c| Counted {
        inner: ThroughHost(c),
        bytes: device_bytes.clone(),
    });
    let source = Counting {
        experts: AtomicUsize::new(0),
    };
    let mut model = match comm {
        Some(c) => Model::build_sharded(cfg, &source, DType::F32, &dev, case.quantize, c),
        None => Model::build_with(cfg, &source, DType::F32, &dev, case.quantize),
    }
    .unwrap();
    let expert_bytes_read = source.experts.load(SeqCst);
    if case.autocast {
        model.set_autocast().unwrap();
    }
    model.set_keep_gathered(case.keep);
    assert_eq!(
        model.set_prefetch(case.prefetch),
        case.prefetch && comm_is_sharded
    );
    if let (true, Some(t)) = (case.device, transport) {
        assert!(model.set_device_gather(Rc::new(t)).unwrap());
        // As the trainer does: prefetch asked again of the device transport (launched ahead).
        assert_eq!(model.set_prefetch(case.prefetch), case.prefetch);
    }
    let spec = LoraSpec::new(4, 8.0, 0.1, false, &["all-linear".into()])
        .unwrap()
        .with_dora(case.dora);
    let spec = match case.moe {
        true => spec
            .with_target_parameters(&EXPERT_STACKS.map(String::from))
            .unwrap(),
        false => spec,
    };
    let mut adapter = Adapter::init(spec.clone(), &model.lora_modules(&spec), 3, &dev).unwrap();
    for (i, p) in adapter.pairs.iter_mut().enumerate() {
        let n = p.b.elem_count();
        let b: Vec<f32> = (0..n)
            .map(|j| ((i * 31 + j * 7) % 13) as f32 * 0.01 - 0.06)
            .collect();
        p.b = Tensor::from_vec(b, p.b.dims(), &dev).unwrap();
    }
    model.attach(&adapter);
    if case.dora {
        model.init_dora(&mut adapter).unwrap();
    }
    let resident = model.resident_bytes();
    let (b, t) = (2, 12);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 + 3) as u32 % v as u32).collect();
    let inputs = Inputs::new(ids.clone(), b, t);
    let targets: Vec<Option<u32>> = (0..b * t)
        .map(|i| ((i + 1) % t != 0).then(|| ids[i + 1]))
        .collect();
    let lc = LoraCtx {
        adapter: &adapter,
        scaling: spec.scaling(),
        dropout: 0.1,
        seed: 11,
    };
    let mut grads = Grads::new(adapter.pairs.len());
    let before = gathered.load(SeqCst);
    let loss = model
        .forward_backward(&inputs, &targets, &lc, 0.01, case.checkpoint, &mut grads)
        .unwrap();
    let train_gathered = gathered.load(SeqCst) - before;
    // With the device path every gathered byte went through it (none through the host one).
    let on_device = device_bytes.load(SeqCst);
    match case.device && comm_is_sharded {
        true => assert!(
            on_device >= train_gathered && train_gathered > 0,
            "{case:?}: {on_device} B through the device transport, {train_gathered} B gathered"
        ),
        false => assert_eq!(on_device, 0, "{case:?}"),
    }
    let mut all: Vec<Vec<u32>> = Vec::new();
    for g in grads.a.iter().chain(&grads.b).chain(&grads.m).flatten() {
        all.push(bits(g));
    }
    let eval = LoraCtx { dropout: 0.0, ..lc };
    let logits = model.forward(&inputs, Some(&eval), false).unwrap().logits;
    let mut cache = KvCache::default();
    model.decode(&ids[..5], &mut cache, Some(&eval)).unwrap();
    let decoded = model.decode(&ids[5..6], &mut cache, Some(&eval)).unwrap();
    let out = Outcome {
        loss: loss.to_bits(),
        grads: all,
        logits: bits(&logits),
        decoded: bits(&decoded),
    };
    (out, resident, train_gathered, expert_bytes_read)
}

/// A rank's outcome, frozen bytes held, bytes gathered by the training pass and bytes of the
/// expert stacks read at load.
type Ran = (Outcome, usize, usize, usize);

/// Every rank of a `size`-rank world, each in its own thread with its own model.
/// Every rank of a `size`-rank world, each in its own thread with its own model; and the bytes
/// all ranks gathered on their background threads.
fn ranks(case: Case, size: usize) -> (Vec<Ran>, usize) {
    let slots = Arc::new(Mutex::new(vec![Vec::new(); size]));
    let barrier = Arc::new(Barrier::new(size));
    let in_background = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..size)
        .map(|rank| {
            let (slots, barrier) = (slots.clone(), barrier.clone());
            let in_background = in_background.clone();
            std::thread::spawn(move || {
                let gathered = Arc::new(AtomicUsize::new(0));
                let comm = Threads {
                    rank,
                    size,
                    slots,
                    barrier,
                    gathered: gathered.clone(),
                    in_background,
                    busy: Arc::default(),
                    prefetch: case.prefetch,
                    background: false,
                };
                run(case, Some(Rc::new(comm)), gathered)
            })
        })
        .collect();
    let got = handles.into_iter().map(|h| h.join().unwrap()).collect();
    (got, in_background.load(SeqCst))
}

/// BLAS loaded, and OpenBLAS on one thread until the guard drops: every product of every rank
/// (and of the whole model) runs on one thread, whichever rank is in its experts (module doc).
fn one_blas_thread() -> Option<rtune_backend::blas::OneThread> {
    rtune_backend::blas::init();
    rtune_backend::blas::one_thread()
}

#[test]
fn every_rank_of_a_sharded_base_computes_the_whole_models_bits() {
    let _one = one_blas_thread();
    let nf4 = Quantize::linears;
    let nf4_experts = |double_quant| Quantize::Nf4 {
        double_quant,
        experts: true,
    };
    let base = Case {
        quantize: Quantize::None,
        autocast: false,
        tied: false,
        dora: false,
        checkpoint: false,
        keep: 0,
        prefetch: false,
        device: false,
        moe: false,
    };
    let cases = [
        base,
        Case {
            prefetch: true,
            ..base
        },
        Case {
            checkpoint: true,
            tied: true,
            ..base
        },
        Case {
            quantize: nf4(false),
            checkpoint: true,
            prefetch: true,
            ..base
        },
        Case {
            quantize: nf4(true),
            dora: true,
            prefetch: true,
            ..base
        },
        Case {
            autocast: true,
            tied: true,
            checkpoint: true,
            prefetch: true,
            ..base
        },
        Case {
            quantize: nf4(true),
            autocast: true,
            ..base
        },
        // The device path: dense, NF4 and NF4 with double quantization (bf16 autocast), tied,
        // checkpointed, DoRA, launched ahead.
        Case {
            device: true,
            tied: true,
            ..base
        },
        Case {
            quantize: nf4(false),
            checkpoint: true,
            prefetch: true,
            device: true,
            ..base
        },
        Case {
            quantize: nf4(true),
            autocast: true,
            dora: true,
            prefetch: true,
            device: true,
            ..base
        },
        // Qwen3-MoE: the routers and expert stacks sharded and gathered with their layer, LoRA
        // on them; checkpointed and prefetched, under autocast, on the device path.
        Case { moe: true, ..base },
        Case {
            moe: true,
            checkpoint: true,
            prefetch: true,
            ..base
        },
        Case {
            moe: true,
            autocast: true,
            checkpoint: true,
            ..base
        },
        Case {
            moe: true,
            device: true,
            prefetch: true,
            ..base
        },
        // NF4 expert stacks (`quantize_experts`), sharded by expert as their records: plain and
        // double-quantized, checkpointed and prefetched, under autocast, on the device path.
        Case {
            moe: true,
            quantize: nf4_experts(false),
            ..base
        },
        Case {
            moe: true,
            quantize: nf4_experts(true),
            checkpoint: true,
            prefetch: true,
            ..base
        },
        Case {
            moe: true,
            quantize: nf4_experts(true),
            autocast: true,
            ..base
        },
        Case {
            moe: true,
            quantize: nf4_experts(false),
            device: true,
            prefetch: true,
            ..base
        },
    ];
    for case in cases {
        let (whole, whole_bytes, _, whole_read) = run(case, None, Default::default());
        // The device path and the MoE model also in a world of 4 (more unequal shards, more
        // empty ones).
        let sizes = if case.device || case.moe {
            1..=4
        } else {
            1..=3
        };
        for size in sizes {
            let (got, in_background) = ranks(case, size);
            // Prefetched, every layer but the first of each pass is gathered in the background
            // (launched ahead on the pass's own thread with the device path).
            assert_eq!(
                in_background > 0,
                case.prefetch && !case.device,
                "{case:?}: {in_background}"
            );
            for (rank, (out, bytes, _, read)) in got.iter().enumerate() {
                assert!(
                    *out == whole,
                    "{case:?}: rank {rank} of {size} differs from the whole model"
                );
                // A rank reads only its experts' bytes of the stacks: its span of the 8 experts.
                let mine = rtune_model::shard::span(8, 1, size, rank).len();
                if case.moe {
                    eprintln!(
                        "{case:?}: rank {rank} of {size} read {read} B of the expert stacks, \
                         the whole model {whole_read} B"
                    );
                    assert_eq!(
                        *read * 8,
                        whole_read * mine,
                        "{case:?}: rank {rank} of {size}"
                    );
                }
                // Norms and biases stay whole: a few KB above whole/size.
                let share = whole_bytes as f64 / size as f64;
                eprintln!("{case:?}: rank {rank} of {size}: {bytes} B of {whole_bytes} B");
                assert!(
                    (*bytes as f64) < share * 1.25 + 32768.0,
                    "{case:?}: rank {rank} of {size} holds {bytes} B, the whole model {whole_bytes} B"
                );
            }
            // NF4 experts' records carry no code tables (each expert's 16 NF4 values and, double
            // quantized, its 256 second-level ones: bitsandbytes' constants, rebuilt when
            // gathered); the whole model holds them once an expert (2 layers × 2 stacks × 8).
            let tables = match case.quantize {
                Quantize::Nf4 {
                    experts: true,
                    double_quant,
                } => 32 * (64 + 1024 * usize::from(double_quant)),
                _ => 0,
            };
            let total: usize = got.iter().map(|g| g.1).sum();
            assert!(
                total as f64 >= (whole_bytes - tables) as f64 * 0.99,
                "{case:?}: shards cover the model"
            );
        }
    }
}

/// `keep` of the 2 layers kept gathered from the forward for the backward: the same bits, and
/// each kept layer spares the backward exactly one layer's gather (every rank alike); keeping
/// more than the model's layers keeps them all. With and without checkpointing, dense and NF4-dq,
/// the next layer prefetched or not (the same gathers either way).
#[test]
fn layers_kept_gathered_spare_the_backwards_gathers_and_change_no_bit() {
    let _one = one_blas_thread();
    let base = Case {
        quantize: Quantize::None,
        autocast: false,
        tied: false,
        dora: false,
        checkpoint: true,
        keep: 0,
        prefetch: false,
        device: false,
        moe: false,
    };
    let nf4 = Case {
        quantize: Quantize::linears(true),
        checkpoint: false,
        ..base
    };
    // One layer's frozen weights as gathered: dense f32 at 4 bytes an element.
    let cfg = config(false);
    let (d, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    );
    let dense_layer = 4 * (d * q + 2 * d * kv + q * d + 3 * d * i);
    for case in [base, nf4] {
        let (whole, _, _, _) = run(case, None, Default::default());
        let size = 2;
        let mut by_keep = Vec::new();
        for keep in [0, 1, 2, 5] {
            let mut each = Vec::new();
            for (prefetch, device) in [(false, false), (true, false), (true, true)] {
                let (got, _) = ranks(
                    Case {
                        keep,
                        prefetch,
                        device,
                        ..case
                    },
                    size,
                );
                for (rank, (out, _, g, _)) in got.iter().enumerate() {
                    let c = format!("{case:?} keep {keep} prefetch {prefetch} device {device}");
                    assert!(*out == whole, "{c}: rank {rank} differs");
                    assert_eq!(*g, got[0].2, "{c}: ranks gathered alike");
                }
                each.push(got[0].2);
            }
            assert_eq!(
                each, [each[0]; 3],
                "{case:?} keep {keep}: prefetch (on another thread, or launched ahead on the \
                 device) gathers the same"
            );
            by_keep.push(each[0]);
        }
        eprintln!("{case:?}: bytes gathered by the pass for keep 0, 1, 2, 5: {by_keep:?}");
        let layer = by_keep[0] - by_keep[1];
        assert!(layer > 0, "{case:?}: keeping a layer spares a gather");
        assert_eq!(
            by_keep[1] - by_keep[2],
            layer,
            "{case:?}: one layer per kept layer"
        );
        assert_eq!(by_keep[3], by_keep[2], "{case:?}: 5 keeps the 2 layers");
        if case.quantize == Quantize::None {
            assert_eq!(layer, dense_layer, "{case:?}: a layer's weights");
        }
    }
}
