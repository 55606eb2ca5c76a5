//! `rtune data scan | prepare | inspect`: the config's data checked for secrets and personal data
//! (`rtune_data::scan`), tokenised into the cache ahead of training, or printed as training sees
//! it (`rtune_data::inspect`).

use anyhow::{bail, Result};
use clap::Subcommand;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use rtune_data::inspect;

#[derive(Subcommand)]
pub enum DataCommand {
    /// Report likely secrets and personal data in the config's training data as `file:line: kind`
    /// (the matched text is never printed). Exits 1 when anything is found.
    Scan {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Tokenise the config's data files into the cache (in parallel, memory bounded), so training
    /// starts at once; prints tokens/s.
    Prepare {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
    },
    /// Print the first formatted samples with their loss masks (trained tokens marked), the row
    /// counts and a length histogram: check template, BOS/EOS and masking before a long run.
    Inspect {
        #[arg(long)]
        config: PathBuf,
        #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
        set: Vec<String>,
        /// How many samples to print.
        #[arg(short = 'n', long = "samples", default_value_t = 3)]
        n: usize,
        /// One JSON object per sample (`text`, `input_ids`, `labels` with -100 where masked).
        #[arg(long)]
        json: bool,
    },
}

pub fn run(c: DataCommand) -> Result<()> {
    match c {
        DataCommand::Scan { config, set } => scan(config, set),
        DataCommand::Prepare { config, set } => prepare(config, set),
        DataCommand::Inspect {
            config,
            set,
            n,
            json,
        } => inspect(config, set, n, json),
    }
}

/// `rtune data scan`: findings on stdout, a count per file on stderr; an error when any.
fn scan(config: PathBuf, set: Vec<String>) -> Result<()> {
    let cfg = rtune_config::load(&config, &set)?;
    let d = &cfg.data;
    let mut flagged = Vec::new();
    for path in d.train.iter().map(|f| &f.path).chain(&d.valid) {
        // Its errors name the file (exit 2: a missing file, a FIFO, a device).
        let findings = rtune_data::scan::scan_file(path, d.max_row_bytes)?;
        for f in &findings {
            println!("{f}");
        }
        let lines: std::collections::BTreeSet<usize> = findings.iter().map(|f| f.line).collect();
        eprintln!(
            "{}: {} finding(s) on {} line(s)",
            path.display(),
            findings.len(),
            lines.len()
        );
        if !findings.is_empty() {
            flagged.push(path.display().to_string());
        }
    }
    if flagged.is_empty() {
        Ok(())
    } else {
        bail!(
            "likely secrets or personal data in {}; review the lines above",
            flagged.join(", ")
        )
    }
}

/// Trained tokens: green on a terminal, `[[` `]]` otherwise (so a log or a pipe still shows them).
fn mark(text: &str, trained: bool, colour: bool) -> String {
    match (trained, colour) {
        (false, _) => text.to_string(),
        (true, true) => format!("\x1b[1;32m{text}\x1b[0m"),
        (true, false) => format!("[[{text}]]"),
    }
}

/// `rtune data inspect`: samples as training sees them, the counts and a length histogram.
fn inspect(config: PathBuf, set: Vec<String>, n: usize, json: bool) -> Result<()> {
    let mut cfg = rtune_config::load(&config, &set)?;
    crate::resolve::resolve_model(&mut cfg)?;
    let (data, tok) = rtune_train::objective::load_for(&cfg)?;
    let sides = rtune_train::objective::about(&cfg).sides;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    // The first samples of the first file, in file order (before shuffling and weighting).
    let first: Vec<_> = data.train.iter().take(n).collect();
    if json {
        for e in first {
            let s = inspect::sample(e, tok.as_ref())?;
            writeln!(out, "{}", serde_json::to_string(&s)?)?;
        }
        return Ok(());
    }
    let colour = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let legend = if colour {
        "trained tokens in green"
    } else {
        "trained tokens in [[...]]"
    };
    writeln!(out, "{} sample(s), {legend}\n", first.len())?;
    for (i, e) in first.iter().enumerate() {
        let s = inspect::sample(e, tok.as_ref())?;
        writeln!(
            out,
            "--- sample {}{} · {} tokens, {} trained ---",
            i + 1,
            side(sides, i),
            s.input_ids.len(),
            s.trained_tokens
        )?;
        let body: String = s
            .spans
            .iter()
            .map(|p| mark(&p.text, p.trained, colour))
            .collect();
        writeln!(out, "{body}\n")?;
    }
    for f in &data.files {
        let c = &f.counts;
        writeln!(
            out,
            "{}: {} rows, {} examples, {} tokens; {}{}",
            f.path.display(),
            c.rows,
            f.examples,
            f.tokens,
            c.summary(),
            if f.reused_cache { " (from cache)" } else { "" }
        )?;
    }
    for line in data.own.iter().flat_map(|o| o.file_lines()) {
        writeln!(out, "{line}")?;
    }
    let lengths: Vec<usize> = data.train.iter().map(|e| e.input_ids.len()).collect();
    let trained: usize = data.train.iter().map(|e| e.target_tokens()).sum();
    // A preference run's rows are its pairs' two sequences each (KTO: a row and its KL row).
    let what = (data.own.as_ref()).map_or("training examples".to_string(), |o| o.sequences());
    writeln!(
        out,
        "\n{} {what}, {} tokens, {} trained; lengths (max_seq_len {}):",
        lengths.len(),
        lengths.iter().sum::<usize>(),
        trained,
        cfg.data.max_seq_len
    )?;
    let hist = inspect::histogram(&lengths, cfg.data.max_seq_len, 10);
    let top = hist.iter().map(|b| b.2).max().unwrap_or(1).max(1);
    for (lo, hi, count) in hist {
        let bar = "#".repeat((count * 40).div_ceil(top));
        writeln!(out, "{lo:>7}-{hi:<7} {count:>8} {bar}")?;
    }
    for w in data.warnings() {
        writeln!(out, "warning: {w}")?;
    }
    Ok(())
}

/// `rtune data prepare`: tokenise every data file into the cache, reporting tokens/s.
fn prepare(config: PathBuf, set: Vec<String>) -> Result<()> {
    let mut cfg = rtune_config::load(&config, &set)?;
    crate::resolve::resolve_model(&mut cfg)?;
    if let Some(note) = rtune_train::objective::about(&cfg).uncached {
        return prepare_uncached(&cfg, &note);
    }
    let Some(root) = &cfg.data.cache_dir else {
        bail!("[data] cache = false: there is no cache to prepare");
    };
    let (tok, vocab) = rtune_train::dataset::model_tokenizer(&cfg)?;
    let t0 = std::time::Instant::now();
    let files = rtune_train::dataset::prepare(&cfg.data, &cfg.model.path, tok.as_ref(), vocab)?;
    for f in &files {
        let c = &f.counts;
        let how = if f.reused_cache {
            "already in the cache".to_string()
        } else {
            format!("tokenised at {:.0} tokens/s", f.tokens_per_s)
        };
        println!(
            "{}: {} rows, {} tokens ({how}); {}",
            f.path.display(),
            c.rows,
            f.tokens,
            c.summary()
        );
    }
    println!(
        "cache {} ready in {:.1}s",
        root.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `rtune data prepare` for an objective whose rows the token cache does not hold (a preference
/// objective's pairs are tokenized at the start of each run): the rows are read and checked as
/// training reads them (the errors a run would stop on, the counts it reports).
fn prepare_uncached(cfg: &rtune_config::RunConfig, note: &str) -> Result<()> {
    let (data, _) = rtune_train::objective::load_for(cfg)?;
    for line in data.own.iter().flat_map(|o| o.prepare_lines()) {
        println!("{line}");
    }
    for w in data.warnings() {
        eprintln!("warning: {w}");
    }
    println!("{note}");
    Ok(())
}

/// Which of its row's sequences sample `i` is (`data.train` holds each row's `sides` in turn):
/// " (pair 1, chosen)"; nothing for one sequence a row.
fn side(sides: &[&str], i: usize) -> String {
    match sides.len() {
        0 | 1 => String::new(),
        n => format!(" (pair {}, {})", i / n + 1, sides[i % n]),
    }
}
