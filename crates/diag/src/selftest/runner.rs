//! The selftest's check runner: each check one [`Runner::attempt`], its error or panic that
//! check's FAIL, the caller told after each; the [`Report`] they add up to. Its own module so that
//! the CUDA checks (`selftest_cuda.rs`) and the step parity ([`super`]) both run through it
//! without naming each other.

use serde::Serialize;

use crate::{Check, DiagError};

/// The test hook's variable: checks whose name contains its value fail with an injected error.
pub const INJECT_ENV: &str = "RTUNE_SELFTEST_INJECT_FAIL";

#[derive(Debug, Clone, Serialize, Default)]
pub struct Report {
    /// The device checked (`cuda:N`, or `cpu` for the harness run CPU against CPU).
    pub device: String,
    /// The seed of every random input of the run.
    pub seed: u64,
    pub checks: Vec<Check>,
    /// Bytes moved by the dequantize kernel per second (codes + scales read, bf16 written).
    pub nf4_dequant_gb_s: Option<f64>,
    /// Device-to-device copy, read + write.
    pub copy_gb_s: Option<f64>,
    pub nf4_vs_copy: Option<f64>,
}

/// Runs the checks one by one into a [`Report`], telling `on_check` after each.
pub struct Runner<'a> {
    pub(crate) report: Report,
    inject: Option<String>,
    on_check: &'a mut dyn FnMut(&Check, &Report),
}

impl<'a> Runner<'a> {
    pub fn new(
        device: &str,
        seed: u64,
        inject: Option<String>,
        on_check: &'a mut dyn FnMut(&Check, &Report),
    ) -> Self {
        Self {
            report: Report {
                device: device.to_string(),
                seed,
                ..Report::default()
            },
            inject: inject.filter(|s| !s.is_empty()),
            on_check,
        }
    }

    /// Runs `f`, the check(s) named `name`, and records what it returns; an error or a panic
    /// (or an injected failure, see [`INJECT_ENV`]) is recorded as `name`'s FAIL with its text.
    pub fn attempt(&mut self, name: &str, f: impl FnOnce() -> Result<Vec<Check>, DiagError>) {
        let injected = self.inject.as_deref().is_some_and(|i| name.contains(i));
        let result = if injected {
            Err(format!("injected failure ({INJECT_ENV})"))
        } else {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                Ok(Ok(checks)) if checks.is_empty() => Err("no result".to_string()),
                Ok(Ok(checks)) => Ok(checks),
                Ok(Err(e)) => Err(format!("error: {e}")),
                Err(p) => Err(format!(
                    "panicked: {}",
                    p.downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| p.downcast_ref::<&str>().copied())
                        .unwrap_or("(no message)")
                )),
            }
        };
        let checks = result.unwrap_or_else(|e| vec![Check::new(name, false, e)]);
        for c in checks {
            self.report.checks.push(c);
            let last = self.report.checks.last().expect("pushed");
            (self.on_check)(last, &self.report);
        }
    }

    pub fn finish(self) -> Report {
        self.report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error, a panic and an injected failure each become their own check's FAIL with the
    /// text; the checks around them still run and pass.
    #[test]
    fn a_failing_check_is_recorded_and_the_rest_run() {
        let mut on_check = |_: &Check, _: &Report| {};
        let mut runner = Runner::new("cpu", 0, Some("poisoned".into()), &mut on_check);
        let ok = |n: &str| Ok(vec![Check::new(n, true, "fine".into())]);
        runner.attempt("first", || ok("first"));
        runner.attempt("errs", || {
            Err(DiagError::BadOption {
                command: "selftest",
                option: "--x",
                value: "y".into(),
                expected: "z",
            })
        });
        runner.attempt("panics", || panic!("boom"));
        runner.attempt("a poisoned check", || ok("a poisoned check"));
        runner.attempt("last", || ok("last"));
        let r = runner.finish();
        let got: Vec<(&str, bool)> = r.checks.iter().map(|c| (c.name.as_str(), c.pass)).collect();
        assert_eq!(
            got,
            [
                ("first", true),
                ("errs", false),
                ("panics", false),
                ("a poisoned check", false),
                ("last", true)
            ]
        );
        assert!(r.checks[1]
            .detail
            .starts_with("error: rtune selftest: --x y"));
        assert_eq!(r.checks[2].detail, "panicked: boom");
        assert!(r.checks[3].detail.contains(INJECT_ENV));
    }
}
