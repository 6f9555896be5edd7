//! The seam through which a tensor-parallel group reaches ranks in other processes (MPI, in
//! `dist`): the comm layer only knows this trait, so engines stay free of any transport.

use crate::device::{Gpu, Tensor};
use crate::error::Result;

/// The part of a tensor-parallel group that lives in other processes.
///
/// A group with a cross-process part has one device per process: after its local shard's
/// partial sum is ready, each rank calls [`all_reduce`](Self::all_reduce), which returns once
/// `tensor` holds the sum over every process (host->device copy queued, as the in-process
/// collectives do).
pub trait CrossProcessGroup: Send + Sync {
    /// Processes in the group (this one included).
    fn size(&self) -> usize;

    /// This process's rank in the group.
    fn rank(&self) -> usize;

    /// Sums `tensor` (on `gpu`) element-wise with the other processes' tensors, in place.
    fn all_reduce(&self, gpu: &Gpu, tensor: &Tensor) -> Result<()>;

    /// Hands the output of the rank that has it (rank 0: `Some`) to every rank, so every
    /// process samples the same next tokens.
    fn share_output(&self, output: Option<Vec<f32>>) -> Result<Vec<f32>>;
}
