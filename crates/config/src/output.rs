//! The `[output]` section, checked (as written: [`crate::OutputSection`]): the run directory,
//! its checkpoints and resume, and where the run is mirrored (S3) and tracked (MLflow).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::file::OutputSection;
use crate::{invalid, Result};

/// The checked `[output]` section.
#[derive(Debug, Clone)]
pub struct OutputConfig {
    pub dir: PathBuf,
    pub overwrite: bool,
    pub save_every: usize,
    pub keep_last: usize,
    /// `resume = "auto"`.
    pub resume: bool,
    pub private: bool,
    /// Keep training when a checkpoint cannot be written (warn instead of stopping).
    pub continue_on_save_error: bool,
    /// Refuse to start without room for the run's outputs (`[output] check_disk`).
    pub check_disk: bool,
    /// `[output] remote`: the S3 URL the run directory is mirrored to.
    pub remote: Option<String>,
    /// `[output] remote_timeout`: how long the end of a run waits for its uploads.
    pub remote_timeout: Duration,
    /// `[output] mlflow`: the tracking server's URL, and the experiment.
    pub mlflow: Option<String>,
    pub mlflow_experiment: String,
}

impl OutputSection {
    pub(crate) fn validate(&self, path: &Path) -> Result<OutputConfig> {
        let bad = |key: &str, message: String| invalid(path, key, message);
        if self.dir.trim().is_empty() {
            return Err(bad("output.dir", "is empty".into()));
        }
        let resume = match self.resume.as_str() {
            "never" => false,
            "auto" => true,
            other => {
                return Err(bad(
                    "output.resume",
                    crate::suggest::not_one_of(other, &["never", "auto"]),
                ))
            }
        };
        let continue_on_save_error = match self.on_save_error.as_str() {
            "stop" => false,
            "continue" => true,
            other => {
                return Err(bad(
                    "output.on_save_error",
                    crate::suggest::not_one_of(other, &["stop", "continue"]),
                ))
            }
        };
        let (remote, remote_timeout, mlflow) = remote_keys(self).map_err(|(k, m)| bad(k, m))?;
        Ok(OutputConfig {
            dir: PathBuf::from(&self.dir),
            overwrite: self.overwrite,
            save_every: self.save_every,
            keep_last: self.keep_last,
            resume,
            private: self.private,
            continue_on_save_error,
            check_disk: self.check_disk,
            remote,
            remote_timeout,
            mlflow,
            mlflow_experiment: self.mlflow_experiment.clone(),
        })
    }
}

/// `[output] remote`, `remote_timeout` and `mlflow`, checked: an `s3://bucket[/prefix]` URL without
/// credentials in it (they come from the environment only, so they never reach run.json), a
/// duration such as "10m", an `http(s)://` URL. Errors are `(key, message)`.
type RemoteKeys = (Option<String>, Duration, Option<String>);
fn remote_keys(o: &OutputSection) -> std::result::Result<RemoteKeys, (&'static str, String)> {
    let remote = match o.remote.trim() {
        "" => None,
        url => {
            let rest = url.strip_prefix("s3://").ok_or((
                "output.remote",
                format!("`{url}` is not an s3://bucket/prefix URL"),
            ))?;
            let bucket = rest.split('/').next().unwrap_or("");
            if bucket.is_empty() {
                return Err(("output.remote", format!("`{url}` names no bucket")));
            }
            if bucket.contains('@') || bucket.contains(':') {
                return Err((
                    "output.remote",
                    "must not carry credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
                     in the environment"
                        .into(),
                ));
            }
            Some(url.trim_end_matches('/').to_string())
        }
    };
    let remote_timeout = parse_duration(&o.remote_timeout).ok_or((
        "output.remote_timeout",
        format!(
            "`{}` is not a duration such as \"10m\" or \"90s\"",
            o.remote_timeout
        ),
    ))?;
    let mlflow = match o.mlflow.trim() {
        "" => None,
        url if url.starts_with("http://") || url.starts_with("https://") => {
            Some(url.trim_end_matches('/').to_string())
        }
        url => {
            return Err((
                "output.mlflow",
                format!("`{url}` is not an http:// or https:// URL"),
            ))
        }
    };
    if mlflow.is_some() && o.mlflow_experiment.trim().is_empty() {
        return Err(("output.mlflow_experiment", "is empty".into()));
    }
    Ok((remote, remote_timeout, mlflow))
}

/// "90s", "10m", "1h", "1h30m", or a bare number of seconds.
fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<f64>() {
        return (secs >= 0.0 && secs.is_finite()).then(|| Duration::from_secs_f64(secs));
    }
    let (mut total, mut num) = (0.0f64, String::new());
    for c in s.chars() {
        match c {
            '0'..='9' | '.' => num.push(c),
            'h' | 'm' | 's' => {
                let n: f64 = num.parse().ok()?;
                total += n * match c {
                    'h' => 3600.0,
                    'm' => 60.0,
                    _ => 1.0,
                };
                num.clear();
            }
            _ => return None,
        }
    }
    (num.is_empty() && !s.is_empty()).then(|| Duration::from_secs_f64(total))
}
