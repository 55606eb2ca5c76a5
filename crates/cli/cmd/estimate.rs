//! `rtune estimate`: the predicted peak memory of a run and its breakdown, and the largest
//! `micro_batch_size` and `max_seq_len` that fit a budget. Reads config.json and the sizes of the
//! model's files (a GGUF or hub model is resolved first, as `rtune train` resolves it: converted or
//! downloaded once into the cache); `--data` also tokenizes the data to size the batch the data
//! can actually form.
//!
//! `--world N` (data parallelism, issue 16): each rank holds the whole frozen base, the adapter and
//! AdamW's state (DDP replicates them) and computes `micro_batch_size` rows at a time, so a rank's
//! peak is the single process's at the same shape plus the gradient all-reduce's two flat f32
//! copies of the LoRA gradients (the send and the receive buffer, 8 bytes per LoRA parameter) and
//! MPI's own memory (`rtune_estimate::Settings::for_world`).
//! With `[distributed] shard_base` (issue 37) a rank holds 1/N of the frozen base and one layer
//! gathered whole at a time, and the layers `keep_gathered_layers` keeps gathered from the forward
//! for the backward (`rtune_estimate::Settings::shard`, `keep_gathered`).

use anyhow::{Context, Result};
use std::path::PathBuf;

use rtune_estimate::{self as estimate, Estimate, Fit, Settings};
use rtune_model::{HfConfig, ModelConfig};
use rtune_train::TrainError;

/// The largest `--world`: far above any data-parallel run (the largest have ~10⁵ ranks).
const MAX_WORLD: u64 = 1 << 20;

#[derive(clap::Args)]
pub struct EstimateArgs {
    #[arg(long)]
    config: PathBuf,
    /// Override a config value: --set train.micro_batch_size=8 (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Memory to fit in, e.g. 24GiB, 16GB, 512MiB (default: the available RAM, MemAvailable).
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    budget: Option<u64>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Size the batch from the data (longest example, its target tokens) instead of assuming
    /// full-length rows where every position is a target. Tokenizes the data (cached).
    #[arg(long)]
    data: bool,
    /// Ranks of a data-parallel run (`mpirun -np N`): the peak is per rank, and the global batch
    /// is micro_batch_size × grad_accum × N. At most 2²⁰ ranks: a larger world is no machine's,
    /// and its products wrapped (issue 46: `--world 18446744073709551615`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=MAX_WORLD))]
    world: u64,
}

pub fn run(a: EstimateArgs) -> Result<()> {
    let mut cfg = rtune_config::load(&a.config, &a.set)?;
    // As `rtune train` does: a GGUF file is converted once into the cache, a hub id downloaded.
    crate::resolve::resolve_model(&mut cfg)?;
    let world = a.world as usize;
    let (model, s) = settings(&cfg, a.data)?;
    let s = s.for_world(&cfg, world);
    // The rows of a step over all ranks (and below, the bytes of all ranks): in u128, which a
    // bounded world times usize settings cannot overflow.
    let global_batch = s.micro_batch_size as u128 * s.grad_accum as u128 * world as u128;
    let (budget, source) = match &a.budget {
        Some(b) => (*b, "--budget"),
        None => match cfg.train.device {
            #[cfg(feature = "cuda")]
            rtune_config::Device::Cuda(n) => (
                rtune_train::memory::device_free_bytes(n)?,
                "free device memory",
            ),
            #[cfg(not(feature = "cuda"))]
            rtune_config::Device::Cuda(_) => anyhow::bail!(
                "[train] device is CUDA and this rtune was built without CUDA: give the device \
                 memory with --budget (e.g. 24GiB)"
            ),
            _ => (
                rtune_train::memory::ram_available_bytes()
                    .context("/proc/meminfo: cannot read MemAvailable; give --budget")?,
                "available RAM",
            ),
        },
    };
    // `gradient_checkpointing = "auto"`: decided as `rtune train` decides it, against this budget.
    let mut s = s;
    let choice = estimate::choose_checkpointing(
        cfg.train.gradient_checkpointing,
        &model,
        &s,
        Some((budget, source)),
    );
    s.gradient_checkpointing = choice.on;
    let est = estimate::estimate(&model, &s);
    let fit = estimate::largest_fitting(&model, &s, budget);
    if a.json {
        let breakdown: serde_json::Map<String, serde_json::Value> = est
            .breakdown
            .iter()
            .map(|(k, v)| (k.clone(), (*v).into()))
            .collect();
        let mut out = serde_json::json!({
            "peak_bytes": est.peak_bytes,
            "phase": est.phase,
            "step_peak_bytes": est.step_peak_bytes,
            "breakdown": breakdown,
            "budget_bytes": budget,
            "max_micro_batch_size": fit.max_micro_batch_size,
            "max_seq_len": fit.max_seq_len,
            "micro_batch_size": s.micro_batch_size,
            "seq_len": s.seq_len,
            "world": world,
            "shard_base": s.shard.is_some(),
            "keep_gathered_layers": s.keep_gathered.min(model.num_layers),
            "prefetch": s.prefetch,
            "global_batch": u64::try_from(global_batch).unwrap_or(u64::MAX),
            "gradient_checkpointing": choice,
        });
        if model.moe.is_some() {
            let (total, active) = estimate::parameters(&model);
            out["parameters"] = total.into();
            out["active_parameters"] = active.into();
        }
        println!("{out}");
        return Ok(());
    }
    print_table(&cfg, &model, &s, &est, budget, source, &fit, a.data);
    let about = rtune_train::objective::about(&cfg);
    if !about.sides.is_empty() {
        println!(
            "objective {}: each pair is 2 rows (chosen, rejected), so micro_batch_size {} pairs \
             is {} rows above{}",
            about.name,
            cfg.train.micro_batch_size,
            s.micro_batch_size,
            match about.reference {
                true =>
                    "; the reference log-probs are one forward pass per pair before training \
                         (below the step's peak)",
                false => "",
            }
        );
    }
    if world > 1 {
        let held = match s.shard {
            Some(_) => {
                let mut held = "each holds 1/world of the frozen base ([distributed] shard_base) \
                                and gathers one layer at a time"
                    .to_string();
                if s.prefetch {
                    held += ", the next one in flight (prefetch)";
                }
                match s.keep_gathered.min(model.num_layers) {
                    0 => held,
                    k => format!(
                        "{held}, keeping the last {k} gathered from the forward for the backward \
                         (keep_gathered_layers)"
                    ),
                }
            }
            None => "each holds the whole model".to_string(),
        };
        println!(
            "world {world}: the peak above is per rank ({held}: {:.1} MB on {world} ranks in \
             all); global batch {} × {} × {world} = {} rows a step",
            (est.peak_bytes as u128 * world as u128) as f64 / 1e6,
            s.micro_batch_size,
            s.grad_accum,
            global_batch
        );
    }
    println!("{}", choice.describe());
    Ok(())
}

/// The model's config and the run's settings, narrowed to the data with `data`.
fn settings(
    cfg: &rtune_config::RunConfig,
    data: bool,
) -> Result<(ModelConfig, Settings), TrainError> {
    let cfg_path = cfg.model.path.join("config.json");
    let mut model = HfConfig::from_file(&cfg_path)?.into_config(&cfg_path)?;
    if let Some(coef) = cfg.train.router_aux_loss_coef {
        model.set_router_aux_loss_coef(coef)?;
    }
    let mut s = estimate::settings_for(cfg)?;
    if data {
        let (data, _) = rtune_train::objective::load_for(cfg)?;
        estimate::fit_to_data(&mut s, &data.train, cfg.data.max_seq_len);
    }
    Ok((model, s))
}

#[allow(clippy::too_many_arguments)]
fn print_table(
    cfg: &rtune_config::RunConfig,
    m: &rtune_model::ModelConfig,
    s: &Settings,
    est: &Estimate,
    budget: u64,
    source: &str,
    fit: &Fit,
    data: bool,
) {
    let mb = |b: u64| format!("{:.1} MB", b as f64 / 1e6);
    let quant = match s.quantize {
        estimate::Quantize::None => String::new(),
        estimate::Quantize::Nf4 {
            double_quant,
            experts,
        } => format!(
            ", NF4{}{}",
            if double_quant { " double-quant" } else { "" },
            if experts {
                ", the expert stacks too"
            } else {
                ""
            }
        ),
    };
    let stacks = match s.target_parameters.is_empty() {
        true => String::new(),
        false => format!(" and the experts' {}", s.target_parameters.join(", ")),
    };
    println!(
        "{}: {} layers, hidden {}, vocab {}; {}{quant}; LoRA r {} on {}{stacks}",
        cfg.model.path.display(),
        m.num_layers,
        m.hidden_size,
        m.vocab_size,
        s.dtype.as_str(),
        s.r,
        s.targets.join(", ")
    );
    if let Some(moe) = &m.moe {
        let (total, active) = estimate::parameters(m);
        println!(
            "mixture of experts: {} experts, {} a token; {:.1} M parameters, {:.1} M active a token",
            moe.experts,
            moe.top_k,
            total as f64 / 1e6,
            active as f64 / 1e6
        );
    }
    let rows = if data {
        format!(
            "rows as the data forms them, {} target rows",
            s.target_rows.unwrap_or(0)
        )
    } else {
        "full-length rows, every position a target".to_string()
    };
    println!(
        "micro_batch_size {} × seq {} ({rows}), gradient checkpointing {}",
        s.micro_batch_size,
        s.seq_len,
        if s.gradient_checkpointing {
            "on"
        } else {
            "off"
        }
    );
    println!();
    for (name, bytes) in &est.breakdown {
        println!("  {name:<40} {:>12}", mb(*bytes));
    }
    println!("  {:<40} {:>12}", "-".repeat(40), "-".repeat(12));
    println!("  {:<40} {:>12}", "peak", mb(est.peak_bytes));
    println!("  at: {}", est.phase);
    if est.step_peak_bytes != est.peak_bytes {
        println!("  (a training step peaks at {})", mb(est.step_peak_bytes));
    }
    println!();
    let verdict = if est.peak_bytes <= budget {
        "fits"
    } else {
        "DOES NOT FIT"
    };
    println!(
        "budget {} ({source}): {verdict} ({:.1}% of it)",
        mb(budget),
        100.0 * est.peak_bytes as f64 / budget as f64
    );
    println!(
        "largest micro_batch_size at seq {}: {}",
        s.seq_len, fit.max_micro_batch_size
    );
    println!(
        "largest max_seq_len at micro_batch_size {}: {}",
        s.micro_batch_size, fit.max_seq_len
    );
}

/// `24GiB`, `16GB`, `512MiB`, `2G` (binary), `1000000` (bytes). Checked by clap, so a bad value
/// is a usage error (exit 2) before the config is read or a model resolved into the cache.
fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{text}`: expected a size like 24GiB, 16GB or 512MiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        other => {
            return Err(format!(
                "`{text}`: unknown unit `{other}` (use B, KB/KiB, MB/MiB, GB/GiB, TB/TiB)"
            ))
        }
    };
    let bytes = (n * mult) as u64;
    if bytes == 0 {
        return Err(format!("`{text}`: must be at least 1 byte"));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn budgets_parse_in_binary_and_decimal_units() {
        assert_eq!(super::parse_bytes("24GiB").unwrap(), 24 << 30);
        assert_eq!(super::parse_bytes("16GB").unwrap(), 16_000_000_000);
        assert_eq!(super::parse_bytes("1.5 G").unwrap(), 3 << 29);
        assert_eq!(super::parse_bytes("4096").unwrap(), 4096);
        assert!(super::parse_bytes("lots").is_err());
        assert!(super::parse_bytes("3 parsecs").is_err());
    }
}
