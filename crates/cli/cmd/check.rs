//! `rtune check`: the pre-flight checks (see `rtune_diag::check`), one line each; exit 1 when any
//! fails.

use anyhow::{bail, Result};
use std::path::PathBuf;

use rtune_diag::check;

#[derive(clap::Args)]
pub struct CheckArgs {
    #[arg(long)]
    config: PathBuf,
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
}

pub fn run(a: CheckArgs) -> Result<()> {
    let CheckArgs { config, set } = a;
    let mut cfg = rtune_config::load(&config, &set)?;
    crate::resolve::resolve_model(&mut cfg)?;
    let tmp = check::temp_dir();
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    eprintln!(
        "rtune check: {} on {} (scratch runs in {})",
        config.display(),
        cfg.model_path.display(),
        tmp.display()
    );
    // `[output] remote`: the probe a run makes at start (write, read back, delete an object).
    let mut remote_failed = false;
    if let Some(url) = cfg.remote.as_deref() {
        let probe = rtune_remote::Remote::open(url).and_then(|r| r.probe());
        remote_failed = probe.is_err();
        let detail = match probe {
            Ok(()) => format!("{url}: wrote, read back and deleted an object"),
            Err(e) => e.to_string(),
        };
        let verdict = if remote_failed { "FAIL" } else { "PASS" };
        println!("{verdict}  {:<30} {detail}", "remote store");
    }
    let result = check::run_checks(&cfg, &tmp, &mut |c| {
        println!(
            "{}  {:<30} {}",
            if c.pass { "PASS" } else { "FAIL" },
            c.name,
            c.detail
        );
    });
    let _ = std::fs::remove_dir_all(&tmp);
    let checks = result?;
    let mut failed: Vec<&str> = checks
        .iter()
        .filter(|c| !c.pass)
        .map(|c| c.name.as_str())
        .collect();
    if remote_failed {
        failed.push("remote store");
    }
    if failed.is_empty() {
        println!("all {} checks passed", checks.len());
        Ok(())
    } else {
        bail!("{} check(s) failed: {}", failed.len(), failed.join(", "))
    }
}
