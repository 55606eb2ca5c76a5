//! MLflow tracking over its REST API (MLflow's `/api/2.0/mlflow/...`, the same calls the Python
//! client makes):
//! - [`Client`]: blocking calls — `experiments/get-by-name` and `create`, `runs/create`, `get`,
//!   `log-batch` (params, tags, metrics), `update` (status), and artifacts through the tracking
//!   server's artifact proxy (`PUT /api/2.0/mlflow-artifacts/artifacts/<exp>/<run>/artifacts/<path>`,
//!   the server started with `--serve-artifacts`, its default);
//! - [`tracker`]: the background thread a run talks to, which never stops training: an unreachable
//!   server is a warning, metrics are buffered and sent when it returns, and the end of the run
//!   makes a last attempt.
//!
//! Limits MLflow sets on one `log-batch`: 1000 metrics, 100 params, 100 tags (1000 items in all);
//! params are at most 6000 characters. Non-finite metric values are not sent (JSON has no NaN).

pub mod tracker;

use serde_json::{json, Value};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use tracker::{Start, Tracker};

#[derive(Debug, thiserror::Error)]
pub enum TrackError {
    /// No answer (connection refused, timeout).
    #[error("{url}: unreachable ({message})")]
    Unreachable { url: String, message: String },
    /// The server answered with an error.
    #[error("{url}: HTTP {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
}

/// One metric value at a step.
#[derive(Debug, Clone)]
pub struct Metric {
    pub key: String,
    pub value: f64,
    pub step: u64,
    /// Milliseconds since the Unix epoch.
    pub timestamp: u64,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// An MLflow tracking server at `base` (`http://host:5000`).
pub struct Client {
    base: String,
    agent: ureq::Agent,
}

impl Client {
    pub fn new(base: &str, timeout: Duration) -> Self {
        let config = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build();
        Self {
            base: base.trim_end_matches('/').to_string(),
            agent: ureq::Agent::new_with_config(config),
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn answer(
        &self,
        url: &str,
        r: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Value, TrackError> {
        let mut r = r.map_err(|e| TrackError::Unreachable {
            url: self.base.clone(),
            message: e.to_string(),
        })?;
        let status = r.status().as_u16();
        let body = r.body_mut().read_to_string().unwrap_or_default();
        if !(200..300).contains(&status) {
            return Err(TrackError::Status {
                url: url.to_string(),
                status,
                body: body.chars().take(300).collect(),
            });
        }
        Ok(serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// POST `/api/2.0/mlflow/<path>` with a JSON body.
    pub fn post(&self, path: &str, body: &Value) -> Result<Value, TrackError> {
        let url = format!("{}/api/2.0/mlflow/{path}", self.base);
        self.answer(&url, self.agent.post(&url).send_json(body))
    }

    /// GET `/api/2.0/mlflow/<path>?<query>`.
    pub fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Value, TrackError> {
        let url = format!("{}/api/2.0/mlflow/{path}", self.base);
        let mut req = self.agent.get(&url);
        for (k, v) in query {
            req = req.query(*k, *v);
        }
        self.answer(&url, req.call())
    }

    /// The id of experiment `name`, created if missing.
    pub fn experiment(&self, name: &str) -> Result<String, TrackError> {
        match self.get("experiments/get-by-name", &[("experiment_name", name)]) {
            Ok(v) => Ok(str_at(&v, &["experiment", "experiment_id"])),
            Err(TrackError::Status { status: 404, .. }) => {
                let v = self.post("experiments/create", &json!({ "name": name }))?;
                Ok(str_at(&v, &["experiment_id"]))
            }
            Err(e) => Err(e),
        }
    }

    /// A new run in `experiment_id` tagged `rtune_uid = uid`; its id. A run with that tag made by
    /// an earlier attempt whose answer was lost (a timeout) is reused, not duplicated.
    pub fn create_run(
        &self,
        experiment_id: &str,
        run_name: &str,
        uid: &str,
    ) -> Result<String, TrackError> {
        let found = self.post(
            "runs/search",
            &json!({ "experiment_ids": [experiment_id], "filter": format!("tags.rtune_uid = '{uid}'") }),
        )?;
        let existing = str_at(&found, &["runs", "0", "info", "run_id"]);
        if !existing.is_empty() {
            return Ok(existing);
        }
        let v = self.post(
            "runs/create",
            &json!({ "experiment_id": experiment_id, "run_name": run_name, "start_time": now_ms(),
                     "tags": [{ "key": "rtune_uid", "value": uid }] }),
        )?;
        Ok(str_at(&v, &["run", "info", "run_id"]))
    }

    /// The run's info (`status`, `artifact_uri`, ...) and data (`params`, `tags`, latest
    /// `metrics`), as MLflow returns them.
    pub fn get_run(&self, run_id: &str) -> Result<Value, TrackError> {
        self.get("runs/get", &[("run_id", run_id)])
    }

    /// One `log-batch` (the caller keeps to MLflow's limits).
    pub fn log_batch(
        &self,
        run_id: &str,
        metrics: &[Metric],
        params: &[(String, String)],
        tags: &[(String, String)],
    ) -> Result<(), TrackError> {
        let metrics: Vec<Value> = metrics
            .iter()
            .map(|m| json!({ "key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step }))
            .collect();
        let kv = |xs: &[(String, String)]| -> Vec<Value> {
            xs.iter()
                .map(|(k, v)| json!({ "key": k, "value": v }))
                .collect()
        };
        let body =
            json!({ "run_id": run_id, "metrics": metrics, "params": kv(params), "tags": kv(tags) });
        self.post("runs/log-batch", &body).map(|_| ())
    }

    /// Sets the run's status: RUNNING, FINISHED, FAILED or KILLED (an end time with the last three).
    pub fn set_status(&self, run_id: &str, status: &str) -> Result<(), TrackError> {
        let mut body = json!({ "run_id": run_id, "status": status });
        if status != "RUNNING" {
            body["end_time"] = json!(now_ms());
        }
        self.post("runs/update", &body).map(|_| ())
    }

    /// The artifact proxy's URL of `rel` in the run whose `artifact_uri` is
    /// `mlflow-artifacts:/<exp>/<run>/artifacts`.
    pub fn artifact_url(&self, artifact_uri: &str, rel: &str) -> String {
        let path = artifact_uri
            .strip_prefix("mlflow-artifacts:")
            .unwrap_or(artifact_uri)
            .trim_start_matches('/');
        format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{path}/{rel}",
            self.base
        )
    }

    /// Uploads `bytes` as the run's artifact `rel`.
    pub fn put_artifact(
        &self,
        artifact_uri: &str,
        rel: &str,
        bytes: &[u8],
    ) -> Result<(), TrackError> {
        let url = self.artifact_url(artifact_uri, rel);
        let r = self
            .agent
            .put(&url)
            .content_type("application/octet-stream")
            .send(bytes);
        self.answer(&url, r).map(|_| ())
    }

    /// Downloads the run's artifact `rel`.
    pub fn get_artifact(&self, artifact_uri: &str, rel: &str) -> Result<Vec<u8>, TrackError> {
        let url = self.artifact_url(artifact_uri, rel);
        let mut r = self
            .agent
            .get(&url)
            .call()
            .map_err(|e| TrackError::Unreachable {
                url: self.base.clone(),
                message: e.to_string(),
            })?;
        let status = r.status().as_u16();
        if status != 200 {
            return Err(TrackError::Status {
                url,
                status,
                body: String::new(),
            });
        }
        r.body_mut()
            .with_config()
            .limit(u64::MAX)
            .read_to_vec()
            .map_err(|e| TrackError::Unreachable {
                url: self.base.clone(),
                message: e.to_string(),
            })
    }
}

/// The string at `path` in `v` ("" when absent).
pub fn str_at(v: &Value, path: &[&str]) -> String {
    let mut v = v;
    for p in path {
        v = match p.parse::<usize>() {
            Ok(i) => &v[i],
            Err(_) => &v[*p],
        };
    }
    v.as_str().unwrap_or_default().to_string()
}

/// The resolved config (as JSON) flattened into MLflow params: `train.lr = "0.0002"`; arrays as
/// their JSON text; values cut to MLflow's 6000 characters.
pub fn flatten_params(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(map) => {
            for (k, x) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten_params(&key, x, out);
            }
        }
        Value::String(s) => out.push((prefix.to_string(), s.chars().take(6000).collect())),
        other => out.push((
            prefix.to_string(),
            other.to_string().chars().take(6000).collect(),
        )),
    }
}
