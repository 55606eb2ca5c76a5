//! The pre-tokenized cache: a JSONL file is tokenised once, in parallel, into binary shards, and
//! reused by every later run whose inputs are the same.
//!
//! An entry lives in `root/<key>/`, where `key` is the sha256 of everything that determines the
//! tokens: the source file's sha256, tokenizer.json's sha256, the chat template's sha256 and the
//! data settings (format, masks, max_seq_len, truncation, ...). `manifest.json` repeats those inputs
//! in clear, plus the shards and the row counts. Any change gives another key, so a stale entry is
//! never read; an entry that fails its checks (missing shard, wrong size) is rebuilt.
//!
//! The source is streamed: chunks of lines are parsed by all cores, a round at a time, and written
//! out before the next round is read, so memory stays bounded by a round, not by the file.
//! An entry is built in a temporary directory and renamed into place, so a crash leaves no half
//! entry. Entries are private (0700/0600): they hold the training data.
//!
//! Shard layout (little-endian): `b"RTUNEDS1"`, `n: u64`, `offsets: [u64; n + 1]` (token offsets of
//! each example), `input_ids: [u32; total]`, `labels: [i32; total]`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rtune_fsio::{sha256_bytes, sha256_file, Privacy};

use crate::{DataError, Example, Result};

const MAGIC: &[u8; 8] = b"RTUNEDS1";
const VERSION: u32 = 1;
/// Lines handed to one worker at a time.
const CHUNK_BYTES: usize = 1 << 20;
/// A shard is closed once it holds this many tokens (1 M tokens: 8 MiB of ids and labels on disk,
/// ~12 MiB while pending as examples), which bounds the memory of a build.
const SHARD_TOKENS: usize = 1 << 20;

/// What happened to the rows of a chunk (or a file).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowCounts {
    /// Non-empty lines read.
    pub rows: usize,
    /// Rows longer than `max_seq_len`, cut to it.
    pub truncated: usize,
    /// Rows dropped after tokenizing: over `max_seq_len` (with `truncation = "drop"`) or left with
    /// no target token.
    pub dropped: usize,
    /// Malformed rows skipped (`on_bad_row = "skip"`).
    pub skipped: usize,
    /// Rows longer than `max_row_bytes`, dropped unread (not in `dropped`: the remedy differs).
    /// No serde default: a manifest written before this field fails to read and is rebuilt, as
    /// its `dropped` still holds these rows.
    pub oversized: usize,
}

impl RowCounts {
    pub fn add(&mut self, o: &RowCounts) {
        self.rows += o.rows;
        self.truncated += o.truncated;
        self.dropped += o.dropped;
        self.skipped += o.skipped;
        self.oversized += o.oversized;
    }

    /// Rows that gave no example, for any reason.
    pub fn left_out(&self) -> usize {
        self.dropped + self.skipped + self.oversized
    }

    /// `"3 truncated, 1 dropped, 0 skipped"`, and `", 2 over max_row_bytes"` when there are any.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} truncated, {} dropped, {} skipped",
            self.truncated, self.dropped, self.skipped
        );
        if self.oversized > 0 {
            s.push_str(&format!(", {} over max_row_bytes", self.oversized));
        }
        s
    }
}

/// A file's examples, from the cache or freshly tokenised.
#[derive(Debug)]
pub struct Loaded {
    pub examples: Vec<Example>,
    pub counts: RowCounts,
    /// Read from an existing cache entry (no tokenisation).
    pub reused: bool,
    /// The cache entry, when caching is on.
    pub entry: Option<PathBuf>,
    /// Tokens per second of the tokenisation (0 when reused).
    pub tokens_per_s: f64,
    /// Tokens in all examples.
    pub tokens: usize,
    /// Bytes of the source file.
    pub source_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    version: u32,
    key: String,
    source: String,
    /// What the key was made from: `source sha256`, `tokenizer sha256`, settings...
    inputs: BTreeMap<String, String>,
    shards: Vec<ShardInfo>,
    counts: RowCounts,
    tokens: usize,
    build_seconds: f64,
}

#[derive(Debug, Serialize, Deserialize)]
struct ShardInfo {
    file: String,
    examples: usize,
    tokens: usize,
    bytes: u64,
}

fn io_err(path: &Path, message: String) -> DataError {
    DataError::File {
        path: path.to_path_buf(),
        message,
    }
}

/// Parses one chunk of lines; `first_line` is the 1-based line number of the chunk's first line.
pub trait ChunkParser: Sync {
    fn parse(&self, text: &str, first_line: usize) -> Result<(Vec<Example>, RowCounts)>;

    /// Rows longer than this many bytes are dropped before they are read into memory (counted
    /// as rows and as dropped); unlimited unless the parser is [`Capped`].
    fn max_row_bytes(&self) -> usize {
        usize::MAX
    }
}

/// `parser` with a row-size cap ([`ChunkParser::max_row_bytes`]). The cap decides which rows are
/// kept, so it belongs in the cache key (`inputs`) as well.
pub struct Capped<P> {
    pub parser: P,
    pub max_row_bytes: usize,
}

impl<P: ChunkParser> ChunkParser for Capped<P> {
    fn parse(&self, text: &str, first_line: usize) -> Result<(Vec<Example>, RowCounts)> {
        self.parser.parse(text, first_line)
    }
    fn max_row_bytes(&self) -> usize {
        self.max_row_bytes
    }
}

/// Reads one line (through its `\n`) into `buf` unless it is longer than `cap` bytes; a longer
/// one is consumed without being stored and `Ok((n, true))` returned. `n` = 0 at end of file.
/// Memory: at most `cap` bytes plus the reader's buffer, whatever the line's length.
pub fn read_line_capped(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
) -> std::io::Result<(usize, bool)> {
    let (mut n, mut over) = (0usize, false);
    loop {
        let chunk = r.fill_buf()?;
        if chunk.is_empty() {
            return Ok((n, over));
        }
        let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        if !over && buf.len() + take > cap.saturating_add(1) {
            over = true;
            buf.clear();
            buf.shrink_to(0);
        }
        if !over {
            buf.extend_from_slice(&chunk[..take]);
        }
        r.consume(take);
        n += take;
        if done {
            return Ok((n, over));
        }
    }
}

impl<F> ChunkParser for F
where
    F: Fn(&str, usize) -> Result<(Vec<Example>, RowCounts)> + Sync,
{
    fn parse(&self, text: &str, first_line: usize) -> Result<(Vec<Example>, RowCounts)> {
        self(text, first_line)
    }
}

/// Loads `source` through the cache under `root` (or, with `root = None`, tokenises it without
/// caching). `inputs` are the settings that determine the tokens (the source's sha256 is added
/// here); `threads` workers parse chunks in parallel.
pub fn load(
    root: Option<&Path>,
    source: &Path,
    inputs: &BTreeMap<String, String>,
    threads: usize,
    parser: &dyn ChunkParser,
) -> Result<Loaded> {
    load_keeping(root, source, inputs, threads, parser, true)
}

/// Tokenises `source` into the cache under `root` (or finds it there) without reading the
/// examples into memory: [`Loaded::examples`] is empty. Memory stays bounded by one round of
/// chunks and one shard, whatever the file's size.
pub fn prepare(
    root: &Path,
    source: &Path,
    inputs: &BTreeMap<String, String>,
    threads: usize,
    parser: &dyn ChunkParser,
) -> Result<Loaded> {
    load_keeping(Some(root), source, inputs, threads, parser, false)
}

fn load_keeping(
    root: Option<&Path>,
    source: &Path,
    inputs: &BTreeMap<String, String>,
    threads: usize,
    parser: &dyn ChunkParser,
    keep: bool,
) -> Result<Loaded> {
    // Opened (and checked a regular file) before anything else: the size below, the checksum
    // and the stream all read a file, never a FIFO or a device.
    let source_bytes = crate::open_data(source)?
        .metadata()
        .map_err(|e| io_err(source, format!("cannot read data: {e}")))?
        .len();
    let Some(root) = root else {
        let mut examples = Vec::new();
        let t0 = Instant::now();
        let counts = stream(source, threads, parser, |ex| {
            examples.extend(ex);
            Ok(())
        })?;
        let tokens: usize = examples.iter().map(|e| e.input_ids.len()).sum();
        return Ok(Loaded {
            examples,
            counts,
            reused: false,
            entry: None,
            tokens_per_s: tokens as f64 / t0.elapsed().as_secs_f64().max(1e-9),
            tokens,
            source_bytes,
        });
    };
    let mut inputs = inputs.clone();
    let sha = sha256_file(source).map_err(|e| io_err(source, e.to_string()))?;
    inputs.insert("source sha256".into(), sha);
    inputs.insert("cache version".into(), VERSION.to_string());
    let key = sha256_bytes(serde_json::to_string(&inputs).expect("strings").as_bytes());
    let entry = root.join(&key[..32]);
    if let Some(m) = read_manifest(&entry, &key) {
        let examples = if keep {
            read_shards(&entry, &m)?
        } else {
            Vec::new()
        };
        return Ok(Loaded {
            examples,
            counts: m.counts,
            reused: true,
            entry: Some(entry),
            tokens_per_s: 0.0,
            tokens: m.tokens,
            source_bytes,
        });
    }
    let m = build(root, &entry, &key, source, inputs, threads, parser)?;
    let tokens_per_s = m.tokens as f64 / m.build_seconds.max(1e-9);
    // Read back from the shards: the build itself never holds more than a round of chunks and
    // one shard, so tokenising a file larger than memory works (`keep = false`).
    let examples = if keep {
        read_shards(&entry, &m)?
    } else {
        Vec::new()
    };
    Ok(Loaded {
        examples,
        counts: m.counts,
        reused: false,
        entry: Some(entry),
        tokens_per_s,
        tokens: m.tokens,
        source_bytes,
    })
}

/// Reads `source` in chunks of whole lines; every round, `threads` chunks are parsed in parallel
/// and handed to `sink` in file order.
fn stream(
    source: &Path,
    threads: usize,
    parser: &dyn ChunkParser,
    mut sink: impl FnMut(Vec<Example>) -> Result<()>,
) -> Result<RowCounts> {
    let f = crate::open_data(source)?;
    let mut reader = BufReader::with_capacity(1 << 20, f);
    let mut counts = RowCounts::default();
    let mut line = 1usize;
    let threads = threads.max(1);
    loop {
        // One round: up to `threads` chunks of whole lines.
        let mut chunks: Vec<(String, usize)> = Vec::with_capacity(threads);
        let mut eof = false;
        while chunks.len() < threads && !eof {
            let (mut text, start) = (String::with_capacity(CHUNK_BYTES + 4096), line);
            while text.len() < CHUNK_BYTES {
                let mut buf = Vec::new();
                let (n, over) = read_line_capped(&mut reader, &mut buf, parser.max_row_bytes())
                    .map_err(|e| io_err(source, format!("cannot read data: {e}")))?;
                if n == 0 {
                    eof = true;
                    break;
                }
                if over {
                    // Dropped unread, as an over-long row would be after tokenizing; the line
                    // numbers of the rows after it stay right.
                    counts.rows += 1;
                    counts.oversized += 1;
                    text.push('\n');
                    line += 1;
                    continue;
                }
                let s = crate::line_utf8(source, line, buf)?;
                text.push_str(&s);
                if !s.ends_with('\n') {
                    text.push('\n');
                }
                line += 1;
            }
            if !text.is_empty() {
                chunks.push((text, start));
            }
        }
        if chunks.is_empty() {
            return Ok(counts);
        }
        let results: Vec<Result<(Vec<Example>, RowCounts)>> = std::thread::scope(|s| {
            let handles: Vec<_> = chunks
                .iter()
                .map(|(text, start)| s.spawn(move || parser.parse(text, *start)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("parser thread panicked"))
                .collect()
        });
        drop(chunks);
        for r in results {
            let (ex, c) = r?;
            counts.add(&c);
            sink(ex)?;
        }
        if eof {
            return Ok(counts);
        }
    }
}

fn read_manifest(entry: &Path, key: &str) -> Option<Manifest> {
    let text = rtune_fsio::read_string_bounded(
        &entry.join("manifest.json"),
        rtune_fsio::FileKind::RunRecord,
    )
    .ok()?;
    let m: Manifest = serde_json::from_str(&text).ok()?;
    let sizes_ok = m
        .shards
        .iter()
        .all(|s| std::fs::metadata(entry.join(&s.file)).is_ok_and(|md| md.len() == s.bytes));
    (m.version == VERSION && m.key == key && sizes_ok).then_some(m)
}

fn build(
    root: &Path,
    entry: &Path,
    key: &str,
    source: &Path,
    inputs: BTreeMap<String, String>,
    threads: usize,
    parser: &dyn ChunkParser,
) -> Result<Manifest> {
    let privacy = Privacy::PRIVATE;
    let fs = |e: rtune_fsio::IoError| io_err(&e.path.clone(), e.to_string());
    privacy.create_dir_all(root).map_err(fs)?;
    let tmp = root.join(format!("{}.tmp-{}", &key[..32], std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    privacy.create_dir_all(&tmp).map_err(fs)?;
    let t0 = Instant::now();
    let mut shards = Vec::new();
    let mut pending: Vec<Example> = Vec::new();
    let mut pending_tokens = 0usize;
    let flush = |pending: &mut Vec<Example>, shards: &mut Vec<ShardInfo>| -> Result<()> {
        if pending.is_empty() {
            return Ok(());
        }
        let file = format!("shard-{:05}.bin", shards.len());
        let info = write_shard(&tmp.join(&file), pending, privacy)?;
        shards.push(ShardInfo { file, ..info });
        pending.clear();
        Ok(())
    };
    let res = stream(source, threads, parser, |ex| {
        pending_tokens += ex.iter().map(|e| e.input_ids.len()).sum::<usize>();
        pending.extend(ex);
        if pending_tokens >= SHARD_TOKENS {
            pending_tokens = 0;
            flush(&mut pending, &mut shards)?;
        }
        Ok(())
    });
    let counts = match res.and_then(|c| flush(&mut pending, &mut shards).map(|_| c)) {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    let m = Manifest {
        version: VERSION,
        key: key.to_string(),
        source: source.display().to_string(),
        inputs,
        tokens: shards.iter().map(|s| s.tokens).sum(),
        shards,
        counts,
        build_seconds: t0.elapsed().as_secs_f64(),
    };
    let json = serde_json::to_string_pretty(&m).expect("manifest serialises");
    rtune_fsio::write_atomic(&tmp.join("manifest.json"), json.as_bytes(), privacy).map_err(fs)?;
    // A damaged entry is replaced. Two runs building the same entry at once both succeed: the
    // loser of the rename finds the winner's (identical) entry and drops its own.
    if entry.exists() && read_manifest(entry, key).is_none() {
        let _ = std::fs::remove_dir_all(entry);
    }
    if let Err(e) = std::fs::rename(&tmp, entry) {
        let _ = std::fs::remove_dir_all(&tmp);
        if read_manifest(entry, key).is_none() {
            return Err(io_err(entry, format!("cannot publish cache: {e}")));
        }
    }
    rtune_fsio::fsync_dir(root).map_err(fs)?;
    Ok(m)
}

fn write_shard(path: &Path, exs: &[Example], privacy: Privacy) -> Result<ShardInfo> {
    let total: usize = exs.iter().map(|e| e.input_ids.len()).sum();
    let f = privacy
        .create(path)
        .map_err(|e| io_err(path, e.to_string()))?;
    // Streamed through a small buffer: the shard is never held in memory a second time.
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let mut put = |b: &[u8]| w.write_all(b);
    let res = (|| -> std::io::Result<()> {
        put(MAGIC)?;
        put(&(exs.len() as u64).to_le_bytes())?;
        let mut off = 0u64;
        put(&off.to_le_bytes())?;
        for e in exs {
            off += e.input_ids.len() as u64;
            put(&off.to_le_bytes())?;
        }
        for e in exs {
            for i in &e.input_ids {
                put(&i.to_le_bytes())?;
            }
        }
        for e in exs {
            for &l in &e.labels {
                put(&(l as i32).to_le_bytes())?;
            }
        }
        Ok(())
    })();
    res.and_then(|_| w.into_inner().map_err(|e| e.into_error()))
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err(path, format!("cannot write cache shard: {e}")))?;
    Ok(ShardInfo {
        file: String::new(),
        examples: exs.len(),
        tokens: total,
        bytes: (16 + 8 * (exs.len() + 1) + 8 * total) as u64,
    })
}

fn read_shards(entry: &Path, m: &Manifest) -> Result<Vec<Example>> {
    let mut out = Vec::new();
    for s in &m.shards {
        let path = entry.join(&s.file);
        // The manifest's size is the cap: a shard swapped for a device or a larger file is
        // refused, not read without end.
        let kind = rtune_fsio::FileKind::Sized {
            cap: s.bytes,
            name: "cache shard",
        };
        let bytes = rtune_fsio::read_bounded(&path, kind)
            .map_err(|e| io_err(&path, format!("cannot read cache shard: {e}")))?;
        let bad = || io_err(&path, "corrupt cache shard (delete the cache entry)".into());
        if bytes.len() < 16 || &bytes[..8] != MAGIC {
            return Err(bad());
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        let n = u64_at(8) as usize;
        let offs: Vec<usize> = (0..=n).map(|i| u64_at(16 + 8 * i) as usize).collect();
        let total = offs[n];
        let ids_at = 16 + 8 * (n + 1);
        let labels_at = ids_at + 4 * total;
        if bytes.len() != labels_at + 4 * total {
            return Err(bad());
        }
        let word = |at: usize, i: usize| {
            <[u8; 4]>::try_from(&bytes[at + 4 * i..at + 4 * i + 4]).expect("4 bytes")
        };
        for w in offs.windows(2) {
            out.push(Example {
                input_ids: (w[0]..w[1])
                    .map(|i| u32::from_le_bytes(word(ids_at, i)))
                    .collect(),
                labels: (w[0]..w[1])
                    .map(|i| i32::from_le_bytes(word(labels_at, i)) as i64)
                    .collect(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
