//! Where and how a step is computed: the config's device and dtype as candle's. Below both the
//! set-up (`setup.rs`) and the LoRA variants' model loading (`variants.rs`), which use them.

use candle_core::{DType, Device};
use rtune_data::MicroBatch;
use rtune_model::Inputs;

use crate::TrainError;

/// The model's inputs of a micro-batch, moved out of it (token ids, positions, packed segments;
/// the targets and counts stay), so a step hands them over without a copy.
pub(crate) fn take_inputs(mb: &mut MicroBatch) -> Inputs {
    Inputs {
        ids: std::mem::take(&mut mb.input_ids),
        positions: std::mem::take(&mut mb.positions),
        b: mb.b,
        t: mb.t,
        segments: mb.segments.take(),
        lens: Some(mb.lens.clone()),
    }
}

/// The compute device for a config value. `auto` is the first GPU when this rtune was built with
/// the `cuda` feature and one opens, else the CPU; `cuda:N` needs that build.
pub fn device(d: rtune_config::Device) -> Result<Device, TrainError> {
    match d {
        rtune_config::Device::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        rtune_config::Device::Auto => Ok(rtune_backend::cuda::open(0).unwrap_or(Device::Cpu)),
        #[cfg(not(feature = "cuda"))]
        rtune_config::Device::Auto => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        rtune_config::Device::Cuda(n) => rtune_backend::cuda::open(n)
            .map_err(|source| TrainError::DeviceOpen { ordinal: n, source }),
        #[cfg(not(feature = "cuda"))]
        rtune_config::Device::Cuda(n) => Err(TrainError::NoCuda { ordinal: n }),
    }
}

pub fn dtype(d: rtune_config::DType) -> DType {
    match d {
        rtune_config::DType::F32 => DType::F32,
        rtune_config::DType::BF16 => DType::BF16,
        rtune_config::DType::F16 => DType::F16,
        // Loaded in f32, then `Model::set_autocast` (see `setup::prepare`).
        rtune_config::DType::Bf16Autocast => DType::F32,
    }
}
