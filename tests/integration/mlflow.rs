//! `[output] mlflow` against a real `mlflow server` (PyPI `mlflow` in the venv that
//! scripts/deps/mlflow.sh makes), started by each test on a free 127.0.0.1 port with a SQLite
//! store and the artifact proxy. Everything is read back through MLflow's REST API: the params
//! (the resolved config), every step's metrics equal to metrics.jsonl, the artifacts byte for byte,
//! the status; and a server killed mid-run: training finishes and the metrics arrive after the
//! restart.

use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::{root, stderr};
use crate::remote::{free_port, wait_for_port};
use crate::resume::config;

/// Where scripts/deps/mlflow.sh installs the server.
fn mlflow_bin() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache"));
    let bin = cache.join("rtune-deps/mlflow/bin/mlflow");
    assert!(
        bin.is_file(),
        "{} is missing: run scripts/test.sh (or scripts/deps/mlflow.sh) to install the MLflow test server",
        bin.display()
    );
    bin
}

/// An `mlflow server` over `dir` (SQLite store, proxied artifacts); killed when dropped.
struct Mlflow {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl Mlflow {
    fn start(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut m = Self {
            child: None,
            port: free_port(),
            dir: dir.to_path_buf(),
        };
        m.restart();
        m
    }

    fn restart(&mut self) {
        let db = format!("sqlite:///{}", self.dir.join("mlflow.db").display());
        let child = Command::new(mlflow_bin())
            .args([
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                &self.port.to_string(),
            ])
            .args(["--workers", "1", "--backend-store-uri", &db])
            .arg("--artifacts-destination")
            .arg(self.dir.join("artifacts"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start mlflow server");
        self.child = Some(child);
        wait_for_port(self.port, "mlflow server", Duration::from_secs(180));
        // The port opens before the app answers.
        let t0 = std::time::Instant::now();
        while self
            .get("experiments/search", &[("max_results", "1")])
            .is_none()
        {
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "mlflow server does not answer"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Kills the server and its workers (its process group).
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on the process group of our own child; no memory is involved.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn get(&self, path: &str, query: &[(&str, &str)]) -> Option<Value> {
        let mut req = ureq::get(format!("{}/api/2.0/mlflow/{path}", self.url()));
        for (k, v) in query {
            req = req.query(*k, *v);
        }
        req.call().ok()?.body_mut().read_json().ok()
    }

    fn get_ok(&self, path: &str, query: &[(&str, &str)]) -> Value {
        self.get(path, query)
            .unwrap_or_else(|| panic!("GET {path} {query:?} failed"))
    }

    /// The only run of `experiment`.
    fn run(&self, experiment: &str) -> Value {
        let exp = self.get_ok(
            "experiments/get-by-name",
            &[("experiment_name", experiment)],
        );
        let id = exp["experiment"]["experiment_id"]
            .as_str()
            .unwrap()
            .to_string();
        let body = serde_json::json!({ "experiment_ids": [id] });
        let found: Value = ureq::post(format!("{}/api/2.0/mlflow/runs/search", self.url()))
            .send_json(&body)
            .unwrap()
            .body_mut()
            .read_json()
            .unwrap();
        let runs = found["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 1, "{found}");
        runs[0].clone()
    }

    /// `(step, value)` of every logged value of `key`.
    fn history(&self, run_id: &str, key: &str) -> Vec<(u64, f64)> {
        let h = self.get_ok(
            "metrics/get-history",
            &[
                ("run_id", run_id),
                ("metric_key", key),
                ("max_results", "10000"),
            ],
        );
        let mut v: Vec<(u64, f64)> = h["metrics"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|m| {
                        (
                            m["step"].as_u64().unwrap_or(0),
                            m["value"].as_f64().unwrap(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort_by_key(|a| a.0);
        v
    }

    fn artifact(&self, artifact_uri: &str, rel: &str) -> Vec<u8> {
        let path = artifact_uri
            .trim_start_matches("mlflow-artifacts:")
            .trim_start_matches('/');
        let url = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{path}/{rel}",
            self.url()
        );
        ureq::get(&url)
            .call()
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
            .body_mut()
            .with_config()
            .limit(u64::MAX)
            .read_to_vec()
            .unwrap()
    }
}

impl Drop for Mlflow {
    fn drop(&mut self) {
        self.stop();
    }
}

fn spawn(cfg: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_rtune"))
        .args(["train", "--config", cfg.to_str().unwrap()])
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The losses of metrics.jsonl, by step.
fn losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap()))
        .collect()
}

fn param<'a>(run: &'a Value, key: &str) -> &'a str {
    run["data"]["params"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["key"] == key)
        .and_then(|p| p["value"].as_str())
        .unwrap_or_else(|| panic!("no param {key}"))
}

/// Params, tags, every step's metrics, the artifacts and FINISHED, read back from the server.
#[test]
fn a_run_is_tracked_in_mlflow() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Mlflow::start(&tmp.path().join("mlflow"));
    let out = tmp.path().join("tracked");
    let extra = format!(
        "mlflow = \"{}\"\nmlflow_experiment = \"rtune-it\"",
        server.url()
    );
    let cfg = config(tmp.path(), &out, &extra);
    let o = spawn(&cfg).wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));

    let run = server.run("rtune-it");
    let info = &run["info"];
    assert_eq!(info["status"], "FINISHED", "{run}");
    let run_id = info["run_id"].as_str().unwrap();
    let saved: Value =
        serde_json::from_slice(&std::fs::read(out.join("mlflow.json")).unwrap()).unwrap();
    assert_eq!(saved["run_id"], run_id);
    assert_eq!(param(&run, "train.lr"), "0.005");
    assert_eq!(param(&run, "train.steps"), "30");
    assert_eq!(param(&run, "lora.r"), "4");
    let tags = run["data"]["tags"].as_array().unwrap();
    assert!(tags
        .iter()
        .any(|t| t["key"] == "rtune.version" && t["value"] == env!("CARGO_PKG_VERSION")));
    assert!(tags.iter().any(|t| t["key"] == "rtune.data.0.sha256"));
    // f64 → MLflow's double → JSON: the same number.
    assert_eq!(server.history(run_id, "loss"), losses(&out));
    assert_eq!(server.history(run_id, "grad_norm").len(), 30);
    assert_eq!(server.history(run_id, "target_tokens").len(), 30);
    let uri = info["artifact_uri"].as_str().unwrap();
    for f in [
        "adapter_model.safetensors",
        "adapter_config.json",
        "loss.svg",
        "run.json",
    ] {
        assert_eq!(
            server.artifact(uri, f),
            std::fs::read(out.join(f)).unwrap(),
            "{f}"
        );
    }
}

/// The server is killed after a few steps and restarted later: training never waits, and every
/// step's loss is in MLflow at the end.
#[test]
fn metrics_arrive_after_the_server_returns() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = Mlflow::start(&tmp.path().join("mlflow"));
    let out = tmp.path().join("interrupted");
    let extra = format!(
        "mlflow = \"{}\"\nmlflow_experiment = \"rtune-kill\"",
        server.url()
    );
    let cfg = config(tmp.path(), &out, &extra);
    let child = spawn(&cfg);
    let t0 = std::time::Instant::now();
    while !out.join("mlflow.json").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the MLflow run was not created"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    server.stop();
    let steps =
        || std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |m| m.lines().count());
    let down_at = steps();
    let t0 = std::time::Instant::now();
    while steps() < (down_at + 3).min(30) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "training stopped with the server down"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    server.restart();
    let o = child.wait_with_output().unwrap();
    let log = stderr(&o);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("metrics are buffered"), "{log}");
    let run = server.run("rtune-kill");
    assert_eq!(run["info"]["status"], "FINISHED", "{run}");
    let run_id = run["info"]["run_id"].as_str().unwrap();
    assert_eq!(server.history(run_id, "loss"), losses(&out));
}
