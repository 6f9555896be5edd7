//! wgpar: a portable multi-GPU runtime. Real transformer layer math, sharded across several
//! wgpu adapters (Vulkan, Metal, DX12, GL) with tensor and pipeline parallelism.
//!
//! Layers, top to bottom: engines (`engine`) -> model blocks (`model`) and collectives (`comm`)
//! -> kernels (`kernels`, `shaders/*.wgsl`) -> devices (`device`). See `docs/ARCHITECTURE.md`.

pub mod comm;
pub mod device;
pub mod error;
pub mod kernels;

pub use error::{Result, WgparError};
