//! `rtune selftest`: the CUDA path against the CPU (see `rtune_diag::selftest`). Every check prints
//! its PASS/FAIL line as it completes and the JSON report (`--json-out`) is rewritten atomically
//! after each, so a run that dies midway still leaves every result so far. The seed is printed
//! first; `--seed` reproduces a run's inputs. Exit 1 when any check failed.
//! Test hook: `RTUNE_SELFTEST_INJECT_FAIL=<text>` fails every check whose name contains `<text>`.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

use rtune_diag::selftest::{Report, INJECT_ENV};

#[derive(clap::Args)]
pub struct SelftestArgs {
    /// The device to check: cuda or cuda:N (needs a build with `--features cuda`); cpu runs the
    /// training-step checks CPU against CPU (the harness only).
    #[arg(long, default_value = "cuda:0")]
    device: String,
    /// Seed of every random input (default: from the clock; printed either way).
    #[arg(long)]
    seed: Option<u64>,
    /// Also write the report as JSON to this file (rewritten after every check).
    #[arg(long)]
    json_out: Option<PathBuf>,
}

fn write_report(path: &Path, r: &Report) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(r)?;
    rtune_fsio::write_atomic(path, &bytes, rtune_fsio::Privacy::SHARED)
        .with_context(|| format!("{}", path.display()))
}

/// Prints one PASS/FAIL line per check as it completes; an error (exit 1) when any failed.
pub fn run(a: SelftestArgs) -> Result<()> {
    let seed = a.seed.unwrap_or_else(rtune_diag::selftest::clock_seed);
    println!(
        "rtune selftest on {}, seed {seed} (rerun with --seed {seed})",
        a.device
    );
    let inject = std::env::var(INJECT_ENV).ok();
    if let Some(i) = &inject {
        println!("{INJECT_ENV}={i}: checks whose name contains it fail (test hook)");
    }
    let mut write_err = None;
    let mut on_check = |c: &rtune_diag::Check, r: &Report| {
        println!(
            "{}  {:<64} {}",
            if c.pass { "PASS" } else { "FAIL" },
            c.name,
            c.detail
        );
        if let (Some(p), None) = (&a.json_out, &write_err) {
            write_err = write_report(p, r).err();
        }
    };
    let r = rtune_diag::selftest::run(&a.device, seed, inject, &mut on_check)?;
    if let Some(e) = write_err {
        return Err(e);
    }
    if let Some(p) = &a.json_out {
        write_report(p, &r)?;
    }
    let failed = r.checks.iter().filter(|c| !c.pass).count();
    if failed > 0 {
        bail!(
            "selftest: {failed} of {} checks failed (seed {seed})",
            r.checks.len()
        );
    }
    println!("selftest: all {} checks passed", r.checks.len());
    Ok(())
}
