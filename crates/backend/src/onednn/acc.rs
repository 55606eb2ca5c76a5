//! `c = alpha·a·b + c` in place through oneDNN (`beta = 1`): the CPU engine of
//! [`crate::blas::acc`], what the LoRA branch in bf16 uses to add its rank-`r` products into the
//! frozen path's tensors (`y += s·xa·Bᵀ`, `dx += dxa·A`) and to form the adapters' f32 gradients
//! straight from bf16 operands (`dB = s·dyᵀ·xa`, `dA = dxaᵀ·x`, into zeros).
//!
//! The matmul primitive with two attributes: the output scale `alpha` and the sum post-op
//! (`dst = alpha·Σ + dst`), the bf16 products summed in f32 and rounded once to `c`'s type
//! (bf16 or f32) — the numerics of cuBLAS's `CUBLAS_COMPUTE_32F` GEMM that the CUDA path runs,
//! up to the order of the f32 sums. `c` may be a column view (rows at a stride wider than its
//! columns: a member's slice of a fused q/k/v product); oneDNN writes only its columns.
//!
//! The LoRA branch takes this path on the CPU only when asked, [`lora_bf16`] (`RTUNE_ONEDNN_LORA=on`):
//! for `dtype = "bf16"` PEFT keeps the branch in f32 (the input cast to the adapter's f32, f32
//! products), which `rtune`'s default CPU branch matches and the bf16 parity goldens require; the
//! bf16 branch is PEFT's numerics under bf16 autocast (bf16 operands and outputs of `lora_A` and
//! `lora_B`, f32 gradients), as the CUDA path runs it.

use candle_core::{CpuStorage, Layout, Result};

use super::{dims_strides, get, Out};

/// Whether the LoRA branch of a bf16 CPU step runs in bf16 on oneDNN ([`gemm_acc`]): oneDNN in
/// use and `RTUNE_ONEDNN_LORA` set to `on` or `1`, read once (see the module note: off by default).
pub fn lora_bf16() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        matches!(
            std::env::var("RTUNE_ONEDNN_LORA").as_deref(),
            Ok("on") | Ok("1")
        )
    }) && get().is_ok()
}

/// `c = alpha·a·b + c` for bf16 `a: (M, K)` and `b: (K, N)` at any positive strides and a bf16
/// or f32 `c: (M, N)` of packed rows at row stride `ldc` (shapes checked by the caller,
/// [`crate::blas::acc`]); `None` when oneDNN is not in use or the operands are not bf16, so
/// that the caller runs its own loop.
pub fn gemm_acc(
    (sc, lc, ldc): (&mut CpuStorage, &Layout, usize),
    (sa, la): (&CpuStorage, &Layout),
    (sb, lb): (&CpuStorage, &Layout),
    alpha: f32,
) -> Option<Result<()>> {
    let (CpuStorage::BF16(a), CpuStorage::BF16(b)) = (sa, sb) else {
        return None;
    };
    let lib = get().ok()?;
    // oneDNN's plain formats want real strides (no broadcast dims).
    let real = |l: &Layout| {
        l.dims()
            .iter()
            .zip(l.stride())
            .all(|(&d, &s)| s > 0 || d == 1)
    };
    if !real(la) || !real(lb) || la.dims().contains(&0) || lb.dims().contains(&0) {
        return None;
    }
    let (m, n) = (la.dims()[0], lb.dims()[1]);
    if m == 0 || n == 0 {
        return Some(Ok(()));
    }
    // The last element of c's rows must lie in its storage.
    let (off, end) = (lc.start_offset(), lc.start_offset() + (m - 1) * ldc + n);
    let (a, b) = (&a[la.start_offset()..], &b[lb.start_offset()..]);
    let cs = vec![ldc as i64, 1];
    let (dst, ptr) = match sc {
        CpuStorage::F32(c) if c.len() >= end => (
            candle_core::DType::F32,
            c[off..].as_mut_ptr().cast::<std::ffi::c_void>(),
        ),
        CpuStorage::BF16(c) if c.len() >= end => (
            candle_core::DType::BF16,
            c[off..].as_mut_ptr().cast::<std::ffi::c_void>(),
        ),
        _ => return None,
    };
    let out = Out {
        ptr,
        cs,
        alpha,
        sum: true,
    };
    debug_assert_eq!(dims_strides(lc).0, [m as i64, n as i64]);
    // `exec`'s contract: c's rows (`m` of `ldc`, the last `n` long) lie in the storage checked
    // above, initialized (it is summed into), and the borrow of `sc` outlives the call.
    Some(lib.exec(a, la, b, lb, dst, out).map(|_| ()))
}
