//! GRPO's rows: the prompts of the run's training files (`rtune_data::load_prompts`: text,
//! conversational or `prompt_ids`, the other columns kept for the rewards), what loading them
//! left out (the reports' [`OwnRows`]), and the tokens that end a completion.

use std::path::PathBuf;

use rtune_config::RunConfig;
use rtune_data::cache::RowCounts;
use rtune_data::{ChatTemplate, Example, OnBadRow, Prompt, PromptOptions, PromptSet, Tokenizer};

use crate::dataset::OwnRows;
use crate::TrainError;

/// What loading the prompts read and left out, per file.
pub struct PromptFiles {
    /// Per file: its path, counts (prompts moved out) and prompts kept.
    files: Vec<(PathBuf, PromptSet, usize)>,
    prompts: usize,
}

/// The prompts of every `[data] train` file, in order (a prompt of `max_seq_len −
/// max_completion_length` tokens or more is dropped, counted: no room to sample).
pub fn load(
    cfg: &RunConfig,
    max_completion_length: usize,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    vocab: usize,
) -> Result<(Vec<Prompt>, PromptFiles), TrainError> {
    let d = &cfg.data;
    let opts = PromptOptions {
        max_prompt_len: d.max_seq_len.saturating_sub(max_completion_length),
        max_row_bytes: d.max_row_bytes,
        on_bad_row: match d.skip_bad_rows {
            true => OnBadRow::Skip,
            false => OnBadRow::Error,
        },
        vocab,
    };
    let (mut prompts, mut files) = (Vec::new(), Vec::new());
    for f in &d.train {
        let mut set = rtune_data::load_prompts(&f.path, tok, template, &opts)?;
        let kept = set.prompts.len();
        prompts.append(&mut set.prompts);
        files.push((f.path.clone(), set, kept));
    }
    let n = prompts.len();
    Ok((prompts, PromptFiles { files, prompts: n }))
}

/// Each prompt as a row of the estimate (`RunData::train`): its tokens, no target.
pub fn as_examples(prompts: &[Prompt]) -> Vec<Example> {
    prompts
        .iter()
        .map(|p| Example {
            input_ids: p.ids.clone(),
            labels: vec![rtune_data::IGNORE; p.ids.len()],
        })
        .collect()
}

/// The tokens that end a completion: the model's `eos_token_id`s and the tokenizer's EOS.
pub fn stop_tokens(cfg: &RunConfig, tok: Option<&Tokenizer>) -> Result<Vec<u32>, TrainError> {
    let path = cfg.model.path.join("config.json");
    let mc = rtune_model::HfConfig::from_file(&path)?.into_config(&path)?;
    let mut stop = mc.eos_token_ids;
    stop.extend(tok.and_then(|t| t.eos_id));
    stop.sort_unstable();
    stop.dedup();
    Ok(stop)
}

impl OwnRows for PromptFiles {
    fn counts(&self) -> RowCounts {
        let mut c = RowCounts::default();
        for (_, s, _) in &self.files {
            c.add(&RowCounts {
                rows: s.rows,
                truncated: 0,
                dropped: s.too_long,
                skipped: s.bad_rows,
                oversized: s.oversized,
            });
        }
        c
    }

    fn warnings(&self) -> Vec<String> {
        (self.files.iter())
            .filter(|(_, s, _)| s.too_long > 0)
            .map(|(p, s, _)| {
                format!(
                    "{}: {} prompts left no room for a completion (max_seq_len − \
                     max_completion_length tokens or more) and were dropped",
                    p.display(),
                    s.too_long
                )
            })
            .collect()
    }

    fn file_lines(&self) -> Vec<String> {
        (self.files.iter())
            .map(|(p, s, kept)| {
                format!(
                    "{}: {} rows, {} prompts, {} too long, {} malformed (skipped)",
                    p.display(),
                    s.rows,
                    kept,
                    s.too_long,
                    s.bad_rows
                )
            })
            .collect()
    }

    fn prepare_lines(&self) -> Vec<String> {
        self.file_lines()
    }

    fn sequences(&self) -> String {
        format!("prompts of {} training rows", self.prompts)
    }

    fn rows(&self) -> String {
        format!(
            "{} prompts (completions sampled during training)",
            self.prompts
        )
    }
}
