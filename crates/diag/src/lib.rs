//! The diagnostics around training, each driving the real model and trainer at a small scale:
//! - [`check`]: `rtune check` — the pre-flight before a long run, on the real config;
//! - [`bench`](mod@bench): `rtune bench` — training throughput and peak memory on a random model;
//! - [`selftest`]: `rtune selftest` — the CUDA path checked against the CPU, every check reported;
//! - [`weights`]: the random weights bench and selftest build their models from.
//!
//! Every verdict is a [`Check`]; every failure a [`DiagError`]. The memory model they compare the
//! measured peaks with is `rtune_estimate`.

pub mod bench;
pub mod check;
pub mod selftest;
#[cfg(feature = "cuda")]
mod selftest_cuda;
#[cfg(feature = "cuda")]
mod selftest_nf4;
pub mod weights;

use serde::Serialize;

use rtune_train::TrainError;

/// One check's verdict: PASS/FAIL and the figure(s) it rests on.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub pass: bool,
    /// The figure(s) the verdict rests on, as printed.
    pub detail: String,
    /// A numerical check's error against its reference (`‖x − y‖ / ‖y‖`, or a mismatch fraction).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rel_err: Option<f64>,
}

impl Check {
    pub fn new(name: impl Into<String>, pass: bool, detail: String) -> Self {
        Self {
            name: name.into(),
            pass,
            detail,
            max_rel_err: None,
        }
    }

    /// A numerical check: `err` against a reference, passed or not.
    pub fn measured(name: impl Into<String>, err: f64, pass: bool) -> Self {
        Self {
            name: name.into(),
            pass,
            detail: format!("max rel err {err:.2e}"),
            max_rel_err: Some(err),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    /// Loading the model or data, or a training step, failed (the diagnostics run real ones).
    #[error(transparent)]
    Train(Box<TrainError>),
    /// An option of `rtune bench` / `rtune selftest` has a value the command does not take.
    #[error("rtune {command}: {option} {value}: one of {expected}")]
    BadOption {
        command: &'static str,
        option: &'static str,
        value: String,
        expected: &'static str,
    },
    /// `rtune bench`'s flags contradict each other or give an empty shape (heads not dividing
    /// hidden, `--batch 0`): a usage error, found before anything is built.
    #[error("rtune bench: {0}")]
    BadShape(String),
    /// A kernel of `rtune_ops` / `rtune_backend` (launch, module load, self-test) failed.
    #[cfg(feature = "cuda")]
    #[error("{op}: {source}")]
    Kernel {
        op: &'static str,
        source: rtune_backend::KernelError,
    },
    /// A CUDA driver call of the selftest itself (allocation, copy, synchronisation) failed.
    #[cfg(feature = "cuda")]
    #[error("cuda {op}: {source}")]
    Driver {
        op: &'static str,
        source: cudarc::driver::DriverError,
    },
    /// Quantizing or dequantizing the selftest's NF4 weight on the CPU failed.
    #[cfg(feature = "cuda")]
    #[error("{op}: {source}")]
    Quant {
        op: &'static str,
        source: rtune_quant::QuantError,
    },
}

impl DiagError {
    /// The input is wrong (exit status 2) rather than the diagnostic failing to run (1).
    pub fn is_input_error(&self) -> bool {
        match self {
            DiagError::Train(t) => t.is_input_error(),
            DiagError::BadOption { .. } | DiagError::BadShape(_) => true,
            #[cfg(feature = "cuda")]
            DiagError::Kernel { .. } | DiagError::Driver { .. } | DiagError::Quant { .. } => false,
        }
    }
}

impl From<TrainError> for DiagError {
    fn from(e: TrainError) -> Self {
        DiagError::Train(Box::new(e))
    }
}

impl From<rtune_infer::InferError> for DiagError {
    fn from(e: rtune_infer::InferError) -> Self {
        TrainError::from(e).into()
    }
}

impl From<rtune_dist::DistError> for DiagError {
    fn from(e: rtune_dist::DistError) -> Self {
        TrainError::from(e).into()
    }
}

impl From<rtune_model::ModelError> for DiagError {
    fn from(e: rtune_model::ModelError) -> Self {
        TrainError::from(e).into()
    }
}

impl From<rtune_lora::LoraError> for DiagError {
    fn from(e: rtune_lora::LoraError) -> Self {
        TrainError::from(e).into()
    }
}

impl From<Box<rtune_lora::LoraError>> for DiagError {
    fn from(e: Box<rtune_lora::LoraError>) -> Self {
        TrainError::from(e).into()
    }
}

impl From<rtune_data::DataError> for DiagError {
    fn from(e: rtune_data::DataError) -> Self {
        TrainError::from(e).into()
    }
}
