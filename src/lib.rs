//! wgpar: a portable multi-GPU runtime. Real transformer layer math, sharded across several
//! wgpu adapters (Vulkan, Metal, DX12, GL) with tensor and pipeline parallelism.
//!
//! Layers, top to bottom: engines (`parallel`) -> model blocks (`model`) and collectives
//! (`comm`) -> kernels (`kernels`, `shaders/*.wgsl`) -> devices (`device`). The timeline
//! (`trace`) is recorded as engines run; the simulator (`sim`) replays it on host profiles;
//! `calibrate` measures this machine into one.
//! See `docs/ARCHITECTURE.md`.

pub mod batching;
pub mod calibrate;
pub mod chat;
pub mod comm;
pub mod compare;
pub mod device;
pub mod dist;
pub mod error;
pub mod files;
pub mod generate;
pub mod kernels;
pub mod load;
pub mod memory_check;
pub mod model;
pub mod parallel;
pub mod server;
pub mod serving;
pub mod sim;
pub mod stats;
pub mod switches;
pub mod threads;
pub mod trace;

pub use error::{Result, WgparError};
