//! Engines whose devices are spread over MPI ranks.
//!
//! - Tensor parallel: one device per rank; the all-reduce runs over MPI ([`MpiGroup`]) and
//!   every rank gets the logits, so every rank drives the same generation loop.
//! - Pipeline parallel and hybrid: each rank runs a segment of the pipeline (one stage per
//!   device, or per `tp` devices for hybrid, which keeps tensor parallelism inside a rank);
//!   stages inside a rank hand off in process, stage boundaries between ranks go over remote
//!   stage links ([`super::link`]). Rank 0 drives (it embeds and schedules); the other ranks
//!   serve their stages until rank 0 stops; the last rank sends its picks back to rank 0,
//!   with the logits where rank 0 needs them (it samples, or was asked for logits).

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam::channel::{bounded, unbounded, Receiver, Sender};

use super::error::DistError;
use super::link::{self, Links};
use super::reduce::MpiGroup;
use super::world::World;
use crate::comm::{Collectives, CommConfig};
use crate::device::{DType, Gpu};
use crate::error::Result;
use crate::model::sampling::SamplingParams;
use crate::model::{ModelConfig, ModelWeights};
use crate::parallel::pp::{Output, Segment};
use crate::parallel::{
    partition, BatchStep, Decoded, Engine, Partition, PartitionSpec, PipelineEngine, PipelineStats,
    Schedule, StageStats, StepDone, StepEngine, StepOutput, StepStats, Strategy,
    TensorParallelEngine,
};
use crate::sim::LinkPacer;
use crate::trace::Recorder;

/// What this rank runs.
pub enum DistEngine {
    /// Drives generation: rank 0 of a pipeline, or any rank of tensor parallelism.
    Driver(Box<dyn DistDriver>),
    /// Serves its pipeline stages until rank 0 stops (pipeline ranks other than 0).
    Server(Box<StageServer>),
}

/// An engine that drives generation under MPI.
pub trait DistDriver: Engine {
    /// The in-process pipeline on this rank, for its other schedules (pipelines only).
    fn pipeline(&mut self) -> Option<&mut PipelineEngine> {
        None
    }

    /// This driver as the engine of a server's continuous batching, where it can be one
    /// (pipelines: the other ranks follow rank 0's passes). Tensor parallelism cannot: every
    /// rank would have to run the steps only rank 0's scheduler decides.
    fn into_serving(self: Box<Self>) -> Option<Box<dyn StepEngine + Send>> {
        None
    }
}

impl DistDriver for TensorParallelEngine {}

/// Builds this rank's part of `strategy` over every rank's devices (`gpus` are this rank's).
pub fn build(
    world: &World,
    strategy: &Strategy,
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    config: &CommConfig,
) -> Result<DistEngine> {
    let counts = device_counts(world, gpus.len());
    let local = Local {
        gpus,
        weights,
        dtype,
        config,
    };
    match strategy {
        Strategy::Tensor { split } => tensor(world, &counts, split.as_deref(), local),
        _ => pipeline(world, &counts, layout_of(strategy)?, local),
    }
}

/// Every rank's count of devices (each rank gives its own).
fn device_counts(world: &World, mine: usize) -> Vec<usize> {
    (world.all_gather(&mine.to_string()).iter())
        .map(|c| c.parse().unwrap_or(0))
        .collect()
}

/// The pipeline layout of `strategy` (pp or hybrid); tp is laid out by [`tensor`], and one
/// device is refused.
fn layout_of(strategy: &Strategy) -> Result<Layout<'_>> {
    let (tp, partition, micro_batches, schedule) = match strategy {
        Strategy::Single => {
            return Err(DistError::Unsupported {
                option: "--strategy none".into(),
                why: "one device has nothing to spread over ranks: use tp, pp or hybrid under \
                      mpirun, or run without it"
                    .into(),
            }
            .into())
        }
        Strategy::Tensor { .. } => {
            return Err(
                DistError::Layout("tensor parallelism over ranks has no stages".into()).into(),
            )
        }
        Strategy::Pipeline {
            partition,
            micro_batches,
            schedule,
        } => (1, partition, micro_batches, schedule),
        Strategy::Hybrid {
            tp,
            partition,
            micro_batches,
            schedule,
        } => (*tp, partition, micro_batches, schedule),
    };
    Ok(Layout {
        tp,
        partition,
        micro_batches: *micro_batches,
        schedule: *schedule,
    })
}

/// The layers this rank's part of `strategy` holds, with `devices` of its own, out of the
/// model's `layers`: every layer under tensor parallelism (each rank holds a shard of each),
/// its own stages' under a pipeline. Every rank takes part (it gathers the device counts), so
/// a rank can load its own layers alone before [`build`].
pub fn rank_layers(
    world: &World,
    strategy: &Strategy,
    devices: usize,
    layers: usize,
) -> Result<Range<usize>> {
    let counts = device_counts(world, devices);
    if matches!(strategy, Strategy::Tensor { .. }) {
        return Ok(0..layers);
    }
    let (ranges, stages) = stage_ranges(world, &counts, &layout_of(strategy)?, layers)?;
    let (_, mine) = own_stages(&ranges, &stages, world.rank());
    Ok(mine.first().map_or(0, |r| r.start)..mine.last().map_or(0, |r| r.end))
}

/// Rank `rank`'s stages out of every rank's (`stages[r]` of them on rank `r`, in order): the
/// index of its first stage, and their layer ranges.
fn own_stages<'a>(
    ranges: &'a [Range<usize>],
    stages: &[usize],
    rank: usize,
) -> (usize, &'a [Range<usize>]) {
    let first: usize = stages[..rank].iter().sum();
    (first, &ranges[first..first + stages[rank]])
}

/// What this rank brings to an engine: its devices, the weights and how they are stored, and
/// the communication settings.
#[derive(Clone, Copy)]
struct Local<'a> {
    gpus: &'a [Arc<Gpu>],
    weights: &'a ModelWeights,
    dtype: DType,
    config: &'a CommConfig,
}

/// A pipeline's settings: tensor-parallel devices per stage, the layer split, micro-batches
/// and the decode schedule.
struct Layout<'a> {
    tp: usize,
    partition: &'a PartitionSpec,
    micro_batches: usize,
    schedule: Schedule,
}

/// Tensor parallelism over ranks: one device per rank, the all-reduce over MPI.
fn tensor(
    world: &World,
    counts: &[usize],
    split: Option<&[usize]>,
    local: Local,
) -> Result<DistEngine> {
    if let Some((r, n)) = counts.iter().enumerate().find(|(_, n)| **n != 1) {
        return Err(DistError::Layout(format!(
            "tensor parallelism across ranks uses one device per rank, but rank {r} \
             ({}) opened {n}: pass --virtual 1 or one --devices index; for tensor \
             parallelism inside a rank and pipeline stages across ranks, use \
             --strategy hybrid --tp N",
            world.hosts()[r]
        ))
        .into());
    }
    let coll = Arc::new(Collectives::new(local.config.clone())?);
    let group = Arc::new(MpiGroup::new(world, coll, local.config));
    let engine = TensorParallelEngine::spanning(
        &local.gpus[0],
        local.weights,
        local.dtype,
        split,
        local.config.clone(),
        group,
    )?;
    Ok(DistEngine::Driver(Box::new(engine)))
}

/// A pipeline over ranks: this rank's segment of the stages, joined to its neighbours by
/// remote stage links; rank 0 drives, the others serve.
fn pipeline(world: &World, counts: &[usize], layout: Layout, local: Local) -> Result<DistEngine> {
    let tp = layout.tp;
    let (ranges, stages) = stage_ranges(world, counts, &layout, local.weights.config.layers)?;
    let (rank, size) = (world.rank(), world.size());
    let (first, mine) = own_stages(&ranges, &stages, rank);
    let mine = mine.to_vec();
    let name = pipeline_name(&layout, &ranges, world.size(), (first, &mine));
    let (to_first, upstream) = link_channel(rank > 0);
    let (downstream, from_last) = link_channel(rank + 1 < size);
    let (out_tx, out_rx) = unbounded();
    let mut segment = PipelineEngine::segment(
        local.gpus,
        local.weights,
        local.dtype,
        layout.micro_batches,
        local.config.clone(),
        Segment {
            stages: mine,
            tp,
            embeds: rank == 0,
            head: rank + 1 == size,
            upstream,
            downstream,
            output: (out_tx.clone(), out_rx.clone()),
        },
    )?;
    // The driver (rank 0) schedules decode; the other ranks' stages follow its passes.
    segment.set_schedule(layout.schedule);
    // Spans of remote ranks start at the job's clock origin.
    let recorder = Recorder::with_epoch(world.epoch());
    let stats = segment.stage_stats_handle();
    let failed = out_tx.clone();
    let links = Links::start(
        world,
        to_first,
        from_last,
        out_tx,
        recorder.clone(),
        stats.clone(),
    )?;
    if rank == 0 && world.serving() {
        fail_steps_on_peer_failure(world, failed);
    }
    if rank == 0 {
        return Ok(DistEngine::Driver(Box::new(PipelineDriver {
            inner: Some(segment),
            links: Some(links),
            name,
            failed: false,
        })));
    }
    Ok(DistEngine::Server(Box::new(StageServer {
        inner: Some(segment),
        links: Some(links),
        output: out_rx,
        last: rank + 1 == size,
        stats,
        recorder,
        name,
        failed: false,
    })))
}

/// A serving rank 0: a peer's failure fails the steps in flight (the server answers them
/// with the error) before the watchdog ends this process.
fn fail_steps_on_peer_failure(world: &World, failed: Sender<Result<Output>>) {
    world.on_peer_failure(
        Box::new(move |cause| {
            let _ = failed.send(Err(crate::WgparError::EngineStopped {
                engine: "pipeline over ranks".into(),
                cause,
            }));
        }),
        PEER_FAILURE_GRACE,
    );
}

/// Every stage's layers over all ranks, and how many stages each rank holds (its devices
/// over `tp`); refuses ranks whose devices do not form stages.
fn stage_ranges(
    world: &World,
    counts: &[usize],
    layout: &Layout,
    layers: usize,
) -> Result<(Vec<Range<usize>>, Vec<usize>)> {
    let tp = layout.tp;
    if tp == 0 {
        return Err(DistError::Layout("--tp must be at least 1".into()).into());
    }
    if let Some((r, n)) = counts
        .iter()
        .enumerate()
        .find(|(_, n)| **n == 0 || **n % tp != 0)
    {
        return Err(DistError::Layout(format!(
            "rank {r} ({}) opened {n} devices, which do not form stages of {tp} (--tp): every \
             rank needs a multiple of {tp} devices",
            world.hosts()[r]
        ))
        .into());
    }
    let stages: Vec<usize> = counts.iter().map(|n| n / tp).collect();
    let total: usize = stages.iter().sum();
    let how = match layout.partition {
        PartitionSpec::Even => Partition::Even,
        PartitionSpec::Explicit(l) => Partition::Explicit(l.clone()),
        PartitionSpec::Balanced | PartitionSpec::BalancedWithin(_) => {
            return Err(DistError::Unsupported {
                option: "--partition balanced".into(),
                why: "it measures every device in one process; give --layers or use even".into(),
            }
            .into())
        }
    };
    Ok((partition(layers, total, &how)?, stages))
}

/// The two ends of a remote stage link's channel, where this rank has that neighbour.
fn link_channel<T>(present: bool) -> (Option<Sender<T>>, Option<Receiver<T>>) {
    if !present {
        return (None, None);
    }
    let (tx, rx) = bounded(2);
    (Some(tx), Some(rx))
}

/// The engine's name on this rank: the whole pipeline, then this rank's stages (from `first`,
/// holding `mine`).
fn pipeline_name(
    layout: &Layout,
    ranges: &[Range<usize>],
    size: usize,
    (first, mine): (usize, &[Range<usize>]),
) -> String {
    let (tp, total) = (layout.tp, ranges.len());
    format!(
        "{} over {size} ranks ({total} stages, layers {:?}; this rank: stages {}..{}, layers \
         {}..{}, {} micro-batches)",
        if tp > 1 {
            format!("hybrid tp={tp} x pp={total}")
        } else {
            format!("pp={total}")
        },
        ranges.iter().map(|r| r.len()).collect::<Vec<_>>(),
        first,
        first + mine.len(),
        mine[0].start,
        mine[mine.len() - 1].end,
        layout.micro_batches
    )
}

/// How long a serving rank 0 keeps answering after a peer failed (its requests in flight get
/// the error), before it ends.
const PEER_FAILURE_GRACE: Duration = Duration::from_secs(2);

/// How long a rank waits, when leaving cleanly, for the stop message to make its way round the
/// pipeline (one message per rank boundary).
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Rank 0 of a pipeline over ranks: the in-process pipeline of its own stages, whose last
/// stage hands off to rank 1 and whose output receives the last rank's logits.
pub struct PipelineDriver {
    inner: Option<PipelineEngine>,
    links: Option<Links>,
    name: String,
    /// A run failed: leave at once, without waiting for peers.
    failed: bool,
}

impl PipelineDriver {
    fn inner(&mut self) -> &mut PipelineEngine {
        // Only `Drop` takes it.
        self.inner.as_mut().expect("pipeline used after drop")
    }

    fn inner_ref(&self) -> &PipelineEngine {
        self.inner.as_ref().expect("pipeline used after drop")
    }
}

impl Engine for PipelineDriver {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn prefill_step(&mut self, prompts: &[Vec<u32>], logits: bool) -> Result<StepOutput> {
        let r = self.inner().prefill_step(prompts, logits);
        self.failed |= r.is_err();
        r
    }

    fn decode_step(&mut self, tokens: &[u32], logits: bool) -> Result<StepOutput> {
        let r = self.inner().decode_step(tokens, logits);
        self.failed |= r.is_err();
        r
    }

    /// The pipeline's own schedule (in flight unless `--schedule gpipe`): the other ranks'
    /// stages take whatever passes arrive, so in-flight decode spans ranks as it is.
    fn decode_greedy(&mut self, next: &[u32], steps: usize, keep_logits: bool) -> Result<Decoded> {
        let r = self.inner().decode_greedy(next, steps, keep_logits);
        self.failed |= r.is_err();
        r
    }

    fn set_sampling(&mut self, params: SamplingParams) -> Result<()> {
        self.inner().set_sampling(params)
    }

    fn last_step(&self) -> Option<StepStats> {
        self.inner.as_ref().and_then(|p| p.last_step())
    }

    fn set_recorder(&mut self, recorder: Recorder) {
        // The last rank's logits arrive on a link thread: their arrival spans belong to the
        // same timeline as the passes that wait for them.
        if let Some(l) = &self.links {
            l.set_logits_recorder(recorder.clone());
        }
        self.inner().set_recorder(recorder);
    }

    fn set_pacer(&mut self, pacer: Option<Arc<LinkPacer>>) {
        self.inner().set_pacer(pacer);
    }

    fn inject_fault(&mut self, worker: usize, fault: crate::parallel::Fault) -> Result<()> {
        self.inner().inject_fault(worker, fault)
    }

    /// This rank's own stages only; `gather_stage_stats` adds the other ranks'.
    fn pipeline_stats(&self) -> Option<PipelineStats> {
        self.inner.as_ref().and_then(|p| p.last_run().cloned())
    }
}

impl DistDriver for PipelineDriver {
    fn pipeline(&mut self) -> Option<&mut PipelineEngine> {
        self.inner.as_mut()
    }

    fn into_serving(self: Box<Self>) -> Option<Box<dyn StepEngine + Send>> {
        Some(self)
    }
}

/// Serving steps run on rank 0's segment; its remote stages take the sequence tables and KV
/// slots from each pass's header.
impl StepEngine for PipelineDriver {
    fn model_config(&self) -> &ModelConfig {
        self.inner_ref().model_config()
    }

    fn lanes(&self) -> usize {
        self.inner_ref().lanes()
    }

    fn reserve_slots(&mut self, slots: usize) -> Result<()> {
        self.inner().reserve_slots(slots)
    }

    fn slots(&self) -> usize {
        self.inner_ref().slots()
    }

    fn submit(&mut self, step: BatchStep) -> Result<()> {
        // A bad copy is refused before anything travels: the pipeline itself is fine.
        crate::parallel::check_kv_edits(&step, self.slots(), self.model_config())?;
        let r = self.inner().submit(step);
        self.failed |= r.is_err();
        r
    }

    fn complete(&mut self, timeout: Option<Duration>) -> Result<Option<StepDone>> {
        let r = self.inner().complete(timeout);
        self.failed |= r.is_err();
        r
    }

    fn serving_stats(&self) -> Option<PipelineStats> {
        self.inner.as_ref().and_then(|p| p.serving_stats())
    }
}

impl Drop for PipelineDriver {
    fn drop(&mut self) {
        // Closing the stages closes the link to rank 1, which sends it the stop; the stop
        // travels to the last rank and comes back on the logits link, ending its thread.
        self.inner = None;
        if let Some(l) = self.links.take() {
            l.finish(if self.failed {
                Duration::ZERO
            } else {
                STOP_GRACE
            });
        }
    }
}

/// A pipeline rank other than 0: its stages, fed by the link from the previous rank.
pub struct StageServer {
    inner: Option<PipelineEngine>,
    links: Option<Links>,
    output: Receiver<Result<Output>>,
    last: bool,
    stats: Arc<Mutex<Vec<StageStats>>>,
    recorder: Recorder,
    name: String,
    failed: bool,
}

impl StageServer {
    /// What this rank runs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This rank's recorder (spans of the work rank 0 recorded).
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// Serves until rank 0 stops the pipeline: the last rank sends each micro-batch's logits
    /// to rank 0. Returns the first error of a stage or link.
    pub fn serve(&mut self, world: &World) -> Result<()> {
        // Drop this handle's own sender side: `output` ends when every stage and link has.
        let r = self.relay(world);
        self.failed = r.is_err();
        r?;
        self.inner = None;
        if let Some(l) = self.links.take() {
            l.finish(STOP_GRACE);
        }
        Ok(())
    }

    fn relay(&mut self, world: &World) -> Result<()> {
        for msg in self.output.iter() {
            let out = msg?;
            if self.last {
                link::send_logits(world, &out, !out.dep.is_none())?;
            }
        }
        if self.last {
            link::send_logits_stop(world)?;
        }
        Ok(())
    }

    /// Makes local `stage` fail as `fault` says (tests and demonstrations).
    pub fn inject_fault(&mut self, stage: usize, fault: crate::parallel::Fault) -> Result<()> {
        match self.inner.as_mut() {
            Some(p) => p.inject_fault(stage, fault),
            None => Ok(()),
        }
    }

    /// This rank's stage accounting since rank 0 started recording.
    pub fn stage_stats(&self) -> Vec<StageStats> {
        crate::threads::lock(&self.stats).clone()
    }
}

impl Drop for StageServer {
    fn drop(&mut self) {
        self.inner = None;
        if let Some(l) = self.links.take() {
            l.finish(if self.failed {
                Duration::ZERO
            } else {
                STOP_GRACE
            });
        }
    }
}

/// Every rank's stage accounting, in pipeline order, on rank 0 (empty elsewhere).
pub fn gather_stage_stats(world: &World, mine: &[StageStats]) -> Result<Vec<StageStats>> {
    let text = serde_json::to_string(mine).map_err(|e| DistError::Protocol {
        peer: world.rank(),
        detail: e.to_string(),
    })?;
    let all = world.gather_to_root(&text);
    let mut out = Vec::new();
    for (r, t) in all.iter().enumerate() {
        let stages: Vec<StageStats> = serde_json::from_str(t).map_err(|e| DistError::Protocol {
            peer: r,
            detail: format!("stage accounting: {e}"),
        })?;
        out.extend(stages);
    }
    Ok(out)
}
