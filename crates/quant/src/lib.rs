//! NF4 weights' file formats and the quantization choice: a bnb-4bit checkpoint's tensors in and
//! out ([`bnb`], bit-for-bit as bitsandbytes 0.50.2 writes and reads them), the pieces of a weight
//! sharded across ranks ([`shard`]), and how the frozen layers are held ([`Quantize`]: none, nf4,
//! nf4-dq).
//!
//! The NF4 op itself — the weight type ([`Nf4Weight`], [`Absmax`]), the code tables, quantization and
//! the CPU and CUDA dequantization — is `rtune_ops::nf4`, re-exported here under the names this
//! crate always had (`rtune_quant::Nf4Weight`, `rtune_quant::quantize::quantize_tensor`, ...).
//! The methods of a weight that are file formats are traits: [`Bnb`] (`from_bnb`, `to_bnb`) and
//! [`shard::Pieces`] (`piece`).
//!
//! - [`mxfp4`]: gpt-oss's MXFP4 expert tensors as its checkpoints store them, dequantized bit for
//!   bit as transformers does (then trained over in f32/bf16, or re-quantized to NF4).
//!
//! `tests/` holds the NF4 goldens (files bitsandbytes wrote) for both: the format and the op; and
//! the MXFP4 golden (transformers').

pub mod bnb;
mod choice;
pub mod mxfp4;
pub mod shard;

pub use bnb::{load_bnb_4bit, Bnb, BnbParts, RawTensor, BNB_SUFFIXES};
pub use choice::{Quantize, UnknownQuantize, EXPERTS_SUFFIX, QUANTIZE_NAMES};
pub use rtune_ops::nf4::{cpu as dequant, quantize, tables};
pub use rtune_ops::nf4::{
    quantize_nf4, quantize_tensor, torch_mean_f32, Absmax, Nf4Weight, QuantError, QuantType,
    Result, BLOCKSIZE, DYNAMIC_SIGNED, FP4, NESTED_BLOCKSIZE, NF4,
};
