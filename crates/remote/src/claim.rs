//! A remote prefix claimed like a local run directory (issue 35). At start a run writes the
//! marker object [`RUN_MARKER`] (run id, host, pid, start time) with a conditional create (S3
//! `PutObject` with `If-None-Match: *`; s3s-fs honours it too), so of two runs starting on one
//! prefix the second is refused. A fresh run is refused on a prefix that holds a finished run
//! (`summary.json`), another run's marker or checkpoints, unless `overwrite`. A resumed (or
//! overwriting) run takes the marker over with a conditional replace (`If-Match` on the ETag it
//! read), refused while the holder is a live process on this machine. From then on the marker is
//! a lease: the mirror checks it names this run before every upload ([`Remote::check_lease`]),
//! and a run whose prefix was taken over uploads nothing more.

use object_store::{GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutPayload, UpdateVersion};
use serde::{Deserialize, Serialize};

use crate::{Remote, RemoteError};

/// The run marker object under the prefix.
pub const RUN_MARKER: &str = "rtune-run.json";
const FORMAT: &str = "rtune-remote-run/1";

/// What the marker says: which run holds the prefix.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claim {
    pub format: String,
    pub run_id: String,
    pub host: String,
    pub pid: u32,
    /// Seconds since the Unix epoch.
    pub started: u64,
}

impl Claim {
    /// This process's claim, with a run id unique to it.
    pub fn new() -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let (host, pid) = (rtune_fsio::hostname(), std::process::id());
        Self {
            format: FORMAT.into(),
            run_id: format!("{host}-{pid}-{:x}", now.as_nanos()),
            host,
            pid,
            started: now.as_secs(),
        }
    }

    fn describe(&self) -> String {
        format!(
            "run {} (pid {} on {}, started at {} s since the epoch)",
            self.run_id, self.pid, self.host, self.started
        )
    }

    /// A live process on this machine.
    fn is_alive_here(&self) -> bool {
        self.host == rtune_fsio::hostname()
            && self.pid != std::process::id()
            && rtune_fsio::process_alive(self.pid)
    }
}

impl Default for Claim {
    fn default() -> Self {
        Self::new()
    }
}

/// How a run takes its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimMode {
    /// `--resume` or `resume = "auto"`: an unfinished run's prefix is taken over.
    pub resume: bool,
    /// `[output] overwrite`: a finished run's prefix is taken over.
    pub overwrite: bool,
}

impl Remote {
    fn claimed(&self, message: String) -> RemoteError {
        RemoteError::Claimed {
            url: self.url.clone(),
            message,
        }
    }

    /// The marker and its ETag, if there is one. An unreadable marker is another program's
    /// object: `Err`.
    fn read_marker(&self) -> Result<Option<(Claim, Option<String>)>, RemoteError> {
        let key = self.key(RUN_MARKER);
        let got = self.rt.block_on(async {
            let r = self
                .store
                .get_opts(&key, GetOptions::default())
                .await
                .map_err(crate::Capped::Store)?;
            let tag = r.meta.e_tag.clone();
            Ok((crate::read_capped(r, crate::SMALL_OBJECT_BYTES).await?, tag))
        });
        let (bytes, tag) = match got {
            Ok(x) => x,
            Err(crate::Capped::Store(object_store::Error::NotFound { .. })) => return Ok(None),
            Err(e) => return Err(self.capped_err(RUN_MARKER, crate::SMALL_OBJECT_BYTES, e)),
        };
        let claim: Claim = serde_json::from_slice(&bytes).map_err(|e| {
            self.claimed(format!(
                "{RUN_MARKER} is not an rtune run marker ({e}); use another prefix"
            ))
        })?;
        Ok(Some((claim, tag)))
    }

    /// Claims the prefix for `claim`'s run (see the module's rules); on success the lease is
    /// this run's and [`check_lease`](Self::check_lease) holds it to that.
    pub fn claim(&mut self, claim: &Claim, mode: ClaimMode) -> Result<(), RemoteError> {
        if !mode.overwrite && self.exists("summary.json")? {
            return Err(self.claimed(
                "holds a finished run (summary.json); use another prefix, or set [output] \
                 overwrite = true to replace it"
                    .into(),
            ));
        }
        let held = self.read_marker()?;
        let take_over = mode.resume || mode.overwrite;
        let put_mode = match &held {
            Some((other, _)) if !take_over => {
                return Err(self.claimed(format!(
                    "is claimed by {}: it is running, or stopped before finishing; wait for it, \
                     pass --resume to continue it, or set [output] overwrite = true",
                    other.describe()
                )))
            }
            Some((other, _)) if other.is_alive_here() => {
                return Err(self.claimed(format!(
                    "is in use by {}, still running on this machine; wait for it to finish",
                    other.describe()
                )))
            }
            Some((_, tag)) => PutMode::Update(UpdateVersion {
                e_tag: tag.clone(),
                version: None,
            }),
            None => PutMode::Create,
        };
        if held.is_none() && !take_over {
            if let Some((step, _)) = self.checkpoints()?.first() {
                return Err(self.claimed(format!(
                    "holds checkpoints of an unfinished run (newest: step {step}); pass --resume \
                     to continue it, or set [output] overwrite = true to start over"
                )));
            }
        }
        let body = serde_json::to_vec_pretty(claim).expect("claim serialises");
        let key = self.key(RUN_MARKER);
        let put = self.rt.block_on(self.store.put_opts(
            &key,
            PutPayload::from(body),
            put_mode.into(),
        ));
        match put {
            Ok(_) => {
                self.owner = Some(claim.run_id.clone());
                self.created_marker = held.is_none();
                Ok(())
            }
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => {
                let now = self.read_marker()?.map(|(c, _)| c.describe());
                Err(self.claimed(format!(
                    "was claimed meanwhile by {}; two runs cannot share a prefix",
                    now.unwrap_or_else(|| "another run".into())
                )))
            }
            Err(e) => Err(self.store_err("put", RUN_MARKER)(e)),
        }
    }

    /// For a run refused before it wrote anything: deletes the marker if [`claim`](Self::claim)
    /// created it (a taken-over marker stays this run's). Best effort.
    pub fn release(&mut self) {
        if std::mem::take(&mut self.created_marker) && self.check_lease().is_ok() {
            let _ = self.delete(RUN_MARKER);
        }
        self.owner = None;
    }

    /// The lease: the marker still names this run (a no-op before [`claim`](Self::claim)).
    /// [`RemoteError::TakenOver`] when another run claimed the prefix since.
    pub fn check_lease(&self) -> Result<(), RemoteError> {
        let Some(owner) = &self.owner else {
            return Ok(());
        };
        match self.read_marker() {
            Ok(Some((c, _))) if &c.run_id == owner => Ok(()),
            Ok(other) => Err(RemoteError::TakenOver {
                url: self.url.clone(),
                by: other.map_or("no run (the marker was deleted)".into(), |(c, _)| {
                    c.describe()
                }),
            }),
            Err(RemoteError::Claimed { message, .. }) => Err(RemoteError::TakenOver {
                url: self.url.clone(),
                by: message,
            }),
            Err(e) => Err(e),
        }
    }

    /// Deletes what an earlier run wrote under the prefix, for a run that replaces it
    /// (`overwrite`): `summary.json` first (the prefix no longer holds a finished run), then
    /// `files` (names in the run directory), every checkpoint and the TensorBoard event files.
    /// Nothing else under the prefix is touched.
    pub fn clear_run(&self, files: &[&str]) -> Result<(), RemoteError> {
        self.delete("summary.json")?;
        for f in files {
            self.delete(f)?;
        }
        for (step, _) in self.checkpoints()? {
            self.delete_checkpoint(step)?;
        }
        let tb = self.key("tb");
        let events: Vec<_> = self.rt.block_on(async {
            use futures::StreamExt;
            self.store.list(Some(&tb)).collect::<Vec<_>>().await
        });
        for m in events {
            let m = m.map_err(self.store_err("list", "tb"))?;
            let own = m
                .location
                .filename()
                .is_some_and(|n| n.starts_with("events.out.tfevents."));
            if own {
                self.rt
                    .block_on(self.store.delete(&m.location))
                    .map_err(self.store_err("delete", "tb"))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_names_this_process() {
        let c = Claim::new();
        assert_eq!(c.pid, std::process::id());
        assert!(c.run_id.contains(&c.pid.to_string()));
        let back: Claim = serde_json::from_slice(&serde_json::to_vec(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        // This process is alive here, but a claim of its own is not another live holder.
        assert!(!c.is_alive_here());
    }
}
