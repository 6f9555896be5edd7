//! Ranks over MPI: one wgpar process per rank, launched by `mpirun`, each opening its own
//! devices. Tensor parallelism across ranks all-reduces through MPI; pipeline stages across
//! ranks hand activations over MPI; hybrid keeps tensor parallelism inside a rank and puts
//! pipeline stages across ranks. Built on the `mpi` crate (rsmpi) over the system's MPI,
//! behind the `mpi` cargo feature; [`launch`] and [`DistError`] are always there, so a binary
//! built without the feature refuses to run as N copies under `mpirun`.
//!
//! See `docs/MULTINODE.md`.

mod error;
mod fault;
pub mod launch;
pub mod report;

pub use error::DistError;
pub use fault::{RankFault, RankFaultKind};

#[cfg(feature = "mpi")]
pub mod bench;
#[cfg(feature = "mpi")]
mod calibrate;
#[cfg(feature = "mpi")]
mod engine;
#[cfg(feature = "mpi")]
pub mod job;
#[cfg(feature = "mpi")]
mod link;
#[cfg(feature = "mpi")]
pub mod options;
#[cfg(feature = "mpi")]
mod reduce;
#[cfg(feature = "mpi")]
pub mod run_ranks;
#[cfg(feature = "mpi")]
pub mod serve_ranks;
#[cfg(feature = "mpi")]
mod world;

#[cfg(feature = "mpi")]
pub use calibrate::calibrate_ranks;
#[cfg(feature = "mpi")]
pub use engine::{
    build, gather_stage_stats, rank_layers, DistDriver, DistEngine, PipelineDriver, StageServer,
};
#[cfg(feature = "mpi")]
pub use reduce::MpiGroup;
#[cfg(feature = "mpi")]
pub use world::{Backoff, World};
