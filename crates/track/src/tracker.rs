//! [`Tracker`]: one MLflow run fed from a background thread. The trainer hands it each
//! metrics.jsonl line's numbers and returns at once; the thread
//!
//! 1. finds or creates the experiment and the run (or continues the run whose id the caller
//!    passes: a resumed rtune run is the same MLflow run, set RUNNING again), then logs the params
//!    and tags once;
//! 2. sends the buffered metrics through `log-batch`, up to 1000 a request;
//! 3. at [`finish`](Tracker::finish): the remaining metrics, the artifacts, and the run's status
//!    (FINISHED, FAILED or KILLED), by a deadline.
//!
//! A failure keeps everything buffered and is retried with backoff (0.5 s doubling to 10 s); the
//! first failure of a streak and the recovery are reported as notices, never as errors.

use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{now_ms, str_at, Client, Metric, TrackError};

/// What the run is logged as.
pub struct Start {
    /// `http://host:5000`.
    pub url: String,
    pub experiment: String,
    pub run_name: String,
    /// The MLflow run to continue (a resumed rtune run), if any.
    pub run_id: Option<String>,
    pub params: Vec<(String, String)>,
    pub tags: Vec<(String, String)>,
}

#[derive(Default)]
struct Shared {
    /// `(experiment id, run id)` once the run exists.
    ids: Option<(String, String)>,
    notices: Vec<String>,
}

enum Msg {
    Metrics(Vec<Metric>),
    Finish {
        status: String,
        artifacts: Vec<(String, PathBuf)>,
        deadline: Instant,
        reply: Sender<Result<(), String>>,
    },
}

/// The handle the run's writer holds.
pub struct Tracker {
    tx: Option<Sender<Msg>>,
    shared: Arc<Mutex<Shared>>,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

impl Tracker {
    /// Starts the thread; nothing here waits for the server.
    pub fn start(s: Start) -> Self {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Mutex::new(Shared::default()));
        let w = Worker {
            client: Client::new(&s.url, Duration::from_secs(30)),
            shared: Arc::clone(&shared),
            start: s,
            artifact_uri: String::new(),
            logged_params: false,
            uid: format!("{}-{}", std::process::id(), now_ms()),
        };
        std::thread::Builder::new()
            .name("rtune-mlflow".into())
            .spawn(move || w.run(rx))
            .expect("spawn the MLflow thread");
        Self {
            tx: Some(tx),
            shared,
        }
    }

    /// `(experiment id, run id)` once the run exists on the server.
    pub fn ids(&self) -> Option<(String, String)> {
        self.shared.lock().expect("tracker").ids.clone()
    }

    /// Queues one line's numbers at `step` (non-finite values dropped).
    pub fn metrics(&self, step: u64, values: Vec<(String, f64)>) {
        let timestamp = now_ms();
        let ms: Vec<Metric> = values
            .into_iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(key, value)| Metric {
                key,
                value,
                step,
                timestamp,
            })
            .collect();
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::Metrics(ms));
        }
    }

    /// What happened since the last call, one line each.
    pub fn take_notices(&self) -> Vec<String> {
        std::mem::take(&mut self.shared.lock().expect("tracker").notices)
    }

    /// Sends what is buffered, uploads `artifacts` (`(name, local path)`, missing ones skipped)
    /// and sets `status`, waiting at most `timeout`; the error says what did not get there.
    pub fn finish(
        &mut self,
        status: &str,
        artifacts: Vec<(String, PathBuf)>,
        timeout: Duration,
    ) -> Result<(), String> {
        let Some(tx) = self.tx.take() else {
            return Ok(());
        };
        let (reply, answer) = mpsc::channel();
        let msg = Msg::Finish {
            status: status.to_string(),
            artifacts,
            deadline: Instant::now() + timeout,
            reply,
        };
        if tx.send(msg).is_err() {
            return Err("the MLflow thread has stopped".into());
        }
        answer
            .recv_timeout(timeout + Duration::from_secs(15))
            .unwrap_or_else(|_| Err("the MLflow thread did not answer".into()))
    }
}

struct Worker {
    client: Client,
    shared: Arc<Mutex<Shared>>,
    start: Start,
    artifact_uri: String,
    logged_params: bool,
    /// Tags the run this process creates, so a retried create finds it.
    uid: String,
}

struct Ending {
    status: String,
    artifacts: Vec<(String, PathBuf)>,
    deadline: Instant,
    reply: Sender<Result<(), String>>,
}

impl Worker {
    fn notice(&self, n: String) {
        self.shared.lock().expect("tracker").notices.push(n);
    }

    fn run_id(&self) -> Option<String> {
        self.shared
            .lock()
            .expect("tracker")
            .ids
            .as_ref()
            .map(|(_, r)| r.clone())
    }

    fn run(mut self, rx: Receiver<Msg>) {
        let mut buffer: Vec<Metric> = Vec::new();
        let mut ending: Option<Ending> = None;
        let (mut backoff, mut retry_at, mut failing) = (FIRST_BACKOFF, None::<Instant>, false);
        loop {
            let busy = !buffer.is_empty() || ending.is_some() || self.run_id().is_none();
            let msg = if busy {
                let wait = retry_at.map_or(Duration::ZERO, |t| {
                    t.saturating_duration_since(Instant::now())
                });
                match rx.recv_timeout(wait) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) if ending.is_none() => return,
                    Err(RecvTimeoutError::Disconnected) => None,
                }
            } else {
                match rx.recv() {
                    Ok(m) => Some(m),
                    Err(_) => return,
                }
            };
            match msg {
                Some(Msg::Metrics(ms)) => {
                    buffer.extend(ms);
                    continue;
                }
                Some(Msg::Finish {
                    status,
                    artifacts,
                    deadline,
                    reply,
                }) => {
                    ending = Some(Ending {
                        status,
                        artifacts,
                        deadline,
                        reply,
                    });
                    continue;
                }
                None => {}
            }
            if let Some(e) = &ending {
                if Instant::now() >= e.deadline {
                    let _ = e.reply.send(Err(format!(
                        "{}: not reached in time; {} metric values, {} artifact(s) and the final status not sent",
                        self.client.base(),
                        buffer.len(),
                        e.artifacts.len()
                    )));
                    return;
                }
            }
            let r = self.work(&mut buffer, &mut ending);
            match r {
                Ok(true) => return,
                Ok(false) => {
                    if failing {
                        self.notice(format!(
                            "MLflow at {} reachable again; buffered metrics sent",
                            self.client.base()
                        ));
                    }
                    failing = false;
                    backoff = FIRST_BACKOFF;
                    retry_at = None;
                }
                Err(e) => {
                    if !failing {
                        self.notice(format!(
                            "MLflow: {e}; training goes on, metrics are buffered and sent when it answers"
                        ));
                    }
                    failing = true;
                    retry_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// One round: the run, its params, the buffered metrics, and (ending) the artifacts and the
    /// status. `Ok(true)` when the run is finished.
    fn work(
        &mut self,
        buffer: &mut Vec<Metric>,
        ending: &mut Option<Ending>,
    ) -> Result<bool, TrackError> {
        let run_id = match self.run_id() {
            Some(r) => r,
            None => self.open_run()?,
        };
        if !self.logged_params {
            let (params, tags) = (&self.start.params, &self.start.tags);
            for chunk in params.chunks(100) {
                let r = self.client.log_batch(&run_id, &[], chunk, &[]);
                if !matches!(r, Err(TrackError::Status { status: 400, .. })) {
                    r?;
                    continue;
                }
                // One param refused (a `--force`d resume that changed a setting: MLflow keeps the
                // first value; or a value it does not take): the others one by one.
                for p in chunk {
                    match self
                        .client
                        .log_batch(&run_id, &[], std::slice::from_ref(p), &[])
                    {
                        Err(TrackError::Status {
                            status: 400, body, ..
                        }) => self.notice(format!("MLflow did not take param {}: {body}", p.0)),
                        r => r?,
                    }
                }
            }
            for chunk in tags.chunks(100) {
                self.client.log_batch(&run_id, &[], &[], chunk)?;
            }
            self.logged_params = true;
        }
        while !buffer.is_empty() {
            let n = buffer.len().min(1000);
            self.client.log_batch(&run_id, &buffer[..n], &[], &[])?;
            buffer.drain(..n);
        }
        let Some(e) = ending.as_mut() else {
            return Ok(false);
        };
        while let Some((name, path)) = e.artifacts.first() {
            if let Ok(bytes) = std::fs::read(path) {
                self.client.put_artifact(&self.artifact_uri, name, &bytes)?;
            }
            e.artifacts.remove(0);
        }
        self.client.set_status(&run_id, &e.status)?;
        let _ = e.reply.send(Ok(()));
        Ok(true)
    }

    /// Continues `start.run_id` (RUNNING again) or creates the run; learns its artifact URI.
    fn open_run(&mut self) -> Result<String, TrackError> {
        let run_id = match &self.start.run_id {
            Some(r) => {
                self.client.set_status(r, "RUNNING")?;
                r.clone()
            }
            None => {
                let exp = self.client.experiment(&self.start.experiment)?;
                self.client
                    .create_run(&exp, &self.start.run_name, &self.uid)?
            }
        };
        let info = self.client.get_run(&run_id)?;
        self.artifact_uri = str_at(&info, &["run", "info", "artifact_uri"]);
        let exp = str_at(&info, &["run", "info", "experiment_id"]);
        self.shared.lock().expect("tracker").ids = Some((exp, run_id.clone()));
        Ok(run_id)
    }
}
