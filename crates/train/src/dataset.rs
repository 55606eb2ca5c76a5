//! The run's data: every `[data] train` file through the tokenized cache, weighted, with the
//! validation split, and a report of what was cut, dropped or skipped on the way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rtune_config::{DataConfig, RunConfig};
use rtune_data::cache::{self, RowCounts};
use rtune_data::{
    detect_format, ChatTemplate, DataError, DataOptions, Dataset, Example, Format, OnBadRow,
    RowParser, Tokenizer, TrainOn, Truncation,
};
use rtune_fsio::sha256_file;

use crate::sample::{check_weights, file_seed, hold_out, weighted};
use crate::TrainError;

/// One source file as loaded.
#[derive(Debug, Clone)]
pub struct FileReport {
    pub path: PathBuf,
    pub weight: f64,
    pub counts: RowCounts,
    /// Examples after filtering (before weighting and the validation split).
    pub examples: usize,
    pub tokens: usize,
    pub reused_cache: bool,
    /// Tokenisation speed (0 when read from the cache).
    pub tokens_per_s: f64,
    /// The first few malformed rows skipped, as `file:line: what is wrong` (not kept in the cache).
    pub bad_rows: Vec<String>,
}

impl FileReport {
    fn of(
        path: &Path,
        weight: f64,
        ex: &[Example],
        loaded: &cache::Loaded,
        bad_rows: Vec<String>,
    ) -> Self {
        FileReport {
            path: path.to_path_buf(),
            weight,
            counts: loaded.counts,
            examples: ex.len(),
            tokens: ex.iter().map(|e| e.input_ids.len()).sum(),
            reused_cache: loaded.reused,
            tokens_per_s: loaded.tokens_per_s,
            bad_rows,
        }
    }
}

pub struct RunData {
    /// The training examples; the sequences of an objective's own rows (a preference run's pairs
    /// as their two sequences each): what the memory estimate looks at.
    pub train: Vec<Example>,
    pub valid: Vec<Example>,
    pub files: Vec<FileReport>,
    /// The report of an objective's own rows, when they are not examples through the token cache
    /// (the rows themselves are its recipe's: `crate::objective`).
    pub own: Option<Box<dyn OwnRows>>,
}

/// What the reports need of an objective's own rows (a preference run's pairs).
pub trait OwnRows {
    /// Rows read, cut, left out, skipped, over `max_row_bytes`, over every file.
    fn counts(&self) -> RowCounts;
    /// Warnings before a long run.
    fn warnings(&self) -> Vec<String>;
    /// `rtune data inspect`: one line per file.
    fn file_lines(&self) -> Vec<String>;
    /// `rtune data prepare` (which checks these rows rather than caching them): one line per file.
    fn prepare_lines(&self) -> Vec<String>;
    /// What [`RunData::train`] holds, after its count ("sequences of 3 training pairs").
    fn sequences(&self) -> String;
    /// The rows themselves, with their count ("3 pairs as their chosen and rejected sequences").
    fn rows(&self) -> String;
}

impl RunData {
    pub fn counts(&self) -> RowCounts {
        let mut c = RowCounts::default();
        self.files.iter().for_each(|f| c.add(&f.counts));
        if let Some(own) = &self.own {
            c.add(&own.counts());
        }
        c
    }

    /// Warnings a user should see before a long run: more than 1% of rows cut or dropped at
    /// `max_seq_len`; any row over `max_row_bytes` (apart: its remedy is another setting).
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        for f in &self.files {
            let c = &f.counts;
            let affected = c.truncated + c.dropped;
            if c.rows > 0 && affected * 100 > c.rows {
                w.push(format!(
                    "{}: {} of {} rows ({:.1}%) were truncated ({}) or dropped ({}) at max_seq_len; \
                     raise [data] max_seq_len or check the data",
                    f.path.display(),
                    affected,
                    c.rows,
                    100.0 * affected as f64 / c.rows as f64,
                    c.truncated,
                    c.dropped
                ));
            }
            if c.oversized > 0 {
                w.push(format!(
                    "{}: {} of {} rows were longer than [data] max_row_bytes and dropped unread; \
                     raise max_row_bytes if they are wanted",
                    f.path.display(),
                    c.oversized,
                    c.rows
                ));
            }
            if c.skipped > 0 {
                w.push(format!(
                    "{}: {} malformed row(s) skipped (on_bad_row = \"skip\"){}",
                    f.path.display(),
                    c.skipped,
                    f.bad_rows
                        .iter()
                        .map(|b| format!("\n  {b}"))
                        .collect::<String>()
                ));
            }
        }
        if let Some(own) = &self.own {
            w.extend(own.warnings());
        }
        w
    }
}

/// The settings that determine the tokens of a file, for the cache key.
fn cache_inputs(
    d: &DataConfig,
    opts: &DataOptions,
    model_dir: &Path,
    vocab: usize,
) -> Result<BTreeMap<String, String>, TrainError> {
    let mut m = BTreeMap::new();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let p = model_dir.join(f);
        let v = if p.exists() {
            sha256_file(&p)?
        } else {
            "(none)".into()
        };
        m.insert(format!("{f} sha256"), v);
    }
    if let Some(t) = &opts.chat_template {
        m.insert(
            "chat_template sha256".into(),
            rtune_fsio::sha256_bytes(t.source().as_bytes()),
        );
    }
    if !opts.chat_template_kwargs.is_empty() {
        let kw: serde_json::Map<String, serde_json::Value> =
            opts.chat_template_kwargs.iter().cloned().collect();
        m.insert(
            "chat_template_kwargs".into(),
            serde_json::Value::Object(kw).to_string(),
        );
    }
    m.insert("train_on_all".into(), d.train_on_all.to_string());
    m.insert("max_seq_len".into(), d.max_seq_len.to_string());
    m.insert("drop_long".into(), d.drop_long.to_string());
    m.insert("skip_bad_rows".into(), d.skip_bad_rows.to_string());
    m.insert("vocab".into(), vocab.to_string());
    m.insert("rtune".into(), env!("CARGO_PKG_VERSION").into());
    Ok(m)
}

/// The template conversational rows render with, as chat rows take it: `[data] chat_template`,
/// else the model's, with `[data] chat_template_kwargs` set; `None` without either.
pub fn chat_template(
    d: &DataConfig,
    tok: Option<&Tokenizer>,
) -> Result<Option<ChatTemplate>, TrainError> {
    let opts = options(d, tok)?;
    let template = match (opts.chat_template, tok) {
        (Some(t), _) => Some(t),
        (None, Some(tok)) => ChatTemplate::from_tokenizer(tok)?,
        (None, None) => None,
    };
    Ok(template.map(|t| {
        opts.chat_template_kwargs
            .iter()
            .fold(t, |t, (k, v)| t.with_var(k, v))
    }))
}

/// The data options of the config, with the chat template override loaded.
pub fn options(d: &DataConfig, tok: Option<&Tokenizer>) -> Result<DataOptions, TrainError> {
    use rtune_config::RowFormat as R;
    let mut o = DataOptions::new(d.max_seq_len);
    o.format = match d.format {
        R::Auto => None,
        R::Text => Some(Format::Text),
        R::PromptCompletion => Some(Format::PromptCompletion),
        R::Alpaca => Some(Format::Alpaca),
        R::Chat => Some(Format::Chat),
        R::Tokens => Some(Format::Tokens),
    };
    o.train_on = if d.train_on_all {
        TrainOn::All
    } else {
        TrainOn::Assistant
    };
    o.truncation = if d.drop_long {
        Truncation::Drop
    } else {
        Truncation::Truncate
    };
    o.on_bad_row = if d.skip_bad_rows {
        OnBadRow::Skip
    } else {
        OnBadRow::Error
    };
    // TOML values as JSON (dates are refused by the config check).
    o.chat_template_kwargs = d
        .chat_template_kwargs
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::to_value(v).unwrap_or_default()))
        .collect();
    if let Some(path) = &d.chat_template {
        let tok = tok.ok_or_else(|| DataError::File {
            path: path.clone(),
            message: "a chat template needs the model's tokenizer.json".into(),
        })?;
        o.chat_template = Some(ChatTemplate::from_file(path, tok)?);
    }
    Ok(o)
}

/// The first lines of `path` (up to ~1 MiB), for format detection; rows over `max_row_bytes` are
/// passed over unread (as training drops them), blank lines kept so line numbers stay right.
fn head_text(path: &Path, max_row_bytes: usize) -> Result<String, TrainError> {
    let mut reader = std::io::BufReader::new(rtune_data::open_data(path)?);
    let mut text = String::new();
    for line in 1.. {
        let mut buf = Vec::new();
        let (n, over) =
            cache::read_line_capped(&mut reader, &mut buf, max_row_bytes).map_err(|e| {
                DataError::File {
                    path: path.to_path_buf(),
                    message: format!("cannot read data: {e}"),
                }
            })?;
        if n == 0 {
            break;
        }
        if over {
            text.push('\n');
            continue;
        }
        text.push_str(rtune_data::line_utf8(path, line, buf)?.trim_end_matches(['\n', '\r']));
        text.push('\n');
        if text.len() > 1 << 20 {
            break;
        }
    }
    Ok(text)
}

/// Loads one file through the cache.
fn load_file(
    path: &Path,
    tok: Option<&Tokenizer>,
    opts: &DataOptions,
    inputs: &BTreeMap<String, String>,
    d: &DataConfig,
    vocab: usize,
    keep: bool,
) -> Result<(Vec<Example>, cache::Loaded, Vec<String>), TrainError> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let format = detect_format(&head_text(path, d.max_row_bytes)?, 1, path, opts)?;
    let rows = RowParser::new(path, format, tok, opts, vocab)?;
    let samples = std::sync::Mutex::new(Vec::new());
    let parser = |text: &str, first: usize| -> rtune_data::Result<(Vec<Example>, RowCounts)> {
        let ds = rows.parse_chunk(text, first)?;
        let mut kept = samples.lock().expect("not poisoned");
        let room = Dataset::BAD_ROW_SAMPLES.saturating_sub(kept.len());
        kept.extend(ds.bad_row_samples.into_iter().take(room));
        let counts = RowCounts {
            rows: ds.rows,
            truncated: ds.truncated,
            dropped: ds.dropped + ds.skipped,
            skipped: ds.bad_rows,
            oversized: 0,
        };
        Ok((ds.examples, counts))
    };
    let parser = cache::Capped {
        parser,
        max_row_bytes: d.max_row_bytes,
    };
    let mut inputs = inputs.clone();
    inputs.insert("format".into(), format.name().into());
    inputs.insert("max_row_bytes".into(), d.max_row_bytes.to_string());
    let mut loaded = match (&d.cache_dir, keep) {
        (Some(root), false) => cache::prepare(root, path, &inputs, threads, &parser)?,
        (root, _) => cache::load(root.as_deref(), path, &inputs, threads, &parser)?,
    };
    let usable = if keep {
        !loaded.examples.is_empty()
    } else {
        loaded.counts.rows > loaded.counts.left_out()
    };
    if !usable {
        return Err(DataError::File {
            path: path.to_path_buf(),
            message: if loaded.counts.rows == 0 {
                "no rows: the file holds no JSON line".into()
            } else {
                format!(
                    "no usable example ({} rows read: {} dropped as too long or without a target token, \
                     {} over max_row_bytes, {} malformed rows skipped)",
                    loaded.counts.rows,
                    loaded.counts.dropped,
                    loaded.counts.oversized,
                    loaded.counts.skipped
                )
            },
        }
        .into());
    }
    let ex = std::mem::take(&mut loaded.examples);
    Ok((ex, loaded, samples.into_inner().expect("not poisoned")))
}

/// Tokenises every training and validation file into the cache without holding the examples
/// (`rtune data prepare`): memory stays bounded whatever the files' sizes.
pub fn prepare(
    d: &DataConfig,
    model_dir: &Path,
    tok: Option<&Tokenizer>,
    vocab: usize,
) -> Result<Vec<FileReport>, TrainError> {
    let opts = options(d, tok)?;
    let inputs = cache_inputs(d, &opts, model_dir, vocab)?;
    let mut out = Vec::new();
    for (path, weight) in d
        .train
        .iter()
        .map(|f| (&f.path, f.weight))
        .chain(d.valid.iter().map(|v| (v, 0.0)))
    {
        let (_, loaded, bad) = load_file(path, tok, &opts, &inputs, d, vocab, false)?;
        out.push(FileReport {
            path: path.clone(),
            weight,
            counts: loaded.counts,
            examples: loaded.counts.rows - loaded.counts.left_out(),
            tokens: loaded.tokens,
            reused_cache: loaded.reused,
            tokens_per_s: loaded.tokens_per_s,
            bad_rows: bad,
        });
    }
    Ok(out)
}

/// Loads the run's training and validation data.
pub fn load(
    d: &DataConfig,
    model_dir: &Path,
    tok: Option<&Tokenizer>,
    vocab: usize,
    seed: u64,
) -> Result<RunData, TrainError> {
    let opts = options(d, tok)?;
    let inputs = cache_inputs(d, &opts, model_dir, vocab)?;
    let (mut kept, mut valid, mut files) = (Vec::new(), Vec::new(), Vec::new());
    for (i, f) in d.train.iter().enumerate() {
        let (ex, loaded, bad) = load_file(&f.path, tok, &opts, &inputs, d, vocab, true)?;
        files.push(FileReport::of(&f.path, f.weight, &ex, &loaded, bad));
        let (t, v) = hold_out(ex, d.valid_fraction, file_seed(seed, i));
        valid.extend(v);
        kept.push(t);
    }
    // Weights checked on every file's rows before any is copied.
    let sizes: Vec<_> = (d.train.iter().zip(&kept))
        .map(|(f, ex)| (f.path.as_path(), ex.len(), f.weight))
        .collect();
    check_weights(&sizes)?;
    let mut train = Vec::new();
    for (i, (f, ex)) in d.train.iter().zip(kept).enumerate() {
        train.extend(weighted(ex, f.weight, file_seed(seed, i).rotate_left(17)));
    }
    if let Some(v) = &d.valid {
        let (ex, loaded, bad) = load_file(v, tok, &opts, &inputs, d, vocab, true)?;
        files.push(FileReport::of(v, 0.0, &ex, &loaded, bad));
        valid = ex;
    }
    if train.is_empty() {
        return Err(DataError::File {
            path: d.train[0].path.clone(),
            message: "no training example left after weighting".into(),
        }
        .into());
    }
    Ok(RunData {
        train,
        valid,
        files,
        own: None,
    })
}

/// The model's tokenizer (when it has one) and vocabulary size, from the config's model path.
pub fn model_tokenizer(cfg: &RunConfig) -> Result<(Option<Tokenizer>, usize), TrainError> {
    let cfg_path = cfg.model.path.join("config.json");
    let mc = rtune_model::HfConfig::from_file(&cfg_path)?.into_config(&cfg_path)?;
    let tok = if cfg.model.path.join("tokenizer.json").exists() {
        Some(Tokenizer::load(
            &cfg.model.path,
            mc.eos_token_ids.first().copied(),
        )?)
    } else {
        None
    };
    Ok((tok, mc.vocab_size))
}
