//! The settings an estimate is made for: from a run config ([`settings_for`]), narrowed to the
//! data ([`fit_to_data`]), or plain ([`Settings::new`]); and the host facts they include.

use rtune_config::{DType, RunConfig};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::{choose_checkpointing, Quantize, Settings, RUNTIME_BYTES, TRAIN_RUNTIME_BYTES};

impl Settings {
    /// These settings for one rank of `world` (`rtune estimate --world`, a rank of `rtune
    /// train`): with `[distributed] shard_base` the base is sharded over the world.
    pub fn for_world(mut self, cfg: &RunConfig, world: usize) -> Self {
        self.shard = cfg.distributed.shard_base.then_some(world.max(1));
        self.keep_gathered = cfg.distributed.keep_gathered_layers;
        // One process has no transport to gather on another thread with.
        self.prefetch = cfg.distributed.prefetch && world > 1;
        if world > 1 && self.world <= 1 {
            self.runtime_bytes += crate::MPI_RUNTIME_BYTES;
        }
        self.world = world.max(1);
        self
    }

    /// f32, no quantization, LoRA on all linear layers, worst-case rows.
    pub fn new(r: usize, micro_batch_size: usize, seq_len: usize, checkpointing: bool) -> Self {
        Self {
            dtype: DType::F32,
            quantize: Quantize::None,
            r,
            targets: rtune_lora::KNOWN_LINEAR
                .iter()
                .map(|s| s.to_string())
                .collect(),
            target_parameters: Vec::new(),
            dropout: 0.0,
            dora: false,
            trainable_tokens: 0,
            micro_batch_size,
            grad_accum: 1,
            seq_len,
            target_rows: None,
            packing: false,
            gradient_checkpointing: checkpointing,
            checkpoint_bytes: 0,
            checkpoint_elem_bytes: 0,
            runtime_bytes: RUNTIME_BYTES,
            matmul_workspace: matmul_workspace_bytes(),
            shard: None,
            keep_gathered: 0,
            prefetch: false,
            world: 1,
            sampling: None,
        }
    }
}

/// gemm (candle's CPU matmul) keeps a thread-local scratch slab of the L2 cache's size in every
/// thread that multiplies: the compute pool's threads and the main thread (measured: 3 × 1 MiB live
/// with 2 threads and a 1 MiB L2).
pub fn matmul_workspace_bytes() -> u64 {
    let l2 = (0..8)
        .find_map(|i| {
            let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
            let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).ok();
            if read("level")?.trim() != "2" || read("type")?.trim() == "Instruction" {
                return None;
            }
            let size = read("size")?;
            let size = size.trim();
            let (num, mult) = match size.strip_suffix('K') {
                Some(k) => (k, 1024),
                None => match size.strip_suffix('M') {
                    Some(m) => (m, 1 << 20),
                    None => (size, 1),
                },
            };
            num.parse::<u64>().ok().map(|n| n * mult)
        })
        .unwrap_or(1 << 20);
    (candle_core::utils::get_num_threads() as u64 + 1) * l2
}

/// Bytes the tokenizers library holds per byte of tokenizer.json (vocab and merges as hash maps
/// both ways). A rough figure: measured only on the fixtures' small tokenizers.
const TOKENIZER_PER_FILE_BYTE: u64 = 3;

/// Bytes a tokenized example holds per token (`input_ids` u32, `labels` i64).
const DATA_PER_TOKEN: u64 = 12;

/// Rows a micro-batch holds per configured example: 2 for a preference pair, 1 for SFT.
pub fn rows_per_example(cfg: &RunConfig) -> usize {
    match cfg.train.objective.is_preference() {
        true => 2,
        false => 1,
    }
}

/// The settings of a run as its config gives them (worst case: full-length rows, every position
/// a target; `gradient_checkpointing = "auto"` as on until [`choose_checkpointing`] decides). Reads only the sizes of the model's files, not their contents. Fails only on LoRA
/// targets that name no module (boxed: the error is large, and the trainer boxes it too).
pub fn settings_for(cfg: &RunConfig) -> Result<Settings, Box<rtune_lora::LoraError>> {
    let spec = cfg.lora.spec()?;
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let files: Vec<PathBuf> = std::fs::read_dir(&cfg.model.path)
        .map(|dir| {
            dir.flatten()
                .map(|f| f.path())
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect()
        })
        .unwrap_or_default();
    let checkpoint_bytes = files.iter().map(|f| size(f)).sum();
    let tokenizer = size(&cfg.model.path.join("tokenizer.json"));
    Ok(Settings {
        dtype: cfg.model.dtype,
        quantize: cfg.model.quantize,
        r: cfg.lora.r,
        targets: spec.targets,
        target_parameters: spec.target_parameters,
        dropout: cfg.lora.dropout,
        dora: cfg.lora.dora,
        trainable_tokens: cfg.lora.trainable_tokens.len(),
        // Rows a micro-batch: a preference objective's pair is two (chosen, rejected); its
        // reference pass is a forward pass of the same rows, below the training step's peak.
        micro_batch_size: cfg.train.micro_batch_size * rows_per_example(cfg),
        grad_accum: cfg.train.grad_accum,
        seq_len: cfg.data.max_seq_len,
        target_rows: None,
        packing: cfg.data.packing,
        gradient_checkpointing: cfg.train.gradient_checkpointing
            != rtune_config::Checkpointing::Off,
        checkpoint_bytes,
        checkpoint_elem_bytes: files.first().map_or(0, |f| stored_elem_bytes(f)),
        runtime_bytes: RUNTIME_BYTES + TRAIN_RUNTIME_BYTES + TOKENIZER_PER_FILE_BYTE * tokenizer,
        matmul_workspace: matmul_workspace_bytes(),
        // Set for the world by the caller ([`Settings::for_world`]).
        shard: None,
        keep_gathered: 0,
        prefetch: false,
        world: 1,
        // GRPO: `micro_batch_size` completion rows of `max_seq_len` tokens (prompt and
        // completion) train; the generation batch they come from is `sampling.rs`'s.
        sampling: crate::sampling::for_config(cfg),
    })
}

/// Bytes per element of the floating-point tensors in a safetensors file, from its header (the
/// first 8 bytes give the header's length, then JSON with each tensor's dtype); 0 when unknown.
fn stored_elem_bytes(path: &Path) -> u64 {
    let read = || -> Option<u64> {
        let mut f = std::fs::File::open(path).ok()?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).ok()?;
        let len = u64::from_le_bytes(len);
        if len > 100 << 20 {
            return None;
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header).ok()?;
        let v: serde_json::Value = serde_json::from_slice(&header).ok()?;
        v.as_object()?
            .values()
            .find_map(|t| match t.get("dtype")?.as_str()? {
                "F32" => Some(4),
                "BF16" | "F16" => Some(2),
                _ => None,
            })
    };
    read().unwrap_or(0)
}

/// Narrows `s` to the largest micro-batch `examples` can form: rows padded to the longest example
/// (packed rows: up to `max_seq_len`), as many target rows as the `B` examples with the most, and
/// the tokenized data itself in memory.
///
/// GRPO's `examples` are its prompts: a training row is the longest prompt and a completion of
/// `max_completion_length` tokens, each completion token a target (the prompts are not).
pub fn fit_to_data(s: &mut Settings, examples: &[rtune_data::Example], max_seq_len: usize) {
    let lens = examples.iter().map(|e| e.input_ids.len());
    let total: usize = lens.clone().sum();
    if let Some(g) = s.sampling.as_mut() {
        let prompt = lens.max().unwrap_or(1).clamp(1, max_seq_len.max(1));
        g.prompt_len = prompt;
        s.seq_len = (prompt + g.max_completion).min(max_seq_len.max(1));
        s.target_rows = Some(s.micro_batch_size * s.seq_len.saturating_sub(prompt));
        s.runtime_bytes += DATA_PER_TOKEN * total as u64;
        return;
    }
    let mut targets: Vec<usize> = examples.iter().map(|e| e.target_tokens()).collect();
    targets.sort_unstable_by(|a, b| b.cmp(a));
    let b = s.micro_batch_size;
    if s.packing {
        s.seq_len = max_seq_len.min(total.max(1));
        s.target_rows = Some((b * s.seq_len).min(targets.iter().sum()));
    } else {
        s.seq_len = lens.max().unwrap_or(1).clamp(1, max_seq_len.max(1));
        s.target_rows = Some(targets.iter().take(b).sum::<usize>().min(b * s.seq_len));
    }
    s.runtime_bytes += DATA_PER_TOKEN * total as u64;
}

/// The estimate of a run about to train on the CPU, fitted to its data, with checkpointing as
/// decided (`checkpointing`): what `rtune estimate` prints, written into metrics.jsonl and
/// summary.json beside the measured peak. `None` on CUDA (the estimator models host memory only)
/// or when the settings cannot be read.
pub fn for_run(
    cfg: &RunConfig,
    model: &rtune_model::ModelConfig,
    examples: &[rtune_data::Example],
    dev: &candle_core::Device,
    checkpointing: bool,
    world: usize,
) -> Option<u64> {
    if !dev.is_cpu() {
        return None;
    }
    let mut s = settings_for(cfg).ok()?.for_world(cfg, world);
    fit_to_data(&mut s, examples, cfg.data.max_seq_len);
    s.gradient_checkpointing = checkpointing;
    Some(crate::estimate(model, &s).peak_bytes)
}

/// [`choose_checkpointing`] for a run config, fitted to its data: what `rtune train` decides at
/// start (and `rtune estimate` prints).
pub fn checkpointing_for(
    cfg: &RunConfig,
    model: &rtune_model::ModelConfig,
    examples: Option<&[rtune_data::Example]>,
    budget: crate::Budget,
    world: usize,
) -> Result<crate::CheckpointingChoice, Box<rtune_lora::LoraError>> {
    let mut s = settings_for(cfg)?.for_world(cfg, world);
    if let Some(e) = examples {
        fit_to_data(&mut s, e, cfg.data.max_seq_len);
    }
    Ok(choose_checkpointing(
        cfg.train.gradient_checkpointing,
        model,
        &s,
        budget,
    ))
}
