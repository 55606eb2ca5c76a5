//! A preference run's data (`[train] objective` other than `sft`): the pairs of every `[data]
//! train` file (weighted as SFT files are), the validation pairs (`[data] valid` or
//! `valid_fraction`), and the reference policy's log-probabilities of each pair, computed once
//! before training.

use rtune_config::RunConfig;
use rtune_data::preference::{assign_kl_completions, load_pairs, PairOptions};
use rtune_data::{ChatTemplate, Example, Pair, PairBatch, PairSet, Tokenizer, IGNORE};
use rtune_model::{LoraCtx, Model};

use super::Loss;
use crate::TrainError;

/// The pairs of a preference run, and what loading them cut or left out.
pub struct PairData {
    pub train: Vec<Pair>,
    pub valid: Vec<Pair>,
    /// Per file: its path and counts (rows read, truncated, dropped, identical; `pairs` emptied:
    /// they are in `train` and `valid`).
    pub files: Vec<(std::path::PathBuf, PairSet)>,
}

/// Warnings before a run about the pairs of `files`: pairs cut or dropped at `max_seq_len`,
/// pairs whose chosen and rejected completions are identical (no preference signal).
pub fn warnings(files: &[(std::path::PathBuf, PairSet)]) -> Vec<String> {
    let mut w = Vec::new();
    for (path, s) in files {
        if s.truncated + s.dropped > 0 {
            w.push(format!(
                "{}: {} of {} pairs had completions cut ({}) or were dropped ({}: the prompt \
                 fills max_seq_len, or the pair is longer with truncation = \"drop\") at \
                 [data] max_seq_len",
                path.display(),
                s.truncated + s.dropped,
                s.rows,
                s.truncated,
                s.dropped
            ));
        }
        if s.no_target > 0 {
            w.push(format!(
                "{}: {} of {} pairs dropped with no token to train on (an empty completion, \
                 or a one-token completion after an empty prompt)",
                path.display(),
                s.no_target,
                s.rows
            ));
        }
        if s.oversized > 0 {
            w.push(format!(
                "{}: {} of {} rows were longer than [data] max_row_bytes and dropped unread; \
                 raise max_row_bytes if they are wanted",
                path.display(),
                s.oversized,
                s.rows
            ));
        }
        if s.bad_rows > 0 {
            w.push(format!(
                "{}: {} malformed row(s) skipped (on_bad_row = \"skip\"){}",
                path.display(),
                s.bad_rows,
                s.bad_row_samples
                    .iter()
                    .map(|b| format!("\n  {b}"))
                    .collect::<String>()
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

impl PairData {
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
    loss: &Loss,
    tok: Option<&Tokenizer>,
    template: Option<&ChatTemplate>,
    vocab: usize,
) -> Result<PairData, TrainError> {
    let d = &cfg.data;
    let opts = options(d, vocab);
    let (mut kept, mut valid, mut files) = (Vec::new(), Vec::new(), Vec::new());
    for (i, f) in d.train.iter().enumerate() {
        let mut set = load_pairs(&f.path, tok, template, &opts)?;
        check_kind(loss, &f.path, &set)?;
        let seed = crate::sample::file_seed(cfg.train.seed, i);
        let rows = std::mem::take(&mut set.pairs);
        let (mut pairs, mut held) = crate::sample::hold_out(rows, d.valid_fraction, seed);
        if loss.is_unpaired() {
            let mbs = cfg.train.micro_batch_size;
            assign_kl_completions(&mut pairs, mbs, d.max_seq_len);
            assign_kl_completions(&mut held, mbs, d.max_seq_len);
        }
        valid.extend(held);
        kept.push(pairs);
        files.push((f.path.clone(), set));
    }
    // Weights checked on every file's pairs before any is copied.
    let sizes: Vec<_> = (d.train.iter().zip(&kept))
        .map(|(f, p)| (f.path.as_path(), p.len(), f.weight))
        .collect();
    crate::sample::check_weights(&sizes)?;
    let mut train = Vec::new();
    for (i, (f, pairs)) in d.train.iter().zip(kept).enumerate() {
        let seed = crate::sample::file_seed(cfg.train.seed, i);
        train.extend(crate::sample::weighted(
            pairs,
            f.weight,
            seed.rotate_left(17),
        ));
    }
    if let Some(v) = &d.valid {
        let mut set = load_pairs(v, tok, template, &opts)?;
        check_kind(loss, v, &set)?;
        valid = std::mem::take(&mut set.pairs);
        if loss.is_unpaired() {
            assign_kl_completions(&mut valid, cfg.train.micro_batch_size, d.max_seq_len);
        }
        files.push((v.clone(), set));
    }
    if train.is_empty() {
        let mut c = PairSet::default();
        for (_, s) in files.iter().take(d.train.len()) {
            c.rows += s.rows;
            c.dropped += s.dropped;
            c.no_target += s.no_target;
            c.oversized += s.oversized;
            c.bad_rows += s.bad_rows;
        }
        return Err(rtune_data::DataError::File {
            path: d.train[0].path.clone(),
            message: format!(
                "no preference pair left for training of {} rows read: {} dropped at \
                 max_seq_len, {} without a token to train on, {} over max_row_bytes, {} \
                 malformed (skipped)",
                c.rows, c.dropped, c.no_target, c.oversized, c.bad_rows
            ),
        }
        .into());
    }
    Ok(PairData {
        train,
        valid,
        files,
    })
}

/// The `[data]` settings as the preference loader takes them (`format` and `train_on`, which
/// are SFT's, are refused with a preference objective when the config is checked).
pub fn options(d: &rtune_config::DataConfig, vocab: usize) -> PairOptions {
    PairOptions {
        max_row_bytes: d.max_row_bytes,
        truncation: match d.drop_long {
            true => rtune_data::Truncation::Drop,
            false => rtune_data::Truncation::Truncate,
        },
        on_bad_row: match d.skip_bad_rows {
            true => rtune_data::OnBadRow::Skip,
            false => rtune_data::OnBadRow::Error,
        },
        ..PairOptions::new(d.max_seq_len, vocab)
    }
}

/// The rows a reference pass fills in: the training pairs (in file order) and the held-out ones.
pub struct Rows<'a> {
    pub train: &'a mut [Pair],
    /// `train`'s indices in the order the first epoch draws them: the reference pass batches
    /// them so, each forward the first steps' (TRL computes the reference in the policy's own
    /// forward; a mixture of experts rounds a token by the rows beside it in its experts).
    pub train_order: &'a [usize],
    pub valid: &'a mut [Pair],
}

/// The reference log-probabilities of a run's pairs (train and validation), from the cache or computed (and cached by the `writer`: rank 0 of a data-parallel
/// run); the forward passes run. `every(hit)`: whether every rank that must run the same
/// forwards found the cache (a sharded base's ranks; otherwise `hit` itself). `interrupted()`
/// is asked between forward passes: a stop request ends the pass ([`TrainError::Interrupted`]).
#[allow(clippy::too_many_arguments)]
pub fn reference(
    cfg: &RunConfig,
    model: &Model,
    adapter: &rtune_lora::Adapter,
    data: Rows,
    pad_id: u32,
    writer: bool,
    every: &dyn Fn(bool) -> bool,
    interrupted: &dyn Fn() -> bool,
) -> Result<usize, TrainError> {
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
    let cached = match &cfg.data.cache_dir {
        Some(root) => Some(ReferenceCache::new(cfg, &data, root)?),
        None => None,
    };
    let rows = data.train.len() + data.valid.len();
    let found = cached.as_ref().and_then(|c| c.read(rows));
    if every(found.is_some()) {
        if let (Some(c), Some(found)) = (&cached, found) {
            let all = data.train.iter_mut().chain(data.valid.iter_mut());
            for (p, [c, r, lc, lr]) in all.zip(found) {
                p.reference = Some([c, r]);
                p.reference_long = ([lc, lr] != [c, r]).then_some([lc, lr]);
            }
            tracing::info!(
                "reference log-probabilities of {rows} rows from the cache ({})",
                c.path.display()
            );
        }
        return Ok(0);
    }
    let t0 = std::time::Instant::now();
    let pass = |pairs: &mut [Pair], order: Option<&[usize]>| {
        fill_reference(model, lora, pairs, order, mbs, pad_id, interrupted)
    };
    let passes = pass(data.train, Some(data.train_order))? + pass(data.valid, None)?;
    tracing::info!(
        "reference log-probabilities of {rows} rows: {passes} forward passes in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    if let (Some(c), true) = (&cached, writer) {
        c.write(&data);
    }
    Ok(passes)
}

/// The reference log-probabilities on disk beside the token cache (`[data] cache_dir`), so a
/// restarted or repeated run does not run the reference pass again: `<cache_dir>/reference/
/// <key>.bin`, the key the sha256 of everything that determines them (the model's files, the
/// starting adapter's, dtype, quantization, device, micro-batch, every row's token ids in order);
/// `b"RTUNERF2"`, the count `n: u64`, `n` rows of 4 f64 (little-endian: the reference, and
/// the one under LongRoPE's long factors, the same when the pair has none), train rows then
/// validation rows, then the SHA-256 (hex) of all that. Written atomically, private. A file that
/// does not verify (its size, checksum or a value not finite: issue 46, where finite garbage of
/// the right size trained to loss 0) is recomputed with a warning.
struct ReferenceCache {
    path: std::path::PathBuf,
}

const REF_MAGIC: &[u8; 8] = b"RTUNERF2";
/// The checksum's length: SHA-256 in hex.
const REF_SUM: usize = 64;
/// Bytes of a row: 4 f64.
const ROW: usize = 32;

impl ReferenceCache {
    fn new(cfg: &RunConfig, data: &Rows, root: &std::path::Path) -> Result<Self, TrainError> {
        // `key\0value\0` for each part (a row's ids by their own sha256), hashed at the end.
        let mut parts = Vec::new();
        let mut put = |k: &str, v: &str| {
            parts.extend(k.as_bytes());
            parts.push(0);
            parts.extend(v.as_bytes());
            parts.push(0);
        };
        put("rtune", env!("CARGO_PKG_VERSION"));
        for f in rtune_run::record::model_files(&cfg.model.path) {
            put("model file", &rtune_run::record::sha256_once(&f)?);
        }
        if let Some(dir) = &cfg.lora.init_from {
            for f in ["adapter_model.safetensors", "adapter_config.json"] {
                put("init_from", &rtune_run::record::sha256_once(&dir.join(f))?);
            }
            let l = &cfg.lora;
            put(
                "lora",
                &format!("{} {} {} {}", l.r, l.alpha, l.rslora, l.dora),
            );
        }
        put("dtype", cfg.model.dtype.as_str());
        put("quantize", &format!("{:?}", cfg.model.quantize));
        put("device", &format!("{:?}", cfg.train.device));
        put("micro_batch_size", &cfg.train.micro_batch_size.to_string());
        for p in data.train.iter().chain(data.valid.iter()) {
            for ids in [&p.prompt, &p.chosen, &p.rejected] {
                let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
                put("ids", &rtune_fsio::sha256_bytes(&bytes));
            }
        }
        put(
            "split",
            &format!("{} {}", data.train.len(), data.valid.len()),
        );
        let key = rtune_fsio::sha256_bytes(&parts);
        Ok(Self {
            path: root.join("reference").join(format!("{key}.bin")),
        })
    }

    /// The `n` rows' references (train rows, then validation rows) from the file; `None` when
    /// it is missing, or (with a warning) does not verify.
    fn read(&self, n: usize) -> Option<Vec<[f64; 4]>> {
        let size = 16 + ROW * n + REF_SUM;
        let kind = rtune_fsio::FileKind::Sized {
            cap: size as u64,
            name: "reference log-probabilities",
        };
        let bytes = match rtune_fsio::read_bounded(&self.path, kind) {
            Ok(bytes) => bytes,
            Err(rtune_fsio::ReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                return None
            }
            Err(e) => return self.unverified(&e.to_string()),
        };
        if bytes.len() != size || &bytes[..8] != REF_MAGIC {
            return self.unverified("not of this run's size and format");
        }
        let (body, sum) = bytes.split_at(size - REF_SUM);
        if body[8..16] != (n as u64).to_le_bytes() {
            return self.unverified("another count of rows");
        }
        if rtune_fsio::sha256_bytes(body).as_bytes() != sum {
            return self.unverified("its checksum does not match its content");
        }
        let f = |i: usize| f64::from_le_bytes(body[i..i + 8].try_into().expect("8 bytes"));
        let row = |k: usize| std::array::from_fn(|j| f(16 + ROW * k + 8 * j));
        let rows: Vec<[f64; 4]> = (0..n).map(row).collect();
        if rows.iter().flatten().any(|x| !x.is_finite()) {
            return self.unverified("a log-probability is not finite");
        }
        Some(rows)
    }

    /// A cache file that does not verify: warned about, then recomputed (and replaced).
    fn unverified<T>(&self, why: &str) -> Option<T> {
        tracing::warn!(
            "{}: reference log-probabilities do not verify ({why}); computing them again",
            self.path.display()
        );
        None
    }

    /// Saves every row's reference; a failure is a warning (the run goes on without the cache).
    fn write(&self, data: &Rows) {
        let rows: Vec<&Pair> = data.train.iter().chain(data.valid.iter()).collect();
        let mut bytes = REF_MAGIC.to_vec();
        bytes.extend((rows.len() as u64).to_le_bytes());
        for p in rows {
            let short = p.reference.expect("filled in");
            for x in short.iter().chain(&p.reference_long.unwrap_or(short)) {
                bytes.extend(x.to_le_bytes());
            }
        }
        let sum = rtune_fsio::sha256_bytes(&bytes);
        bytes.extend(sum.as_bytes());
        let dir = self.path.parent().expect("under the cache root");
        let written = rtune_fsio::Privacy::PRIVATE
            .create_dir_all(dir)
            .and_then(|()| {
                rtune_fsio::write_atomic(&self.path, &bytes, rtune_fsio::Privacy::PRIVATE)
            });
        if let Err(e) = written {
            tracing::warn!(
                "{}: reference log-probabilities not cached: {e}",
                self.path.display()
            );
        }
    }
}

/// The file's rows are of the objective's kind: unpaired (`label`) rows for KTO, pairs otherwise.
fn check_kind(loss: &Loss, path: &std::path::Path, set: &PairSet) -> Result<(), TrainError> {
    let unpaired = set.pairs.iter().filter(|p| p.label.is_some()).count();
    let kto = loss.is_unpaired();
    let message = match (kto, unpaired) {
        (true, n) if n < set.pairs.len() => format!(
            "objective \"kto\" takes unpaired rows ({{\"prompt\", \"completion\", \"label\"}}); {} \
             of its rows are preference pairs",
            set.pairs.len() - n
        ),
        (false, n) if n > 0 => format!(
            "objective \"{}\" takes preference pairs ({{\"prompt\", \"chosen\", \"rejected\"}}); {n} \
             of its rows are unpaired (`label`) rows, which objective \"kto\" takes",
            loss.name()
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
/// `order` (a permutation of `pairs`' indices), file order without it. The caller passes the
/// first epoch's order, so the first steps' batches are the reference pass's: a row's bits
/// depend on the rows beside it, through the GEMMs' shapes and a mixture of experts' groups, and
/// TRL computes the reference in the policy's own forward. Pairs that already have them are
/// skipped. Returns the forward passes run.
///
/// A pair's reference must be what its policy computes at step 0, whatever batch training puts
/// it in. Each row's results are its own (up to rounding) but for LongRoPE, whose factors a
/// whole batch shares (the long ones once the batch is longer than `model.long_rope_past()`): a
/// pair short enough for the short factors gets them only in a batch of short pairs (issue 46:
/// file-order batches gave it the long ones, and its policy at step 0 another value). So the
/// short pairs are batched apart from the long ones, and when training can batch them together
/// (more than one pair a batch, long pairs in the set) each short pair also gets its reference
/// under the long factors (`reference_long`, rows padded past the length), which a long batch
/// takes.
pub fn fill_reference(
    model: &Model,
    lora: Option<&LoraCtx>,
    pairs: &mut [Pair],
    order: Option<&[usize]>,
    micro_batch: usize,
    pad_id: u32,
    interrupted: &dyn Fn() -> bool,
) -> Result<usize, TrainError> {
    let b = Batching {
        micro_batch,
        pad_id,
        interrupted,
    };
    let order: Vec<usize> = match order {
        Some(o) => o.to_vec(),
        None => (0..pairs.len()).collect(),
    };
    let todo: Vec<usize> = order
        .into_iter()
        .filter(|&i| pairs[i].reference.is_none())
        .collect();
    let Some(past) = model.long_rope_past() else {
        return fill(model, lora, pairs, &todo, &b, None);
    };
    let (short, long): (Vec<usize>, Vec<usize>) =
        todo.iter().partition(|&&i| pairs[i].len() <= past);
    let mut passes = fill(model, lora, pairs, &long, &b, None)?;
    passes += fill(model, lora, pairs, &short, &b, None)?;
    if micro_batch > 1 && pairs.iter().any(|p| p.len() > past) {
        passes += fill(model, lora, pairs, &short, &b, Some(past + 1))?;
    }
    Ok(passes)
}

/// How a reference pass batches: pairs a forward pass, the padding id, and the stop request
/// asked before each pass.
struct Batching<'a> {
    micro_batch: usize,
    pad_id: u32,
    interrupted: &'a dyn Fn() -> bool,
}

/// The references of `pairs[todo]`, `micro_batch` a forward pass: into `reference`, or with
/// `long_from` (rows padded to that length: LongRoPE's long factors) into `reference_long`.
fn fill(
    model: &Model,
    lora: Option<&LoraCtx>,
    pairs: &mut [Pair],
    todo: &[usize],
    how: &Batching,
    long_from: Option<usize>,
) -> Result<usize, TrainError> {
    let mut passes = 0;
    for chunk in todo.chunks(how.micro_batch.max(1)) {
        if (how.interrupted)() {
            return Err(TrainError::Interrupted {
                during: "the reference log-probabilities pass",
            });
        }
        let refs: Vec<&Pair> = chunk.iter().map(|&i| &pairs[i]).collect();
        let mut pb = PairBatch::padded(&refs, how.pad_id, false, long_from.unwrap_or(1));
        let nll = pair_nll(model, lora, &mut pb)?;
        let logps = pb.row_logps(&nll);
        let b = chunk.len();
        for (k, &i) in chunk.iter().enumerate() {
            let r = Some([logps[k], logps[b + k]]);
            match long_from {
                Some(_) => pairs[i].reference_long = r,
                None => pairs[i].reference = r,
            }
        }
        passes += 1;
    }
    Ok(passes)
}

/// Every position's target NLL of a pair batch, no gradient (its inputs are moved out of it:
/// the targets, the completion mask and the counts stay for the objective).
pub fn pair_nll(
    model: &Model,
    lora: Option<&LoraCtx>,
    pb: &mut PairBatch,
) -> Result<Vec<f32>, TrainError> {
    let inputs = crate::compute::take_inputs(&mut pb.batch);
    Ok(model.token_nll(&inputs, &pb.batch.targets, lora)?)
}
