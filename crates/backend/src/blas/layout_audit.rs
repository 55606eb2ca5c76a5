//! A record of the matmul operands that fail [`cuda_gemm_ok`]'s rule, for tests: while a
//! [`layout_audit::Guard`] from [`layout_audit::start`] lives, every [`matmul`] call with such an operand is recorded with its
//! call site, shapes and strides; so is every product's shapes ([`matmul`]'s and the tiled
//! attention's, [`layout_audit::Call`]), which tests count. Process-wide (any thread's calls
//! count): a test that asserts on it should be the only one of its binary running model code at
//! the time.

use candle_core::Layout;
use std::panic::Location;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Where a failing layout was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// As the caller passed it to [`super::matmul`] (the code produced it; it was then copied
    /// to a contiguous tensor before the GEMM).
    Passed,
    /// As it reached the GEMM, after that copy: cuBLAS would refuse it. Never expected.
    AtGemm,
}

/// One matmul whose operands fail the rule.
#[derive(Debug, Clone)]
pub struct Violation {
    pub stage: Stage,
    /// `file:line` of the [`super::matmul`] call.
    pub site: String,
    pub lhs_dims: Vec<usize>,
    pub lhs_stride: Vec<usize>,
    pub rhs_dims: Vec<usize>,
    pub rhs_stride: Vec<usize>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} at {}: lhs {:?} strides {:?} · rhs {:?} strides {:?}",
            self.stage, self.site, self.lhs_dims, self.lhs_stride, self.rhs_dims, self.rhs_stride
        )
    }
}

/// One product computed while recording: `op` (`matmul`, `flash_attn`) and its first two
/// operands' dims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub op: &'static str,
    pub lhs: Vec<usize>,
    pub rhs: Vec<usize>,
}

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static SEEN: Mutex<Vec<Violation>> = Mutex::new(Vec::new());
static CALLS: Mutex<Vec<Call>> = Mutex::new(Vec::new());

/// Records until the guard drops; what was recorded before is cleared.
pub fn start() -> Guard {
    SEEN.lock().unwrap_or_else(|e| e.into_inner()).clear();
    CALLS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    ACTIVE.fetch_add(1, Ordering::SeqCst);
    Guard(())
}

/// Recording is on while one lives.
pub struct Guard(());

impl Guard {
    /// Everything recorded since [`start`].
    pub fn violations(&self) -> Vec<Violation> {
        SEEN.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Everything recorded since [`start`] or the last `take`, cleared.
    pub fn take(&self) -> Vec<Violation> {
        std::mem::take(&mut *SEEN.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Every product since [`start`] or the last `take_calls`, in call order, cleared.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut *CALLS.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Notes a product of operands `lhs`, `rhs` while recording.
pub fn call(op: &'static str, lhs: &[usize], rhs: &[usize]) {
    if ACTIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    CALLS.lock().unwrap_or_else(|e| e.into_inner()).push(Call {
        op,
        lhs: lhs.to_vec(),
        rhs: rhs.to_vec(),
    });
}

impl Drop for Guard {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) fn record(site: &Location<'_>, stage: Stage, lhs: &Layout, rhs: &Layout) {
    if ACTIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    SEEN.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Violation {
            stage,
            site: format!("{}:{}", site.file(), site.line()),
            lhs_dims: lhs.dims().to_vec(),
            lhs_stride: lhs.stride().to_vec(),
            rhs_dims: rhs.dims().to_vec(),
            rhs_stride: rhs.stride().to_vec(),
        });
}
