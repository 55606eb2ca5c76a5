//! The LoRA branch's accumulating GEMMs in the compute dtype (issue 48, item 2): `c += alpha·a·b`
//! with `beta = 1` on cuBLAS, their shapes, layouts and numerics in [`rtune_backend::blas::acc`].
//! Here each call is counted as the `lora_bf16` fused path ([`crate::fused::forced`]'s tests
//! check that the layer took it).

use candle_core::{DType, Result, Tensor};

use crate::fused::{ran, Fused};

/// `c += alpha · a·b` in place ([`rtune_backend::blas::acc::gemm_acc`]).
pub fn gemm_acc(c: &Tensor, a: &Tensor, b: &Tensor, alpha: f64) -> Result<()> {
    ran(Fused::LoraBf16);
    rtune_backend::blas::acc::gemm_acc(c, a, b, alpha)
}

/// `alpha · a·b` as a new tensor of `dtype` ([`rtune_backend::blas::acc::gemm`]).
pub fn gemm(a: &Tensor, b: &Tensor, alpha: f64, dtype: DType) -> Result<Tensor> {
    ran(Fused::LoraBf16);
    rtune_backend::blas::acc::gemm(a, b, alpha, dtype)
}
