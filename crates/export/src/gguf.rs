//! The adapter as a GGUF file for llama.cpp's `--lora`, laid out as llama.cpp's
//! `convert_lora_to_gguf.py` writes it (default `--outtype f32`):
//!
//! - metadata `general.architecture` (the family descriptor's `gguf.arch`: `llama` for Llama and
//!   Mistral, `qwen2` for Qwen2, `olmo2` for OLMo 2, ...: the architecture of the base model's
//!   GGUF, which llama.cpp checks), `general.type = "adapter"`,
//!   `adapter.type = "lora"`, `adapter.lora.alpha` (f32);
//! - per adapted layer `blk.N.<t>.weight.lora_a` and `.lora_b`, `<t>` the descriptor's name of
//!   the module (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down; Phi-3's
//!   attn_qkv, ffn_up); f32. Neither is transposed: A `(r, in)` and
//!   B `(out, r)` row-major, i.e. GGUF dims `ne = [in, r]` and `[r, out]` (GGUF lists the fastest
//!   dimension first), which is what llama-adapter.cpp checks against the base tensor's
//!   `ne = [in, out]`;
//! - where the descriptor says so (`gguf.permute_qk`: the `llama` architecture) the rows of B for
//!   attn_q and attn_k are permuted exactly as
//!   convert_hf_to_gguf.py permutes the base's q_proj/k_proj weights (Hugging Face's rotate-half
//!   RoPE layout to GGML's interleaved pairs); A is unchanged. `qwen2` uses NeoX RoPE: no permute.
//!
//! llama.cpp scales the adapter by `adapter.lora.alpha / r` (r from B's shape); for rsLoRA the file
//! stores `alpha·√r`, so that the product is PEFT's `alpha / √r` (convert_lora_to_gguf.py writes
//! `lora_alpha` as is and gets rsLoRA adapters wrong).
//!
//! The file is GGUF version 3 (magic, version, tensor count, metadata count; metadata; tensor
//! infos; data aligned to 32 bytes), written by hand: candle's writer writes version 2.
//!
//! scripts/check_gguf_lora.py compares the file with convert_lora_to_gguf.py's (every tensor
//! bit-identical) and runs it in llama.cpp (logits equal PEFT's base+adapter within ~1e-6).

use candle_core::Device;
use std::path::Path;

use rtune_fsio::{write_atomic, Privacy};
use rtune_lora::Adapter;
use rtune_model::{Family, ModelConfig};

use crate::{adapter_spec, base_config, module_shapes, ExportError, Result};

pub const ALIGNMENT: usize = 32;
const GGML_TYPE_F32: u32 = 0;
const GGUF_TYPE_UINT32: u32 = 4;
const GGUF_TYPE_FLOAT32: u32 = 6;
const GGUF_TYPE_STRING: u32 = 8;

/// llama.cpp's name for a module's weight in a base of family `family` (its descriptor's
/// [`Gguf::linears`](rtune_model::family::Gguf)): `model.layers.3.self_attn.q_proj` →
/// `blk.3.attn_q.weight`.
pub fn gguf_tensor_name(family: &Family, module: &str) -> Option<String> {
    let rest = module.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let &(_, t) = family.gguf.linears.iter().find(|(hf, _)| *hf == rest)?;
    Some(format!("blk.{layer}.{t}.weight"))
}

/// convert_hf_to_gguf.py's `LlamaModel.permute` on the rows of a `(rows, cols)` row-major matrix:
/// `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(rows, cols)`. Within each
/// head, row `s·half + j` (the two rotate-half halves) moves to row `2j + s` (interleaved pairs).
pub fn llama_permute_rows(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    assert_eq!(w.len(), rows * cols);
    assert!(
        n_head > 0 && rows.is_multiple_of(2 * n_head),
        "rows {rows}, heads {n_head}"
    );
    let half = rows / n_head / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_head {
        for s in 0..2 {
            for j in 0..half {
                let src = h * 2 * half + s * half + j;
                let dst = h * 2 * half + 2 * j + s;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

enum Value<'a> {
    Str(&'a str),
    F32(f32),
    U32(u32),
}

fn kv(out: &mut Vec<u8>, key: &str, v: Value) {
    string(out, key);
    match v {
        Value::Str(s) => {
            out.extend_from_slice(&GGUF_TYPE_STRING.to_le_bytes());
            string(out, s);
        }
        Value::F32(x) => {
            out.extend_from_slice(&GGUF_TYPE_FLOAT32.to_le_bytes());
            out.extend_from_slice(&x.to_le_bytes());
        }
        Value::U32(x) => {
            out.extend_from_slice(&GGUF_TYPE_UINT32.to_le_bytes());
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
}

fn pad(out: &mut Vec<u8>) {
    out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
}

fn host(t: &candle_core::Tensor) -> Result<Vec<f32>> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(ExportError::candle("adapter to host"))
}

/// The GGUF bytes of `adapter` for a base with config `cfg`.
pub fn gguf_lora_bytes(cfg: &ModelConfig, adapter: &Adapter) -> Result<Vec<u8>> {
    // The `general.architecture` of the base's GGUF (which llama.cpp requires the adapter to
    // match), and whether q/k rows are permuted for it.
    let (arch, permute) = (cfg.arch.gguf.arch, cfg.arch.gguf.permute_qk);
    let r = adapter.spec.r;
    // llama.cpp: scale = alpha / r.
    let alpha = (adapter.spec.scaling() * r as f64) as f32;
    // (name, ne = [cols, rows], data)
    let mut tensors: Vec<(String, [usize; 2], Vec<f32>)> = Vec::new();
    for (name, pair) in adapter.names.iter().zip(&adapter.pairs) {
        let base = gguf_tensor_name(cfg.arch, name).ok_or_else(|| {
            ExportError::input(
                Path::new(rtune_lora::ADAPTER_WEIGHTS),
                format!("module `{name}` has no llama.cpp tensor name"),
            )
        })?;
        let (a_dims, b_dims) = (pair.a.dims(), pair.b.dims()); // (r, in), (out, r)
        let a = host(&pair.a)?;
        let mut b = host(&pair.b)?;
        if permute {
            let heads = if name.ends_with("q_proj") {
                Some(cfg.num_heads)
            } else if name.ends_with("k_proj") {
                Some(cfg.num_kv_heads)
            } else {
                None
            };
            if let Some(h) = heads {
                b = llama_permute_rows(&b, b_dims[0], b_dims[1], h);
            }
        }
        tensors.push((format!("{base}.lora_a"), [a_dims[1], a_dims[0]], a));
        tensors.push((format!("{base}.lora_b"), [b_dims[1], b_dims[0]], b));
    }

    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    let meta = [
        ("general.architecture", Value::Str(arch)),
        ("general.type", Value::Str("adapter")),
        ("general.name", Value::Str("rtune LoRA adapter")),
        ("adapter.type", Value::Str("lora")),
        ("adapter.lora.alpha", Value::F32(alpha)),
        // As gguf-py's writer adds it to every file.
        ("general.quantization_version", Value::U32(2)),
    ];
    out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        kv(&mut out, k, v);
    }
    let mut offset = 0usize;
    for (name, ne, data) in &tensors {
        string(&mut out, name);
        out.extend_from_slice(&2u32.to_le_bytes());
        for d in ne {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        out.extend_from_slice(&GGML_TYPE_F32.to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += (data.len() * 4).div_ceil(ALIGNMENT) * ALIGNMENT;
    }
    pad(&mut out);
    for (_, _, data) in &tensors {
        out.extend(data.iter().flat_map(|x| x.to_le_bytes()));
        pad(&mut out);
    }
    Ok(out)
}

/// What llama.cpp's LoRA format does not carry, refused before anything is written, naming the
/// format that does: DoRA (no magnitude tensors) and LoRA on expert stacks (`target_parameters`).
pub fn refuse_unsupported(adapter_dir: &Path) -> Result<()> {
    let spec = adapter_spec(adapter_dir)?;
    let why = if spec.dora {
        "use_dora = true: llama.cpp's LoRA format has no DoRA magnitudes; export with \
         --format merged (the magnitudes folded into the weights) and convert that to GGUF"
    } else if !spec.target_parameters.is_empty() {
        "target_parameters (LoRA on a mixture-of-experts model's expert stacks): rtune does not \
         write llama.cpp's expert tensors as LoRA; export with --format merged and convert that \
         to GGUF"
    } else {
        return Ok(());
    };
    Err(ExportError::input(
        &adapter_dir.join(rtune_lora::ADAPTER_CONFIG),
        why,
    ))
}

/// Reads the adapter in `adapter_dir` (checked against `base`'s config.json) and writes it to
/// `out` as GGUF, atomically.
pub fn write_gguf_lora(
    base: &Path,
    adapter_dir: &Path,
    out: &Path,
    privacy: Privacy,
) -> Result<()> {
    let cfg = base_config(base)?;
    refuse_unsupported(adapter_dir)?;
    let spec = adapter_spec(adapter_dir)?;
    let modules = module_shapes(&cfg, &spec);
    let adapter = Adapter::load_peft(adapter_dir, &spec, &modules, &Device::Cpu)?;
    if adapter.tokens.is_some() {
        return Err(ExportError::input(
            &adapter_dir.join(rtune_lora::ADAPTER_CONFIG),
            "trainable_token_indices is set: llama.cpp's LoRA format has no token rows; export \
             with --format peft",
        ));
    }
    let bytes = gguf_lora_bytes(&cfg, &adapter)?;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        privacy.create_dir_all(parent)?;
    }
    write_atomic(out, &bytes, privacy)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_llama_cpp() {
        let n = |s| gguf_tensor_name(&rtune_model::family::LLAMA, s);
        assert_eq!(
            n("model.layers.0.self_attn.q_proj").unwrap(),
            "blk.0.attn_q.weight"
        );
        assert_eq!(
            n("model.layers.11.self_attn.o_proj").unwrap(),
            "blk.11.attn_output.weight"
        );
        assert_eq!(
            n("model.layers.2.mlp.down_proj").unwrap(),
            "blk.2.ffn_down.weight"
        );
        assert!(n("lm_head").is_none() && n("model.layers.x.mlp.up_proj").is_none());
    }

    #[test]
    fn permute_matches_reshape_swapaxes() {
        // One head of 4 rows, HF rotate-half order [x0, x1 | y0, y1] -> GGML pairs [x0, y0, x1, y1].
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect(); // rows of 2 columns
        assert_eq!(
            llama_permute_rows(&w, 4, 2, 1),
            vec![0., 1., 4., 5., 2., 3., 6., 7.]
        );
        // Two heads of 6 rows, 1 column: numpy's
        // np.arange(12).reshape(2, 2, 3, 1).swapaxes(1, 2).reshape(12)
        // = [0 3 1 4 2 5 6 9 7 10 8 11].
        let w: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let want: Vec<f32> = [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]
            .iter()
            .map(|&i| i as f32)
            .collect();
        assert_eq!(llama_permute_rows(&w, 12, 1, 2), want);
    }
}
