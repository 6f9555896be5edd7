//! Pipeline parallelism: the layers split into stages, one OS thread per stage owning its
//! device, layers and KV caches. Activations move between stages as host bytes over bounded
//! crossbeam channels (device -> host on one stage, host -> device on the next).
//!
//! Each device stage has a second thread for its hand-off: the stage thread uploads its
//! input, computes, starts the download of its output and goes on to the next micro-batch,
//! while the hand-off thread finishes the download (paced to a modelled link when asked) and
//! sends the bytes on ([`Downstream`](handoff::Downstream)). So a micro-batch's hand-off
//! overlaps the next one's compute (double buffering), and every recorded span holds exactly
//! the time it names: a compute span is the stage's compute, a `d2h` span the download on its
//! link. The stage statistics ([`StageStats`]) are sums of those same spans.
//!
//! Schedules ([`Schedule`]): prefill is a GPipe fill-drain of the batch's micro-batches.
//! Decode is in flight by default: each micro-batch's next token enters stage 0 as soon as its
//! previous token has left the last stage and been sampled, with no barrier between tokens;
//! `Schedule::GPipe` keeps a fill-drain per token for comparison. A stream of requests
//! ([`PipelineEngine::serve`]) moves each request to its next step as soon as its logits return.
//!
//! Every span records what it waited for (the upstream hand-off, the sampled token of the
//! previous step, and for a batched call the previous call's outputs), so a trace replays as it
//! ran without inferred step barriers (the timeline's `dependencies` metadata says so).
//!
//! Failure: a stage whose job errors or panics (or whose device is lost) reports an error
//! naming itself and stops; its neighbours see the closed channels and stop; the driver
//! returns the first error. Every thread is joined when the engine is dropped.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{Receiver, Sender};

use super::partition::{partition, Partition};
use super::pick::Picker;
use super::{
    check_decode, prompt_shape, Decoded, Engine, Fault, Generation, StepOutput, StepStats,
};
use crate::comm::CommConfig;
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::sampling::SamplingParams;
use crate::model::{ModelConfig, ModelWeights, Step};
use crate::sim::LinkPacer;
use crate::threads::lock;
use crate::trace::{Recorder, SpanId};

mod bench;
mod device;
mod driver;
mod handoff;
mod hybrid;
mod schedule;
mod segment;
mod serve;
mod stage;
mod stats;

pub(crate) use super::tp::Readout;
pub use bench::{bench_pipeline, PipelineBench, PipelineBenchRow};
#[cfg(feature = "mpi")]
pub(crate) use handoff::Payload;
pub(crate) use handoff::{Output, Work};
pub use schedule::{split_groups, Schedule};
pub(crate) use segment::Segment;
use serve::Serving;
pub use stats::{PipelineStats, StageStats};

/// The model split into pipeline stages, one thread per stage (plus one hand-off thread per
/// device stage).
pub struct PipelineEngine {
    input: Option<Sender<Work>>,
    output: Receiver<Result<Output>>,
    threads: Vec<JoinHandle<()>>,
    ranges: Vec<Range<usize>>,
    labels: Vec<String>,
    config: ModelConfig,
    tp: usize,
    micro_batches: usize,
    schedule: Schedule,
    stats: Arc<Mutex<Vec<StageStats>>>,
    faults: Arc<Mutex<Vec<Option<Fault>>>>,
    groups: Vec<Range<usize>>,
    group_past: Vec<usize>,
    /// Per sequence group, the span that returned its last logits (the next step waits on it).
    group_deps: HashMap<usize, SpanId>,
    /// The spans that returned the last call's outputs: a later batched call starts after
    /// the driver has them all.
    last_outputs: Vec<SpanId>,
    batch: usize,
    /// GPipe steps since the prefill (the prefill is step 0).
    steps: usize,
    picker: Picker,
    /// The head is on another rank (`dist`): the pick's settings do not travel there, so its
    /// last stage picks greedily and sends the logits too; other picks happen here.
    remote_head: bool,
    last: Option<StepStats>,
    last_run: Option<PipelineStats>,
    failed: Option<String>,
    recorder: Recorder,
    timeout: Duration,
    pacer: Option<Arc<LinkPacer>>,
    /// Continuous batching ([`StepEngine`]): see [`Serving`].
    serving: Serving,
    /// Counts driver runs (see `Work::run`).
    run: u64,
}

impl PipelineEngine {
    /// Splits `weights` into one stage per device (`partition` decides the layers), stored as
    /// `dtype`, and starts the stage threads. `micro_batches` is the split of a batch into
    /// sequence groups (GPipe prefill; in-flight or GPipe decode, see [`Schedule`]).
    pub fn new(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        how: &Partition,
        micro_batches: usize,
        comm_config: CommConfig,
    ) -> Result<Self> {
        Self::hybrid(gpus, weights, dtype, 1, how, micro_batches, comm_config)
    }

    /// Hybrid TP x PP: `gpus.len() / tp` pipeline stages, each a tensor-parallel group of `tp`
    /// consecutive devices (stage s holds devices `s*tp .. (s+1)*tp`). `tp = 1` is plain
    /// pipeline parallelism.
    pub fn hybrid(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        tp: usize,
        how: &Partition,
        micro_batches: usize,
        comm_config: CommConfig,
    ) -> Result<Self> {
        let config = weights.config.clone();
        if tp == 0 || gpus.is_empty() || !gpus.len().is_multiple_of(tp) {
            return Err(WgparError::unsupported(format!(
                "{} devices do not form pipeline stages of {tp} tensor-parallel devices",
                gpus.len()
            )));
        }
        let p = gpus.len() / tp;
        let ranges = partition(config.layers, p, how)?;
        let seg = Segment::whole(ranges, tp);
        Self::segment(gpus, weights, dtype, micro_batches, comm_config, seg)
    }

    /// Layers of each stage.
    pub fn stage_layers(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Changes the micro-batch count for later batches.
    pub fn set_micro_batches(&mut self, m: usize) -> Result<()> {
        if m == 0 {
            return Err(WgparError::option(
                "--micro-batches",
                "--micro-batches must be at least 1".into(),
            ));
        }
        self.micro_batches = m;
        Ok(())
    }

    /// Chooses how later decode runs are scheduled ([`Engine::decode_greedy`]).
    pub fn set_schedule(&mut self, schedule: Schedule) {
        self.schedule = schedule;
    }

    /// How decode runs are scheduled.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// Makes `stage` fail as `fault` describes (tests and demos of the failure path): once it
    /// has taken `fault.after` micro-batches since the engine started.
    pub fn inject_fault(&mut self, stage: usize, fault: Fault) -> Result<()> {
        let mut faults = lock(&self.faults);
        let slot = faults
            .get_mut(stage)
            .ok_or_else(|| WgparError::OutOfRange {
                what: "pipeline stage".into(),
                index: stage,
                count: self.ranges.len(),
            })?;
        *slot = Some(fault);
        Ok(())
    }

    /// How long the driver waits for any output before declaring the pipeline stuck.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The live per-stage accounting (a remote segment of `dist` resets and reads it).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn stage_stats_handle(&self) -> Arc<Mutex<Vec<StageStats>>> {
        self.stats.clone()
    }

    /// Accounting of the last run.
    pub fn last_run(&self) -> Option<&PipelineStats> {
        self.last_run.as_ref()
    }

    /// Greedy generation (prefill, then [`Engine::decode_greedy`]) with this engine's
    /// schedule; the same as [`generate`](super::generate).
    pub fn generate(&mut self, prompts: &[Vec<u32>], steps: usize) -> Result<Generation> {
        super::generate(self, prompts, steps)
    }
}

impl Engine for PipelineEngine {
    fn name(&self) -> String {
        let layers: Vec<usize> = self.ranges.iter().map(|r| r.len()).collect();
        let kind = if self.tp > 1 {
            format!("hybrid tp={} x pp={}", self.tp, self.ranges.len())
        } else {
            format!("pp={}", self.ranges.len())
        };
        format!(
            "{kind} on {} (layers {:?}, {} micro-batches, {} decode)",
            self.labels.join(","),
            layers,
            self.micro_batches,
            self.schedule
        )
    }

    fn prefill_step(&mut self, prompts: &[Vec<u32>], logits: bool) -> Result<StepOutput> {
        let (batch, seq) = prompt_shape(prompts)?;
        self.batch = batch;
        self.steps = 0;
        self.groups = split_groups(batch, self.micro_batches);
        self.group_past = vec![seq; self.groups.len()];
        let mut out = None;
        // Sliding layers' rings take a long prompt in chunks; the first makes the caches.
        for chunk in super::prefill_chunks(&self.config, seq) {
            let steps = (self.groups.iter())
                .map(|g| {
                    let step = Step {
                        batch: g.len(),
                        seq: chunk.1,
                        past: chunk.0,
                    };
                    (super::chunk_ids(&prompts[g.clone()], chunk), step)
                })
                .collect();
            out = Some(self.gpipe(steps, chunk.0 == 0, logits)?);
        }
        out.ok_or(WgparError::NoPrompt)
    }

    fn decode_step(&mut self, tokens: &[u32], logits: bool) -> Result<StepOutput> {
        check_decode(self.batch, tokens)?;
        let steps = self
            .groups
            .iter()
            .zip(&self.group_past)
            .map(|(g, &past)| {
                (
                    tokens[g.clone()].to_vec(),
                    Step {
                        batch: g.len(),
                        seq: 1,
                        past,
                    },
                )
            })
            .collect();
        let out = self.gpipe(steps, false, logits)?;
        for p in &mut self.group_past {
            *p += 1;
        }
        Ok(out)
    }

    fn set_sampling(&mut self, params: SamplingParams) -> Result<()> {
        self.picker = Picker::new(params)?;
        Ok(())
    }

    fn decode_greedy(&mut self, next: &[u32], steps: usize, keep_logits: bool) -> Result<Decoded> {
        match self.schedule {
            Schedule::InFlight => self.decode_in_flight(next, steps, keep_logits),
            Schedule::GPipe => super::decode_step_by_step(self, next, steps, keep_logits),
        }
    }

    fn last_step(&self) -> Option<StepStats> {
        self.last.clone()
    }

    fn set_recorder(&mut self, recorder: Recorder) {
        for (i, label) in self.labels.iter().enumerate() {
            recorder.label_device(i as u32, label.clone());
        }
        // Every pass records what it waited for (see the module docs): a projection needs no
        // inferred step barriers.
        recorder.declare_complete_dependencies();
        recorder.set_meta("schedule", self.schedule.label());
        // Span ids belong to one recorder: never carry a dependency into another.
        self.group_deps.clear();
        self.last_outputs.clear();
        self.recorder = recorder;
    }

    fn set_pacer(&mut self, pacer: Option<Arc<LinkPacer>>) {
        self.pacer = pacer;
    }

    fn pipeline_stats(&self) -> Option<PipelineStats> {
        self.last_run.clone()
    }

    fn inject_fault(&mut self, stage: usize, fault: Fault) -> Result<()> {
        PipelineEngine::inject_fault(self, stage, fault)
    }
}

impl Drop for PipelineEngine {
    fn drop(&mut self) {
        // Closing stage 0's input ends stage 0, whose closed outlet ends its hand-off thread,
        // whose closed channel ends stage 1, and so on.
        self.input = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
