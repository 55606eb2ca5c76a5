//! A resumed run keeps the CPU libraries its run recorded.
//!
//! Two libraries serve the CPU's products and are chosen when a process starts: the f32 CBLAS
//! ([`crate::blas`]: OpenBLAS or MKL, the faster on a start-up probe when both load) and the bf16
//! GEMM's oneDNN ([`crate::onednn`]: 2.6 or 3.x, the first found). Each sums in its own order, so a
//! resume that took the other one would not continue the run bit for bit, and the probe's answer
//! can change between two processes on one machine. run.json records both (`hardware.blas`,
//! `hardware.bf16_gemm`); a resume hands them here ([`set`], before [`crate::blas::init`]) and
//! each library is loaded as `RTUNE_BLAS` / `RTUNE_ONEDNN` naming the recorded file would load it.
//!
//! The user's variable wins over the record (`RTUNE_BLAS` or `RTUNE_MKL` for the CBLAS,
//! `RTUNE_ONEDNN` for oneDNN), with a notice that the resume may then differ. A recorded library
//! that does not load now falls back to what a fresh run would take and is kept in [`lost`]: `rtune
//! train` refuses to resume on it without `--force`, as it refuses changed settings.

use std::sync::{Mutex, OnceLock};

/// What run.json recorded: `hardware.blas` and `hardware.bf16_gemm`, as [`crate::blas::loaded`]
/// and [`crate::onednn::describe`] wrote them.
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    /// `libopenblas.so.0 (skylakex); measured at start …`; `None`: no CBLAS served.
    pub blas: Option<String>,
    /// `oneDNN (libdnnl.so.2, oneDNN 2.6.3)` or `candle's gemm (why)`; `None` in records written
    /// before it was recorded (then nothing is pinned).
    pub bf16_gemm: Option<String>,
}

static RECORDED: OnceLock<Recorded> = OnceLock::new();
static NOTICES: Mutex<Vec<String>> = Mutex::new(Vec::new());
static LOST: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Pins the libraries `r` records for this process. Call once, before [`crate::blas::init`] and
/// before anything loads oneDNN; a later call changes nothing (the libraries may be loaded).
pub fn set(r: Recorded) {
    let _ = RECORDED.set(r);
}

/// The `RTUNE_BLAS` value that loads the library `hardware.blas` describes: its file (the text
/// before ` (` or `;`: [`crate::blas::Blas::name`] is `FILE` or `FILE (core)`, and `described`
/// goes on after either), or `off` when no CBLAS served.
pub fn blas_value(recorded: Option<&str>) -> String {
    match recorded {
        None => "off".into(),
        Some(d) => {
            let end = [d.find(" ("), d.find(';')].into_iter().flatten().min();
            d[..end.unwrap_or(d.len())].trim().to_string()
        }
    }
}

/// The `RTUNE_ONEDNN` value that loads what `hardware.bf16_gemm` describes: the file of `oneDNN
/// (FILE, oneDNN X.Y.Z)`, `off` for `candle's gemm (…)`, nothing for a text of neither form.
pub fn onednn_value(recorded: &str) -> Option<String> {
    if recorded.starts_with("candle's gemm") {
        return Some("off".into());
    }
    let inner = recorded.strip_prefix("oneDNN (")?;
    let end = inner.rfind(", oneDNN ")?;
    Some(inner[..end].to_string())
}

/// What loads a library: the user's variable, else the resumed run's record, else the default
/// search (a fresh run's).
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// Nothing set, nothing recorded.
    Default,
    /// The user's variable's value.
    User(String),
    /// The record's value, in the variable's syntax ([`blas_value`], [`onednn_value`]).
    Recorded(String),
}

/// `env`: the user's variable (`name`) if set and not empty; `recorded`: the record's value. The
/// user's wins, with a notice when it overrides a record that names something else.
pub fn choose(name: &str, env: Option<&str>, recorded: Option<String>) -> Choice {
    match (env.filter(|e| !e.is_empty()), recorded) {
        (Some(e), Some(r)) => {
            if e != r {
                notice(format!(
                    "{name}={e} is set: it chooses, not the {r} this resumed run recorded (the \
                     resume may then differ from an uninterrupted run)"
                ));
            }
            Choice::User(e.to_string())
        }
        (Some(e), None) => Choice::User(e.to_string()),
        (None, Some(r)) => Choice::Recorded(r),
        (None, None) => Choice::Default,
    }
}

/// The CBLAS's [`Choice`] given `RTUNE_BLAS` and `RTUNE_MKL` (either set is the user choosing;
/// with only `RTUNE_MKL` set the default search runs, as it says).
pub(crate) fn blas(env_blas: Option<&str>, env_mkl: Option<&str>) -> Choice {
    let recorded = RECORDED.get().map(|r| blas_value(r.blas.as_deref()));
    match (
        env_blas.filter(|e| !e.is_empty()),
        env_mkl.filter(|e| !e.is_empty()),
    ) {
        (Some(_), _) => choose("RTUNE_BLAS", env_blas, recorded),
        (None, Some(m)) => match choose("RTUNE_MKL", Some(m), recorded) {
            Choice::User(_) => Choice::Default,
            c => c,
        },
        (None, None) => choose("RTUNE_BLAS", None, recorded),
    }
}

/// oneDNN's [`Choice`] given `RTUNE_ONEDNN`.
pub(crate) fn onednn(env: Option<&str>) -> Choice {
    let recorded = RECORDED
        .get()
        .and_then(|r| r.bf16_gemm.as_deref())
        .and_then(onednn_value);
    choose("RTUNE_ONEDNN", env, recorded)
}

fn notice(n: String) {
    NOTICES.lock().unwrap_or_else(|e| e.into_inner()).push(n);
}

/// Records that the library the run recorded did not load (`what`: the message); see [`lost`].
pub(crate) fn lose(what: String) {
    notice(what.clone());
    LOST.lock().unwrap_or_else(|e| e.into_inner()).push(what);
}

/// The notices so far (a user's variable overriding the record, a recorded library missing), for
/// the binary's log; each is returned once.
pub fn take_notices() -> Vec<String> {
    std::mem::take(&mut *NOTICES.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The recorded libraries that did not load, with why (empty when each loaded or none was
/// pinned): of those loaded so far — the CBLAS at [`crate::blas::init`], oneDNN at the first
/// [`crate::onednn::get`] (call it first to have its pin checked too).
pub fn lost() -> Vec<String> {
    LOST.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files come back from each text the libraries' descriptions take.
    #[test]
    fn the_recorded_file_is_read_back_from_each_description() {
        let b = |s| blas_value(Some(s));
        assert_eq!(b("libopenblas.so.0 (skylakex)"), "libopenblas.so.0");
        assert_eq!(
            b(
                "libopenblas.so.0 (skylakex); measured at start 27.6 GFLOP/s against \
               /c/lib/libmkl_rt.so.3 11.3 on a 512×512·512×1376 f32 GEMM: the faster serves"
            ),
            "libopenblas.so.0"
        );
        assert_eq!(
            b(
                "/c/lib/libmkl_rt.so.3; measured at start 30 GFLOP/s against libopenblas.so.0 \
               (skylakex) 20"
            ),
            "/c/lib/libmkl_rt.so.3"
        );
        assert_eq!(b("/x/libcblas.so (RTUNE_BLAS names it)"), "/x/libcblas.so");
        assert_eq!(blas_value(None), "off");
        assert_eq!(
            onednn_value("oneDNN (libdnnl.so.2, oneDNN 2.6.3)").as_deref(),
            Some("libdnnl.so.2")
        );
        assert_eq!(
            onednn_value("oneDNN (/v/lib/libdnnl.so.3, oneDNN 3.2.0)").as_deref(),
            Some("/v/lib/libdnnl.so.3")
        );
        assert_eq!(
            onednn_value("candle's gemm (RTUNE_ONEDNN=off)").as_deref(),
            Some("off")
        );
        assert_eq!(onednn_value("something else"), None);
    }

    /// The user's variable beats the record, the record beats the default search.
    #[test]
    fn the_users_variable_wins_over_the_record() {
        let r = || Some("libopenblas.so.0".to_string());
        assert_eq!(choose("V", None, None), Choice::Default);
        assert_eq!(
            choose("V", None, r()),
            Choice::Recorded("libopenblas.so.0".into())
        );
        assert_eq!(choose("V", Some(""), r()), choose("V", None, r()));
        assert_eq!(
            choose("V", Some("/m/libmkl_rt.so.3"), r()),
            Choice::User("/m/libmkl_rt.so.3".into())
        );
        assert!(take_notices()
            .iter()
            .any(|n| n.contains("V=/m/libmkl_rt.so.3 is set") && n.contains("libopenblas.so.0")));
    }
}
