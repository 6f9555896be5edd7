//! The model: configurations and presets, synthetic weights, the CPU reference forward pass,
//! shard specs for tensor parallelism, and the GPU blocks engines compose.

pub mod config;
pub mod gpu;
pub mod reference;
pub mod shard;
pub mod weights;

pub use config::{Arch, ModelConfig, PRESETS};
pub use gpu::{Activations, GpuModel, KvCache, Placement, Step};
pub use reference::CpuReference;
pub use shard::{valid_tp_degrees, ShardSpec};
pub use weights::{LayerWeights, ModelWeights};
