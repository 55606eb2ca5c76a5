//! `rtune check`: the pre-flight checks (see `rtune_diag::check`), one line each; exit 1 when any
//! fails. Under `mpirun` (feature `mpi`) every rank runs them in its own scratch directory, its
//! lines prefixed by its rank, then all take part in the all-reduce check (and with
//! `[distributed] shard_base` the gather check: unequal shares gathered exactly).

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
    let world = crate::world()?;
    let verdict = match check_as(a, &world) {
        Ok(v) => v,
        Err(e) if world.is_distributed() => {
            // A rank failing before the all-reduce check would leave the others waiting in it.
            crate::print_error(&format!("rank {} of {}: {e:#}", world.rank, world.size));
            world.abort(i32::from(crate::exit_code(&e)));
        }
        Err(e) => return Err(e),
    };
    // Every rank has printed all its lines and agreed on the verdict: each ends by itself, with
    // no abort that could cut another rank's lines short (a timing check failing on one rank
    // killed the other before it printed its gather line).
    let Verdict {
        checks,
        failed,
        elsewhere,
    } = verdict;
    let who = if world.is_distributed() {
        format!("rank {} of {}: ", world.rank, world.size)
    } else {
        String::new()
    };
    if !failed.is_empty() {
        bail!(
            "{who}{} check(s) failed: {}",
            failed.len(),
            failed.join(", ")
        )
    }
    if elsewhere {
        bail!("{who}all {checks} checks passed here, but another rank's failed")
    }
    println!("all {checks} checks passed");
    Ok(())
}

/// What one rank's checks found, once every rank has finished its own.
struct Verdict {
    /// How many checks ran here.
    checks: usize,
    /// The names of those that failed here.
    failed: Vec<String>,
    /// Some other rank's checks failed (under `mpirun`; false in one process).
    elsewhere: bool,
}

fn check_as(a: CheckArgs, world: &rtune_dist::World) -> Result<Verdict> {
    let CheckArgs { config, set } = a;
    let who = if world.is_distributed() {
        format!("rank {}/{} ({}): ", world.rank, world.size, world.host)
    } else {
        String::new()
    };
    let mut cfg = rtune_config::load(&config, &set)?;
    crate::resolve::resolve_model(&mut cfg)?;
    // The scratch directory has a predictable name under the shared temp dir: created afresh
    // and exclusively (mkdir, 0700, never through a link another user planted there), and removed
    // if a signal stops the check.
    let staging = rtune_fsio::Staging::register(check::temp_dir());
    let tmp = staging.path().to_path_buf();
    let _ = std::fs::remove_dir_all(&tmp);
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .map_err(|e| anyhow::anyhow!("{}: cannot create: {e}", tmp.display()))?;
    }
    eprintln!(
        "{who}rtune check: {} on {} (scratch runs in {})",
        config.display(),
        cfg.model.path.display(),
        tmp.display()
    );
    // `[output] remote`: the probe a run makes at start (write, read back, delete an object).
    let mut remote_failed = false;
    if let Some(url) = cfg.output.remote.as_deref().filter(|_| world.is_root()) {
        let probe = rtune_remote::Remote::open(url).and_then(|r| r.probe());
        remote_failed = probe.is_err();
        let detail = match probe {
            Ok(()) => format!("{url}: wrote, read back and deleted an object"),
            Err(e) => e.to_string(),
        };
        let verdict = if remote_failed { "FAIL" } else { "PASS" };
        println!("{who}{verdict}  {:<30} {detail}", "remote store");
    }
    let print = |c: &rtune_diag::Check| {
        println!(
            "{who}{}  {:<30} {}",
            if c.pass { "PASS" } else { "FAIL" },
            c.name,
            c.detail
        );
    };
    let result = check::run_checks(&cfg, &tmp, &mut |c| print(c));
    let _ = std::fs::remove_dir_all(&tmp);
    let mut checks = result?;
    if world.is_distributed() {
        let c = check::all_reduce(world);
        print(&c);
        checks.push(c);
        // A sharded base gathers every layer's weights from every rank.
        if cfg.distributed.shard_base {
            let c = check::all_gather(world);
            print(&c);
            checks.push(c);
        }
    }
    let mut failed: Vec<String> = checks
        .iter()
        .filter(|c| !c.pass)
        .map(|c| c.name.clone())
        .collect();
    if remote_failed {
        failed.push("remote store".into());
    }
    // Collective: no rank ends before every rank has printed its lines.
    let any = world.any("rtune check's verdict", !failed.is_empty());
    Ok(Verdict {
        checks: checks.len(),
        elsewhere: any && failed.is_empty(),
        failed,
    })
}
