//! The model: configurations and presets, synthetic weights, the CPU reference forward pass,
//! shard specs for tensor parallelism, the GPU blocks engines compose, Hugging Face checkpoint
//! loading and token sampling.

pub mod budget;
pub mod config;
pub mod constraint;
pub mod gguf;
pub mod gpu;
pub mod hf;
pub mod hub;
pub mod input;
pub mod memory;
pub mod quant;
pub mod reference;
pub mod reference_encoder;
pub mod rope;
pub mod sampling;
pub mod shard;
pub mod weights;

pub use config::{
    Activation, Arch, Llama3Scaling, LongRopeScaling, ModelConfig, PoolMode, Pooling, RopeScaling,
    SlidingWindow, YarnScaling, PRESETS,
};
pub use gpu::{Activations, GpuModel, KvCache, Placement, SeqRow, Step, StepOut};
pub use input::EncoderInput;
pub use reference::CpuReference;
pub use shard::{valid_tp_degrees, ShardSpec};
pub use weights::{LayerWeights, ModelWeights};
