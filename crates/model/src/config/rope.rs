//! The RoPE keys of `config.json`: the base (`rope_theta`), the scaling rule, the rotary part of a
//! head (`partial_rotary_factor`), and Gemma 3's local base. Read from `rope_parameters`
//! (transformers 5: flat, or per layer type) or `rope_theta` + `rope_scaling` (transformers 4),
//! as transformers' `standardize_rope_params` merges them.

use serde_json::Value;

use super::family::RopeRules;
use super::values::{number, positive, string, table};
use super::{HfConfig, RopeScaling, Yarn};

/// What the RoPE keys give: the global layers' base and scaling, the local (sliding) layers' own
/// where a family gives them one (Gemma 3), and the rotated width of a head when it is not all of
/// it (Phi-4-mini's `partial_rotary_factor`).
pub(super) struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
    pub local: Option<(f64, RopeScaling)>,
    pub rotary_dim: Option<usize>,
}

/// Reads the RoPE keys of `c` (by the family's `rules`, heads of `head_dim`). A key of the wrong
/// type (`rope_theta: "1"`, `rope_parameters: [..]`) is an error naming it, never a default;
/// every base and factor is a number above 0 ([`positive`]).
pub(super) fn rope(c: &HfConfig, rules: &RopeRules, head_dim: usize) -> Result<Rope, String> {
    let default_theta = rules.default_theta;
    let parameters = match &c.rope_parameters {
        Some(v) => table(v, "rope_parameters")?,
        None => None,
    };
    let scaling = match &c.rope_scaling {
        Some(v) => table(v, "rope_scaling")?,
        None => None,
    };
    let per_type = parameters
        .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
    let rotary_dim = rotary_dim(c, parameters, rules, head_dim)?;
    let ctx = Ctx {
        c,
        rules,
        half: rotary_dim.unwrap_or(head_dim) / 2,
        per_type: per_type.is_some(),
    };
    if let Some(p) = per_type {
        let set = |k: &str, default: f64| -> Result<Option<(f64, RopeScaling)>, String> {
            let at = format!("rope_parameters.{k}");
            match p.get(k).map(|v| table(v, &at)).transpose()?.flatten() {
                Some(set) => ctx.params(Some((set, &at)), None, default).map(Some),
                None => Ok(None),
            }
        };
        let global = set("full_attention", default_theta)?;
        let global = global.unwrap_or((default_theta, RopeScaling::None));
        let local = set("sliding_attention", 10_000.0)?;
        return Ok(Rope {
            theta: global.0,
            scaling: global.1,
            local,
            rotary_dim,
        });
    }
    let params = match parameters {
        Some(p) => Some((p, "rope_parameters")),
        None => scaling.map(|p| (p, "rope_scaling")),
    };
    let (theta, scaling) = ctx.params(params, c.rope_theta, default_theta)?;
    let local = match (rules.local_theta, c.rope_local_base_freq) {
        (Some(_), Some(b)) => Some((positive("rope_local_base_freq", b)?, RopeScaling::None)),
        (Some(default), None) => Some((default, RopeScaling::None)),
        (None, _) => None,
    };
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
fn rotary_dim(
    c: &HfConfig,
    parameters: Option<&Value>,
    rules: &RopeRules,
    head_dim: usize,
) -> Result<Option<usize>, String> {
    let nested = match parameters {
        Some(p) => number(p, "rope_parameters", "partial_rotary_factor")?,
        None => None,
    };
    let factor = nested.or(c.partial_rotary_factor).unwrap_or(1.0);
    if factor == 1.0 {
        return Ok(None);
    }
    if !rules.partial {
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
    rules: &'a RopeRules,
    /// Frequencies of a head: half its rotated width (LongRoPE's factor lists have this length).
    half: usize,
    /// Whether the sets are per layer type (`rope_parameters.full_attention`, ...).
    per_type: bool,
}

impl Ctx<'_> {
    /// One set of RoPE parameters `p` (with the key it is under, for errors): `rope_theta` from
    /// `p` (v5), else `theta` (v4's top-level key), else `default_theta`; the scaling rule from
    /// `p`'s `rope_type` (or `type`).
    fn params(
        &self,
        p: Option<(&Value, &str)>,
        theta: Option<f64>,
        default_theta: f64,
    ) -> Result<(f64, RopeScaling), String> {
        let nested = match p {
            Some((p, at)) => number(p, at, "rope_theta")?.map(|t| (t, format!("{at}.rope_theta"))),
            None => None,
        };
        let theta = match (nested, theta) {
            (Some((t, key)), _) => positive(&key, t)?,
            (None, Some(t)) => positive("rope_theta", t)?,
            (None, None) => default_theta,
        };
        let Some((p, at)) = p else {
            return Ok((theta, RopeScaling::None));
        };
        let kind = match string(p, at, "rope_type")? {
            Some(k) => k,
            None => string(p, at, "type")?.unwrap_or("default"),
        };
        let num = |k: &str| -> Result<f64, String> {
            let v = number(p, at, k)?
                .ok_or_else(|| format!("{at}: rope scaling `{kind}` needs a number `{k}`"))?;
            positive(&format!("{at}.{k}"), v)
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
            "longrope" | "su" => self.longrope(p, at, kind)?,
            "yarn" if self.rules.longrope => self.longrope(p, at, kind)?,
            "yarn" => self.yarn(p, at)?,
            other => {
                return Err(format!(
                    "rope scaling type `{other}` is not supported (default, linear, llama3, yarn, \
                     and longrope for Phi3ForCausalLM are)"
                ))
            }
        };
        Ok((theta, scaling))
    }

    /// YaRN's keys as transformers' `standardize_rope_params` and `_compute_yarn_parameters` read
    /// them: the pre-training length from the top-level `original_max_position_embeddings` (a flat
    /// set only), else the set's, else `max_position_embeddings`; `factor` (null: the ratio of
    /// the two lengths); `truncate` from a flat set only (transformers reads it from the outer
    /// `rope_parameters`, which per layer type never has it: true). The frequencies are the op's
    /// ([`rtune_ops::rope::Freqs`]).
    fn yarn(&self, p: &Value, at: &str) -> Result<RopeScaling, String> {
        let c = self.c;
        let top = c
            .original_max_position_embeddings
            .filter(|_| !self.per_type);
        let original = match top {
            Some(o) => o as f64,
            None => match number(p, at, "original_max_position_embeddings")? {
                Some(o) => o,
                None => c.max_position_embeddings.ok_or(
                    "rope scaling `yarn` needs original_max_position_embeddings (or \
                     max_position_embeddings)",
                )? as f64,
            },
        };
        let original = positive(&format!("{at}.original_max_position_embeddings"), original)?;
        let factor = match number(p, at, "factor")? {
            Some(f) => f,
            None => c.max_position_embeddings.map_or(1.0, |m| m as f64) / original,
        };
        let factor = positive(&format!("{at}.factor"), factor)?;
        let opt = |k: &str| number(p, at, k);
        let truncate = match p.get("truncate") {
            _ if self.per_type => true,
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(format!(
                    "{at}.truncate = {}: not a boolean",
                    super::values::shown(v)
                ))
            }
        };
        let attention_factor = opt("attention_factor")?
            .map(|a| positive(&format!("{at}.attention_factor"), a))
            .transpose()?;
        Ok(RopeScaling::Yarn(Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast: opt("beta_fast")?,
            beta_slow: opt("beta_slow")?,
            mscale: opt("mscale")?,
            mscale_all_dim: opt("mscale_all_dim")?,
            attention_factor,
            truncate,
        }))
    }

    /// transformers' `_compute_longrope_parameters`: the factor lists, the pre-training length
    /// (Phi3Config's top-level `original_max_position_embeddings` first, default 4096; else the
    /// set's own; else `max_position_embeddings`), and the attention factor (given, or
    /// `√(1 + ln s / ln original)` with `s = factor` or `max_position_embeddings / original`).
    /// Every factor is above 0: one of 0 makes its frequency infinite, cos and sin NaN.
    fn longrope(&self, p: &Value, at: &str, kind: &str) -> Result<RopeScaling, String> {
        let list = |k: &str| -> Result<Vec<f64>, String> {
            let v: Option<Vec<f64>> = p
                .get(k)
                .and_then(|v| v.as_array())
                .and_then(|a| a.iter().map(|x| x.as_f64()).collect());
            match v {
                Some(v) if v.len() == self.half => {
                    for (i, x) in v.iter().enumerate() {
                        positive(&format!("{at}.{k}[{i}]"), *x)?;
                    }
                    Ok(v)
                }
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
        let top = match self.rules.longrope {
            true => Some(c.original_max_position_embeddings.unwrap_or(4096)),
            false => c.original_max_position_embeddings,
        };
        let nested = number(p, at, "original_max_position_embeddings")?;
        let original = top
            .map(|o| o as f64)
            .or(nested)
            .or(c.max_position_embeddings.map(|m| m as f64))
            .filter(|o| *o >= 1.0)
            .ok_or_else(|| {
                format!("rope scaling `{kind}` needs original_max_position_embeddings")
            })?;
        let factor = match number(p, at, "factor")? {
            Some(f) => positive(&format!("{at}.factor"), f)?,
            None => c.max_position_embeddings.map_or(1.0, |m| m as f64) / original,
        };
        let attention_factor = match number(p, at, "attention_factor")? {
            Some(a) => positive(&format!("{at}.attention_factor"), a)?,
            None if factor <= 1.0 => 1.0,
            // ln 1 = 0: an original length of 1 with a factor above 1 divides by zero.
            None => positive(
                &format!(
                    "{at}.attention_factor (from factor {factor} and original length {original})"
                ),
                (1.0 + factor.ln() / original.ln()).sqrt(),
            )?,
        };
        Ok(RopeScaling::LongRope {
            short_factor: list("short_factor")?,
            long_factor: list("long_factor")?,
            original_max_position_embeddings: original as usize,
            attention_factor,
        })
    }
}
