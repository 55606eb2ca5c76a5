//! What a converted model's tensors must look like, from its config.json (issue 46: a GGUF with no
//! tensors, a scalar q projection or shapes that contradict its metadata converted with exit 0, or
//! panicked). Shapes are Hugging Face's (rows first: candle reverses GGUF's `ne`).

use serde_json::Value;

use crate::names::Family;

/// The sizes the shapes are made of, from config.json.
pub struct Dims {
    pub hidden: usize,
    pub ff: usize,
    pub layers: usize,
    pub vocab: usize,
    /// Rows of q_proj (heads × head_dim) and of k_proj / v_proj (kv heads × head_dim).
    pub q_rows: usize,
    pub kv_rows: usize,
    pub head_dim: usize,
}

impl Dims {
    pub fn of(cfg: &Value) -> Dims {
        let n = |k: &str| {
            cfg[k]
                .as_u64()
                .map_or(0, |v| usize::try_from(v).unwrap_or(usize::MAX))
        };
        let head_dim = n("head_dim");
        Dims {
            hidden: n("hidden_size"),
            ff: n("intermediate_size"),
            layers: n("num_hidden_layers"),
            vocab: n("vocab_size"),
            q_rows: n("num_attention_heads").saturating_mul(head_dim),
            kv_rows: n("num_key_value_heads").saturating_mul(head_dim),
            head_dim,
        }
    }

    /// The shape the Hugging Face model expects for `hf` (a `.weight` or `.bias`), `None` for a
    /// name it does not know (the name map refuses those first).
    pub fn expected(&self, hf: &str) -> Option<Vec<usize>> {
        let (stem, suffix) = hf.rsplit_once('.')?;
        let t = match stem.strip_prefix("model.layers.") {
            Some(rest) => rest.split_once('.')?.1,
            None => stem,
        };
        let (h, f) = (self.hidden, self.ff);
        let weight = match t {
            "model.embed_tokens" | "lm_head" => vec![self.vocab, h],
            "model.norm" => vec![h],
            "self_attn.q_proj" => vec![self.q_rows, h],
            "self_attn.k_proj" | "self_attn.v_proj" => vec![self.kv_rows, h],
            "self_attn.o_proj" => vec![h, self.q_rows],
            "self_attn.q_norm" | "self_attn.k_norm" => vec![self.head_dim],
            "mlp.gate_proj" | "mlp.up_proj" => vec![f, h],
            "mlp.down_proj" => vec![h, f],
            t if t.ends_with("layernorm") => vec![h],
            _ => return None,
        };
        Some(match suffix {
            // A bias has one value per output row.
            "bias" => vec![weight[0]],
            _ => weight,
        })
    }
}

/// The llama.cpp names every model of `family` has: the embedding, the final norm and, per layer,
/// the projections and norms (q/k norms are optional for a llama: only Qwen3-style ones have them).
pub fn required(family: Family, layer: usize) -> Vec<String> {
    let per_layer: &[&str] = match family {
        Family::Llama => &[
            "attn_norm",
            "ffn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
        Family::Gemma3 => &[
            "attn_norm",
            "post_attention_norm",
            "ffn_norm",
            "post_ffw_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "attn_q_norm",
            "attn_k_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ],
    };
    per_layer
        .iter()
        .map(|t| format!("blk.{layer}.{t}.weight"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn shapes_follow_the_config() {
        let d = Dims::of(&json!({"hidden_size": 64, "intermediate_size": 160,
            "num_hidden_layers": 2, "vocab_size": 512, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16}));
        let e = |n: &str| d.expected(n).unwrap();
        assert_eq!(e("model.embed_tokens.weight"), [512, 64]);
        assert_eq!(e("model.layers.1.self_attn.q_proj.weight"), [64, 64]);
        assert_eq!(e("model.layers.1.self_attn.k_proj.bias"), [32]);
        assert_eq!(e("model.layers.0.self_attn.o_proj.weight"), [64, 64]);
        assert_eq!(e("model.layers.0.mlp.down_proj.weight"), [64, 160]);
        assert_eq!(e("model.layers.0.pre_feedforward_layernorm.weight"), [64]);
        assert_eq!(e("model.layers.0.self_attn.k_norm.weight"), [16]);
        assert_eq!(d.expected("model.layers.0.mlp.experts.weight"), None);
    }
}
