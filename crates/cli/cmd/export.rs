//! `rtune export --run DIR --format peft|merged|gguf-lora --out PATH`: the run's adapter in the
//! form another tool loads (see `rtune_export`). Bad input (no adapter, output exists, base not
//! found) exits 2; a failure while writing exits 1.

use anyhow::Result;
use clap::{Args, ValueEnum};
use std::path::PathBuf;

use rtune_export::{ExportOptions, Format};

#[derive(Clone, Copy, ValueEnum)]
pub enum FormatArg {
    /// PEFT adapter directory (adapter_model.safetensors + adapter_config.json).
    Peft,
    /// Hugging Face model directory with the adapter merged into the weights.
    Merged,
    /// LoRA adapter as GGUF for llama.cpp's --lora.
    GgufLora,
}

#[derive(Args)]
pub struct ExportArgs {
    /// The run directory ([output] dir of `rtune train`), or a PEFT adapter directory.
    #[arg(long)]
    run: PathBuf,
    #[arg(long, value_enum)]
    format: FormatArg,
    /// Output directory (peft, merged) or file (gguf-lora).
    #[arg(long)]
    out: PathBuf,
    /// Export checkpoint-N instead of the final adapter.
    #[arg(long, value_name = "N")]
    checkpoint: Option<usize>,
    /// Replace an existing output (only an earlier export).
    #[arg(long)]
    force: bool,
    /// Base model directory, instead of the one recorded in the run's run.json.
    #[arg(long, value_name = "DIR")]
    base: Option<PathBuf>,
    /// base_model_name_or_path for --format peft (e.g. a hub id); default: the base's absolute path.
    #[arg(long, value_name = "NAME")]
    base_name: Option<String>,
    /// Largest weight shard for --format merged (as transformers: 5GB, 500MB, 2GiB ...).
    #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = parse_size)]
    max_shard_size: u64,
    /// --format merged of a QLoRA run: `dequantized` (default) merges into the NF4 weights the
    /// adapter was trained against; `original` into the unquantized base (results then differ
    /// from the trained model's by the quantization error).
    #[arg(long, value_name = "WHICH", default_value = "dequantized", value_parser = ["dequantized", "original"])]
    merge_into: String,
}

/// `5GB`, `500MB`, `2GiB`, `1048576`: decimal units as transformers' max_shard_size, binary with `i`.
fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}`: expected a size like 5GB or 500MB"))?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        u => {
            return Err(format!(
                "`{s}`: unknown unit `{u}` (use B, KB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    let bytes = (n * mult as f64).round();
    if bytes < 1.0 {
        return Err(format!("`{s}`: must be at least 1 byte"));
    }
    Ok(bytes as u64)
}

pub fn run(a: ExportArgs) -> Result<()> {
    let format = match a.format {
        FormatArg::Peft => Format::Peft,
        FormatArg::Merged => Format::Merged,
        FormatArg::GgufLora => Format::GgufLora,
    };
    let _lock = lock_run(&a.run)?;
    // `--run s3://bucket/prefix`: the run's files (and the checkpoint asked for, verified)
    // are fetched into a private temporary directory first.
    let remote_copy = match a.run.to_str().filter(|r| r.starts_with("s3://")) {
        Some(url) => {
            let tmp = std::env::temp_dir().join(format!("rtune-export-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&tmp);
            let remote = rtune_remote::Remote::open(url.trim_end_matches('/'))?;
            rtune_remote::fetch::run_files(&remote, &tmp, a.checkpoint)?;
            Some(tmp)
        }
        None => None,
    };
    let opts = ExportOptions {
        run: remote_copy.clone().unwrap_or(a.run),
        format,
        out: a.out,
        checkpoint: a.checkpoint,
        force: a.force,
        base: a.base,
        base_name: a.base_name,
        max_shard_bytes: a.max_shard_size,
        merge_into_original: a.merge_into == "original",
    };
    let done = rtune_export::export(&opts);
    if let Some(tmp) = &remote_copy {
        let _ = std::fs::remove_dir_all(tmp);
    }
    let done = done?;
    for w in &done.warnings {
        tracing::warn!("{w}");
    }
    let base = done
        .base
        .as_ref()
        .map_or(String::new(), |b| format!(" onto {}", b.display()));
    println!(
        "exported {} of {}{base} to {} ({})",
        format.as_str(),
        done.adapter.display(),
        done.out.display(),
        done.files.join(", ")
    );
    Ok(())
}

/// A run directory is read under a shared lock (`rtune_fsio::RunLock::acquire_shared`): while a
/// training process holds it, export is refused at once with exit 2 naming the holder (not made
/// to wait: a run can last hours, and a checkpoint it rotates away could vanish mid-read), and a
/// training started during the export is refused in turn. Only directories with a `run.json` (a
/// training's `[output] dir`) are locked; an adapter directory is read as it is.
fn lock_run(dir: &std::path::Path) -> Result<Option<rtune_fsio::RunLock>> {
    if !dir.join("run.json").is_file() {
        return Ok(None);
    }
    let input = |message: String| rtune_export::ExportError::Input {
        path: dir.to_path_buf(),
        message,
    };
    Ok(
        rtune_fsio::RunLock::acquire_shared(dir, rtune_fsio::Privacy::PRIVATE).map_err(
            |e| match e {
                rtune_fsio::LockError::Held { pid, host, .. } => input(format!(
                    "in use by a training process (pid {pid} on {host}); export once it has \
                     finished, or copy a checkpoint-N directory elsewhere and export that"
                )),
                rtune_fsio::LockError::Io { op, source, .. } => input(format!(
                    "cannot lock ({op} {}): {source}",
                    rtune_fsio::LOCK_FILE
                )),
            },
        )?,
    )
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1.5 MB").unwrap(), 1_500_000);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("5 parsecs").is_err() && parse_size("0").is_err());
    }
}
