//! PEFT's adapter format: `adapter_model.safetensors` + `adapter_config.json`, and every name
//! PEFT gives a tensor (`base_model.model.<module>.lora_A.weight`): the rest of rtune asks these
//! functions for a key and never formats one itself.

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

use rtune_fsio::{read_bounded, write_atomic, FileKind, Privacy};

use crate::{cerr, Adapter, LoraError, LoraPair, LoraSpec, ModuleShape, Result, TokenRows};

pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
const WEIGHTS: &str = ADAPTER_WEIGHTS;
const CONFIG: &str = ADAPTER_CONFIG;
const PREFIX: &str = "base_model.model.";

/// `base_model.model.<module>.lora_A.weight`: PEFT's key of a module's A `(r, in)` in
/// `adapter_model.safetensors`; `module` is the checkpoint name (`model.layers.0.self_attn.q_proj`).
pub fn lora_a_key(module: &str) -> String {
    format!("{PREFIX}{module}.lora_A.weight")
}

/// `base_model.model.<module>.lora_B.weight`: PEFT's key of a module's B `(out, r)`.
pub fn lora_b_key(module: &str) -> String {
    format!("{PREFIX}{module}.lora_B.weight")
}

/// `base_model.model.<module>.lora_magnitude_vector`: PEFT's key of a DoRA magnitude `(out,)` —
/// no `.weight` suffix, as PEFT saves it.
pub fn magnitude_key(module: &str) -> String {
    format!("{PREFIX}{module}.lora_magnitude_vector")
}

/// PEFT's key of the trainable token rows `(n, hidden)` (LoRA's `trainable_token_indices` on the
/// input embedding): the rows themselves, named `…delta` by PEFT. A tied lm_head has no key of its
/// own (PEFT's tied wrapper saves nothing; it shares these rows).
pub const TOKENS_KEY: &str =
    "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta";

/// `exp_avg.<key>`: AdamW's first moment of the adapter tensor `key` ([`lora_a_key`] or
/// [`lora_b_key`]) in a checkpoint's optimizer file — torch's state name on PEFT's key.
pub fn exp_avg_key(key: &str) -> String {
    format!("exp_avg.{key}")
}

/// `exp_avg_sq.<key>`: AdamW's second moment of the adapter tensor `key`.
pub fn exp_avg_sq_key(key: &str) -> String {
    format!("exp_avg_sq.{key}")
}

/// The keys of adapter_config.json that rtune reads and writes (PEFT ignores none of them).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeftAdapterConfig {
    pub peft_type: String,
    #[serde(default)]
    pub task_type: Option<String>,
    pub r: usize,
    pub lora_alpha: f64,
    #[serde(default)]
    pub lora_dropout: f64,
    #[serde(default)]
    pub target_modules: serde_json::Value,
    #[serde(default = "none_str")]
    pub bias: String,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub use_dora: bool,
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(default)]
    pub inference_mode: bool,
    #[serde(default = "yes")]
    pub init_lora_weights: bool,
    #[serde(default)]
    pub modules_to_save: Option<serde_json::Value>,
    #[serde(default)]
    pub rank_pattern: HashMap<String, serde_json::Value>,
    #[serde(default)]
    pub alpha_pattern: HashMap<String, serde_json::Value>,
    /// PEFT's `trainable_token_indices`: a list of ids (the input embedding's), or
    /// `{"embed_tokens": [ids]}`; `null` when no token rows train.
    #[serde(default)]
    pub trainable_token_indices: Option<serde_json::Value>,
    /// PEFT's `target_parameters`: the expert stacks adapted (`null` or absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_parameters: Option<Vec<String>>,
}

impl PeftAdapterConfig {
    /// The trainable token ids (`trainable_token_indices`), `None` when unset; `path` labels
    /// errors (another layer than the input embedding, or not a list of ids).
    pub fn token_ids(&self, path: &Path) -> Result<Option<Vec<u32>>> {
        let v = match &self.trainable_token_indices {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::Object(m)) => match (m.len(), m.get("embed_tokens")) {
                (1, Some(v)) => v,
                _ => {
                    return Err(file_err(
                        path,
                        "trainable_token_indices names layers other than embed_tokens; rtune \
                         trains the input embedding's rows only",
                    ))
                }
            },
            Some(v) => v,
        };
        serde_json::from_value::<Vec<u32>>(v.clone())
            .map(Some)
            .map_err(|e| file_err(path, format!("trainable_token_indices: {e}")))
    }
}

fn none_str() -> String {
    "none".into()
}
fn yes() -> bool {
    true
}

/// The largest adapter_model.safetensors an adapter of rank `spec.r` on `modules` can be: every
/// A and B in f32, a DoRA magnitude per output, and 1 GiB for trainable token rows and the header.
fn weights_kind(spec: &LoraSpec, modules: &[ModuleShape]) -> FileKind {
    let r = spec.r as u64;
    let floats: u64 = modules
        .iter()
        .map(|m| {
            let (i, o) = (m.in_features as u64, m.out_features as u64);
            r.saturating_mul(i.saturating_add(o)).saturating_add(o)
        })
        .fold(0u64, u64::saturating_add);
    FileKind::Sized {
        cap: floats.saturating_mul(4).saturating_add(1 << 30),
        name: "LoRA adapter",
    }
}

fn file_err(path: &Path, message: impl Into<String>) -> LoraError {
    LoraError::File {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Reads and checks `dir/adapter_config.json` for what rtune supports.
pub fn read_adapter_config(dir: &Path) -> Result<PeftAdapterConfig> {
    let path = dir.join(CONFIG);
    let text = read_bounded(&path, FileKind::ModelConfig)
        .map_err(|e| file_err(&path, format!("cannot read: {e}")))?;
    parse_adapter_config(&text, &path)
}

/// [`read_adapter_config`] on bytes already read; `path` labels errors.
pub fn parse_adapter_config(text: &[u8], path: &Path) -> Result<PeftAdapterConfig> {
    let path = path.to_path_buf();
    let cfg: PeftAdapterConfig = serde_json::from_slice(text)
        .map_err(|e| file_err(&path, format!("not a PEFT adapter config: {e}")))?;
    if cfg.peft_type != "LORA" {
        return Err(file_err(
            &path,
            format!(
                "peft_type is `{}`; rtune continues only LORA adapters",
                cfg.peft_type
            ),
        ));
    }
    if cfg.fan_in_fan_out {
        return Err(file_err(
            &path,
            "fan_in_fan_out = true (GPT-2 style Conv1D) is not supported",
        ));
    }
    if cfg.bias != "none" {
        return Err(file_err(
            &path,
            format!("bias = `{}`: only \"none\" is supported", cfg.bias),
        ));
    }
    if !cfg.rank_pattern.is_empty() || !cfg.alpha_pattern.is_empty() {
        return Err(file_err(
            &path,
            "rank_pattern / alpha_pattern (per-module ranks) are not supported",
        ));
    }
    if cfg.modules_to_save.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(file_err(
            &path,
            "modules_to_save is set: fully trained extra modules are not supported",
        ));
    }
    Ok(cfg)
}

impl Adapter {
    /// Loads a PEFT adapter directory for a model whose LoRA-able modules are `modules` (with the
    /// spec's targets already applied). Every tensor must match a module and have its shape.
    pub fn load_peft(
        dir: &Path,
        spec: &LoraSpec,
        modules: &[ModuleShape],
        device: &Device,
    ) -> Result<Self> {
        let cfg_path = dir.join(CONFIG);
        let config = read_bounded(&cfg_path, FileKind::ModelConfig)
            .map_err(|e| file_err(&cfg_path, format!("cannot read: {e}")))?;
        // The config first: a non-LoRA adapter is reported as such, not as a missing file.
        parse_adapter_config(&config, &cfg_path)?;
        let path = dir.join(WEIGHTS);
        if !path.exists() {
            return Err(file_err(
                &path,
                "missing (only safetensors adapters are read; convert .bin with PEFT)",
            ));
        }
        let weights = read_bounded(&path, weights_kind(spec, modules))
            .map_err(|e| file_err(&path, format!("cannot read: {e}")))?;
        Self::from_peft_bytes(&config, &weights, dir, spec, modules, device)
    }

    /// [`load_peft`](Self::load_peft) on the two files' bytes; `dir` labels errors.
    pub fn from_peft_bytes(
        config: &[u8],
        weights: &[u8],
        dir: &Path,
        spec: &LoraSpec,
        modules: &[ModuleShape],
        device: &Device,
    ) -> Result<Self> {
        let cfg_path = dir.join(CONFIG);
        let cfg = parse_adapter_config(config, &cfg_path)?;
        if cfg.r != spec.r {
            return Err(file_err(
                &cfg_path,
                format!(
                    "r = {} but the config asks for [lora] r = {}",
                    cfg.r, spec.r
                ),
            ));
        }
        if spec.dora && !cfg.use_dora {
            return Err(file_err(
                &cfg_path,
                "is a plain LoRA adapter (use_dora false, no lora_magnitude_vector): [lora] dora = true \
                 needs a DoRA adapter to continue from; set dora = false or drop init_from",
            ));
        }
        if cfg.use_dora && !spec.dora {
            return Err(file_err(
                &cfg_path,
                "is a DoRA adapter (use_dora true): set [lora] dora = true to continue it",
            ));
        }
        let path = dir.join(WEIGHTS);
        let mut tensors = candle_core::safetensors::load_buffer(weights, device)
            .map_err(|e| file_err(&path, format!("cannot read safetensors: {e}")))?;
        let mut names = Vec::new();
        let mut pairs = Vec::new();
        for m in modules {
            let mut take = |key: String, want: [usize; 2], hint: &str| -> Result<Tensor> {
                let t = tensors.remove(&key).ok_or_else(|| LoraError::Missing {
                    path: path.clone(),
                    key: key.clone(),
                })?;
                if t.dims() != want {
                    return Err(LoraError::Shape {
                        path: path.clone(),
                        key,
                        got: t.dims().to_vec(),
                        want: want.to_vec(),
                        hint: hint.to_string(),
                    });
                }
                t.to_dtype(DType::F32).map_err(cerr("adapter to f32"))
            };
            // An expert stack's pair: rank r per expert ([`ModuleShape::experts`]).
            let r = spec.r * m.experts;
            let a = take(lora_a_key(&m.name), [r, m.in_features], "[r, in_features]")?;
            let b = take(
                lora_b_key(&m.name),
                [m.out_features, r],
                "[out_features, r]",
            )?;
            let mag = if spec.dora {
                let key = magnitude_key(&m.name);
                let t = tensors.remove(&key).ok_or_else(|| LoraError::Missing {
                    path: path.clone(),
                    key: key.clone(),
                })?;
                if t.dims() != [m.out_features] {
                    return Err(LoraError::Shape {
                        path: path.clone(),
                        key,
                        got: t.dims().to_vec(),
                        want: vec![m.out_features],
                        hint: "[out_features]".into(),
                    });
                }
                Some(t.to_dtype(DType::F32).map_err(cerr("magnitude to f32"))?)
            } else {
                None
            };
            names.push(m.name.clone());
            pairs.push(LoraPair { a, b, m: mag });
        }
        let tokens = match cfg.token_ids(&cfg_path)? {
            None => None,
            Some(ids) => {
                let key = TOKENS_KEY.to_string();
                let t = tensors.remove(&key).ok_or_else(|| LoraError::Missing {
                    path: path.clone(),
                    key: key.clone(),
                })?;
                if t.rank() != 2 || t.dim(0).ok() != Some(ids.len()) {
                    return Err(LoraError::Shape {
                        path: path.clone(),
                        key,
                        got: t.dims().to_vec(),
                        want: vec![ids.len(), t.dims().last().copied().unwrap_or(0)],
                        hint: "[trainable tokens, hidden]".into(),
                    });
                }
                let rows = t.to_dtype(DType::F32).map_err(cerr("token rows to f32"))?;
                Some(TokenRows { ids, rows })
            }
        };
        if let Some(key) = tensors.keys().min() {
            return Err(LoraError::Unexpected {
                path,
                key: key.clone(),
            });
        }
        Ok(Self {
            spec: spec.clone(),
            names,
            pairs,
            tokens,
        })
    }

    /// `target_modules` as PEFT writes it: the spec's targets that name a module of this
    /// adapter (`all-linear` expands to every family's names; a Phi-3 adapter lists only
    /// `qkv_proj, o_proj, gate_up_proj, down_proj`), the spec's own when it has no module.
    fn target_modules(&self) -> Vec<&str> {
        let short = |n: &String| n.rsplit('.').next().unwrap_or_default().to_string();
        let present: Vec<String> = self.names.iter().map(short).collect();
        let hit: Vec<&str> = self
            .spec
            .targets
            .iter()
            .filter(|t| present.contains(t))
            .map(String::as_str)
            .collect();
        if hit.is_empty() {
            self.spec.targets.iter().map(String::as_str).collect()
        } else {
            hit
        }
    }

    /// Writes `adapter_model.safetensors` and `adapter_config.json` into `dir` (created if needed),
    /// each through a temporary file and a rename, so a reader never sees half a file.
    pub fn save_peft(
        &self,
        dir: &Path,
        base_model_name_or_path: &str,
        privacy: Privacy,
    ) -> Result<()> {
        privacy.create_dir_all(dir)?;
        let mut data: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
        for (key, t) in self.trainable() {
            {
                let v: Vec<f32> = t
                    .to_dtype(DType::F32)
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1())
                    .map_err(cerr("adapter to host"))?;
                let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                data.push((key, bytes, t.dims().to_vec()));
            }
        }
        let views: Vec<(String, safetensors::tensor::TensorView)> = data
            .iter()
            .map(|(k, bytes, shape)| {
                let view = safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape.clone(),
                    bytes,
                )
                .expect("shape and byte count agree by construction");
                (k.clone(), view)
            })
            .collect();
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let bytes = safetensors::serialize(views, Some(meta))
            .map_err(|e| file_err(&dir.join(WEIGHTS), format!("serialize: {e}")))?;
        write_atomic(&dir.join(WEIGHTS), &bytes, privacy)?;

        let cfg = PeftAdapterConfig {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            r: self.spec.r,
            lora_alpha: self.spec.alpha,
            lora_dropout: self.spec.dropout,
            target_modules: serde_json::json!(self.target_modules()),
            bias: "none".into(),
            use_rslora: self.spec.rslora,
            use_dora: self.spec.dora,
            fan_in_fan_out: false,
            base_model_name_or_path: Some(base_model_name_or_path.to_string()),
            inference_mode: true,
            init_lora_weights: true,
            modules_to_save: None,
            rank_pattern: HashMap::new(),
            alpha_pattern: HashMap::new(),
            trainable_token_indices: self.tokens.as_ref().map(|t| serde_json::json!(t.ids)),
            target_parameters: (!self.spec.target_parameters.is_empty())
                .then(|| self.spec.target_parameters.clone()),
        };
        let text = serde_json::to_string_pretty(&cfg).expect("config serialises");
        write_atomic(&dir.join(CONFIG), text.as_bytes(), privacy)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{max_abs_diff, one_q_proj};

    /// The keys PEFT writes to adapter_model.safetensors for a Llama module (the parity goldens in
    /// tests/integration/parity.rs read the same names from PEFT's own output).
    #[test]
    fn keys_are_peft_names() {
        let m = "model.layers.3.mlp.down_proj";
        assert_eq!(
            lora_a_key(m),
            "base_model.model.model.layers.3.mlp.down_proj.lora_A.weight"
        );
        assert_eq!(
            lora_b_key(m),
            "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
        );
        assert_eq!(
            exp_avg_sq_key(&lora_b_key(m)),
            "exp_avg_sq.base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"
        );
        assert_eq!(exp_avg_key("k"), "exp_avg.k");
    }

    #[test]
    fn save_then_load_round_trips() {
        let (spec, mods) = one_q_proj();
        let mut ad = Adapter::init(spec.clone(), &mods, 3, &Device::Cpu).unwrap();
        ad.pairs[0].b = Tensor::ones((5, 4), DType::F32, &Device::Cpu).unwrap();
        let dir = std::env::temp_dir().join(format!("rtune-lora-rt-{}", std::process::id()));
        ad.save_peft(&dir, "base", Privacy::PRIVATE).unwrap();
        let back = Adapter::load_peft(&dir, &spec, &mods, &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff(&back.pairs[0].a, &ad.pairs[0].a), 0.0);
        // A model with another shape is refused, naming the tensor.
        let other = vec![ModuleShape {
            name: mods[0].name.clone(),
            in_features: 7,
            out_features: 5,
            experts: 1,
        }];
        let e = Adapter::load_peft(&dir, &spec, &other, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("lora_A") && e.contains("[4, 6]"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Trainable token rows: saved under PEFT's key (the rows, `(n, hidden)`) with
    /// `trainable_token_indices` in the config, read back equal; PEFT's dict form naming the input
    /// embedding is read too, another layer refused; the rows without the config key are
    /// unexpected.
    #[test]
    fn token_rows_round_trip() {
        let (spec, mods) = one_q_proj();
        let mut ad = Adapter::init(spec.clone(), &mods, 3, &Device::Cpu).unwrap();
        let rows = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 6))
            .unwrap();
        ad.tokens = Some(TokenRows {
            ids: vec![9, 4],
            rows: rows.clone(),
        });
        assert_eq!(ad.num_params(), 4 * 6 + 5 * 4 + 12);
        let dir = std::env::temp_dir().join(format!("rtune-lora-tok-{}", std::process::id()));
        ad.save_peft(&dir, "base", Privacy::PRIVATE).unwrap();
        let st = candle_core::safetensors::load(dir.join(WEIGHTS), &Device::Cpu).unwrap();
        assert_eq!(
            st[TOKENS_KEY].to_vec2::<f32>().unwrap(),
            rows.to_vec2::<f32>().unwrap()
        );
        let text = std::fs::read_to_string(dir.join(CONFIG)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["trainable_token_indices"], serde_json::json!([9, 4]));
        let back = Adapter::load_peft(&dir, &spec, &mods, &Device::Cpu).unwrap();
        let t = back.tokens.expect("token rows");
        assert_eq!(t.ids, vec![9, 4]);
        assert_eq!(
            t.rows.to_vec2::<f32>().unwrap(),
            rows.to_vec2::<f32>().unwrap()
        );
        let with = |tti: serde_json::Value| {
            let mut v = v.clone();
            v["trainable_token_indices"] = tti;
            std::fs::write(dir.join(CONFIG), v.to_string()).unwrap();
            Adapter::load_peft(&dir, &spec, &mods, &Device::Cpu)
        };
        let t = with(serde_json::json!({"embed_tokens": [9, 4]}))
            .unwrap()
            .tokens;
        assert_eq!(t.unwrap().ids, vec![9, 4]);
        let e = with(serde_json::json!({"lm_head": [9, 4]})).unwrap_err();
        assert!(e.to_string().contains("embed_tokens"), "{e}");
        let e = with(serde_json::json!([9])).unwrap_err();
        assert!(e.to_string().contains("[2, 6]"), "{e}");
        let e = with(serde_json::Value::Null).unwrap_err();
        assert!(e.to_string().contains(TOKENS_KEY), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A DoRA adapter: the magnitude saved under PEFT's key (no `.weight`), `use_dora: true`, read
    /// back equal; a plain adapter refused for a DoRA spec and the other way round.
    #[test]
    fn dora_magnitudes_round_trip() {
        let (plain, mods) = one_q_proj();
        let spec = plain.clone().with_dora(true);
        let mut ad = Adapter::init(spec.clone(), &mods, 3, &Device::Cpu).unwrap();
        let m = Tensor::new(&[1.0f32, 2.0, 3.0, 4.0, 5.0], &Device::Cpu).unwrap();
        ad.pairs[0].m = Some(m.clone());
        assert_eq!(ad.trainable().len(), 3);
        assert_eq!(ad.num_params(), 4 * 6 + 5 * 4 + 5);
        let dir = std::env::temp_dir().join(format!("rtune-lora-dora-{}", std::process::id()));
        ad.save_peft(&dir, "base", Privacy::PRIVATE).unwrap();
        let st = candle_core::safetensors::load(dir.join(WEIGHTS), &Device::Cpu).unwrap();
        let key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector";
        assert!(st.contains_key(key), "{:?}", st.keys());
        let cfg = read_adapter_config(&dir).unwrap();
        assert!(cfg.use_dora);
        let back = Adapter::load_peft(&dir, &spec, &mods, &Device::Cpu).unwrap();
        let got: Vec<f32> = back.pairs[0].m.as_ref().unwrap().to_vec1().unwrap();
        assert_eq!(got, m.to_vec1::<f32>().unwrap());
        let e = Adapter::load_peft(&dir, &plain, &mods, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("dora = true"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        let pdir = std::env::temp_dir().join(format!("rtune-lora-plain-{}", std::process::id()));
        Adapter::init(plain, &mods, 3, &Device::Cpu)
            .unwrap()
            .save_peft(&pdir, "base", Privacy::PRIVATE)
            .unwrap();
        let e = Adapter::load_peft(&pdir, &spec, &mods, &Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("use_dora false"), "{e}");
        std::fs::remove_dir_all(&pdir).unwrap();
    }
}
