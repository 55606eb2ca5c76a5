//! The error of an NF4 weight: made (quantization's inputs), read back (an output buffer of the
//! wrong size) or loaded from a bnb-4bit checkpoint's tensors (`rtune_quant`'s reader, which uses
//! this enum as its own: one error type for NF4 weights wherever they come from).

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("bnb-4bit weight `{layer}`: tensor `{tensor}` is missing ({hint})")]
    MissingTensor {
        layer: String,
        tensor: String,
        hint: String,
    },
    #[error("bnb-4bit tensor `{tensor}`: {message}")]
    BadTensor { tensor: String, message: String },
    #[error("bnb-4bit tensor `{tensor}`: quant state: {message}")]
    QuantState { tensor: String, message: String },
    #[error(
        "bnb-4bit tensor `{tensor}`: blocksize {blocksize} is not supported; rtune reads blocksize 64 \
         (bitsandbytes' default, used by QLoRA). Re-quantize with bnb_4bit_blocksize=64 or load the \
         16-bit checkpoint with quantize = \"nf4\""
    )]
    Blocksize { tensor: String, blocksize: usize },
    #[error(
        "bnb-4bit tensor `{tensor}`: quant_type `{quant_type}` is not supported; rtune reads nf4 and fp4 \
         (8-bit bnb checkpoints are not 4-bit: load the 16-bit checkpoint instead)"
    )]
    QuantType { tensor: String, quant_type: String },
    #[error("nf4 quantize: {0}")]
    Input(String),
    #[error("nf4 dequantize: output buffer has {got} elements, the weight has {want}")]
    OutLen { got: usize, want: usize },
    #[error("nf4 {op}: {source}")]
    Candle {
        op: &'static str,
        source: candle_core::Error,
    },
}

pub type Result<T> = std::result::Result<T, QuantError>;
