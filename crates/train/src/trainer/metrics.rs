//! What a run reports about its numbers: [`StepMetrics`] (one metrics.jsonl line and one set of
//! TensorBoard scalars a step), [`Summary`] (summary.json), and the median the summary's speed is.

use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::evaluate::EvalMetrics;

/// One line of metrics.jsonl.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub step: usize,
    /// Mean loss over all target tokens of this step's micro-batches, before the update.
    pub loss: f64,
    pub lr: f64,
    /// Global L2 norm of the LoRA gradients before clipping.
    pub grad_norm: f64,
    /// Non-padding input tokens in the step.
    pub tokens: usize,
    /// Tokens that carried a loss.
    pub target_tokens: usize,
    pub tokens_per_s: f64,
    /// The update was skipped: the loss or a gradient was NaN/Inf.
    pub skipped: bool,
    /// f16 only: the loss scale this step's gradients were computed with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// The objective's own metrics of the step, under its names
    /// ([`Recipe::metrics`](crate::objective::Recipe::metrics)); empty for none.
    #[serde(flatten)]
    pub recipe: BTreeMap<String, f64>,
    /// Peak memory so far: resident set of the process on the CPU, device memory on CUDA.
    pub peak_memory_bytes: u64,
    /// What `rtune estimate` predicted for this run's peak (CPU runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_peak_bytes: Option<u64>,
    pub elapsed_s: f64,
}

impl StepMetrics {
    /// The TensorBoard scalars of a step (the objective's own under `train/` too).
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let mut v: Vec<(String, f64)> = [
            ("train/loss", self.loss),
            ("train/lr", self.lr),
            ("train/grad_norm", self.grad_norm),
            ("train/tokens_per_s", self.tokens_per_s),
            ("train/peak_memory_mb", self.peak_memory_bytes as f64 / 1e6),
        ]
        .into_iter()
        .map(|(k, x)| (k.to_string(), x))
        .collect();
        v.extend(self.recipe.iter().map(|(k, &x)| (format!("train/{k}"), x)));
        v
    }
}

/// The TensorBoard scalars of an evaluation.
pub fn eval_scalars(ev: &EvalMetrics) -> Vec<(String, f64)> {
    let mut v = vec![("valid/loss".to_string(), ev.valid_loss)];
    v.extend(ev.valid_ppl.map(|p| ("valid/ppl".to_string(), p)));
    v.extend(ev.recipe.iter().map(|(k, &x)| (format!("valid/{k}"), x)));
    v
}

/// summary.json.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub steps: usize,
    pub final_loss: f64,
    /// Median over steps after the first (the first includes warm-up costs).
    pub tokens_per_s: f64,
    pub peak_memory_bytes: u64,
    /// `rtune estimate`'s prediction of `peak_memory_bytes` (CPU runs).
    pub estimated_peak_bytes: Option<u64>,
    pub wall_s: f64,
    pub total_tokens: usize,
    pub lora_params: usize,
    /// Bytes of the frozen weights as held (4-bit layers at their packed size).
    pub model_bytes: usize,
    pub examples: usize,
    pub epochs_started: usize,
    /// Steps whose update was skipped for a non-finite loss or gradient.
    pub skipped_steps: usize,
    /// The forward passes of the objective's reference pass (once per row, before training;
    /// none for an objective without one).
    #[serde(skip_serializing_if = "is_zero")]
    pub reference_passes: usize,
    /// A distributed run's per-rank `peak_memory_bytes` (and `model_bytes`), in rank order:
    /// what a sharded base divides. Empty (absent) for one process.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rank_peak_memory_bytes: Vec<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rank_model_bytes: Vec<u64>,
    pub output_dir: PathBuf,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The median of `v` (the mean of the middle two for an even count; 0 when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(super::median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(super::median(&[]), 0.0);
    }
}
