//! The merged model: every adapted linear layer's weight replaced by `W' = W + scaling·B·A`
//! (`W: (out, in)`, `B: (out, r)`, `A: (r, in)`), computed in f32 and rounded once to the base's
//! dtype; every other tensor copied byte for byte. A DoRA adapter folds its magnitude in as PEFT's
//! `merge_and_unload()` does (`DoraLinearVariant.merge_unsafe`): `W' = (m / ‖W + ΔW‖) ⊙ (W + ΔW)`
//! row-wise, `ΔW = scaling·B·A`, all in f32 and rounded once. This is PEFT's `merge_and_unload()`: the weights
//! came out bit-identical to PEFT 0.21's for an f32 and a bf16 base (scripts/check_export.py).
//!
//! LoRA on a mixture-of-experts model's expert stacks (PEFT's `ParamWrapper`, `target_parameters`)
//! merges as PEFT's `ParamWrapper.merge` does: expert `e`'s `ΔW_e = scaling·B_e·A_e` (`A_e`: rows
//! `e·r..(e+1)·r` of `A: (E·r, in)`, `B_e`: columns `j·E + e` of `B: (out, r·E)`) added to its
//! slice of the stack, in f32 and rounded once. The base may hold the stacks fused (transformers
//! 5: `mlp.experts.gate_up_proj: (E, 2I, H)`, rows gate then up, and `down_proj: (E, H, I)`) or
//! per expert (the family's released layout, e.g. Mixtral's `block_sparse_moe.experts.N.w1`):
//! either is merged in place, its layout kept.
//!
//! The base is read through mmap one tensor at a time and each output shard is streamed to disk, so
//! the export holds one weight matrix (plus its f32 copy) in memory, never the model. Output shards
//! follow `save_pretrained`: `model.safetensors`, or `model-0000k-of-0000n.safetensors` with
//! `model.safetensors.index.json` once the tensors pass `max_shard_bytes`.

use candle_core::safetensors::{Load, MmapedSafetensors};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use rtune_fsio::{write_atomic, Privacy};
use rtune_lora::Adapter;

use crate::out::{io, write_streamed};
use crate::{adapter_spec, base_config, module_shapes, ExportError, Result};

/// transformers' `save_pretrained` default shard size ("5GB").
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Files of the base copied as they are (those present).
pub const COPIED_FILES: [&str; 11] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

#[derive(Debug, Clone)]
pub struct MergeOptions {
    /// A new shard starts before a tensor that would take the current one past this many bytes.
    pub max_shard_bytes: u64,
    /// Merge into the NF4 round trip of each adapted weight, `deq(nf4(W))` (`Some(double_quant)`):
    /// the weights a QLoRA adapter was trained against. `None`: into `W` itself.
    pub dequantized: Option<bool>,
    /// With `dequantized`: the adapted expert stacks too (`[model] quantize_experts`), each
    /// expert's `(out, in)` matrix through its own NF4 round trip, as the run held it
    /// (`rtune_experts::moe::Nf4Stack`).
    pub dequantized_experts: bool,
}

impl Default for MergeOptions {
    fn default() -> Self {
        Self {
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            dequantized: None,
            dequantized_experts: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct MergeReport {
    /// File names written, weights first.
    pub files: Vec<String>,
    /// Weight matrices changed by the adapter.
    pub merged: usize,
    pub tensors: usize,
    pub total_bytes: u64,
}

/// The safetensors files of a Hugging Face model directory: the shards its index lists, or
/// `model.safetensors`.
pub fn base_files(base: &Path) -> Result<Vec<PathBuf>> {
    let index = base.join("model.safetensors.index.json");
    if index.exists() {
        let text = rtune_fsio::read_bounded(&index, rtune_fsio::FileKind::ShardIndex)
            .map_err(|e| ExportError::input(&index, format!("cannot read: {e}")))?;
        let v: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| ExportError::input(&index, format!("not JSON: {e}")))?;
        let shards = rtune_model::weights::index_shards(&v)
            .map_err(|message| ExportError::input(&index, message))?;
        return Ok(shards.into_iter().map(|f| base.join(f)).collect());
    }
    let single = base.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(ExportError::input(
        base,
        "no model.safetensors or model.safetensors.index.json (a merged export needs safetensors weights)",
    ))
}

/// One tensor of the output: where it comes from and, for an adapted weight, its LoRA pair.
struct Entry {
    file: usize,
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: u64,
    lora: Option<Target>,
}

/// Which part of which LoRA pair a base tensor takes.
#[derive(Debug, Clone)]
struct Target {
    /// The pair's index in the adapter.
    slot: usize,
    part: Part,
    /// The tensor's shape the config and the adapter imply.
    shape: Vec<usize>,
}

#[derive(Debug, Clone, PartialEq)]
enum Part {
    /// A linear weight `(out, in)`: the whole `ΔW`.
    Linear,
    /// A fused expert stack `(E, out, in)`: every expert's `ΔW_e`.
    Stack,
    /// A fused expert stack stored `(E, in, out)` (gpt-oss): every expert's `ΔW_eᵀ`.
    StackTransposed,
    /// One expert's weight in a per-expert checkpoint: rows `rows` of `ΔW_e` (gate and up are
    /// the two halves of gate_up's `2I` rows, `pair` the other half's tensor).
    Expert {
        e: usize,
        experts: usize,
        rows: std::ops::Range<usize>,
        pair: Option<String>,
    },
}

/// The base tensors an adapter's pairs merge into, by name: each targeted linear's
/// `<module>.weight`, and each adapted expert stack both as transformers 5's fused tensor and as
/// the family's released per-expert tensors (a checkpoint has one or the other). With the number
/// of tensors a pair needs in each layout: 1, or 1 fused / `E` (down) or `2E` (gate and up).
fn targets(
    cfg: &rtune_model::ModelConfig,
    spec: &rtune_lora::LoraSpec,
    modules: &[rtune_lora::ModuleShape],
    adapter: &Adapter,
) -> (std::collections::HashMap<String, Target>, Vec<[usize; 2]>) {
    let mut map = std::collections::HashMap::new();
    let mut needed = vec![[1, 1]; adapter.names.len()];
    for m in modules.iter().filter(|m| m.experts == 1) {
        if let Some(slot) = adapter.index_of(&m.name) {
            let shape = vec![m.out_features, m.in_features];
            let t = Target {
                slot,
                part: Part::Linear,
                shape,
            };
            map.insert(format!("{}.weight", m.name), t);
        }
    }
    let Some(moe) = &cfg.moe else {
        return (map, needed);
    };
    let (e_n, i, h) = (moe.experts, moe.intermediate, cfg.hidden_size);
    for l in 0..cfg.num_layers {
        for (m, stack) in rtune_model::moe::expert_modules(cfg, l, spec) {
            let Some(slot) = adapter.index_of(&m.name) else {
                continue;
            };
            let layer = format!("model.layers.{l}");
            let stacks = moe.stacks(h);
            let fused = format!("{layer}.{}", stacks[stack].param);
            let (o, inp) = (stacks[stack].out_features, stacks[stack].in_features);
            // gpt-oss stores its stacks `(E, in, out)`: PEFT's ΔW is then `(E, in, out)` too.
            let (part, shape) = match moe.transposed {
                false => (Part::Stack, vec![e_n, o, inp]),
                true => (Part::StackTransposed, vec![e_n, inp, o]),
            };
            map.insert(fused, Target { slot, part, shape });
            // No released per-expert layout (gpt-oss): the fused stack or nothing.
            let Some(released) = moe.released else {
                needed[slot] = [1, usize::MAX];
                continue;
            };
            let [gate, up, down] = released.names;
            let per = format!("{layer}.{}.experts", released.module);
            let parts: Vec<(&str, std::ops::Range<usize>)> = match stack {
                0 => vec![(gate, 0..i), (up, i..2 * i)],
                _ => vec![(down, 0..h)],
            };
            needed[slot] = [1, e_n * parts.len()];
            for e in 0..e_n {
                for (k, (p, rows)) in parts.iter().enumerate() {
                    let shape = vec![rows.len(), inp];
                    let pair = (parts.len() == 2).then(|| {
                        let other = parts[1 - k].0;
                        format!("{per}.{e}.{other}.weight")
                    });
                    let part = Part::Expert {
                        e,
                        experts: e_n,
                        rows: rows.clone(),
                        pair,
                    };
                    map.insert(
                        format!("{per}.{e}.{p}.weight"),
                        Target { slot, part, shape },
                    );
                }
            }
        }
    }
    (map, needed)
}

/// Splits `entries` (in order) into shards of at most `max` bytes (a larger tensor gets its own).
fn plan(entries: &[Entry], max: u64) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut size) = (0, 0u64);
    for (i, e) in entries.iter().enumerate() {
        if i > start && size + e.bytes > max {
            shards.push(start..i);
            (start, size) = (i, 0);
        }
        size += e.bytes;
    }
    if start < entries.len() {
        shards.push(start..entries.len());
    }
    shards
}

/// Writes the merge of `base` and the PEFT adapter in `adapter_dir` into `dest` (an existing,
/// empty directory): weights, index, config and tokenizer files.
pub fn merge_into(
    base: &Path,
    adapter_dir: &Path,
    dest: &Path,
    opts: &MergeOptions,
    privacy: Privacy,
) -> Result<MergeReport> {
    let cfg = base_config(base)?;
    let spec = adapter_spec(adapter_dir)?;
    let modules = module_shapes(&cfg, &spec);
    let adapter = Adapter::load_peft(adapter_dir, &spec, &modules, &Device::Cpu)?;
    if adapter.tokens.is_some() {
        return Err(ExportError::input(
            &adapter_dir.join(rtune_lora::ADAPTER_CONFIG),
            "trainable_token_indices is set: merging trainable token rows is not supported yet; \
             export with --format peft (PEFT's merge_and_unload() folds them in)",
        ));
    }
    let scaling = spec.scaling();

    let files = base_files(base)?;
    let mut maps = Vec::with_capacity(files.len());
    for f in &files {
        let shard = rtune_fsio::FileKind::Sized {
            cap: u64::MAX,
            name: "safetensors shard",
        };
        rtune_fsio::open_regular(f, shard)
            .map_err(|e| ExportError::input(f, format!("cannot read: {e}")))?;
        // SAFETY: mapped read-only; the export never writes to the base (check_destination).
        let m = unsafe { MmapedSafetensors::new(f) }
            .map_err(|e| ExportError::input(f, format!("not a safetensors file: {e}")))?;
        maps.push(m);
    }
    let (targets, needed) = targets(&cfg, &spec, &modules, &adapter);
    let mut entries = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (file, m) in maps.iter().enumerate() {
        let mut views = m.tensors();
        views.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, v) in views {
            if !seen.insert(name.clone()) {
                return Err(ExportError::input(
                    &files[file],
                    format!("tensor `{name}` is stored in more than one shard"),
                ));
            }
            let lora = targets.get(&name).cloned();
            entries.push(Entry {
                file,
                bytes: v.data().len() as u64,
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                name,
                lora,
            });
        }
    }
    // Tensors found per pair, fused stacks apart from per-expert tensors.
    let mut found = vec![[0usize; 2]; adapter.names.len()];
    for e in &entries {
        let Some(t) = &e.lora else { continue };
        if e.shape != t.shape {
            return Err(ExportError::input(
                &files[e.file],
                format!(
                    "tensor `{}` has shape {:?}, config.json and the adapter imply {:?}",
                    e.name, e.shape, t.shape
                ),
            ));
        }
        use safetensors::Dtype as D;
        if !matches!(e.dtype, D::F32 | D::BF16 | D::F16) {
            return Err(ExportError::input(
                &files[e.file],
                format!(
                    "tensor `{}` is {:?}; merging needs f32, bf16 or f16 weights (a quantized base \
                     cannot be merged into)",
                    e.name, e.dtype
                ),
            ));
        }
        found[t.slot][usize::from(matches!(t.part, Part::Expert { .. }))] += 1;
    }
    for (k, (f, n)) in found.iter().zip(&needed).enumerate() {
        if f[0] != n[0] && f[1] != n[1] {
            let name = &adapter.names[k];
            let what = match n[1] {
                1 => format!("`{name}.weight`"),
                usize::MAX => format!(
                    "the fused expert stack `{name}` adapts (an MXFP4 stack cannot be merged \
                     into: dequantize the base first)"
                ),
                _ => format!(
                    "all of the experts of `{name}` (fused stack, or {} per-expert tensors; found \
                     {})",
                    n[1], f[1]
                ),
            };
            return Err(ExportError::input(
                base,
                format!("has no tensor {what}, which the adapter modifies"),
            ));
        }
    }

    let shards = plan(&entries, opts.max_shard_bytes.max(1));
    let n = shards.len();
    let shard_name = |k: usize| {
        if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        }
    };
    let mut written = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (k, range) in shards.into_iter().enumerate() {
        let name = shard_name(k);
        let group = &entries[range];
        for e in group {
            weight_map.insert(e.name.clone(), name.clone());
        }
        let path = dest.join(&name);
        write_streamed(&path, privacy, |w| {
            write_shard(w, &path, group, &maps, &adapter, scaling, opts)
        })?;
        written.push(name);
    }
    let total_bytes: u64 = entries.iter().map(|e| e.bytes).sum();
    if n > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total_bytes},
            "weight_map": weight_map,
        });
        let text = serde_json::to_string_pretty(&index).expect("index serialises");
        write_atomic(
            &dest.join("model.safetensors.index.json"),
            text.as_bytes(),
            privacy,
        )?;
        written.push("model.safetensors.index.json".into());
    }
    for f in COPIED_FILES {
        let src = base.join(f);
        if src.is_file() {
            let bytes = rtune_fsio::read_bounded(&src, rtune_fsio::FileKind::Tokenizer)
                .map_err(|e| io(&src, "read")(e.into_io()))?;
            write_atomic(&dest.join(f), &bytes, privacy)?;
            written.push(f.to_string());
        }
    }
    Ok(MergeReport {
        files: written,
        merged: adapter.names.len(),
        tensors: entries.len(),
        total_bytes,
    })
}

/// One safetensors file: `u64 header length | JSON header (space-padded to 8 bytes) | data`, the
/// tensors' data back to back in `group` order.
fn write_shard(
    w: &mut dyn Write,
    path: &Path,
    group: &[Entry],
    maps: &[MmapedSafetensors],
    adapter: &Adapter,
    scaling: f64,
    opts: &MergeOptions,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    for e in group {
        header.insert(
            e.name.clone(),
            serde_json::json!({
                "dtype": e.dtype,
                "shape": e.shape,
                "data_offsets": [offset, offset + e.bytes],
            }),
        );
        offset += e.bytes;
    }
    let mut head = serde_json::to_vec(&header).expect("header serialises");
    head.resize(head.len().div_ceil(8) * 8, b' ');
    w.write_all(&(head.len() as u64).to_le_bytes())
        .and_then(|()| w.write_all(&head))
        .map_err(io(path, "write"))?;
    for e in group {
        let view = maps[e.file]
            .get(&e.name)
            .map_err(ExportError::candle(format!("read {}", e.name)))?;
        match &e.lora {
            None => w.write_all(view.data()).map_err(io(path, "write"))?,
            Some(t) => {
                // The other half of a per-expert gate/up pair, for an NF4 expert's round trip.
                let sibling = |name: &str| -> candle_core::Result<Tensor> {
                    for m in maps {
                        if let Ok(v) = m.get(name) {
                            return v.load(&Device::Cpu);
                        }
                    }
                    candle_core::bail!("no tensor `{name}` (the other half of an expert's gate_up)")
                };
                let bytes = merged_weight(&view, adapter, t, scaling, opts, &sibling)
                    .map_err(ExportError::candle(format!("merge {}", e.name)))?;
                if bytes.len() as u64 != e.bytes {
                    return Err(ExportError::Candle {
                        op: format!("merge {}", e.name),
                        cause: Box::new(candle_core::Error::Msg(format!(
                            "{} bytes, expected {}",
                            bytes.len(),
                            e.bytes
                        ))),
                    });
                }
                w.write_all(&bytes).map_err(io(path, "write"))?;
            }
        }
    }
    Ok(())
}

/// `W + scaling·(B·A)` in f32, rounded to W's dtype; the little-endian bytes. With
/// `dequantized`, a linear `W` is first replaced by its NF4 round trip, bitsandbytes-exact, and
/// with `dequantized_experts` an expert stack's too, expert by expert ([`expert_round_trip`]). An
/// expert part takes its expert's `ΔW_e` (or every expert's, stacked, for a fused stack).
fn merged_weight(
    view: &safetensors::tensor::TensorView<'_>,
    adapter: &Adapter,
    t: &Target,
    scaling: f64,
    opts: &MergeOptions,
    sibling: &dyn Fn(&str) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Vec<u8>> {
    let dequantized = opts.dequantized;
    let w = view.load(&Device::Cpu)?;
    let pair = &adapter.pairs[t.slot];
    let expert = |e: usize, experts: usize| -> candle_core::Result<Tensor> {
        let l = rtune_experts::moe::ExpertLora {
            a: &pair.a,
            b: &pair.b,
            scale: scaling,
        };
        let (a, b) = rtune_experts::moe::expert_factors(&l, e, experts)?;
        b.matmul(&a)?.affine(scaling, 0.0) // (out, r)·(r, in)
    };
    let delta = match &t.part {
        Part::Linear => pair.b.matmul(&pair.a)?.affine(scaling, 0.0)?, // (out, r)·(r, in), as PEFT
        Part::Stack | Part::StackTransposed => {
            let e_n = t.shape[0];
            let transposed = t.part == Part::StackTransposed;
            let d = (0..e_n)
                .map(|e| match transposed {
                    false => expert(e, e_n),
                    true => expert(e, e_n)?.t()?.contiguous(),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::stack(&d, 0)? // (E, out, in), or (E, in, out) transposed
        }
        Part::Expert {
            e, experts, rows, ..
        } => expert(*e, *experts)?.narrow(0, rows.start, rows.len())?,
    };
    let round_trip = match t.part {
        Part::Linear => dequantized,
        _ => dequantized.filter(|_| opts.dequantized_experts),
    };
    let base = match round_trip {
        None => w.to_dtype(DType::F32)?,
        Some(dq) if t.part == Part::Linear => rtune_quant::quantize::quantize_tensor(&w, dq)
            .and_then(|q| q.to_tensor(DType::F32, &Device::Cpu))
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?,
        Some(dq) => expert_round_trip(&w, &t.part, dq, sibling)?,
    };
    let merged = (base + delta)?; // (out, in) or (E, out, in) f32
    let merged = match &pair.m {
        // PEFT: weight_norm = ‖W + ΔW‖ (dim 1, f32, detached); factor = m / weight_norm as a
        // column; new = factor * (W + ΔW).
        Some(m) => {
            let (out, inp) = merged.dims2()?;
            let rows = merged.flatten_all()?.to_vec1::<f32>()?;
            let norm = Tensor::from_vec(torch_row_norms(&rows, inp), (out, 1), &Device::Cpu)?;
            let factor = m.unsqueeze(1)?.div(&norm)?;
            merged.broadcast_mul(&factor)?
        }
        None => merged,
    };
    let merged = merged.to_dtype(w.dtype())?;
    Ok(safetensors::View::data(&merged).into_owned())
}

/// An expert part's NF4 round trip as training held it (`rtune_experts::moe::Nf4Stack`: each
/// expert's `(out, in)` matrix quantized alone), in f32: a fused stack expert by expert (gpt-oss's
/// `(E, in, out)` transposed to `(E, out, in)` and back); a per-expert down weight whole; a gate or
/// up half joined to its other half (`pair`) as the stack's `(2I, H)` rows, its own rows kept.
fn expert_round_trip(
    w: &Tensor,
    part: &Part,
    dq: bool,
    pair: &dyn Fn(&str) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    use rtune_experts::moe::Nf4Stack;
    let stack = |t: &Tensor| Nf4Stack::quantize(t, dq)?.dequantize(DType::F32, &Device::Cpu);
    match part {
        Part::Stack => stack(w),
        Part::StackTransposed => stack(&w.transpose(1, 2)?.contiguous()?)?
            .transpose(1, 2)?
            .contiguous(),
        Part::Expert { rows, pair: p, .. } => {
            let full = match p {
                None => w.clone(),
                Some(name) => {
                    let other = pair(name)?;
                    let halves = match rows.start {
                        0 => [w.clone(), other],
                        _ => [other, w.clone()],
                    };
                    Tensor::cat(&halves, 0)?
                }
            };
            let (start, n) = (if p.is_some() { rows.start } else { 0 }, w.dim(0)?);
            stack(&full.unsqueeze(0)?)?.squeeze(0)?.narrow(0, start, n)
        }
        Part::Linear => w.to_dtype(DType::F32),
    }
}

/// `torch.linalg.norm(v, dim=1)` of a row-major `(rows, cols)` f32 matrix as torch 2.x computes
/// it on the CPU (ReduceOpsKernel.cpp, the vectorised last-dim path for p = 2): eight f32 lanes
/// accumulate `x·x` (a multiply, then an add: no FMA) over whole blocks of 8, the lanes are summed
/// left to right, the tail is added one by one, and the square root is taken in f32. Matching its
/// rounding is what makes a DoRA merge bit-identical to PEFT's `merge_and_unload()` (checked against
/// torch 2.15 with both its AVX2 and AVX-512 kernels: 0 of 300 rows differ; a plain sequential sum
/// differs in the last bit for about a third of the rows).
pub fn torch_row_norms(v: &[f32], cols: usize) -> Vec<f32> {
    const LANES: usize = 8;
    v.chunks_exact(cols.max(1))
        .map(|row| {
            let mut acc = [0f32; LANES];
            let blocks = row.chunks_exact(LANES);
            let tail = blocks.remainder();
            for b in blocks {
                for (a, x) in acc.iter_mut().zip(b) {
                    *a += x * x;
                }
            }
            let mut sum = acc[0];
            for a in &acc[1..] {
                sum += a;
            }
            for x in tail {
                sum += x * x;
            }
            sum.sqrt()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(bytes: u64) -> Entry {
        Entry {
            file: 0,
            name: String::new(),
            dtype: safetensors::Dtype::F32,
            shape: vec![],
            bytes,
            lora: None,
        }
    }

    /// torch 2.15's `torch.linalg.norm(w, dim=1)` bit for bit, on a (12, 173) matrix whose
    /// sequential f32 sum differs from torch's in 8 of 12 rows. Made by:
    /// `i = torch.arange(12*173); w = (((i*7919) % 1000 - 500).float() * 1e-4).reshape(12, 173);`
    /// `torch.linalg.norm(w, dim=1).numpy().view(np.uint32)` (same bits with ATEN_CPU_CAPABILITY
    /// avx2 and avx512).
    #[test]
    fn row_norms_round_as_torch() {
        let w: Vec<f32> = (0..12 * 173i64)
            .map(|i| ((i * 7919) % 1000 - 500) as f32 * 1e-4)
            .collect();
        let want: [u32; 12] = [
            0x3ec2931a, 0x3ec2955a, 0x3ec294f8, 0x3ec29fc2, 0x3ec28c51, 0x3ec29c2e, 0x3ec27920,
            0x3ec2872f, 0x3ec27700, 0x3ec2910c, 0x3ec274b5, 0x3ec28cef,
        ];
        let got: Vec<u32> = torch_row_norms(&w, 173)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn shard_plan_packs_in_order() {
        let e: Vec<Entry> = [40, 40, 30, 100, 10].into_iter().map(entry).collect();
        assert_eq!(plan(&e, 100), vec![0..2, 2..3, 3..4, 4..5]);
        assert_eq!(plan(&e, 1000), vec![0..5]);
        assert_eq!(plan(&e, 110), vec![0..3, 3..5]);
        assert!(plan(&[], 10).is_empty());
    }
}
