//! candle's CUDA GEMM layout rule, which every operand of [`super::matmul`] is held to on every
//! device, and the copy that makes a refused operand pass it.

use candle_core::{Layout, Result, Tensor};
use std::borrow::Cow;

/// The operands with each one that fails [`cuda_gemm_ok`]'s rule replaced by a contiguous copy
/// (a row-major packed matrix with packed batches passes it whatever the other operand is).
pub(super) fn gemm_ready<'a>(
    a: &'a Tensor,
    b: &'a Tensor,
) -> Result<(Cow<'a, Tensor>, Cow<'a, Tensor>)> {
    let fix = |t: &'a Tensor, rows: usize, cols: usize| -> Result<Cow<'a, Tensor>> {
        if operand_ok(t.layout(), rows, cols) {
            Ok(Cow::Borrowed(t))
        } else {
            Ok(Cow::Owned(t.contiguous()?))
        }
    };
    let (da, db) = (a.dims(), b.dims());
    if da.len() < 2 || db.len() < 2 {
        return Ok((Cow::Borrowed(a), Cow::Borrowed(b)));
    }
    let (m, k) = (da[da.len() - 2], da[da.len() - 1]);
    let n = db[db.len() - 1];
    Ok((fix(a, m, k)?, fix(b, k, n)?))
}

/// Whether candle 0.11.1's CUDA matmul accepts `lhs: (..., M, K)` times `rhs: (..., K, N)` as laid
/// out: `gemm_config` in `candle-core/src/cuda_backend/mod.rs`, rule for rule. Each operand's
/// matrix must be packed row-major (unit column stride, row stride = its column count) or
/// column-major (unit row stride, column stride = its row count), a dim of size 1 excusing the
/// stride that steps along it; the batch dims (at most two) must step by one stride (two of
/// them as one, or one of them of size 1). Shapes that do not multiply are not this rule's business: `true`.
pub fn cuda_gemm_ok(lhs: &Layout, rhs: &Layout) -> bool {
    let (dl, dr) = (lhs.dims(), rhs.dims());
    if dl.len() < 2 || dl.len() != dr.len() {
        return true;
    }
    let r = dl.len();
    let (m, k, n) = (dl[r - 2], dl[r - 1], dr[r - 1]);
    operand_ok(lhs, m, k) && operand_ok(rhs, k, n)
}

/// One operand of [`cuda_gemm_ok`], `rows × cols` being its last two dims: candle's
/// `(lda, transa)` / `(ldb, transb)` choice and its `stride_a` / `stride_b` match.
pub fn operand_ok(l: &Layout, rows: usize, cols: usize) -> bool {
    let st = l.stride();
    let r = st.len();
    let (s_row, s_col) = (st[r - 2], st[r - 1]);
    // candle: `(m1 == 1 || cols == 1) && (m2 == cols || rows == 1)` → no transpose, ld = cols.
    let row_major = (s_col == 1 || cols == 1) && (s_row == cols || rows == 1);
    // candle: `(m1 == rows || cols == 1) && (m2 == 1 || rows == 1)` → transpose, ld = rows.
    let col_major = (s_col == rows || cols == 1) && (s_row == 1 || rows == 1);
    (row_major || col_major) && batch_ok(l)
}

/// candle's batch-stride match (`stride_a` / `stride_b`): no batch dim; one; or two that step as
/// one (outer stride = inner stride × inner size), or of which one has size 1. Three or more batch
/// dims are refused whatever their strides.
fn batch_ok(l: &Layout) -> bool {
    let (d, st) = (l.dims(), l.stride());
    match st[..st.len() - 2] {
        [] | [_] => true,
        [s1, s2] => s1 == s2 * d[1] || d[0] == 1 || d[1] == 1,
        _ => false,
    }
}
