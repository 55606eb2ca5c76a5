//! A preference run's data (`[train] objective` other than `sft`): the pairs of every `[data]
//! train` file (weighted as SFT files are), the validation pairs (`[data] valid` or
//! `valid_fraction`), and the reference policy's log-probabilities of each pair, computed once
//! before training.

use rtune_config::RunConfig;
use rtune_data::preference::{assign_kl_completions, load_pairs};
use rtune_data::{ChatTemplate, Example, Pair, PairBatch, PairSet, Tokenizer, IGNORE};
use rtune_model::{Inputs, LoraCtx, Model};

use crate::TrainError;

/// The pairs of a preference run, and what loading them cut or left out.
pub struct PairData {
    pub train: Vec<Pair>,
    pub valid: Vec<Pair>,
    /// Per file: its path and counts (rows read, truncated, dropped, identical; `pairs` emptied:
    /// they are in `train` and `valid`).
    pub files: Vec<(std::path::PathBuf, PairSet)>,
}

impl PairData {
    /// Warnings before a run: pairs cut or dropped at `max_seq_len`, pairs whose chosen and
    /// rejected completions are identical (no preference signal).
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        for (path, s) in &self.files {
            if s.truncated + s.dropped > 0 {
                w.push(format!(
                    "{}: {} of {} pairs had completions cut ({}) or were dropped ({}: the prompt \
                     fills max_seq_len, or a completion is empty) at [data] max_seq_len",
                    path.display(),
                    s.truncated + s.dropped,
                    s.rows,
                    s.truncated,
                    s.dropped
                ));
            }
            if s.identical > 0 {
                w.push(format!(
                    "{}: {} of {} pairs have identical chosen and rejected completions (kept; \
                     they carry no preference)",
                    path.display(),
                    s.identical,
                    s.rows
                ));
            }
        }
        w
    }

    /// Each pair as its two sequences (prompt + chosen, prompt + rejected), loss on the
    /// completions: the shape the memory estimate and `rtune check` look at.
    pub fn as_examples(pairs: &[Pair]) -> Vec<Example> {
        let seq = |p: &Pair, c: &[u32]| Example {
            input_ids: [p.prompt.as_slice(), c].concat(),
            labels: p
                .prompt
                .iter()
                .map(|_| IGNORE)
                .chain(c.iter().map(|&i| i as i64))
                .collect(),
        };
        pairs
            .iter()
            .flat_map(|p| [seq(p, &p.chosen), seq(p, &p.rejected)])
            .collect()
    }
}

/// Loads the run's pairs: each train file's (weighted: whole copies, then a seeded sample of the
/// fraction), the held-out share (`valid_fraction`, seeded per file) or the `valid` file.
/// Conversational rows are rendered with `template` (the run's, `chat_template_kwargs` set).
pub fn load(
    cfg: &RunConfig,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    vocab: usize,
) -> Result<PairData, TrainError> {
    let d = &cfg.data;
    let (mut train, mut valid, mut files) = (Vec::new(), Vec::new(), Vec::new());
    for (i, f) in d.train.iter().enumerate() {
        let mut set = load_pairs(&f.path, tok, template, d.max_seq_len, vocab)?;
        check_kind(cfg, &f.path, &set)?;
        let seed = crate::sample::file_seed(cfg.train.seed, i);
        let rows = std::mem::take(&mut set.pairs);
        let (mut pairs, mut held) = crate::sample::hold_out(rows, d.valid_fraction, seed);
        if cfg.train.objective.is_unpaired() {
            let mbs = cfg.train.micro_batch_size;
            assign_kl_completions(&mut pairs, mbs, d.max_seq_len);
            assign_kl_completions(&mut held, mbs, d.max_seq_len);
        }
        valid.extend(held);
        train.extend(crate::sample::weighted(
            pairs,
            f.weight,
            seed.rotate_left(17),
        ));
        files.push((f.path.clone(), set));
    }
    if let Some(v) = &d.valid {
        let mut set = load_pairs(v, tok, template, d.max_seq_len, vocab)?;
        check_kind(cfg, v, &set)?;
        valid = std::mem::take(&mut set.pairs);
        if cfg.train.objective.is_unpaired() {
            assign_kl_completions(&mut valid, cfg.train.micro_batch_size, d.max_seq_len);
        }
        files.push((v.clone(), set));
    }
    if train.is_empty() {
        return Err(rtune_data::DataError::File {
            path: d.train[0].path.clone(),
            message: "no preference pair left for training (all dropped at max_seq_len, or the \
                      file is empty)"
                .into(),
        }
        .into());
    }
    Ok(PairData {
        train,
        valid,
        files,
    })
}

/// The reference log-probabilities of a run's pairs (train and validation), when its objective
/// needs them; the forward passes run.
pub fn reference(
    cfg: &RunConfig,
    model: &Model,
    adapter: &rtune_lora::Adapter,
    data: &mut PairData,
    pad_id: u32,
) -> Result<usize, TrainError> {
    if !cfg.train.objective.needs_reference() {
        return Ok(0);
    }
    // TRL: a new adapter's reference is the base with the adapter off; an adapter training
    // continues from (`init_from`) is copied as the frozen "ref" adapter. No dropout either way.
    let lc = LoraCtx {
        adapter,
        scaling: adapter.spec.scaling(),
        dropout: 0.0,
        seed: 0,
    };
    let lora = cfg.lora.init_from.as_ref().map(|_| &lc);
    let mbs = cfg.train.micro_batch_size;
    let mut passes = fill_reference(model, lora, &mut data.train, mbs, pad_id)?;
    passes += fill_reference(model, lora, &mut data.valid, mbs, pad_id)?;
    Ok(passes)
}

/// The file's rows are of the objective's kind: unpaired (`label`) rows for KTO, pairs otherwise.
fn check_kind(cfg: &RunConfig, path: &std::path::Path, set: &PairSet) -> Result<(), TrainError> {
    let unpaired = set.pairs.iter().filter(|p| p.label.is_some()).count();
    let kto = cfg.train.objective.is_unpaired();
    let message = match (kto, unpaired) {
        (true, n) if n < set.pairs.len() => format!(
            "objective \"kto\" takes unpaired rows ({{\"prompt\", \"completion\", \"label\"}}); {} \
             of its rows are preference pairs",
            set.pairs.len() - n
        ),
        (false, n) if n > 0 => format!(
            "objective \"{}\" takes preference pairs ({{\"prompt\", \"chosen\", \"rejected\"}}); {n} \
             of its rows are unpaired (`label`) rows, which objective \"kto\" takes",
            cfg.train.objective.name()
        ),
        _ => return Ok(()),
    };
    Err(rtune_data::DataError::File {
        path: path.to_path_buf(),
        message,
    }
    .into())
}

/// Fills in every pair's reference log-probabilities `(chosen, rejected)`: the model as training
/// starts, as TRL defines the reference policy: the base alone (`lora: None`) for a new adapter,
/// or the starting adapter (`[lora] init_from`) frozen. `micro_batch` pairs a forward pass, in
/// order; pairs that already have them are skipped. Returns the forward passes run.
pub fn fill_reference(
    model: &Model,
    lora: Option<&LoraCtx>,
    pairs: &mut [Pair],
    micro_batch: usize,
    pad_id: u32,
) -> Result<usize, TrainError> {
    let todo: Vec<usize> = (0..pairs.len())
        .filter(|&i| pairs[i].reference.is_none())
        .collect();
    let mut passes = 0;
    for chunk in todo.chunks(micro_batch.max(1)) {
        let refs: Vec<&Pair> = chunk.iter().map(|&i| &pairs[i]).collect();
        let pb = PairBatch::new(&refs, pad_id, false);
        let logps = pair_logps(model, lora, &pb)?;
        let b = chunk.len();
        for (k, &i) in chunk.iter().enumerate() {
            pairs[i].reference = Some([logps[k], logps[b + k]]);
        }
        passes += 1;
    }
    Ok(passes)
}

/// Every row's summed target log-probability of a pair batch, no gradient.
pub fn pair_logps(
    model: &Model,
    lora: Option<&LoraCtx>,
    pb: &PairBatch,
) -> Result<Vec<f64>, TrainError> {
    let mb = &pb.batch;
    let inputs = Inputs {
        ids: mb.input_ids.clone(),
        positions: mb.positions.clone(),
        b: mb.b,
        t: mb.t,
        segments: None,
    };
    let nll = model.token_nll(&inputs, &mb.targets, lora)?;
    Ok(pb.row_logps(&nll))
}
