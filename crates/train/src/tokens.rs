//! `[lora] trainable_tokens` (PEFT 0.21.2's `LoraConfig(trainable_token_indices=…)`) at set-up:
//! the tokens as written resolved to ids through the model's tokenizer, and the adapter's
//! trainable rows (fresh: a copy of the embedding's rows, PEFT's `init_weights=True`; or those of
//! the `init_from` adapter). The math is in `rtune_model::tokens`.
//!
//! A token given as text must be exactly one token: first as the vocabulary spells it (added
//! tokens such as `<|im_end|>`, byte-level pieces such as `Ġthe`), else as text that the tokenizer
//! encodes to one id. Unknown text, text that splits, an id outside the vocabulary, or two entries
//! naming one id are input errors naming the entry (exit 2, before anything is written).

use std::path::Path;

use rtune_config::{ConfigError, RunConfig, TokenName};
use rtune_data::Tokenizer;
use rtune_lora::{Adapter, TokenRows};
use rtune_model::Model;

use crate::TrainError;

const KEY: &str = "lora.trainable_tokens";

fn bad(path: &Path, message: String) -> TrainError {
    TrainError::Config(Box::new(ConfigError::Invalid {
        path: path.to_path_buf(),
        key: KEY.into(),
        message,
    }))
}

/// The ids of `cfg.lora.trainable_tokens`, in the order written (empty when the key is unset).
pub fn resolve(
    cfg: &RunConfig,
    tok: Option<&Tokenizer>,
    vocab: usize,
) -> Result<Vec<u32>, TrainError> {
    let path = &cfg.config_path;
    let mut ids: Vec<u32> = Vec::with_capacity(cfg.lora.trainable_tokens.len());
    for name in &cfg.lora.trainable_tokens {
        let id = match name {
            TokenName::Id(i) => *i,
            TokenName::Text(text) => {
                let tok = tok.ok_or_else(|| {
                    bad(
                        path,
                        format!(
                            "{name}: the model has no tokenizer.json to look it up in; give its id"
                        ),
                    )
                })?;
                match tok.token_to_id(text) {
                    Some(i) => i,
                    None => {
                        let enc = tok.encode(text, false)?;
                        match enc.as_slice() {
                            [i] => *i,
                            [] => {
                                return Err(bad(
                                    path,
                                    format!("{name} is not a token of the model's tokenizer"),
                                ))
                            }
                            many => {
                                return Err(bad(
                                    path,
                                    format!(
                                        "{name} is not one token: the tokenizer splits it into {} \
                                         ({many:?}); add it to the tokenizer first or name single tokens",
                                        many.len()
                                    ),
                                ))
                            }
                        }
                    }
                }
            }
        };
        if id as usize >= vocab {
            return Err(bad(
                path,
                format!("{name}: id {id} is outside the model's vocabulary (0..{vocab})"),
            ));
        }
        if let Some(k) = ids.iter().position(|&j| j == id) {
            return Err(bad(
                path,
                format!("{name} is token {id}, which entry {} already names", k + 1),
            ));
        }
        ids.push(id);
    }
    Ok(ids)
}

/// Gives `adapter` its trainable token rows for `ids`: those of an `init_from` adapter when it
/// has the same ids, else fresh copies of the embedding's rows. An `init_from` adapter that trains
/// other tokens, or any when the config names none, is refused.
pub fn attach(
    cfg: &RunConfig,
    model: &Model,
    adapter: &mut Adapter,
    ids: &[u32],
) -> Result<(), TrainError> {
    let path = &cfg.config_path;
    let hidden = model.cfg.hidden_size;
    match (&adapter.tokens, ids.is_empty()) {
        (None, true) => Ok(()),
        (Some(t), true) => Err(bad(
            path,
            format!(
                "is unset but the init_from adapter trains token rows {:?}; set [lora] \
                 trainable_tokens to those ids to continue it",
                t.ids
            ),
        )),
        (Some(t), false) if t.ids != ids => Err(bad(
            path,
            format!(
                "resolves to ids {ids:?} but the init_from adapter trains {:?}; they must be the \
                 same, in the same order",
                t.ids
            ),
        )),
        (Some(t), false) if t.rows.dims() != [ids.len(), hidden] => Err(bad(
            path,
            format!(
                "the init_from adapter's token rows are {:?}, this model needs [{}, {hidden}]",
                t.rows.dims(),
                ids.len()
            ),
        )),
        (Some(_), false) => Ok(()),
        (None, false) => {
            adapter.tokens = Some(TokenRows {
                ids: ids.to_vec(),
                rows: model.token_rows(ids)?,
            });
            Ok(())
        }
    }
}
