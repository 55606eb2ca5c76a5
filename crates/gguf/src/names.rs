//! llama.cpp's tensor names ↔ Hugging Face's (per architecture: [`Family`]), and the q/k row
//! permutation.
//!
//! Gemma 3 (`Gemma3Model` in convert_hf_to_gguf.py) is written without the permutation (it is not
//! a `LlamaModel`: llama.cpp's Gemma graph uses NEOX-style rope on the rows as Hugging Face orders
//! them), with four norms a layer under its own names, and every `*norm.weight` stored as `w + 1`
//! (`Gemma3Model.norm_shift`: Gemma3RMSNorm multiplies by `1 + w`, GGML's norm by the weight), which
//! [`Family::norm_shift`] reports so the converter subtracts it again.
//!
//! convert_hf_to_gguf.py (`LlamaModel.modify_tensors`) stores `q_proj` as
//! `permute(w, n_head, n_head)` and `k_proj` as `permute(w, n_head, n_head_kv)` (weights and
//! biases), where
//!
//! ```python
//! def permute(weights, n_head, n_head_kv):
//!     if n_head_kv is not None and n_head != n_head_kv:
//!         n_head = n_head_kv
//!     return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
//!             .swapaxes(1, 2)
//!             .reshape(weights.shape))
//! ```
//!
//! i.e. within each head, row `s·half + j` (Hugging Face's rotate-half pairs `j`, `j + half`)
//! moves to row `2j + s` (GGML's interleaved pairs). [`unpermute`] moves it back.

use candle_core::Tensor;

/// Which rope permutation a tensor carries in a llama GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rope {
    None,
    /// `q_proj`: permuted with `num_attention_heads`.
    Q,
    /// `k_proj`: permuted with `num_key_value_heads`.
    K,
}

/// The architectures whose tensor names differ (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `llama` (Llama, SmolLM, Mistral; Qwen3-style q/k norms included).
    Llama,
    /// `gemma3` (text).
    Gemma3,
}

impl Family {
    /// The family of a `general.architecture`, `None` for one not read.
    pub fn of(arch: &str) -> Option<Self> {
        match arch {
            "llama" => Some(Family::Llama),
            "gemma3" => Some(Family::Gemma3),
            _ => None,
        }
    }

    fn layer(self) -> &'static [(&'static str, &'static str, Rope)] {
        match self {
            Family::Llama => &LAYER,
            Family::Gemma3 => &GEMMA3_LAYER,
        }
    }

    /// What convert_hf_to_gguf.py added to the tensor `gguf` (a llama.cpp name): 1 for Gemma 3's
    /// norms (`norm_shift`: names ending in `norm.weight`), else 0.
    pub fn norm_shift(self, gguf: &str) -> f64 {
        match self {
            Family::Gemma3 if gguf.ends_with("norm.weight") => 1.0,
            _ => 0.0,
        }
    }
}

const LAYER: [(&str, &str, Rope); 11] = [
    ("attn_norm", "input_layernorm", Rope::None),
    ("ffn_norm", "post_attention_layernorm", Rope::None),
    ("attn_q", "self_attn.q_proj", Rope::Q),
    ("attn_k", "self_attn.k_proj", Rope::K),
    ("attn_v", "self_attn.v_proj", Rope::None),
    ("attn_output", "self_attn.o_proj", Rope::None),
    // Qwen3's per-head norms (never permuted: they act after the projection's rows are split
    // into heads, on each head's `head_dim`).
    ("attn_q_norm", "self_attn.q_norm", Rope::None),
    ("attn_k_norm", "self_attn.k_norm", Rope::None),
    ("ffn_gate", "mlp.gate_proj", Rope::None),
    ("ffn_up", "mlp.up_proj", Rope::None),
    ("ffn_down", "mlp.down_proj", Rope::None),
];

/// gguf-py's `MODEL_ARCH.GEMMA3` tensors: `ffn_norm` is the pre-feed-forward norm here, and the
/// norms after attention and after the feed-forward have their own names.
const GEMMA3_LAYER: [(&str, &str, Rope); 13] = [
    ("attn_norm", "input_layernorm", Rope::None),
    (
        "post_attention_norm",
        "post_attention_layernorm",
        Rope::None,
    ),
    ("ffn_norm", "pre_feedforward_layernorm", Rope::None),
    ("post_ffw_norm", "post_feedforward_layernorm", Rope::None),
    ("attn_q", "self_attn.q_proj", Rope::None),
    ("attn_k", "self_attn.k_proj", Rope::None),
    ("attn_v", "self_attn.v_proj", Rope::None),
    ("attn_output", "self_attn.o_proj", Rope::None),
    ("attn_q_norm", "self_attn.q_norm", Rope::None),
    ("attn_k_norm", "self_attn.k_norm", Rope::None),
    ("ffn_gate", "mlp.gate_proj", Rope::None),
    ("ffn_up", "mlp.up_proj", Rope::None),
    ("ffn_down", "mlp.down_proj", Rope::None),
];

const GLOBAL: [(&str, &str); 3] = [
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
];

/// `blk.3.attn_q.weight` → (`model.layers.3.self_attn.q_proj.weight`, `Rope::Q`) for a llama;
/// `None` for a tensor the family's model does not have.
pub fn hf_name(family: Family, gguf: &str) -> Option<(String, Rope)> {
    let (stem, suffix) = gguf.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    if let Some(&(_, hf)) = GLOBAL.iter().find(|(g, _)| *g == stem) {
        return Some((format!("{hf}.{suffix}"), Rope::None));
    }
    let rest = stem.strip_prefix("blk.")?;
    let (layer, t) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let &(_, hf, rope) = family.layer().iter().find(|(g, _, _)| *g == t)?;
    Some((format!("model.layers.{layer}.{hf}.{suffix}"), rope))
}

/// The reverse of [`hf_name`].
pub fn gguf_name(family: Family, hf: &str) -> Option<(String, Rope)> {
    let (stem, suffix) = hf.rsplit_once('.')?;
    if let Some(&(g, _)) = GLOBAL.iter().find(|(_, h)| *h == stem) {
        return Some((format!("{g}.{suffix}"), Rope::None));
    }
    let rest = stem.strip_prefix("model.layers.")?;
    let (layer, t) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let &(g, _, rope) = family.layer().iter().find(|(_, h, _)| *h == t)?;
    Some((format!("blk.{layer}.{g}.{suffix}"), rope))
}

fn check(t: &Tensor, heads: usize) -> candle_core::Result<(usize, Vec<usize>)> {
    let dims = t.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        candle_core::bail!("{rows} rows do not split into {heads} heads of even size");
    }
    Ok((rows / heads / 2, dims))
}

/// convert_hf_to_gguf.py's permute: `(rows, ...)` with rows = heads·2·half; rotate-half → interleaved.
pub fn permute(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (half, dims) = check(t, heads)?;
    let rest: usize = dims[1..].iter().product();
    t.reshape((heads, 2, half, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// Undoes [`permute`]: interleaved → rotate-half.
pub fn unpermute(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (half, dims) = check(t, heads)?;
    let rest: usize = dims[1..].iter().product();
    t.reshape((heads, half, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rows(t: &Tensor) -> Vec<f32> {
        t.to_vec2::<f32>()
            .unwrap()
            .into_iter()
            .map(|r| r[0])
            .collect()
    }

    /// Rows numbered by their index: 2 heads of 4 rows (half = 2). llama.cpp's permute sends row
    /// s·2 + j of each head to 2j + s: [0, 2, 1, 3] per head.
    #[test]
    fn permute_is_llama_cpps_and_unpermute_inverts_it() {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, 8.0, &dev)
            .unwrap()
            .reshape((8, 1))
            .unwrap()
            .broadcast_as((8, 3))
            .unwrap()
            .contiguous()
            .unwrap();
        let p = permute(&w, 2).unwrap();
        assert_eq!(rows(&p), [0., 2., 1., 3., 4., 6., 5., 7.]);
        assert_eq!(rows(&unpermute(&p, 2).unwrap()), rows(&w));
        // Bias vectors are permuted the same way.
        let b = Tensor::arange(0f32, 8.0, &dev).unwrap();
        let pb = permute(&b, 2).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(pb, [0., 2., 1., 3., 4., 6., 5., 7.]);
        assert!(permute(&w, 3).is_err());
    }

    #[test]
    fn names_both_ways() {
        for (g, h, r) in [
            ("token_embd.weight", "model.embed_tokens.weight", Rope::None),
            ("output.weight", "lm_head.weight", Rope::None),
            ("output_norm.weight", "model.norm.weight", Rope::None),
            (
                "blk.12.attn_q.weight",
                "model.layers.12.self_attn.q_proj.weight",
                Rope::Q,
            ),
            (
                "blk.0.attn_k.bias",
                "model.layers.0.self_attn.k_proj.bias",
                Rope::K,
            ),
            (
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
                Rope::None,
            ),
            (
                "blk.3.ffn_down.weight",
                "model.layers.3.mlp.down_proj.weight",
                Rope::None,
            ),
        ] {
            assert_eq!(hf_name(Family::Llama, g), Some((h.to_string(), r)), "{g}");
            assert_eq!(gguf_name(Family::Llama, h), Some((g.to_string(), r)), "{h}");
        }
        assert_eq!(hf_name(Family::Llama, "rope_freqs.weight"), None);
        assert_eq!(hf_name(Family::Llama, "blk.x.attn_q.weight"), None);
        assert_eq!(hf_name(Family::Llama, "blk.0.post_ffw_norm.weight"), None);
    }

    /// gguf-py's GEMMA3 names: `ffn_norm` is the pre-feed-forward norm (a llama's
    /// post-attention norm), no q/k permutation, and every norm shifted by 1.
    #[test]
    fn gemma3_names_both_ways() {
        let f = Family::Gemma3;
        for (g, h) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            (
                "blk.2.attn_norm.weight",
                "model.layers.2.input_layernorm.weight",
            ),
            (
                "blk.2.post_attention_norm.weight",
                "model.layers.2.post_attention_layernorm.weight",
            ),
            (
                "blk.2.ffn_norm.weight",
                "model.layers.2.pre_feedforward_layernorm.weight",
            ),
            (
                "blk.2.post_ffw_norm.weight",
                "model.layers.2.post_feedforward_layernorm.weight",
            ),
            (
                "blk.2.attn_q.weight",
                "model.layers.2.self_attn.q_proj.weight",
            ),
            (
                "blk.2.attn_k.weight",
                "model.layers.2.self_attn.k_proj.weight",
            ),
            (
                "blk.2.attn_q_norm.weight",
                "model.layers.2.self_attn.q_norm.weight",
            ),
            (
                "blk.2.ffn_down.weight",
                "model.layers.2.mlp.down_proj.weight",
            ),
        ] {
            assert_eq!(hf_name(f, g), Some((h.to_string(), Rope::None)), "{g}");
            assert_eq!(gguf_name(f, h), Some((g.to_string(), Rope::None)), "{h}");
            let shift = if g.ends_with("norm.weight") { 1.0 } else { 0.0 };
            assert_eq!(f.norm_shift(g), shift, "{g}");
            assert_eq!(Family::Llama.norm_shift(g), 0.0, "{g}");
        }
        assert_eq!(Family::of("gemma3"), Some(f));
        assert_eq!(Family::of("gemma2"), None);
    }
}
