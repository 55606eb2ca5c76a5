//! A reward computed by a long-lived process the user names, in any language, speaking JSON lines
//! on its stdin and stdout. Started once with the run; per generation batch, rtune writes one
//! request line
//!
//! ```json
//! {"step": 12, "prompts": ["…" or [messages]], "completions": ["…"], "completion_ids": [[…]],
//!  "columns": {"answer": ["4", …]}}
//! ```
//!
//! (`columns`: every other column of the prompt rows, a list per column in completion order, null
//! where a row lacks it) and reads one line back: a JSON list of one number or `null` per
//! completion (null: this function has no reward for it, as a TRL reward function's `None`).
//! Its stderr is the run's. Bounded: one answer within `timeout_s`, a line of at most
//! [`MAX_LINE`] bytes; its exit, a hang, a wrong count, a NaN or anything else is a one-line
//! error naming the reward and the step, and the process is stopped. It runs in its own process
//! group, so a Ctrl-C at the terminal reaches rtune (which stops it) and not it directly.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Result, RewardError, Sample};

/// The longest answer line read: 16 MiB, room for ~10⁶ numbers per batch.
pub const MAX_LINE: usize = 16 << 20;

/// How long a process may take to exit once its stdin is closed, before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(1);

/// What the reader thread saw on the process's stdout.
enum Line {
    Text(Vec<u8>),
    TooLong,
    Eof,
    Failed(std::io::Error),
}

pub(crate) struct CommandReward {
    name: String,
    timeout: Duration,
    child: Child,
    /// To the writer thread (which owns the stdin); dropped to close it.
    requests: Option<Sender<Vec<u8>>>,
    lines: Receiver<Line>,
    /// Set after an error: the process was stopped and answers nothing more.
    dead: bool,
}

impl CommandReward {
    pub(crate) fn start(name: &str, argv: &[String], timeout_s: f64) -> Result<Self> {
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .map_err(|e| RewardError::Start {
                name: name.to_string(),
                program: argv[0].clone(),
                message: e.to_string(),
            })?;
        let stdin = child.stdin.take().expect("stdin piped");
        let stdout = child.stdout.take().expect("stdout piped");
        let (requests, to_write) = mpsc::channel();
        let (seen, lines) = mpsc::channel();
        // Threads, not blocking calls: a process that stops reading would block a write of a
        // large request forever, and one that stops writing a read; the timeout below stops it.
        thread::Builder::new()
            .name(format!("reward-{name}-in"))
            .spawn(move || write_requests(stdin, to_write))
            .map_err(|e| spawn_failed(name, &argv[0], e))?;
        thread::Builder::new()
            .name(format!("reward-{name}-out"))
            .spawn(move || read_lines(stdout, seen))
            .map_err(|e| spawn_failed(name, &argv[0], e))?;
        Ok(CommandReward {
            name: name.to_string(),
            timeout: Duration::from_secs_f64(timeout_s),
            child,
            requests: Some(requests),
            lines,
            dead: false,
        })
    }

    /// One request for `samples`, one answer per sample.
    pub(crate) fn score(&mut self, step: u64, samples: &[Sample]) -> Result<Vec<Option<f64>>> {
        let name = self.name.clone();
        let fail = move |message: String| RewardError::Command {
            name,
            step,
            message,
        };
        if self.dead {
            return Err(fail("stopped after an earlier error".into()));
        }
        let mut line = match serde_json::to_vec(&request(step, samples)) {
            Ok(l) => l,
            Err(e) => return Err(fail(format!("could not encode the request: {e}"))),
        };
        line.push(b'\n');
        match self.exchange(line, samples.len()) {
            Ok(v) => Ok(v),
            Err(message) => {
                self.stop();
                Err(fail(message))
            }
        }
    }

    fn exchange(
        &mut self,
        request: Vec<u8>,
        n: usize,
    ) -> std::result::Result<Vec<Option<f64>>, String> {
        let sent = self
            .requests
            .as_ref()
            .is_some_and(|r| r.send(request).is_ok());
        if !sent {
            return Err(self.exited("before reading the request"));
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(Line::Text(t)) => t,
                Ok(Line::TooLong) => {
                    return Err(format!("answered a line over {} MiB", MAX_LINE >> 20))
                }
                Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.exited("before answering"))
                }
                Ok(Line::Failed(e)) => return Err(format!("reading its answer failed: {e}")),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!(
                        "gave no answer within {} s (timeout_s); the process was stopped",
                        self.timeout.as_secs_f64()
                    ))
                }
            };
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return parse_answer(&line, n);
        }
    }

    /// Why the process is gone: its exit status if it has one within a moment.
    fn exited(&mut self, when: &str) -> String {
        let deadline = Instant::now() + EXIT_GRACE;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return format!("the process exited ({status}) {when}"),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
                _ => return format!("the process closed its output {when}"),
            }
        }
    }

    /// Closes its stdin, waits [`EXIT_GRACE`] for it to exit, then kills it.
    fn stop(&mut self) {
        self.dead = true;
        self.requests = None;
        let deadline = Instant::now() + EXIT_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for CommandReward {
    fn drop(&mut self) {
        if !matches!(self.child.try_wait(), Ok(Some(_))) {
            self.stop();
        }
    }
}

fn spawn_failed(name: &str, program: &str, e: std::io::Error) -> RewardError {
    RewardError::Start {
        name: name.to_string(),
        program: program.to_string(),
        message: format!("could not start its I/O thread: {e}"),
    }
}

fn write_requests(mut stdin: ChildStdin, requests: Receiver<Vec<u8>>) {
    for r in requests {
        if stdin.write_all(&r).and_then(|_| stdin.flush()).is_err() {
            return;
        }
    }
}

fn read_lines(stdout: ChildStdout, seen: Sender<Line>) {
    let mut reader = BufReader::new(stdout);
    loop {
        let mut buf = Vec::new();
        let got = (&mut reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut buf);
        let line = match got {
            Ok(0) => Line::Eof,
            Ok(_) if buf.len() > MAX_LINE => Line::TooLong,
            Ok(_) => Line::Text(buf),
            Err(e) => Line::Failed(e),
        };
        let last = !matches!(line, Line::Text(_));
        if seen.send(line).is_err() || last {
            return;
        }
    }
}

/// The request line's object.
fn request(step: u64, samples: &[Sample]) -> serde_json::Value {
    use serde_json::{Map, Value};
    let mut names: Vec<&String> = samples.iter().flat_map(|s| s.columns.keys()).collect();
    names.sort();
    names.dedup();
    let columns: Map<String, Value> = names
        .into_iter()
        .map(|c| {
            let col = samples
                .iter()
                .map(|s| s.columns.get(c).cloned().unwrap_or(Value::Null))
                .collect();
            (c.clone(), Value::Array(col))
        })
        .collect();
    serde_json::json!({
        "step": step,
        "prompts": samples.iter().map(|s| s.prompt).collect::<Vec<_>>(),
        "completions": samples.iter().map(|s| s.completion).collect::<Vec<_>>(),
        "completion_ids": samples.iter().map(|s| s.completion_ids).collect::<Vec<_>>(),
        "columns": columns,
    })
}

/// The answer line: a JSON list of `n` finite numbers or nulls.
pub(crate) fn parse_answer(line: &[u8], n: usize) -> std::result::Result<Vec<Option<f64>>, String> {
    let text = String::from_utf8_lossy(line);
    let values: Vec<Option<f64>> = serde_json::from_str(text.trim()).map_err(|_| {
        if ["NaN", "Infinity"].iter().any(|w| text.contains(w)) {
            "answered a number that is not finite (NaN or Infinity; answer null for \"no \
             reward\")"
                .to_string()
        } else {
            format!(
                "answered something that is not a JSON list of numbers or nulls: {}",
                preview(&text)
            )
        }
    })?;
    if values.len() != n {
        return Err(format!(
            "answered {} rewards for {n} completions",
            values.len()
        ));
    }
    Ok(values)
}

/// The first 80 characters of `s`, escaped (control characters and all) onto one line.
fn preview(s: &str) -> String {
    let cut: String = s.trim().chars().take(80).collect();
    let more = if s.trim().chars().count() > 80 {
        "…"
    } else {
        ""
    };
    format!("{}{more}", cut.escape_debug())
}
