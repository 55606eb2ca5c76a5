//! `[output] mlflow` for [`RunFiles`]: one MLflow run per rtune run, fed from metrics.jsonl's
//! lines, its ids kept in mlflow.json so a resume continues it.

use std::path::Path;

use super::RunFiles;
use crate::record::RunRecord;
use rtune_config::RunConfig;
use rtune_fsio::write_atomic;
use rtune_track::{Start, Tracker};

/// The file that keeps a run's MLflow ids, so a resume continues the same MLflow run.
pub const MLFLOW_JSON: &str = "mlflow.json";

/// `[output] mlflow`: one MLflow run per rtune run.
impl RunFiles {
    /// Starts the tracker: the resolved config as params, the record's version, commit and
    /// checksums as tags, the run continued when mlflow.json names one.
    pub(super) fn start_tracking(&mut self, cfg: &RunConfig, record: &RunRecord) {
        let Some(url) = cfg.output.mlflow.as_deref().filter(|_| self.writes) else {
            return;
        };
        let saved =
            rtune_fsio::read_bounded(&self.dir.join(MLFLOW_JSON), rtune_fsio::FileKind::RunRecord)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        let run_id = saved
            .as_ref()
            .map(|v| rtune_track::str_at(v, &["run_id"]))
            .filter(|r| !r.is_empty());
        self.tracker_id_saved = run_id.is_some();
        let mut params = Vec::new();
        let config = serde_json::to_value(&cfg.file).expect("config serialises");
        rtune_track::flatten_params("", &config, &mut params);
        let mut tags = vec![
            ("rtune.version".to_string(), record.rtune_version.clone()),
            ("rtune.git_commit".to_string(), record.git_commit.clone()),
            (
                "rtune.cargo_lock_sha256".to_string(),
                record.cargo_lock_sha256.clone(),
            ),
            ("rtune.model_path".to_string(), record.model_path.clone()),
        ];
        for f in &record.model_files {
            let name = Path::new(&f.path)
                .file_name()
                .map_or(f.path.clone(), |n| n.to_string_lossy().into_owned());
            tags.push((format!("rtune.model.{name}.sha256"), f.sha256.clone()));
        }
        for (i, f) in record.data.iter().enumerate() {
            tags.push((format!("rtune.data.{i}.path"), f.path.clone()));
            tags.push((format!("rtune.data.{i}.sha256"), f.sha256.clone()));
        }
        let run_name = self
            .dir
            .file_name()
            .map_or("rtune".into(), |n| n.to_string_lossy().into_owned());
        self.tracker = Some(Tracker::start(Start {
            url: url.to_string(),
            experiment: cfg.output.mlflow_experiment.clone(),
            run_name,
            run_id,
            params,
            tags,
        }));
    }

    /// Sends one metrics.jsonl line's numbers (booleans as 0/1) at its `step`, and saves the
    /// MLflow ids once the run exists.
    pub(super) fn track_line(&mut self, line: &str) {
        let Some(t) = &self.tracker else {
            return;
        };
        let Ok(serde_json::Value::Object(map)) = serde_json::from_str(line) else {
            return;
        };
        let step = map.get("step").and_then(|s| s.as_u64()).unwrap_or(0);
        let values = map
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| {
                let x = v.as_f64().or_else(|| v.as_bool().map(|b| b as u8 as f64))?;
                Some((k.clone(), x))
            })
            .collect();
        t.metrics(step, values);
        if !self.tracker_id_saved {
            if let Some((exp, run)) = t.ids() {
                let text = serde_json::json!({ "experiment_id": exp, "run_id": run }).to_string();
                self.tracker_id_saved =
                    write_atomic(&self.dir.join(MLFLOW_JSON), text.as_bytes(), self.privacy)
                        .is_ok();
            }
        }
    }

    /// The end of the run for MLflow: what is buffered, the adapter, loss.svg and run.json as
    /// artifacts, and `status` (FINISHED, KILLED, FAILED), within `timeout`; a warning on failure.
    pub fn finish_tracking(
        &mut self,
        status: &str,
        timeout: std::time::Duration,
    ) -> Option<String> {
        let t = self.tracker.as_mut()?;
        let artifacts = [
            rtune_lora::ADAPTER_WEIGHTS,
            rtune_lora::ADAPTER_CONFIG,
            "loss.svg",
            "run.json",
        ]
        .iter()
        .map(|n| (n.to_string(), self.dir.join(n)))
        .collect();
        let r = t.finish(status, artifacts, timeout).err();
        if !self.tracker_id_saved {
            if let Some((exp, run)) = t.ids() {
                let text = serde_json::json!({ "experiment_id": exp, "run_id": run }).to_string();
                let _ = write_atomic(&self.dir.join(MLFLOW_JSON), text.as_bytes(), self.privacy);
            }
        }
        r.map(|e| format!("MLflow: {e}"))
    }
}
