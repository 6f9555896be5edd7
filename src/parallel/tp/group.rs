//! A tensor-parallel group: its ranks' worker threads, the job every rank runs for a step
//! and what the group hands back.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::collective::RankLink;
use super::pass::RankOutput;
use super::rank::Rank;
use crate::comm::{CommConfig, Communicator, CrossProcessGroup};
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::kernels::ops::TokenPick;
use crate::model::{ModelConfig, ModelWeights, Placement, SeqRow, ShardSpec, Step, StepOut};
use crate::parallel::upload::upload_parts;
use crate::parallel::worker::Workers;
use crate::parallel::{Fault, KvEdits};
use crate::sim::LinkPacer;
use crate::trace::{Recorder, SpanId};

/// What a tensor-parallel group computes on: token ids (the group holds the embedding) or
/// the previous pipeline stage's hidden states (host bytes, uploaded to every rank).
#[derive(Clone)]
pub(crate) enum GroupInput {
    Ids(Arc<Vec<u32>>),
    Hidden(Arc<Vec<u8>>),
}

/// What rank 0 hands back: the head's picks (and logits when asked) or an encoder's pooled
/// embeddings when the group holds the last block, or hidden states for the next pipeline
/// stage.
pub(crate) enum GroupOutput {
    Picked(StepOut),
    Pooled(Vec<f32>),
    Hidden(Vec<u8>),
}

/// How the head device picks tokens in a step, and what it reads back.
#[derive(Clone, Debug)]
pub(crate) struct Readout {
    pub pick: TokenPick,
    /// One draw per sequence for a sampling pick (empty for greedy).
    pub draws: Arc<Vec<f32>>,
    /// Read the logits back too.
    pub logits: bool,
    /// Each row's bit set of the tokens it may pick (`ops::allow_words(vocab)` words a row;
    /// empty: no mask). Stays in this process: a remote head never gets one.
    pub allow: Arc<Vec<u32>>,
    /// The rows' packed logit adjustments (`ops::pack_adjustments`; empty: none). Stays in
    /// this process too.
    pub adjust: Arc<Vec<u32>>,
}

impl Default for Readout {
    fn default() -> Self {
        Self {
            pick: TokenPick::Greedy,
            draws: Arc::default(),
            logits: false,
            allow: Arc::default(),
            adjust: Arc::default(),
        }
    }
}

impl Readout {
    /// The readout of a head in another process (`dist`): the pick's settings do not travel
    /// over the link, so the head picks greedily (counting non-finite logits) and reads the
    /// logits back only with `logits`: where the driver asked for them or picks on the host
    /// (a sampling pick). Greedy decoding then moves only the picks between ranks.
    pub(crate) fn remote(logits: bool) -> Self {
        Self {
            logits,
            ..Self::default()
        }
    }
}

/// One step for a tensor-parallel group.
#[derive(Clone)]
pub(crate) struct GroupJob {
    pub group: usize,
    pub input: GroupInput,
    pub step: Step,
    pub new_cache: bool,
    pub release: bool,
    pub recorder: Recorder,
    pub microbatch: Option<u32>,
    /// What the step's first span waits for.
    pub deps: Vec<SpanId>,
    /// Earliest start of the step's first span, microseconds since the recorder's epoch.
    pub release_us: Option<f64>,
    /// The step's sequence table (`None`: row b in slot b, all at `step.past`).
    pub rows: Option<Arc<Vec<SeqRow>>>,
    /// Slots of the cache `new_cache` makes (`None`: one per sequence of the step).
    pub slots: Option<usize>,
    /// Encoders: token types and real lengths of the padded batch (every rank needs the
    /// lengths: they mask attention).
    pub encoder: Option<Arc<EncoderExtras>>,
    /// Slows collectives and hand-offs to a modelled link.
    pub pacer: Option<Arc<LinkPacer>>,
    /// The head's token pick and readback (used by the rank that holds the head).
    pub readout: Readout,
    /// Block tables, then copies of cached KV between slots, applied (to this rank's heads)
    /// before the step.
    pub kv_edits: Arc<KvEdits>,
}

/// Per-batch inputs an encoder needs beside the ids.
#[derive(Debug)]
pub(crate) struct EncoderExtras {
    pub types: Vec<u32>,
    pub lens: Vec<u32>,
}

/// The part of the model a tensor-parallel group holds: its layers, and the model's ends
/// with them.
#[derive(Clone, Debug)]
pub(crate) struct GroupPart {
    pub layers: Range<usize>,
    /// Holds the embedding (the pipeline's first stage).
    pub embeds: bool,
    /// Holds the final norm and LM head, on rank 0 (the pipeline's last stage).
    pub head: bool,
}

impl GroupPart {
    /// The whole model.
    pub(crate) fn whole(config: &ModelConfig) -> Self {
        Self {
            layers: 0..config.layers,
            embeds: true,
            head: true,
        }
    }

    /// Where `shard` of this part goes: the head on rank 0 only.
    pub(crate) fn placement(&self, shard: ShardSpec) -> Placement {
        Placement {
            layers: self.layers.clone(),
            embedding: self.embeds,
            head: self.head && shard.rank == 0,
            shard,
        }
    }
}

/// How a group is laid out: the part of the model it holds, each local rank's shard, and its
/// ranks in other processes when it spans them.
struct Layout {
    shards: Vec<ShardSpec>,
    part: GroupPart,
    remote: Option<Arc<dyn CrossProcessGroup>>,
}

/// A tensor-parallel group: one worker thread per device, each holding a shard of the same
/// layers; the group's collective is the only synchronisation between them. Used alone
/// (tensor parallelism) or as one stage of a pipeline (hybrid).
pub(crate) struct TpGroup {
    pub(super) workers: Workers<GroupJob, RankOutput>,
    pub(super) comm: Arc<Communicator>,
    pub(super) shards: Vec<ShardSpec>,
    pub(super) labels: Vec<String>,
    pub(super) remote: Option<Arc<dyn CrossProcessGroup>>,
    pub(super) faults: Vec<Arc<Mutex<Option<Fault>>>>,
}

impl TpGroup {
    /// Shards `part` of `weights` over `gpus` with relative shares `split` (`None`: even).
    pub(crate) fn new(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        split: Option<&[usize]>,
        part: GroupPart,
        comm_config: CommConfig,
    ) -> Result<Self> {
        let config = &weights.config;
        let even = vec![1; gpus.len()];
        let split = split.unwrap_or(&even);
        if split.len() != gpus.len() {
            return Err(WgparError::option(
                "--split",
                format!(
                    "--split has {} shares for {} devices",
                    split.len(),
                    gpus.len()
                ),
            ));
        }
        let layout = Layout {
            shards: ShardSpec::tensor_parallel(config, split)?,
            part,
            remote: None,
        };
        Self::build(gpus, weights, dtype, layout, comm_config)
    }

    /// A group whose ranks are one device in each of `remote.size()` processes: this process
    /// holds shard `remote.rank()` of the `split` (even by default) on `gpu`.
    pub(crate) fn spanning(
        gpu: &Arc<Gpu>,
        weights: &ModelWeights,
        dtype: DType,
        split: Option<&[usize]>,
        comm_config: CommConfig,
        remote: Arc<dyn CrossProcessGroup>,
    ) -> Result<Self> {
        let n = remote.size();
        let even = vec![1; n];
        let split = split.unwrap_or(&even);
        if split.len() != n {
            return Err(WgparError::option(
                "--split",
                format!(
                    "--split has {} shares for {n} ranks (one device each)",
                    split.len()
                ),
            ));
        }
        let shard = ShardSpec::tensor_parallel(&weights.config, split)?
            .into_iter()
            .nth(remote.rank())
            .ok_or_else(|| WgparError::OutOfRange {
                what: "tensor-parallel rank".into(),
                index: remote.rank(),
                count: n,
            })?;
        let layout = Layout {
            shards: vec![shard],
            part: GroupPart::whole(&weights.config),
            remote: Some(remote),
        };
        Self::build(
            std::slice::from_ref(gpu),
            weights,
            dtype,
            layout,
            comm_config,
        )
    }

    /// Uploads every rank's shard at once (each device copies its own weights) and starts the
    /// ranks' worker threads.
    fn build(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        layout: Layout,
        comm_config: CommConfig,
    ) -> Result<Self> {
        let comm = Communicator::new(gpus.to_vec(), comm_config)?;
        let Layout {
            shards,
            part,
            remote,
        } = layout;
        let placements = shards.iter().map(|s| part.placement(s.clone())).collect();
        let models = upload_parts(gpus, weights, dtype, placements, "a shard");
        let faults: Vec<Arc<Mutex<Option<Fault>>>> =
            (0..gpus.len()).map(|_| Arc::default()).collect();
        let mut states = Vec::new();
        for (rank, model) in models.into_iter().enumerate() {
            let name = format!(
                "tp rank {rank} ({}, layers {}..{})",
                gpus[rank].describe(),
                part.layers.start,
                part.layers.end
            );
            let link = RankLink {
                comm: comm.join(rank)?,
                remote: remote.clone(),
                collectives: 0,
                group_tag: gpus[0].ordinal() as u64,
                world: shards[rank].world,
            };
            states.push((name, Rank::new(model?, link, faults[rank].clone())));
        }
        Ok(Self {
            workers: Workers::spawn(states, Rank::run, |rank, why| rank.link.comm.abort(why))?,
            comm,
            shards,
            labels: gpus.iter().map(|g| g.label().to_string()).collect(),
            remote,
            faults,
        })
    }

    /// Makes `rank` fail as `fault` says, after `fault.after` more steps.
    pub(crate) fn inject_fault(&self, rank: usize, fault: Fault) -> Result<()> {
        let slot = self
            .faults
            .get(rank)
            .ok_or_else(|| WgparError::OutOfRange {
                what: "tensor-parallel rank".into(),
                index: rank,
                count: self.faults.len(),
            })?;
        *crate::threads::lock(slot) = Some(fault);
        Ok(())
    }

    /// Runs `job` on every rank; returns the outputs in rank order.
    pub(crate) fn run(&self, job: GroupJob) -> Result<Vec<RankOutput>> {
        for i in 0..self.workers.len() {
            self.workers.send(i, job.clone())?;
        }
        self.workers.collect(self.workers.len())
    }

    pub(crate) fn shards(&self) -> &[ShardSpec] {
        &self.shards
    }

    pub(crate) fn labels(&self) -> &[String] {
        &self.labels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rank_0_of_a_group_holds_the_head() {
        let config = ModelConfig::default_model();
        let part = GroupPart::whole(&config);
        let shards = ShardSpec::tensor_parallel(&config, &[1, 1]).unwrap();
        let placements: Vec<Placement> = shards.into_iter().map(|s| part.placement(s)).collect();
        assert!(placements
            .iter()
            .all(|p| p.embedding && p.layers == (0..config.layers)));
        assert!(placements[0].head && !placements[1].head);
    }
}
