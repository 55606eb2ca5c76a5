//! The RoPE keys of `config.json`: the base (`rope_theta`), the scaling rule, the rotary part of a
//! head (`partial_rotary_factor`), and Gemma 3's local base. Read from `rope_parameters`
//! (transformers 5: flat, or per layer type) or `rope_theta` + `rope_scaling` (transformers 4),
//! as transformers' `standardize_rope_params` merges them.

use super::{Arch, HfConfig, RopeScaling};

/// What the RoPE keys give: the global layers' base and scaling, the local (sliding) layers' own
/// where a family gives them one (Gemma 3), and the rotated width of a head when it is not all of
/// it (Phi-4-mini's `partial_rotary_factor`).
pub(super) struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
    pub local: Option<(f64, RopeScaling)>,
    pub rotary_dim: Option<usize>,
}

/// Reads the RoPE keys of `c` (architecture `arch`, heads of `head_dim`).
pub(super) fn rope(c: &HfConfig, arch: Arch, head_dim: usize) -> Result<Rope, String> {
    // Gemma 3's default global base is 1e6; the others' 1e4.
    let default_theta = if arch == Arch::Gemma3 { 1e6 } else { 10_000.0 };
    let per_type = c
        .rope_parameters
        .as_ref()
        .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
    let rotary_dim = rotary_dim(c, arch, head_dim)?;
    let ctx = Ctx {
        c,
        arch,
        half: rotary_dim.unwrap_or(head_dim) / 2,
    };
    if let Some(p) = per_type {
        let global = match p.get("full_attention") {
            Some(g) => ctx.params(Some(g), None, default_theta)?,
            None => (default_theta, RopeScaling::None),
        };
        let local = p
            .get("sliding_attention")
            .map(|l| ctx.params(Some(l), None, 10_000.0))
            .transpose()?;
        return Ok(Rope {
            theta: global.0,
            scaling: global.1,
            local,
            rotary_dim,
        });
    }
    let params = c
        .rope_parameters
        .as_ref()
        .filter(|v| !v.is_null())
        .or(c.rope_scaling.as_ref().filter(|v| !v.is_null()));
    let (theta, scaling) = ctx.params(params, c.rope_theta, default_theta)?;
    let local = (arch == Arch::Gemma3).then(|| {
        (
            c.rope_local_base_freq.unwrap_or(10_000.0),
            RopeScaling::None,
        )
    });
    Ok(Rope {
        theta,
        scaling,
        local,
        rotary_dim,
    })
}

/// `int(head_dim · partial_rotary_factor)` when the factor (in `rope_parameters`, or at the top
/// level in transformers 4's layout) is not 1; Phi-3's attention is the only one rtune runs that
/// rotates part of a head (transformers' other families here rotate the whole head).
fn rotary_dim(c: &HfConfig, arch: Arch, head_dim: usize) -> Result<Option<usize>, String> {
    let factor = c
        .rope_parameters
        .as_ref()
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(|v| v.as_f64())
        .or(c.partial_rotary_factor)
        .unwrap_or(1.0);
    if factor == 1.0 {
        return Ok(None);
    }
    if arch != Arch::Phi3 {
        return Err(format!(
            "partial_rotary_factor = {factor}: only Phi3ForCausalLM rotates part of a head"
        ));
    }
    // Python's int(): toward zero.
    let dim = (head_dim as f64 * factor) as usize;
    if !(factor > 0.0 && factor < 1.0) || dim < 2 || !dim.is_multiple_of(2) {
        return Err(format!(
            "partial_rotary_factor = {factor} rotates {dim} of head_dim {head_dim}; it must be in \
             (0, 1] and rotate an even number (≥ 2) of dimensions"
        ));
    }
    Ok(Some(dim))
}

/// What reading one set of parameters needs besides the set itself.
struct Ctx<'a> {
    c: &'a HfConfig,
    arch: Arch,
    /// Frequencies of a head: half its rotated width (LongRoPE's factor lists have this length).
    half: usize,
}

impl Ctx<'_> {
    /// One set of RoPE parameters: `rope_theta` from `p` (v5), else `theta` (v4's top-level
    /// key), else `default_theta`; the scaling rule from `p`'s `rope_type` (or `type`).
    fn params(
        &self,
        p: Option<&serde_json::Value>,
        theta: Option<f64>,
        default_theta: f64,
    ) -> Result<(f64, RopeScaling), String> {
        let theta = p
            .and_then(|p| p.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .or(theta)
            .unwrap_or(default_theta);
        let Some(p) = p else {
            return Ok((theta, RopeScaling::None));
        };
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let num = |k: &str| -> Result<f64, String> {
            p.get(k)
                .and_then(|v| v.as_f64())
                .ok_or_else(|| format!("rope scaling `{kind}` needs a number `{k}`"))
        };
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: num("factor")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            },
            // Phi3Config reads the older names `su` and `yarn` as `longrope`.
            "longrope" | "su" => self.longrope(p, kind)?,
            "yarn" if self.arch == Arch::Phi3 => self.longrope(p, kind)?,
            other => {
                return Err(format!(
                    "rope scaling type `{other}` is not supported (default, linear, llama3, and \
                     longrope for Phi3ForCausalLM are)"
                ))
            }
        };
        Ok((theta, scaling))
    }

    /// transformers' `_compute_longrope_parameters`: the factor lists, the pre-training length
    /// (Phi3Config's top-level `original_max_position_embeddings` first, default 4096; else the
    /// set's own; else `max_position_embeddings`), and the attention factor (given, or
    /// `√(1 + ln s / ln original)` with `s = factor` or `max_position_embeddings / original`).
    fn longrope(&self, p: &serde_json::Value, kind: &str) -> Result<RopeScaling, String> {
        let list = |k: &str| -> Result<Vec<f64>, String> {
            let v: Option<Vec<f64>> = p
                .get(k)
                .and_then(|v| v.as_array())
                .and_then(|a| a.iter().map(|x| x.as_f64()).collect());
            match v {
                Some(v) if v.len() == self.half => Ok(v),
                Some(v) => Err(format!(
                    "rope scaling `{kind}`: `{k}` has {} numbers; a head rotates {} dimensions, so \
                     it needs {}",
                    v.len(),
                    2 * self.half,
                    self.half
                )),
                None => Err(format!(
                    "rope scaling `{kind}` needs a list of numbers `{k}`"
                )),
            }
        };
        let c = self.c;
        let top = match self.arch {
            Arch::Phi3 => Some(c.original_max_position_embeddings.unwrap_or(4096)),
            _ => c.original_max_position_embeddings,
        };
        let original = top
            .map(|o| o as f64)
            .or_else(|| {
                p.get("original_max_position_embeddings")
                    .and_then(|v| v.as_f64())
            })
            .or(c.max_position_embeddings.map(|m| m as f64))
            .filter(|o| *o >= 1.0)
            .ok_or_else(|| {
                format!("rope scaling `{kind}` needs original_max_position_embeddings")
            })?;
        let factor = match p.get("factor").and_then(|v| v.as_f64()) {
            Some(f) => f,
            None => c.max_position_embeddings.map_or(1.0, |m| m as f64) / original,
        };
        let attention_factor = match p.get("attention_factor").and_then(|v| v.as_f64()) {
            Some(a) => a,
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / original.ln()).sqrt(),
        };
        Ok(RopeScaling::LongRope {
            short_factor: list("short_factor")?,
            long_factor: list("long_factor")?,
            original_max_position_embeddings: original as usize,
            attention_factor,
        })
    }
}
