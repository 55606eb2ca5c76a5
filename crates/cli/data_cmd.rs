//! `rtune data inspect`: prints samples as training sees them.

use anyhow::Result;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use rtune_train::inspect;

/// Trained tokens: green on a terminal, `[[` `]]` otherwise (so a log or a pipe still shows them).
fn mark(text: &str, trained: bool, colour: bool) -> String {
    match (trained, colour) {
        (false, _) => text.to_string(),
        (true, true) => format!("\x1b[1;32m{text}\x1b[0m"),
        (true, false) => format!("[[{text}]]"),
    }
}

pub fn inspect(config: PathBuf, set: Vec<String>, n: usize, json: bool) -> Result<()> {
    let mut cfg = rtune_config::load(&config, &set)?;
    crate::convert::resolve_model(&mut cfg)?;
    let (data, tok) = inspect::load(&cfg)?;
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
            "--- sample {} · {} tokens, {} trained ---",
            i + 1,
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
            "{}: {} rows, {} examples, {} tokens; {} truncated, {} dropped, {} skipped{}",
            f.path.display(),
            c.rows,
            f.examples,
            f.tokens,
            c.truncated,
            c.dropped,
            c.skipped,
            if f.reused_cache { " (from cache)" } else { "" }
        )?;
    }
    let lengths: Vec<usize> = data.train.iter().map(|e| e.input_ids.len()).collect();
    let trained: usize = data.train.iter().map(|e| e.target_tokens()).sum();
    writeln!(
        out,
        "\n{} training examples, {} tokens, {} trained; lengths (max_seq_len {}):",
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
pub fn prepare(config: PathBuf, set: Vec<String>) -> Result<()> {
    let mut cfg = rtune_config::load(&config, &set)?;
    crate::convert::resolve_model(&mut cfg)?;
    let Some(root) = &cfg.data.cache_dir else {
        anyhow::bail!("[data] cache = false: there is no cache to prepare");
    };
    let (tok, vocab) = inspect::tokenizer(&cfg)?;
    let t0 = std::time::Instant::now();
    let files = rtune_train::dataset::prepare(&cfg.data, &cfg.model_path, tok.as_ref(), vocab)?;
    for f in &files {
        let c = &f.counts;
        let how = if f.reused_cache {
            "already in the cache".to_string()
        } else {
            format!("tokenised at {:.0} tokens/s", f.tokens_per_s)
        };
        println!(
            "{}: {} rows, {} tokens ({how}); {} truncated, {} dropped, {} skipped",
            f.path.display(),
            c.rows,
            f.tokens,
            c.truncated,
            c.dropped,
            c.skipped
        );
    }
    println!(
        "cache {} ready in {:.1}s",
        root.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
