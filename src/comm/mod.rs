//! Host-staged communication between wgpu devices: collectives (all-reduce, all-gather,
//! reduce-scatter), point-to-point transfers, and an nccl-tests style benchmark.
//!
//! wgpu devices share nothing, so every byte that crosses devices goes device -> host staging
//! buffer -> host -> staging buffer -> device. This module makes that path as cheap as it can be:
//! pooled staging buffers (no allocation per call once warm), one submission per device per
//! chunk, host reductions straight from mapped download buffers into mapped upload buffers on
//! several threads, and chunk pipelining for large tensors. See `docs/COLLECTIVES.md`.
//!
//! Two ways in:
//! - [`Collectives`]: one caller holds every tensor, e.g.
//!   `coll.all_reduce(&[(&gpu0, &t0), (&gpu1, &t1)])`.
//! - [`Communicator`]: one worker thread per device calls `handle.all_reduce(&t)`; the collective
//!   is the rendezvous, and a failed or vanished rank makes the others fail instead of hanging.
//!
//! Everything is recorded in [`CommStats`].

mod allreduce;
pub mod bench;
mod collectives;
mod communicator;
mod compress;
mod config;
mod error;
mod gather;
mod p2p;
mod pipeline;
mod reduce;
mod remote;
mod staging;
mod stats;
pub mod units;
mod workers;

pub use collectives::Collectives;
pub use communicator::{Communicator, RankHandle};
pub use compress::LinkPrecision;
pub use config::{Algorithm, CommConfig};
pub use error::CommError;
pub use p2p::PendingDownload;
pub use reduce::reference_sum;
pub use remote::CrossProcessGroup;
pub use staging::StagingStats;
pub use stats::{CollectiveOp, CommRecord, CommStats, OpSummary};
