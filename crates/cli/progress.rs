//! Training progress on stderr: an indicatif bar (step, loss, lr, tokens/s, peak memory, ETA) on a
//! terminal; plain lines every `log_every` steps otherwise (logs, CI, pipes).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

use rtune_train::StepMetrics;

pub struct Progress {
    bar: Option<ProgressBar>,
    steps: usize,
    every: usize,
}

impl Progress {
    pub fn new(steps: usize, every: usize) -> Self {
        let tty = std::io::stderr().is_terminal() && std::env::var_os("RTUNE_PLAIN").is_none();
        let bar = tty.then(|| {
            let b = ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} {pos}/{len} {msg}  [{elapsed_precise} < {eta_precise}]",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            b
        });
        Self { bar, steps, every }
    }

    /// Resumed runs start the bar where the checkpoint left off.
    pub fn start_at(&self, step: usize) {
        if let Some(b) = &self.bar {
            b.set_position(step as u64);
            b.reset_eta();
        }
    }

    pub fn step(&self, m: &StepMetrics) {
        let acc = objective_part(m);
        let text = format!(
            "loss {:.4}{acc}  lr {:.3e}  grad_norm {:.3}  {:.0} tok/s  peak {:.0} MB",
            m.loss,
            m.lr,
            m.grad_norm,
            m.tokens_per_s,
            m.peak_memory_bytes as f64 / 1e6
        );
        match &self.bar {
            Some(b) => {
                b.set_position(m.step as u64);
                b.set_message(text);
            }
            None if m.step.is_multiple_of(self.every) || m.step == self.steps => {
                eprintln!("step {:>5}/{}  {text}", m.step, self.steps)
            }
            None => {}
        }
    }

    /// A line that must stay visible (checkpoint, evaluation): above the bar on a terminal.
    pub fn line(&self, text: &str) {
        match &self.bar {
            Some(b) => b.println(text),
            None => eprintln!("{text}"),
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// What the step's objective adds to the line, from its metrics: a preference step's reward
/// accuracy (the share of pairs ranked right); a GRPO step's mean reward and mean completion
/// length (TRL's `reward`, `completions/mean_length`).
fn objective_part(m: &StepMetrics) -> String {
    let get = |k: &str| m.recipe.get(k).copied();
    let mut out = String::new();
    if let Some(a) = get("rewards/accuracies") {
        out += &format!("  reward acc {a:.3}");
    }
    if let (Some(r), Some(len)) = (get("reward"), get("completions/mean_length")) {
        out += &format!("  reward {r:.3}  len {len:.1}");
    }
    out
}
