//! [`Mirror`]: the background uploader. Training hands it each checkpoint as soon as it verifies
//! locally and goes on; one thread with its own [`Remote`] (and tokio runtime) uploads:
//!
//! 1. every file the local manifest lists, each checked against its SHA-256 while it is read
//!    (a mismatch aborts that upload: a file that changed on disk is never mirrored);
//! 2. `metrics.jsonl`, `run.json`, `config.toml` (and `mlflow.json`) as they are now (a resume cuts metrics.jsonl back
//!    to the checkpoint's length, so a longer copy is fine);
//! 3. the checkpoint's `manifest.json`, last: the remote checkpoint exists from this moment;
//! 4. then, `keep_last` applied remotely (older checkpoints deleted, manifest first).
//!
//! Before each upload the prefix's lease is checked ([`Remote::check_lease`]): once another run
//! has claimed it, this one uploads nothing more and its end reports why.
//!
//! When uploads fall behind only the newest waiting checkpoint is kept (intermediate ones are
//! skipped, never the newest). A failure is retried with exponential backoff (0.5 s doubling to
//! 30 s) until it succeeds or a newer checkpoint replaces it. [`Mirror::finish`] uploads the run's
//! final files after the last checkpoint and waits for all of it up to a deadline.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Manifest, Remote, RemoteError, MANIFEST};

/// Files of the run directory re-sent with each checkpoint, so a remote resume has them.
const WITH_CHECKPOINT: [&str; 4] = ["metrics.jsonl", "run.json", "config.toml", "mlflow.json"];

/// Where the mirror stands, for the progress line and metrics.jsonl.
#[derive(Debug, Clone, Default)]
pub struct Status {
    /// The newest checkpoint whose manifest is in the store.
    pub uploaded_step: Option<usize>,
    /// A checkpoint is waiting or being uploaded.
    pub pending: bool,
    /// Failed attempts so far (each retried).
    pub failures: usize,
    /// Things to tell the user (failures, recoveries, skipped checkpoints), taken by
    /// [`Mirror::take_notices`].
    notices: Vec<String>,
}

enum Job {
    Checkpoint { step: usize, dir: PathBuf },
    Finish(Finish),
}

struct Finish {
    /// `(name in the run directory, local path)`, uploaded in this order.
    files: Vec<(String, PathBuf)>,
    deadline: Instant,
    reply: Sender<Result<(), String>>,
}

/// The uploader's handle, held by the run's writer.
pub struct Mirror {
    url: String,
    tx: Option<Sender<Job>>,
    status: Arc<Mutex<Status>>,
    thread: Option<JoinHandle<()>>,
}

impl Mirror {
    /// Starts the uploader thread for `remote`, mirroring `run_dir` and keeping the newest
    /// `keep_last` checkpoints remotely (0 = all).
    pub fn start(remote: Remote, run_dir: &Path, keep_last: usize) -> Self {
        let (tx, rx) = mpsc::channel();
        let status = Arc::new(Mutex::new(Status::default()));
        let url = remote.url().to_string();
        let w = Worker {
            remote,
            run_dir: run_dir.to_path_buf(),
            keep_last,
            status: Arc::clone(&status),
        };
        let thread = std::thread::Builder::new()
            .name("rtune-mirror".into())
            .spawn(move || w.run(rx))
            .expect("spawn the mirror thread");
        Self {
            url,
            tx: Some(tx),
            status,
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Queues `checkpoint-<step>` (at `dir`, complete and verified) for upload; returns at once.
    pub fn checkpoint(&self, step: usize, dir: &Path) {
        self.status.lock().expect("mirror status").pending = true;
        if let Some(tx) = &self.tx {
            let _ = tx.send(Job::Checkpoint {
                step,
                dir: dir.to_path_buf(),
            });
        }
    }

    pub fn status(&self) -> Status {
        self.status.lock().expect("mirror status").clone()
    }

    /// What happened since the last call, one line each.
    pub fn take_notices(&self) -> Vec<String> {
        std::mem::take(&mut self.status.lock().expect("mirror status").notices)
    }

    /// Uploads `files` (`(name, local path)`; missing ones are skipped) after any waiting
    /// checkpoint, and waits until all of it is in the store or `timeout` has passed; the error
    /// names what was not uploaded. The uploader stops either way.
    pub fn finish(
        &mut self,
        files: Vec<(String, PathBuf)>,
        timeout: Duration,
    ) -> Result<(), String> {
        let Some(tx) = self.tx.take() else {
            return Ok(());
        };
        let (reply, answer) = mpsc::channel();
        let deadline = Instant::now() + timeout;
        let job = Job::Finish(Finish {
            files,
            deadline,
            reply,
        });
        if tx.send(job).is_err() {
            return Err("the upload thread has stopped".into());
        }
        drop(tx);
        // The worker answers by the deadline; a request under way may hold it up to its timeout.
        let r = answer
            .recv_timeout(timeout + Duration::from_secs(150))
            .unwrap_or_else(|_| Err("the upload thread did not answer".into()));
        if r.is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
        r
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        // Without `finish` (a failed run): the thread ends after its current request.
        self.tx.take();
    }
}

struct Worker {
    remote: Remote,
    run_dir: PathBuf,
    keep_last: usize,
    status: Arc<Mutex<Status>>,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

impl Worker {
    fn note(&self, f: impl FnOnce(&mut Status)) {
        f(&mut self.status.lock().expect("mirror status"));
    }

    fn run(self, rx: Receiver<Job>) {
        let mut want: Option<(usize, PathBuf)> = None;
        let mut finish: Option<Finish> = None;
        let mut retry_at: Option<Instant> = None;
        let mut backoff = FIRST_BACKOFF;
        let mut failing = false;
        // Set when another run took the prefix over: why nothing more is uploaded.
        let mut lost: Option<String> = None;
        loop {
            // Take every job waiting; block when there is nothing to do, wait out a backoff.
            let busy = want.is_some() || finish.is_some();
            let msg = if !busy {
                match rx.recv() {
                    Ok(m) => Some(m),
                    Err(_) => return,
                }
            } else {
                // Wake for the retry, or for the finish deadline if that comes first.
                let until = retry_at.map(|r| finish.as_ref().map_or(r, |f| r.min(f.deadline)));
                let wait = until.map_or(Duration::ZERO, |t| {
                    t.saturating_duration_since(Instant::now())
                });
                match rx.recv_timeout(wait) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) if finish.is_none() => return,
                    Err(RecvTimeoutError::Disconnected) => None,
                }
            };
            if let Some(m) = msg {
                match m {
                    // Taken over: nothing more is uploaded, and the end of the run says so.
                    Job::Checkpoint { .. } if lost.is_some() => {}
                    Job::Finish(f) if lost.is_some() => {
                        let _ = f.reply.send(Err(lost.take().unwrap_or_default()));
                        return;
                    }
                    Job::Checkpoint { step, dir } => {
                        if let Some((old, _)) = want.replace((step, dir)) {
                            self.note(|s| {
                                s.notices.push(format!(
                                    "remote: checkpoint-{old} not uploaded (checkpoint-{step} replaces it)"
                                ))
                            });
                        }
                    }
                    Job::Finish(f) => finish = Some(f),
                }
                continue;
            }
            if let Some(f) = &finish {
                if Instant::now() >= f.deadline {
                    let mut missing: Vec<String> = want
                        .iter()
                        .map(|(s, _)| format!("checkpoint-{s}"))
                        .collect();
                    missing.extend(f.files.iter().map(|(n, _)| n.clone()));
                    let _ = f.reply.send(Err(format!(
                        "not uploaded to {} within [output] remote_timeout: {}{}",
                        self.remote.url(),
                        missing.join(", "),
                        self.status
                            .lock()
                            .map(|s| s
                                .notices
                                .last()
                                .map(|n| format!(" (last error: {n})"))
                                .unwrap_or_default())
                            .unwrap_or_default()
                    )));
                    return;
                }
            }
            // The lease: another run that claimed the prefix since ends this run's uploads.
            if let Err(e @ RemoteError::TakenOver { .. }) = self.remote.check_lease() {
                let message = e.to_string();
                self.note(|s| {
                    s.pending = false;
                    s.notices.push(format!("remote: {message}"));
                });
                want = None;
                if let Some(f) = finish.take() {
                    let _ = f.reply.send(Err(message));
                    return;
                }
                lost = Some(message);
                continue;
            }
            let result = if let Some((step, dir)) = &want {
                let r = self.upload_checkpoint(*step, dir);
                if r.is_ok() {
                    let step = *step;
                    want = None;
                    self.note(|s| {
                        s.uploaded_step = Some(step);
                        s.pending = false;
                    });
                }
                r.map_err(|e| e.to_string())
            } else if let Some(f) = finish.as_mut() {
                let r = self.upload_files(&mut f.files);
                if r.is_ok() {
                    let _ = f.reply.send(Ok(()));
                    return;
                }
                r.map_err(|e| e.to_string())
            } else {
                continue;
            };
            match result {
                Ok(()) => {
                    if failing {
                        self.note(|s| {
                            s.notices.push(format!(
                                "remote: {} reachable again; uploads resumed",
                                self.remote.url()
                            ))
                        });
                    }
                    failing = false;
                    backoff = FIRST_BACKOFF;
                    retry_at = None;
                }
                Err(e) => {
                    // Report the first failure of a streak and then every tenth, not each retry.
                    self.note(|s| {
                        s.failures += 1;
                        if !failing || s.failures.is_multiple_of(10) {
                            s.notices
                                .push(format!("remote: upload failed, retrying: {e}"));
                        }
                    });
                    failing = true;
                    retry_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Steps 1–4 of the module's list for `checkpoint-<step>` at `dir`.
    fn upload_checkpoint(&self, step: usize, dir: &Path) -> Result<(), RemoteError> {
        let mpath = dir.join(MANIFEST);
        let mbytes = std::fs::read(&mpath).map_err(RemoteError::local(&mpath, "read"))?;
        let manifest = Manifest::parse(&mbytes, &mpath.display().to_string())?;
        let name = format!("checkpoint-{step}");
        for (f, entry) in &manifest.files {
            let rel = format!("{name}/{f}");
            self.remote
                .put_file(&rel, &dir.join(f), Some(&entry.sha256))?;
        }
        for f in WITH_CHECKPOINT {
            let p = self.run_dir.join(f);
            if p.exists() {
                self.remote.put_file(f, &p, None)?;
            }
        }
        self.remote
            .put_bytes(&format!("{name}/{MANIFEST}"), mbytes)?;
        if self.keep_last > 0 {
            let older: Vec<usize> = self
                .remote
                .checkpoints()?
                .into_iter()
                .map(|(s, _)| s)
                .filter(|&s| s != step)
                .skip(self.keep_last.saturating_sub(1))
                .collect();
            for s in older {
                self.remote.delete_checkpoint(s)?;
            }
        }
        Ok(())
    }

    /// Uploads `files` in order, removing each from the list once it is in the store.
    fn upload_files(&self, files: &mut Vec<(String, PathBuf)>) -> Result<(), RemoteError> {
        while let Some((name, path)) = files.first() {
            if path.exists() {
                self.remote.put_file(name, path, None)?;
            }
            files.remove(0);
        }
        Ok(())
    }
}
