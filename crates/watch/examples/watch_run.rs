//! Replays a run's `metrics.jsonl` into `RUN/tb/` (TensorBoard) and draws `RUN/loss.svg`:
//!
//!     cargo run -p rtune-watch --example watch_run -- runs/smoke
//!     tensorboard --logdir runs/smoke/tb
//!
//! The trainer writes both while it runs; this is for runs made before it did, and for checking the
//! files with TensorBoard's own reader (scripts/check_tensorboard.py).

use rtune_fsio::Privacy;
use rtune_watch::{plot_run, TbWriter, TB_DIR};
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = PathBuf::from(std::env::args().nth(1).ok_or("usage: watch_run RUN_DIR")?);
    let text = std::fs::read_to_string(run.join("metrics.jsonl"))?;
    let mut tb = TbWriter::create(&run.join(TB_DIR), Privacy::PRIVATE)?;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let Some(step) = v.get("step").and_then(|s| s.as_u64()) else {
            continue;
        };
        let values: Vec<(&str, f64)> = [
            ("train/loss", "loss"),
            ("train/lr", "lr"),
            ("train/grad_norm", "grad_norm"),
            ("train/tokens_per_s", "tokens_per_s"),
            ("valid/loss", "valid_loss"),
            ("valid/ppl", "valid_ppl"),
        ]
        .into_iter()
        .filter_map(|(tag, k)| Some((tag, v.get(k)?.as_f64()?)))
        .collect();
        tb.scalars(step, &values)?;
    }
    tb.flush()?;
    println!("{}", tb.path().display());
    println!("{}", plot_run(&run, Privacy::PRIVATE)?.display());
    Ok(())
}
