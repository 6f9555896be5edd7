//! A rank's collectives glue: the all-reduce of a partial sum over the group (in process, or
//! across processes when the group spans them), paced to a modelled link when asked, and the
//! ids that name each collective on the timeline.

use std::sync::Arc;
use std::time::Instant;

use super::pass::{allreduce_attrs, Pass};
use crate::comm::{Collectives, CrossProcessGroup, RankHandle};
use crate::device::{Gpu, Tensor};
use crate::error::{Result, WgparError};
use crate::sim::Algorithm;
use crate::trace::{CollectiveOp, SpanId};

/// Collective group ids of a group that spans processes carry this bit: every process numbers
/// them alike, so a merge of the processes' traces keeps them (and renumbers the others).
pub(crate) const CROSS_PROCESS_GROUP_BIT: u64 = crate::trace::CROSS_PROCESS_GROUP;

/// A rank's place in its group's collectives.
pub(super) struct RankLink {
    pub(super) comm: RankHandle,
    /// The group's ranks in other processes, when it spans processes (one device here).
    pub(super) remote: Option<Arc<dyn CrossProcessGroup>>,
    /// All-reduces so far: with `group_tag`, the id of the next one on the timeline.
    pub(super) collectives: u64,
    /// The group's first device: several groups (pipeline stages of a hybrid) count their
    /// collectives independently, and the tag keeps their ids apart.
    pub(super) group_tag: u64,
    /// Ranks in the group, in every process.
    pub(super) world: usize,
}

impl RankLink {
    /// The host-side collectives (uploads and downloads of hand-offs).
    pub(super) fn host(&self) -> &Arc<Collectives> {
        self.comm.communicator().collectives()
    }

    /// Sums `partial` (layer `layer`'s output, after the compute span `compute`) over the
    /// group, paced to the job's link; records the wait and the collective in `pass`.
    pub(super) fn all_reduce(
        &mut self,
        gpu: &Gpu,
        partial: &Tensor,
        (layer, compute): (u32, SpanId),
        pass: &mut Pass,
    ) -> Result<()> {
        let bytes = pass.bytes;
        let world = self.world;
        let entered = Instant::now();
        let all_arrived = match &self.remote {
            // One device here: the in-process part is a no-op.
            Some(remote) => {
                remote.all_reduce(gpu, partial)?;
                entered
            }
            None => self.comm.all_reduce_timed(partial)?,
        };
        if let Some(p) = &pass.job.pacer {
            p.collective(
                CollectiveOp::AllReduce,
                Algorithm::HostStaged,
                bytes,
                world,
                all_arrived,
            )
            .map_err(|source| WgparError::Pacing {
                target: "the all-reduce".into(),
                source,
            })?;
        }
        let end = Instant::now();
        let chunks = self.host().config().chunks(bytes);
        let group = self.next_id();
        let (dev, ranks) = (pass.dev, world as u32);
        pass.all_reduced((entered, all_arrived, end), (layer, compute), || {
            allreduce_attrs(dev, ranks, bytes)
                .layer(layer)
                .group(group)
                .chunks(chunks)
        });
        Ok(())
    }

    /// The id of the next collective, unique across the whole timeline.
    fn next_id(&mut self) -> u64 {
        let id = (self.group_tag << 48) | self.collectives;
        self.collectives += 1;
        match self.remote {
            Some(_) => id | CROSS_PROCESS_GROUP_BIT,
            None => id,
        }
    }
}
