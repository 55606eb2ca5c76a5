//! `rtune selftest`: the CUDA path against the CPU (see `rtune_diag::selftest`).

use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct SelftestArgs {
    /// The GPU to check: cuda or cuda:N (needs a build with `--features cuda`).
    #[arg(long, default_value = "cuda:0")]
    device: String,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

/// Prints one PASS/FAIL line per check; an error (exit 1) when any failed.
pub fn run(a: SelftestArgs) -> Result<()> {
    let r = rtune_diag::selftest::run(&a.device)?;
    for c in &r.checks {
        println!(
            "{}  {:<64} {}",
            if c.pass { "PASS" } else { "FAIL" },
            c.name,
            c.detail
        );
    }
    if let (Some(nf4), Some(copy)) = (r.nf4_dequant_gb_s, r.copy_gb_s) {
        println!(
            "NF4 dequant {nf4:.0} GB/s, device copy {copy:.0} GB/s: {:.1}% of copy (goal ≥ 85%)",
            100.0 * nf4 / copy
        );
    }
    if let Some(p) = a.json_out {
        std::fs::write(&p, serde_json::to_string_pretty(&r)?)
            .with_context(|| format!("{}", p.display()))?;
    }
    let failed = r.checks.iter().filter(|c| !c.pass).count();
    if failed > 0 {
        bail!("selftest: {failed} of {} checks failed", r.checks.len());
    }
    println!("selftest: all {} checks passed", r.checks.len());
    Ok(())
}
