//! Pipeline parallelism: the layers split into stages, one OS thread per stage owning its
//! device, layers and KV caches. Activations move between stages as host bytes over bounded
//! crossbeam channels (device -> host on one stage, host -> device on the next).
//!
//! Each device stage has a second thread for its hand-off: the stage thread uploads its
//! input, computes, starts the download of its output and goes on to the next micro-batch,
//! while the hand-off thread finishes the download (paced to a modelled link when asked) and
//! sends the bytes on ([`Downstream`]). So a micro-batch's hand-off overlaps the next one's
//! compute (double buffering), and every recorded span holds exactly the time it names: a
//! compute span is the stage's compute, a `d2h` span the download on its link. The stage
//! statistics ([`StageStats`]) are sums of those same spans.
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
use std::fmt;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};

use super::encoder::{pad_batch, Embeddings, Encoder};
use super::partition::{partition, Partition};
use super::pick::{check_finite, count_non_finite, Picker};
pub(crate) use super::tp::Readout;
use super::tp::{EncoderExtras, GroupInput, GroupJob, GroupOutput, TpGroup};
use super::{
    check_decode, cost, prompt_shape, BatchStep, Decoded, Engine, Generation, Logits, StepDone,
    StepEngine, StepOutput, StepStats,
};
use crate::comm::{Collectives, CommConfig, PendingDownload};
use crate::device::{DType, Gpu, SpanTimer};
use crate::error::{Result, WgparError};
use crate::model::sampling::SamplingParams;
use crate::model::{
    Activations, EncoderInput, GpuModel, KvCache, ModelConfig, ModelWeights, Placement, SeqRow,
    ShardSpec, Step, StepOut,
};
use crate::sim::{Direction, LinkPacer};
use crate::threads::lock;
use crate::trace::{KernelFamily, Recorder, SpanAttrs, SpanId};

/// How a pipeline schedules decode steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// Each micro-batch moves to its next token as soon as its previous token has left the
    /// last stage and been sampled: no barrier between tokens, the pipeline stays full.
    #[default]
    InFlight,
    /// Every decode step fills and drains the pipeline with all micro-batches (a barrier per
    /// token), as GPipe does for one batch.
    GPipe,
}

impl Schedule {
    /// Parses `in-flight` or `gpipe`.
    pub fn parse(text: &str) -> Option<Schedule> {
        match text {
            "in-flight" | "inflight" => Some(Schedule::InFlight),
            "gpipe" => Some(Schedule::GPipe),
            _ => None,
        }
    }

    /// The name [`Schedule::parse`] reads.
    pub fn label(self) -> &'static str {
        match self {
            Schedule::InFlight => "in-flight",
            Schedule::GPipe => "gpipe",
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A failure to inject into a stage (for tests and demos of the failure path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The stage's job returns an error.
    Error,
    /// The stage's job panics.
    Panic,
    /// The stage's device is destroyed (device loss).
    LoseDevice,
}

/// When and how a stage fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Jobs the worker runs before failing, counted from its start: micro-batches for a
    /// pipeline stage, steps for a tensor-parallel rank.
    pub after: usize,
    /// What happens.
    pub kind: FaultKind,
}

/// Per-stage accounting of a run. Every time is the sum of the stage's recorded spans of that
/// kind (on its first device, for a hybrid stage), so the statistics and the timeline agree.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    /// Layers held.
    pub layers: Range<usize>,
    /// Device.
    pub device: String,
    /// Time computing (the compute spans: encode, submit, device work), seconds.
    pub busy_s: f64,
    /// Time receiving the previous stage's activations (host -> device: the h2d spans), seconds.
    pub upload_s: f64,
    /// Time handing the output on (device -> host: the d2h spans), seconds. On a device stage
    /// it overlaps the next micro-batch's compute.
    pub download_s: f64,
    /// Time in the stage's tensor-parallel all-reduces (hybrid: the collective spans), seconds.
    pub collective_s: f64,
    /// Time the stage's own thread was occupied: upload and compute (and, on a hybrid stage,
    /// its collectives, waits and download), seconds. With [`download_s`](Self::download_s),
    /// what limits the stage's rate.
    pub occupied_s: f64,
    /// Bytes received from the previous stage.
    pub bytes_in: u64,
    /// Bytes handed to the next stage (or logits read back on the last stage).
    pub bytes_out: u64,
    /// Bytes the stage's all-reduces carried (hybrid), per device.
    pub collective_bytes: u64,
    /// Host transfers (uploads and downloads).
    pub transfers: usize,
    /// All-reduces (hybrid stages).
    pub collectives: usize,
    /// Micro-batch passes processed.
    pub microbatches: usize,
}

impl StageStats {
    /// Upload plus download time, seconds.
    pub fn handoff_s(&self) -> f64 {
        self.upload_s + self.download_s
    }

    /// Mean time per pass that limits the stage's rate: its thread's occupation or its
    /// outgoing link, whichever is longer.
    pub fn per_pass_s(&self) -> f64 {
        self.occupied_s.max(self.download_s) / self.microbatches.max(1) as f64
    }

    fn clear(&mut self) {
        *self = StageStats {
            layers: self.layers.clone(),
            device: std::mem::take(&mut self.device),
            ..Default::default()
        };
    }
}

/// Accounting of one pipeline run (a GPipe step, an in-flight decode or a served stream).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PipelineStats {
    /// Stages.
    pub stages: Vec<StageStats>,
    /// How the run was scheduled.
    pub schedule: Schedule,
    /// Micro-batches (lanes) in flight.
    pub microbatches: usize,
    /// Passes through the pipeline (micro-batch steps) in the run, per stage.
    pub passes: usize,
    /// First input to last output, seconds.
    pub makespan_s: f64,
    /// 1 - sum(busy) / (p x makespan).
    pub measured_bubble: f64,
    /// The bubble of a perfect pipeline with equal stages: (p - 1) / (m + p - 1) for a GPipe
    /// step; for N passes over lanes of K passes each, 1 - N / max(N + p - 1, K p).
    pub theoretical_bubble: f64,
    /// Makespan of a perfect pipeline with the measured per-pass stage times `t_s` (total
    /// `T_s` per stage): max(max T_s + sum t_s - max t_s, K sum t_s), the slowest stage's
    /// work plus fill and drain, or the longest lane's chain of K passes. For a GPipe step,
    /// sum(t_s) + (m - 1) max(t_s).
    pub ideal_makespan_s: f64,
    /// New tokens processed.
    pub tokens: usize,
    /// Passes the longest lane made in a row (1 for a GPipe step).
    pub chain: usize,
}

impl PipelineStats {
    /// The accounting of `stages` (in pipeline order) over a run of `makespan_s` that
    /// processed `tokens` with `lanes` sequence groups in flight, the longest making `chain`
    /// passes in a row: bubbles and the ideal makespan from the measured stage times. The
    /// engine closes its runs with it; `dist` with the stages of every rank.
    pub fn from_stages(
        stages: Vec<StageStats>,
        schedule: Schedule,
        makespan_s: f64,
        tokens: usize,
        lanes: usize,
        chain: usize,
    ) -> Self {
        let p = stages.len().max(1) as f64;
        let passes = stages.first().map_or(0, |s| s.microbatches);
        let per_pass: Vec<f64> = stages.iter().map(StageStats::per_pass_s).collect();
        let slowest = per_pass.iter().cloned().fold(0.0, f64::max);
        let cycle: f64 = per_pass.iter().sum();
        let bottleneck = stages
            .iter()
            .map(|s| s.occupied_s.max(s.download_s))
            .fold(0.0, f64::max);
        let ideal = (bottleneck + cycle - slowest).max(chain as f64 * cycle);
        let n = passes as f64;
        let uniform = (n + p - 1.0).max(chain as f64 * p);
        let busy: f64 = stages.iter().map(|s| s.busy_s).sum();
        PipelineStats {
            schedule,
            microbatches: lanes,
            passes,
            makespan_s,
            measured_bubble: if makespan_s > 0.0 {
                1.0 - busy / (p * makespan_s)
            } else {
                0.0
            },
            theoretical_bubble: if uniform > 0.0 {
                1.0 - n / uniform
            } else {
                0.0
            },
            ideal_makespan_s: ideal,
            tokens,
            chain,
            stages,
        }
    }

    /// Measured throughput, tokens/s.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.makespan_s
    }

    /// Throughput of the ideal pipeline, tokens/s.
    pub fn ideal_tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.ideal_makespan_s
    }

    /// Mean hand-off time (upload + download) and bytes per pass at one stage boundary.
    pub fn handoff_per_microbatch(&self) -> (f64, u64) {
        let inner = &self.stages[..self.stages.len().saturating_sub(1)];
        let passes: usize = inner.iter().map(|s| s.microbatches).sum();
        if inner.is_empty() || passes == 0 {
            return (0.0, 0);
        }
        // A boundary costs the sender's download and the receiver's upload.
        let secs = inner
            .iter()
            .zip(&self.stages[1..])
            .map(|(a, b)| a.download_s + b.upload_s)
            .sum::<f64>()
            / passes as f64;
        let bytes = inner.iter().map(|s| s.bytes_out).sum::<u64>() / passes as u64;
        (secs, bytes)
    }
}

/// One pass of one micro-batch (sequence group) through the pipeline, as it travels from
/// stage to stage.
pub(crate) struct Work {
    pub(crate) encoder: Option<Arc<EncoderExtras>>,
    pub(crate) pacer: Option<Arc<LinkPacer>>,
    /// The sequence group (micro-batch, or serving lane): what the output is returned as.
    pub(crate) group: usize,
    /// The KV cache the pass reads and writes (the group's own, or the serving cache).
    pub(crate) cache: usize,
    /// The pass's sequence table (`None`: row b in slot b, all at `step.past`).
    pub(crate) rows: Option<Arc<Vec<SeqRow>>>,
    /// Slots of the cache `new_cache` makes (`None`: one per sequence of the step).
    pub(crate) slots: Option<usize>,
    /// Earliest start of the pass's first span (microseconds since the recorder's epoch).
    pub(crate) release_us: Option<f64>,
    pub(crate) ids: Arc<Vec<u32>>,
    pub(crate) step: Step,
    pub(crate) new_cache: bool,
    pub(crate) release: bool,
    pub(crate) hidden: Vec<u8>,
    /// What the pass's first span on this stage waits for.
    pub(crate) deps: Vec<SpanId>,
    pub(crate) recorder: Recorder,
    /// The driver's run (GPipe step, in-flight decode, served stream) this work belongs to:
    /// stages in other processes start their accounting afresh when it changes.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) run: u64,
    /// The last stage's token pick and readback.
    pub(crate) readout: Readout,
}

/// What the last stage hands the driver.
pub(crate) enum Payload {
    /// A decoder's picks: tokens and non-finite counts (and the logits when asked for).
    Picked(StepOut),
    /// An encoder's pooled embeddings.
    Pooled(Vec<f32>),
}

/// What the last stage returns to the driver.
pub(crate) struct Output {
    pub(crate) group: usize,
    pub(crate) batch: usize,
    pub(crate) payload: Payload,
    /// The span that delivered the result: the group's next step depends on it.
    pub(crate) dep: SpanId,
}

/// What a stage hands on: hidden states to the next stage, or the pipeline's result.
enum StageOut {
    Hidden(Vec<u8>),
    Final(Payload),
}

/// Where a pipeline segment sits in a pipeline spread over processes (`dist`): which model
/// ends it holds and the channels of its remote stage links. In one process the segment is
/// the whole pipeline: it embeds, holds the head and talks to the driver only.
pub(crate) struct Segment {
    /// The first stage embeds token ids (else it uploads hidden states it receives).
    pub(crate) embeds: bool,
    /// The last stage holds the final norm and LM head (else it hands hidden states on).
    pub(crate) head: bool,
    /// Work for the first stage from a remote link instead of the driver.
    pub(crate) upstream: Option<Receiver<Work>>,
    /// Where the last stage hands its hidden states when it does not hold the head.
    pub(crate) downstream: Option<Sender<Work>>,
    /// Logits and errors, to the driver (or to the link that carries them to it).
    pub(crate) output: (Sender<Result<Output>>, Receiver<Result<Output>>),
}

impl Segment {
    /// The whole pipeline in one process.
    fn whole() -> Self {
        Segment {
            embeds: true,
            head: true,
            upstream: None,
            downstream: None,
            output: unbounded(),
        }
    }
}

/// A finished compute whose output is still being downloaded.
struct Pending {
    work: Work,
    /// The stage's output (hidden states, picks or pooled embeddings), then the logits when
    /// the readout asks for them.
    downloads: Vec<PendingDownload>,
    started: Instant,
    compute: SpanId,
}

/// Where a stage's output goes: the boundary between a stage and whatever follows it. A stage
/// in another process or on another node plugs in here as one more variant (its hand-off
/// serialises `Work` instead of sending it over a channel).
pub(crate) enum Downstream {
    /// The next stage, in this process.
    Stage(Sender<Work>),
    /// The driver (the engine), from the last stage: logits or pooled embeddings.
    Driver(Sender<Result<Output>>),
}

impl Downstream {
    /// Hands `work`'s output, delivered by span `dep`, to what follows.
    fn deliver(&self, work: Work, out: StageOut, dep: SpanId) -> Result<()> {
        match (self, out) {
            (Downstream::Stage(next), StageOut::Hidden(bytes)) => next
                .send(Work {
                    hidden: bytes,
                    deps: vec![dep],
                    ..work
                })
                .map_err(|_| WgparError::WorkerStopped {
                    worker: "the next stage".into(),
                    detail: "it closed its input".into(),
                }),
            (Downstream::Driver(driver), StageOut::Final(payload)) => driver
                .send(Ok(Output {
                    group: work.group,
                    batch: work.step.batch,
                    payload,
                    dep,
                }))
                .map_err(|_| WgparError::WorkerStopped {
                    worker: "the pipeline's caller".into(),
                    detail: "it stopped reading results".into(),
                }),
            _ => Err(WgparError::Internal(
                "a stage's output does not fit what follows it (hidden states go to a stage, \
                 results to the driver)"
                    .into(),
            )),
        }
    }
}

/// What computes a stage: one device, or a tensor-parallel group (hybrid TP x PP).
// One per stage thread, never copied: the variants' size difference does not matter.
#[allow(clippy::large_enum_variant)]
enum Backend {
    Device {
        model: GpuModel,
        acts: HashMap<(usize, usize), Activations>,
        caches: HashMap<usize, KvCache>,
    },
    Group(TpGroup),
}

/// Where a stage thread puts a finished pass: its hand-off thread (device stages, which
/// overlap the download with the next compute) or straight downstream (hybrid stages, whose
/// rank 0 has already downloaded).
enum Outlet {
    HandOff(Sender<Pending>),
    Direct(Downstream),
}

struct Stage {
    index: usize,
    name: String,
    /// The stage's (first) device: faults, labels.
    gpu: Arc<Gpu>,
    backend: Backend,
    comm: Arc<Collectives>,
    input: Receiver<Work>,
    outlet: Outlet,
    output: Sender<Result<Output>>,
    stats: Arc<Mutex<Vec<StageStats>>>,
    fault: Arc<Mutex<Vec<Option<Fault>>>>,
    /// Micro-batches this stage has taken since it started (what a fault's `after` counts).
    jobs: usize,
    /// Device-side timing of compute spans while a trace is recorded.
    timer: SpanTimer,
    /// Embeds token ids (the pipeline's first stage).
    embeds: bool,
    /// Holds the head (the pipeline's last stage).
    head: bool,
}

/// A device stage's hand-off thread: finishes downloads and sends the bytes on.
struct HandOff {
    index: usize,
    last: bool,
    name: String,
    device: u32,
    input: Receiver<Pending>,
    downstream: Downstream,
    output: Sender<Result<Output>>,
    stats: Arc<Mutex<Vec<StageStats>>>,
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    crate::threads::panic_message(payload)
        .unwrap_or("panic")
        .to_string()
}

/// Sends `cause` to the driver as the failure of worker `name` (a panic names its worker
/// already).
fn report_failure(output: &Sender<Result<Output>>, name: &str, cause: WgparError) {
    let e = match cause {
        e @ WgparError::WorkerPanicked { .. } => e,
        cause => WgparError::WorkerFailed {
            worker: name.to_string(),
            source: Box::new(cause),
        },
    };
    let _ = output.send(Err(e));
}

impl Stage {
    /// Holds the head: the last stage of the whole pipeline (of every rank's stages).
    fn is_last(&self) -> bool {
        self.head
    }

    /// The stage's thread: take work until the input closes; stop at the first failure.
    fn run(mut self) {
        while let Ok(work) = self.input.recv() {
            let outcome = catch_unwind(AssertUnwindSafe(|| self.process(work)));
            let failure = match outcome {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e,
                Err(payload) => WgparError::WorkerPanicked {
                    worker: self.name.clone(),
                    message: panic_text(&*payload),
                },
            };
            return report_failure(&self.output, &self.name, failure);
        }
        // Returning drops the outlet: the hand-off thread drains and stops, then the next
        // stage sees its input close.
    }

    fn inject_fault(&mut self) -> Result<()> {
        let done = self.jobs;
        self.jobs += 1;
        let fault = lock(&self.fault)[self.index];
        match fault {
            Some(f) if done >= f.after => match f.kind {
                FaultKind::Error => Err(WgparError::InjectedFault {
                    kind: "error".into(),
                    at: format!("stage {} after {done} micro-batches", self.index),
                }),
                FaultKind::Panic => panic!("injected panic"),
                FaultKind::LoseDevice => {
                    self.gpu.device().destroy();
                    Ok(())
                }
            },
            _ => Ok(()),
        }
    }

    fn process(&mut self, work: Work) -> Result<()> {
        self.inject_fault()?;
        // A lost device is reported as such, before any call that would trip over it.
        self.gpu.check()?;
        let step = work.step;
        let key = (step.tokens(), step.batch);
        match &mut self.backend {
            Backend::Device {
                model,
                acts,
                caches,
            } => {
                if work.new_cache {
                    let slots = work.slots.unwrap_or(step.batch);
                    // A new cache of the same size reuses the old one (and its bound ops):
                    // every row of the step's table starts where the table says.
                    if caches.get(&work.cache).map(KvCache::slots) != Some(slots) {
                        caches.insert(work.cache, model.kv_cache(slots)?);
                    }
                }
                if let std::collections::hash_map::Entry::Vacant(slot) = acts.entry(key) {
                    slot.insert(model.activations(step.tokens(), step.batch)?);
                    // Up to three of this shape's downloads are out at once: one in the
                    // hand-off thread, one queued for it, one just begun. Holding their
                    // staging buffers now keeps the token loop free of allocations however
                    // the passes interleave.
                    let hidden = step.tokens() * model.config().hidden * 4;
                    self.comm
                        .reserve_downloads(&self.gpu, hidden as u64, HANDOFF_DEPTH);
                }
                let (Some(act), Some(kv)) = (acts.get_mut(&key), caches.get_mut(&work.cache))
                else {
                    return Err(WgparError::InvalidCall(format!(
                        "micro-batch {} decoded before its prefill",
                        work.group
                    )));
                };
                // Inputs staged and the step's ops configured: all that needs the activation
                // set and the cache mutably (nothing is allocated once they have met).
                let m = &*model;
                if self.embeds {
                    m.write_ids(act, &work.ids)?;
                }
                if let Some(e) = &work.encoder {
                    m.write_encoder_inputs(act, &step, &e.types, &e.lens)?;
                }
                if self.head && !m.config().is_encoder() {
                    act.set_readout(work.readout.pick, work.readout.logits);
                    if !work.readout.draws.is_empty() {
                        m.write_draws(act, &work.readout.draws)?;
                    }
                }
                match &work.rows {
                    Some(rows) => m.begin_step(act, kv, &step, rows)?,
                    None => m.begin_step(act, kv, &step, &step.rows())?,
                }
            }
            Backend::Group(_) => return self.process_group(work),
        }
        super::sync_span_timer(&mut self.timer, &self.gpu, &work.recorder);
        let Backend::Device {
            model,
            acts,
            caches,
        } = &self.backend
        else {
            return Ok(());
        };
        let (Some(act), Some(kv)) = (acts.get(&key), caches.get(&work.cache)) else {
            return Err(WgparError::InvalidCall(format!(
                "micro-batch {} decoded before its prefill",
                work.group
            )));
        };
        let m = model;
        let timer = &self.timer;
        let gpu = m.gpu().clone();
        let dev = gpu.ordinal() as u32;
        let rec = work.recorder.clone();
        let mb = work.group as u32;
        let begun = Instant::now();
        let picks = self.head && !m.config().is_encoder();
        let mut deps = work.deps.clone();
        // The pass's first span here starts no earlier than its release (the first stage
        // only: later stages wait for the hand-off anyway).
        let release = if self.embeds { work.release_us } else { None };
        let released = |a: SpanAttrs| match release {
            Some(us) => a.not_before_us(us),
            None => a,
        };
        if !self.embeds {
            let want = step.tokens() * m.config().hidden * 4;
            if work.hidden.len() != want {
                return Err(WgparError::Shape {
                    op: "pipeline hand-off".into(),
                    detail: format!("received {} bytes, expected {want}", work.hidden.len()),
                });
            }
            let upload_start = Instant::now();
            self.comm.upload(&gpu, act.x(), 0, &work.hidden)?;
            if let Some(p) = &work.pacer {
                p.pace(
                    Direction::HostToDevice,
                    work.hidden.len() as u64,
                    upload_start,
                );
            }
            let end = Instant::now();
            let bytes = work.hidden.len() as u64;
            {
                let mut stats = lock(&self.stats);
                let s = &mut stats[self.index];
                s.upload_s += (end - upload_start).as_secs_f64();
                s.bytes_in += bytes;
                s.transfers += 1;
            }
            let h2d = rec.record_with(upload_start, end, || {
                SpanAttrs::h2d("activations", dev, bytes)
                    .microbatch(mb)
                    .after_all(&deps)
            });
            deps = vec![h2d];
        }
        let start = Instant::now();
        let mut enc = gpu.encoder();
        timer.begin(&mut enc);
        if self.embeds {
            m.embed(&mut enc, act)?;
        }
        m.layers(&mut enc, act, kv)?;
        if self.is_last() {
            m.finish(&mut enc, act)?;
        }
        timer.end(&mut enc);
        gpu.submit(enc);
        gpu.wait()?;
        let end = Instant::now();
        let device_us = timer.read_us(&gpu)?;
        let work_cost = cost::total(
            m.config(),
            &m.placement().shard,
            m.num_layers(),
            &step,
            m.weight_dtype(),
            self.embeds,
            self.is_last(),
        );
        let layers = m.placement().layers.clone();
        let compute = rec.record_with(start, end, || {
            let a = SpanAttrs::compute(format!("layers {}..{}", layers.start, layers.end), dev)
                .microbatch(mb)
                .flops(work_cost.flops)
                .bytes(work_cost.bytes)
                .kernels(work_cost.kernels)
                .family(KernelFamily::Matmul)
                .blocks_of(m.config().hidden, m.placement().shard.world)
                .head_part(if self.is_last() {
                    cost::head_work(m.config(), step.batch, m.weight_dtype())
                } else {
                    None
                })
                .device_us(device_us)
                .after_all(&deps);
            released(a)
        });
        {
            let mut stats = lock(&self.stats);
            let s = &mut stats[self.index];
            s.busy_s += (end - start).as_secs_f64();
            s.occupied_s += (end - begun).as_secs_f64();
            s.microbatches += 1;
        }
        // The copy is queued behind this compute and ahead of the next one, so the next
        // micro-batch may reuse the activations while the hand-off thread waits for it.
        let no_output = || WgparError::Internal("last stage has no output buffer".into());
        let mut downloads = Vec::with_capacity(2);
        if picks {
            // Token ids (and non-finite counts) always; logits only when asked for.
            let picked = act.picked().ok_or_else(no_output)?;
            downloads.push(
                self.comm
                    .begin_download_range(&gpu, picked, 0..2 * step.batch)?,
            );
            if work.readout.logits {
                let logits = act.logits().ok_or_else(no_output)?;
                let len = step.batch * m.config().vocab;
                downloads.push(self.comm.begin_download_range(&gpu, logits, 0..len)?);
            }
        } else if self.is_last() {
            let (result, width) = m.output(act).ok_or_else(no_output)?;
            downloads.push(
                self.comm
                    .begin_download_range(&gpu, result, 0..step.batch * width)?,
            );
        } else {
            let len = step.tokens() * m.config().hidden;
            downloads.push(self.comm.begin_download_range(&gpu, act.x(), 0..len)?);
        }
        let started = Instant::now();
        if work.release {
            if let Backend::Device { caches, .. } = &mut self.backend {
                caches.remove(&work.cache);
            }
        }
        let pending = Pending {
            work,
            downloads,
            started,
            compute,
        };
        match &self.outlet {
            Outlet::HandOff(tx) => tx.send(pending).map_err(|_| WgparError::WorkerStopped {
                worker: format!("the hand-off thread of {}", self.name),
                detail: "it stopped taking finished micro-batches".into(),
            }),
            Outlet::Direct(_) => Err(WgparError::Internal(
                "a device stage hands off through its hand-off thread".into(),
            )),
        }
    }

    /// A hybrid stage: the micro-batch runs on the stage's tensor-parallel group; rank 0
    /// returns the hidden states (or logits) to hand on. No hand-off thread here: the group's
    /// ranks synchronise through their all-reduces anyway.
    fn process_group(&mut self, mut work: Work) -> Result<()> {
        let Backend::Group(group) = &self.backend else {
            return Ok(());
        };
        let begun = Instant::now();
        let input = if self.embeds {
            GroupInput::Ids(work.ids.clone())
        } else {
            GroupInput::Hidden(Arc::new(std::mem::take(&mut work.hidden)))
        };
        let job = GroupJob {
            group: work.cache,
            input,
            step: work.step,
            new_cache: work.new_cache,
            release: work.release,
            recorder: work.recorder.clone(),
            microbatch: Some(work.group as u32),
            deps: work.deps.clone(),
            release_us: if self.embeds { work.release_us } else { None },
            rows: work.rows.clone(),
            slots: work.slots,
            encoder: work.encoder.clone(),
            pacer: work.pacer.clone(),
            readout: work.readout.clone(),
        };
        let outputs = group.run(job)?;
        let rank0 = outputs
            .into_iter()
            .next()
            .ok_or_else(|| WgparError::Internal("empty tensor-parallel group".into()))?;
        let (bytes, out) = match rank0.output {
            Some(GroupOutput::Hidden(h)) => (h.len(), StageOut::Hidden(h)),
            Some(GroupOutput::Picked(p)) => {
                let words = 2 * p.tokens.len() + p.logits.as_ref().map_or(0, Vec::len);
                (4 * words, StageOut::Final(Payload::Picked(p)))
            }
            Some(GroupOutput::Pooled(p)) => (4 * p.len(), StageOut::Final(Payload::Pooled(p))),
            None => return Err(WgparError::Internal("rank 0 returned nothing".into())),
        };
        {
            let mut stats = lock(&self.stats);
            let s = &mut stats[self.index];
            s.busy_s += rank0.compute_s;
            s.upload_s += rank0.upload_s;
            s.download_s += rank0.download_s;
            s.collective_s += rank0.comm_s - rank0.wait_s;
            s.occupied_s += begun.elapsed().as_secs_f64();
            s.bytes_in += rank0.upload_bytes;
            s.bytes_out += bytes as u64;
            s.collective_bytes += rank0.bytes;
            s.transfers += rank0.transfers;
            s.collectives += rank0.collectives;
            s.microbatches += 1;
        }
        let dep = rank0.last_span;
        match &self.outlet {
            Outlet::Direct(downstream) => downstream.deliver(work, out, dep),
            Outlet::HandOff(_) => Err(WgparError::Internal(
                "a hybrid stage hands off directly".into(),
            )),
        }
    }
}

impl HandOff {
    /// The hand-off thread: deliver each finished pass in order; stop at the first failure
    /// or when the stage thread has gone and everything it started is delivered.
    fn run(self) {
        // The stage's outgoing link carries one download at a time.
        let mut link_free: Option<Instant> = None;
        for pending in self.input.iter() {
            let outcome = catch_unwind(AssertUnwindSafe(|| self.deliver(pending, &mut link_free)));
            let failure = match outcome {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e,
                Err(payload) => WgparError::WorkerPanicked {
                    worker: format!("the hand-off thread of {}", self.name),
                    message: panic_text(&*payload),
                },
            };
            return report_failure(&self.output, &self.name, failure);
        }
    }

    fn deliver(&self, p: Pending, link_free: &mut Option<Instant>) -> Result<()> {
        let started = link_free.map_or(p.started, |t| t.max(p.started));
        let parts = (p.downloads.into_iter())
            .map(PendingDownload::finish)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let n: u64 = parts.iter().map(|b| b.len() as u64).sum();
        if let Some(pacer) = &p.work.pacer {
            pacer.pace(Direction::DeviceToHost, n, started);
        }
        let end = Instant::now();
        *link_free = Some(end);
        let mb = p.work.group as u32;
        let (dev, last) = (self.device, self.last);
        let what = match (last, p.work.encoder.is_some()) {
            (false, _) => "activations",
            (true, false) => "tokens",
            (true, true) => "pooled",
        };
        let d2h = p.work.recorder.record_with(started, end, || {
            SpanAttrs::d2h(what, dev, n).microbatch(mb).after(p.compute)
        });
        {
            let mut stats = lock(&self.stats);
            let s = &mut stats[self.index];
            s.download_s += (end - started).as_secs_f64();
            s.bytes_out += n;
            s.transfers += 1;
        }
        let out = if last {
            StageOut::Final(payload_of(&p.work, parts)?)
        } else {
            StageOut::Hidden(parts.into_iter().next().unwrap_or_default())
        };
        self.downstream.deliver(p.work, out, d2h)
    }
}

/// The last stage's result from its downloads: pooled embeddings for an encoder; for a
/// decoder the picks (`[2][batch]` u32: tokens, then non-finite counts) and, when the readout
/// asked for them, the logits.
fn payload_of(work: &Work, parts: Vec<Vec<u8>>) -> Result<Payload> {
    let mut parts = parts.into_iter();
    let first = parts.next().unwrap_or_default();
    if work.encoder.is_some() {
        return Ok(Payload::Pooled(bytemuck::pod_collect_to_vec(&first)));
    }
    let batch = work.step.batch;
    let words: Vec<u32> = bytemuck::pod_collect_to_vec(&first);
    if words.len() < 2 * batch {
        return Err(WgparError::Shape {
            op: "pipeline output".into(),
            detail: format!("{} picks for {batch} sequences", words.len()),
        });
    }
    Ok(Payload::Picked(StepOut {
        tokens: words[..batch].to_vec(),
        non_finite: words[batch..2 * batch].to_vec(),
        logits: parts.next().map(|b| bytemuck::pod_collect_to_vec(&b)),
    }))
}

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

/// The continuous-batching state of a pipeline: one KV cache of `slots` on every stage,
/// shared by the lanes (the micro-batches in flight).
#[derive(Debug, Default)]
struct Serving {
    slots: usize,
    /// The next pass makes the cache on every stage.
    fresh: bool,
    /// Lanes with a pass in flight.
    busy: Vec<bool>,
    /// Passes per lane so far.
    passes: Vec<usize>,
    /// New tokens processed so far.
    tokens: usize,
    started: Option<Instant>,
    last_output: Option<Instant>,
}

/// Downloads a device stage may have out at once (see `Stage::process`).
const HANDOFF_DEPTH: usize = 3;

/// The key of the serving KV cache on every stage (micro-batch caches use their index).
const SERVING_CACHE: usize = usize::MAX;

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
            return Err(WgparError::Config(format!(
                "{} devices do not form pipeline stages of {tp} tensor-parallel devices",
                gpus.len()
            )));
        }
        let p = gpus.len() / tp;
        let ranges = partition(config.layers, p, how)?;
        Self::segment(
            gpus,
            weights,
            dtype,
            tp,
            ranges,
            micro_batches,
            comm_config,
            Segment::whole(),
        )
    }

    /// A segment of a pipeline: stages holding `ranges` (one per `tp` devices), with the model
    /// ends and remote links `seg` gives. [`hybrid`](Self::hybrid) is the whole pipeline;
    /// `dist` builds one segment per MPI rank and joins them with remote stage links.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn segment(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        tp: usize,
        ranges: Vec<Range<usize>>,
        micro_batches: usize,
        comm_config: CommConfig,
        seg: Segment,
    ) -> Result<Self> {
        let config = weights.config.clone();
        let p = ranges.len();
        if tp == 0 || p == 0 || gpus.len() != p * tp {
            return Err(WgparError::Config(format!(
                "{} devices do not form {p} pipeline stages of {tp} tensor-parallel devices",
                gpus.len()
            )));
        }
        if micro_batches == 0 {
            return Err(WgparError::Config(
                "--micro-batches must be at least 1".into(),
            ));
        }
        let comm = Arc::new(Collectives::new(comm_config.clone())?);
        let stage_gpus: Vec<&[Arc<Gpu>]> = gpus.chunks(tp).collect();
        let backends: Vec<Result<Backend>> = if tp == 1 {
            std::thread::scope(|s| {
                let handles: Vec<_> = gpus
                    .iter()
                    .zip(&ranges)
                    .enumerate()
                    .map(|(i, (gpu, layers))| {
                        let placement = Placement {
                            layers: layers.clone(),
                            shard: ShardSpec::full(&config),
                            embedding: i == 0 && seg.embeds,
                            head: i + 1 == p && seg.head,
                        };
                        s.spawn(move || GpuModel::upload(gpu.clone(), weights, placement, dtype))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| {
                                Err(WgparError::WorkerPanicked {
                                    worker: "weight upload thread".into(),
                                    message: "while uploading a stage".into(),
                                })
                            })
                            .map(|model| Backend::Device {
                                model,
                                acts: HashMap::new(),
                                caches: HashMap::new(),
                            })
                    })
                    .collect()
            })
        } else {
            stage_gpus
                .iter()
                .zip(&ranges)
                .enumerate()
                .map(|(i, (devices, layers))| {
                    TpGroup::new(
                        devices,
                        weights,
                        dtype,
                        None,
                        layers.clone(),
                        i == 0 && seg.embeds,
                        i + 1 == p && seg.head,
                        comm_config.clone(),
                    )
                    .map(Backend::Group)
                })
                .collect()
        };
        let backends = backends.into_iter().collect::<Result<Vec<_>>>()?;
        let gpus: Vec<Arc<Gpu>> = stage_gpus.iter().map(|g| g[0].clone()).collect();
        let stats = Arc::new(Mutex::new(
            ranges
                .iter()
                .zip(&gpus)
                .map(|(r, g)| StageStats {
                    layers: r.clone(),
                    device: g.describe(),
                    ..Default::default()
                })
                .collect(),
        ));
        let faults = Arc::new(Mutex::new(vec![None; p]));
        let Segment {
            embeds,
            head,
            upstream,
            mut downstream,
            output: (output_tx, output),
        } = seg;
        // The driver feeds the first stage unless a remote link does.
        let (input, mut receiver) = match upstream {
            Some(rx) => (None, rx),
            None => {
                let (tx, rx) = bounded::<Work>(2);
                (Some(tx), rx)
            }
        };
        let mut threads = Vec::new();
        let spawn = |threads: &mut Vec<JoinHandle<()>>,
                     thread: String,
                     name: &str,
                     body: Box<dyn FnOnce() + Send>|
         -> Result<()> {
            threads.push(
                std::thread::Builder::new()
                    .name(thread)
                    .spawn(body)
                    .map_err(|e| WgparError::Worker {
                        worker: name.to_string(),
                        message: format!("could not start thread: {e}"),
                    })?,
            );
            Ok(())
        };
        for (index, backend) in backends.into_iter().enumerate() {
            let (downstream, next_rx) = if index + 1 < p {
                let (tx, rx) = bounded::<Work>(2);
                (Downstream::Stage(tx), Some(rx))
            } else {
                // The last stage here hands on to a remote stage, or to the driver.
                match downstream.take() {
                    Some(remote) => (Downstream::Stage(remote), None),
                    None => (Downstream::Driver(output_tx.clone()), None),
                }
            };
            let devices: Vec<&str> = stage_gpus[index].iter().map(|g| g.label()).collect();
            let name = format!(
                "stage {index} ({} on {}, layers {}..{})",
                devices.join("+"),
                gpus[index].info().label(),
                ranges[index].start,
                ranges[index].end
            );
            let outlet = match backend {
                Backend::Device { .. } => {
                    // One pass may wait for its download while the next computes.
                    let (tx, rx) = bounded::<Pending>(1);
                    let handoff = HandOff {
                        index,
                        last: head && index + 1 == p,
                        name: name.clone(),
                        device: gpus[index].ordinal() as u32,
                        input: rx,
                        downstream,
                        output: output_tx.clone(),
                        stats: stats.clone(),
                    };
                    spawn(
                        &mut threads,
                        format!("pp-handoff-{index}"),
                        &name,
                        Box::new(move || handoff.run()),
                    )?;
                    Outlet::HandOff(tx)
                }
                Backend::Group(_) => Outlet::Direct(downstream),
            };
            let stage = Stage {
                index,
                name: name.clone(),
                gpu: gpus[index].clone(),
                backend,
                comm: comm.clone(),
                input: receiver,
                outlet,
                output: output_tx.clone(),
                stats: stats.clone(),
                fault: faults.clone(),
                jobs: 0,
                timer: SpanTimer::default(),
                embeds: embeds && index == 0,
                head: head && index + 1 == p,
            };
            spawn(
                &mut threads,
                format!("pp-stage-{index}"),
                &name,
                Box::new(move || stage.run()),
            )?;
            receiver = match next_rx {
                Some(rx) => rx,
                None => bounded(0).1,
            };
        }
        Ok(Self {
            input,
            output,
            threads,
            ranges,
            labels: stage_gpus
                .iter()
                .map(|g| g.iter().map(|d| d.label()).collect::<Vec<_>>().join("+"))
                .collect(),
            config,
            tp,
            micro_batches,
            schedule: Schedule::default(),
            stats,
            faults,
            groups: Vec::new(),
            group_past: Vec::new(),
            group_deps: HashMap::new(),
            last_outputs: Vec::new(),
            steps: 0,
            picker: Picker::greedy(),
            remote_head: !head,
            batch: 0,
            last: None,
            last_run: None,
            failed: None,
            recorder: Recorder::disabled(),
            timeout: Duration::from_secs(120),
            pacer: None,
            serving: Serving::default(),
            run: 0,
        })
    }

    /// Layers of each stage.
    pub fn stage_layers(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Changes the micro-batch count for later batches.
    pub fn set_micro_batches(&mut self, m: usize) -> Result<()> {
        if m == 0 {
            return Err(WgparError::Config(
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
        let slot = faults.get_mut(stage).ok_or_else(|| {
            WgparError::InvalidCall(format!(
                "no stage {stage} in a {}-stage pipeline",
                self.ranges.len()
            ))
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

    fn check_alive(&self) -> Result<()> {
        match &self.failed {
            Some(why) => Err(WgparError::EngineStopped {
                engine: "pipeline".into(),
                cause: why.clone(),
            }),
            None => Ok(()),
        }
    }

    fn reset_stats(&mut self) {
        self.run += 1;
        for s in lock(&self.stats).iter_mut() {
            s.clear();
        }
    }

    fn send(&mut self, work: Work) -> Result<()> {
        let input = self
            .input
            .as_ref()
            .ok_or_else(|| WgparError::WorkerStopped {
                worker: "stage 0".into(),
                detail: "the pipeline's input is closed".into(),
            })?;
        if input.send(work).is_err() {
            // Stage 0 is gone: its error (or the root cause further down) is in the output.
            return Err(self
                .receive()
                .err()
                .unwrap_or_else(|| WgparError::WorkerStopped {
                    worker: "stage 0".into(),
                    detail: "it closed its input".into(),
                }));
        }
        Ok(())
    }

    fn receive(&mut self) -> Result<Output> {
        let r = match self.output.recv_timeout(self.timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => Err(WgparError::Timeout {
                engine: "pipeline".into(),
                secs: self.timeout.as_secs_f64(),
            }),
            Err(RecvTimeoutError::Disconnected) => Err(WgparError::WorkerStopped {
                worker: "every stage".into(),
                detail: "no logits came back".into(),
            }),
        };
        if let Err(e) = &r {
            self.failed = Some(e.to_string());
            // Close the input so every stage drains and stops.
            self.input = None;
        }
        r
    }

    /// One pass of `group` through the pipeline; its first span waits for `deps`.
    fn work(
        &self,
        group: usize,
        ids: Vec<u32>,
        step: Step,
        (new_cache, release): (bool, bool),
        deps: Vec<SpanId>,
    ) -> Work {
        Work {
            group,
            cache: group,
            rows: None,
            slots: None,
            release_us: None,
            ids: Arc::new(ids),
            step,
            new_cache,
            release,
            hidden: Vec::new(),
            encoder: None,
            pacer: self.pacer.clone(),
            deps,
            recorder: self.recorder.clone(),
            run: self.run,
            readout: Readout::default(),
        }
    }

    /// The readout of a step of `batch` sequences: the engine's pick with its draws, and the
    /// logits when asked for or when the host picks.
    fn readout(&mut self, batch: usize, logits: bool) -> Readout {
        if self.remote_head {
            return Readout::remote(logits || self.host_picks());
        }
        Readout {
            pick: self.picker.device_or_greedy(),
            draws: Arc::new(self.picker.draws(batch)),
            logits: logits || self.picker.needs_logits(),
        }
    }

    /// Whether tokens are picked here from read-back logits rather than on the device.
    fn host_picks(&self) -> bool {
        self.picker.needs_logits() || (self.remote_head && self.picker.needs_remote_logits())
    }

    /// A step's tokens from the last stage's picks: refused when logits were not finite,
    /// sampled here where the device could not pick this way.
    fn tokens_of(&mut self, step: usize, out: &StepOut) -> Result<Vec<u32>> {
        check_finite(step, &out.non_finite, None)?;
        if !self.host_picks() {
            return Ok(out.tokens.clone());
        }
        let data = out.logits.clone().ok_or_else(|| {
            WgparError::Internal("the host picks tokens but no logits came back".into())
        })?;
        let l = Logits {
            batch: out.tokens.len(),
            vocab: self.config.vocab,
            data,
        };
        check_finite(step, &count_non_finite(&l), None)?;
        Ok(self.picker.host(&l))
    }

    /// Closes a run: its [`PipelineStats`] and [`StepStats`] from the stage statistics.
    /// `lanes` sequence groups were in flight, the longest making `chain` passes in a row.
    fn finish_run(&mut self, start: Instant, tokens: usize, lanes: usize, chain: usize) {
        let (step, run) = self.run_stats(start.elapsed().as_secs_f64(), tokens, lanes, chain);
        self.last = Some(step);
        self.last_run = Some(run);
    }

    /// The accounting of the stage statistics so far, for a run of `makespan_s`.
    fn run_stats(
        &self,
        makespan_s: f64,
        tokens: usize,
        lanes: usize,
        chain: usize,
    ) -> (StepStats, PipelineStats) {
        let stages = lock(&self.stats).clone();
        let p = stages.len().max(1) as f64;
        let mean = |f: &dyn Fn(&StageStats) -> f64| stages.iter().map(f).sum::<f64>() / p;
        let busy: f64 = stages.iter().map(|s| s.busy_s).sum();
        let step = StepStats {
            tokens,
            wall_s: makespan_s,
            compute_s: busy / p,
            comm_s: mean(&|s| s.upload_s + s.download_s + s.collective_s),
            collectives: mean(&|s| (s.transfers + s.collectives) as f64).round() as usize,
            bytes_sent: mean(&|s| (s.bytes_out + s.collective_bytes) as f64).round() as u64,
            bytes_received: mean(&|s| (s.bytes_in + s.collective_bytes) as f64).round() as u64,
            encode_s: None,
            encode_cpu_s: None,
        };
        let run =
            PipelineStats::from_stages(stages, self.schedule, makespan_s, tokens, lanes, chain);
        (step, run)
    }

    /// One GPipe step: every group's work in, every group's tokens (and logits when asked)
    /// out, in group order. The step starts after the previous call's outputs (the driver
    /// had them all).
    fn gpipe(
        &mut self,
        steps: Vec<(Vec<u32>, Step)>,
        new_cache: bool,
        want_logits: bool,
    ) -> Result<StepOutput> {
        self.check_alive()?;
        self.reset_stats();
        let start = Instant::now();
        let tokens: usize = steps.iter().map(|(_, s)| s.tokens()).sum();
        let n = steps.len();
        let barrier = std::mem::take(&mut self.last_outputs);
        for (g, (ids, step)) in steps.into_iter().enumerate() {
            let mut w = self.work(g, ids, step, (new_cache, false), barrier.clone());
            w.readout = self.readout(step.batch, want_logits);
            self.send(w)?;
        }
        let mut rows: Vec<Option<StepOut>> = vec![None; n];
        for _ in 0..n {
            let out = self.receive()?;
            self.group_deps.insert(out.group, out.dep);
            self.last_outputs.push(out.dep);
            match (out.payload, rows.get_mut(out.group)) {
                (Payload::Picked(p), Some(row)) => *row = Some(p),
                _ => return Err(unexpected_output()),
            }
        }
        self.finish_run(start, tokens, n, 1);
        let mut next = Vec::with_capacity(self.batch);
        let mut logits = Vec::new();
        for out in rows {
            let out = out.ok_or_else(unexpected_output)?;
            next.extend(self.tokens_of(self.steps, &out)?);
            logits.extend(out.logits.unwrap_or_default());
        }
        self.steps += 1;
        Ok(StepOutput {
            tokens: next,
            logits: want_logits.then_some(Logits {
                batch: self.batch,
                vocab: self.config.vocab,
                data: logits,
            }),
        })
    }

    /// Decode with every micro-batch in flight: a group's next token enters stage 0 as soon
    /// as its pick is back, whatever the other groups are doing. Only token ids come back
    /// unless `keep_logits` (or a host-side pick) asks for the logits.
    fn decode_in_flight(
        &mut self,
        next: &[u32],
        steps: usize,
        keep_logits: bool,
    ) -> Result<Decoded> {
        self.check_alive()?;
        check_decode(self.batch, next)?;
        let start = Instant::now();
        let mut out = Decoded {
            tokens: vec![Vec::with_capacity(steps); self.batch],
            ..Decoded::default()
        };
        if steps == 0 {
            return Ok(out);
        }
        self.reset_stats();
        let groups = self.groups.clone();
        let vocab = self.config.vocab;
        let mut kept: Vec<Vec<Vec<f32>>> = vec![Vec::new(); groups.len()];
        let mut left = vec![steps; groups.len()];
        // The first tokens were sampled from the previous call's outputs, all of them.
        let barrier = std::mem::take(&mut self.last_outputs);
        for (g, range) in groups.iter().enumerate() {
            let step = Step {
                batch: range.len(),
                seq: 1,
                past: self.group_past[g],
            };
            let mut w = self.work(
                g,
                next[range.clone()].to_vec(),
                step,
                (false, false),
                barrier.clone(),
            );
            w.readout = self.readout(step.batch, keep_logits);
            self.send(w)?;
        }
        let mut running = groups.len();
        while running > 0 {
            let o = self.receive()?;
            let g = o.group;
            self.group_deps.insert(g, o.dep);
            self.group_past[g] += 1;
            left[g] -= 1;
            let Payload::Picked(picked) = o.payload else {
                return Err(unexpected_output());
            };
            // Step k of this group: the prefill was step 0.
            let chosen = self.tokens_of(steps - left[g], &picked)?;
            for (seq, &t) in groups[g].clone().zip(&chosen) {
                out.tokens[seq].push(t);
            }
            if keep_logits {
                let mut data = picked.logits.unwrap_or_default();
                data.truncate(o.batch * vocab);
                kept[g].push(data);
            }
            if left[g] > 0 {
                let step = Step {
                    batch: o.batch,
                    seq: 1,
                    past: self.group_past[g],
                };
                let mut w = self.work(g, chosen, step, (false, false), vec![o.dep]);
                w.readout = self.readout(step.batch, keep_logits);
                self.send(w)?;
            } else {
                running -= 1;
            }
        }
        self.last_outputs = (0..groups.len())
            .filter_map(|g| self.group_deps.get(&g).copied())
            .collect();
        self.finish_run(start, self.batch * steps, groups.len(), steps);
        if keep_logits {
            out.logits = (0..steps)
                .map(|s| Logits {
                    batch: self.batch,
                    vocab,
                    data: kept.iter().flat_map(|k| k[s].iter().copied()).collect(),
                })
                .collect();
        }
        out.wall_s = start.elapsed().as_secs_f64();
        out.stats = self.last.clone().unwrap_or_default();
        Ok(out)
    }

    /// Greedy generation (prefill, then [`Engine::decode_greedy`]) with this engine's
    /// schedule; the same as [`generate`](super::generate).
    pub fn generate(&mut self, prompts: &[Vec<u32>], steps: usize) -> Result<Generation> {
        super::generate(self, prompts, steps)
    }
}

impl Encoder for PipelineEngine {
    fn name(&self) -> String {
        Engine::name(self)
    }

    /// The batch split into micro-batches (each its own padded group) flowing through the
    /// stages; the last stage pools.
    fn encode(&mut self, inputs: &[EncoderInput]) -> Result<Embeddings> {
        self.check_alive()?;
        let seq = EncoderInput::check_batch(inputs, &self.config)?;
        let groups = split_groups(inputs.len(), self.micro_batches);
        self.reset_stats();
        let start = Instant::now();
        let barrier = std::mem::take(&mut self.last_outputs);
        for (g, range) in groups.iter().enumerate() {
            let (ids, types, lens) = pad_batch(&inputs[range.clone()], seq);
            let step = Step {
                batch: range.len(),
                seq,
                past: 0,
            };
            let mut w = self.work(g, ids, step, (true, true), barrier.clone());
            w.encoder = Some(Arc::new(EncoderExtras { types, lens }));
            self.send(w)?;
        }
        let mut rows: Vec<Option<Vec<f32>>> = vec![None; groups.len()];
        let dim = self.config.hidden;
        for _ in 0..groups.len() {
            let out = self.receive()?;
            self.last_outputs.push(out.dep);
            let (Payload::Pooled(mut data), Some(row)) = (out.payload, rows.get_mut(out.group))
            else {
                return Err(unexpected_output());
            };
            data.truncate(out.batch * dim);
            *row = Some(data);
        }
        self.finish_run(start, inputs.len() * seq, groups.len(), 1);
        Ok(Embeddings {
            batch: inputs.len(),
            dim,
            data: rows.into_iter().flatten().flatten().collect(),
        })
    }
}

fn unexpected_output() -> WgparError {
    WgparError::Internal("the last stage returned an output of another kind or group".into())
}

/// Contiguous sequence ranges for `m` micro-batches of a batch (at most one per sequence).
pub fn split_groups(batch: usize, m: usize) -> Vec<Range<usize>> {
    let m = m.clamp(1, batch.max(1));
    let base = batch / m;
    let extra = batch % m;
    let mut start = 0;
    (0..m)
        .map(|g| {
            let n = base + usize::from(g < extra);
            let r = start..start + n;
            start += n;
            r
        })
        .collect()
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
        let steps = self
            .groups
            .iter()
            .map(|g| {
                (
                    prompts[g.clone()].concat(),
                    Step {
                        batch: g.len(),
                        seq,
                        past: 0,
                    },
                )
            })
            .collect();
        self.gpipe(steps, true, logits)
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

impl StepEngine for PipelineEngine {
    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    /// One lane per micro-batch.
    fn lanes(&self) -> usize {
        self.micro_batches
    }

    /// The stages make their caches with the next pass; the accounting starts over.
    fn reserve_slots(&mut self, slots: usize) -> Result<()> {
        self.check_alive()?;
        if slots == 0 {
            return Err(WgparError::InvalidCall(
                "a KV cache needs at least one slot".into(),
            ));
        }
        self.reset_stats();
        self.serving = Serving {
            slots,
            fresh: true,
            busy: vec![false; self.micro_batches],
            passes: vec![0; self.micro_batches],
            ..Serving::default()
        };
        // The plain batch lived in the micro-batch caches.
        self.batch = 0;
        Ok(())
    }

    fn slots(&self) -> usize {
        self.serving.slots
    }

    fn submit(&mut self, step: BatchStep) -> Result<()> {
        self.check_alive()?;
        let lanes = self.serving.busy.len();
        if self.serving.slots == 0 {
            return Err(WgparError::InvalidCall(
                "submit before reserve_slots".into(),
            ));
        }
        if step.lane >= lanes || self.serving.busy[step.lane] {
            return Err(WgparError::InvalidCall(format!(
                "lane {} of {lanes} is not free",
                step.lane
            )));
        }
        let shape = Step {
            batch: step.rows.len(),
            seq: step.seq,
            past: 0,
        };
        let new_cache = std::mem::take(&mut self.serving.fresh);
        let mut w = self.work(step.lane, step.ids, shape, (new_cache, false), step.deps);
        w.cache = SERVING_CACHE;
        w.rows = Some(Arc::new(step.rows));
        w.slots = Some(self.serving.slots);
        w.release_us = step.release_us;
        // The device picks greedily; logits come back only for a caller that samples.
        w.readout = Readout {
            logits: step.logits,
            ..Readout::default()
        };
        self.serving.started.get_or_insert_with(Instant::now);
        self.serving.busy[step.lane] = true;
        self.serving.tokens += shape.tokens();
        self.send(w)
    }

    fn complete(&mut self, timeout: Option<Duration>) -> Result<Option<StepDone>> {
        let out = match timeout {
            None => self.receive()?,
            Some(t) => match self.output.recv_timeout(t.min(self.timeout)) {
                Ok(Ok(out)) => out,
                Err(RecvTimeoutError::Timeout) if t < self.timeout => return Ok(None),
                // A failure, a stop or a real stall: `receive` reports it.
                Ok(Err(e)) => {
                    self.failed = Some(e.to_string());
                    self.input = None;
                    return Err(e);
                }
                Err(_) => self.receive()?,
            },
        };
        let lane = out.group;
        let s = &mut self.serving;
        if let Some(b) = s.busy.get_mut(lane) {
            *b = false;
        }
        if let Some(p) = s.passes.get_mut(lane) {
            *p += 1;
        }
        s.last_output = Some(Instant::now());
        let Payload::Picked(picked) = out.payload else {
            return Err(unexpected_output());
        };
        check_finite(
            s.passes.get(lane).copied().unwrap_or(0),
            &picked.non_finite,
            None,
        )?;
        let mut tokens = picked.tokens;
        tokens.truncate(out.batch);
        let vocab = self.model_config().vocab;
        Ok(Some(StepDone {
            lane,
            tokens,
            logits: super::batch::row_logits(picked.logits, out.batch, vocab)?,
            span: out.dep,
        }))
    }

    fn serving_stats(&self) -> Option<PipelineStats> {
        let s = &self.serving;
        let makespan = match (s.started, s.last_output) {
            (Some(a), Some(b)) => (b - a).as_secs_f64(),
            _ => 0.0,
        };
        let chain = s.passes.iter().copied().max().unwrap_or(0);
        let lanes = s.passes.iter().filter(|&&p| p > 0).count();
        Some(self.run_stats(makespan, s.tokens, lanes, chain).1)
    }
}
