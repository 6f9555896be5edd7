//! Pipeline parallelism: the layers split into stages, one OS thread per stage owning its
//! device, layers and KV caches. Activations move between stages as host bytes over bounded
//! crossbeam channels (device -> host on one stage, host -> device on the next). A stage submits
//! micro-batch k+1's compute before it finishes k's download and hands it on (double
//! buffering), so the hand-off overlaps the next compute.
//!
//! Schedules: GPipe fill-drain (`prefill`/`decode` split the batch into micro-batches), and a
//! continuous stream of requests ([`PipelineEngine::serve`]) in which each request (a group
//! of sequences) moves on to its next decode step as soon as its logits return, so generation
//! keeps the pipeline full too.
//!
//! Failure: a stage whose job errors or panics (or whose device is lost) reports an error
//! naming itself and stops; its neighbours see the closed channels and stop; the driver
//! returns the first error. Every thread is joined when the engine is dropped.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam::channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use serde::Serialize;

use super::encoder::{pad_batch, Embeddings, Encoder};
use super::partition::{partition, Partition};
use super::pick::{check_finite, count_non_finite, Picker};
use super::tp::{EncoderExtras, GroupInput, GroupJob, GroupOutput, Readout, TpGroup};
use super::{check_decode, cost, prompt_shape, Engine, Generation, Logits, StepOutput, StepStats};
use crate::comm::{Collectives, CommConfig, PendingDownload};
use crate::device::{DType, Gpu, SpanTimer};
use crate::error::{Result, WgparError};
use crate::model::sampling::SamplingParams;
use crate::model::{
    Activations, EncoderInput, GpuModel, KvCache, ModelConfig, ModelWeights, Placement, ShardSpec,
    Step, StepOut,
};
use crate::sim::{Direction, LinkPacer};
use crate::trace::{KernelFamily, Recorder, SpanAttrs, SpanId};

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

/// Per-stage accounting of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StageStats {
    /// Layers held.
    pub layers: Range<usize>,
    /// Device.
    pub device: String,
    /// Time computing (encode + GPU), seconds.
    pub busy_s: f64,
    /// Time in hand-offs (host -> device upload, device -> host download wait), seconds.
    pub handoff_s: f64,
    /// Bytes handed to the next stage (or logits read back on the last stage).
    pub bytes_out: u64,
    /// Micro-batches processed.
    pub microbatches: usize,
}

/// Accounting of one pipeline run (a GPipe step or a served stream).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PipelineStats {
    /// Stages.
    pub stages: Vec<StageStats>,
    /// Micro-batches in the run (per stage).
    pub microbatches: usize,
    /// First input to last output, seconds.
    pub makespan_s: f64,
    /// 1 - sum(busy) / (p x makespan).
    pub measured_bubble: f64,
    /// (p - 1) / (m + p - 1).
    pub theoretical_bubble: f64,
    /// Makespan of a perfect pipeline with the measured per-micro-batch stage times:
    /// sum(t_s) + (m - 1) max(t_s).
    pub ideal_makespan_s: f64,
    /// New tokens processed.
    pub tokens: usize,
}

impl PipelineStats {
    /// Measured throughput, tokens/s.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.makespan_s
    }

    /// Throughput of the ideal pipeline, tokens/s.
    pub fn ideal_tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.ideal_makespan_s
    }

    /// Mean hand-off time and bytes per micro-batch at one stage boundary.
    pub fn handoff_per_microbatch(&self) -> (f64, u64) {
        let inner = &self.stages[..self.stages.len().saturating_sub(1)];
        let m = self.microbatches.max(1);
        if inner.is_empty() {
            return (0.0, 0);
        }
        let secs = inner.iter().map(|s| s.handoff_s).sum::<f64>() / (inner.len() * m) as f64;
        let bytes = inner.iter().map(|s| s.bytes_out).sum::<u64>() / (inner.len() * m) as u64;
        (secs, bytes)
    }
}

/// One request of a served stream: a group of equal-length prompts and how many tokens to
/// generate for each.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompts (equal lengths).
    pub prompts: Vec<Vec<u32>>,
    /// Tokens to generate per prompt (>= 1; the first comes from the prefill).
    pub max_new: usize,
}

/// A finished request.
#[derive(Debug, Clone)]
pub struct Response {
    /// Index of the request.
    pub request: usize,
    /// Generated tokens per prompt.
    pub tokens: Vec<Vec<u32>>,
    /// Logits of every step (prefill first).
    pub logits: Vec<Logits>,
    /// Time from the start of the stream to the first token, seconds.
    pub first_token_s: f64,
    /// Time from the start of the stream to the last token, seconds.
    pub done_s: f64,
}

struct Work {
    encoder: Option<Arc<EncoderExtras>>,
    pacer: Option<Arc<LinkPacer>>,
    group: usize,
    ids: Arc<Vec<u32>>,
    step: Step,
    new_cache: bool,
    release: bool,
    hidden: Vec<u8>,
    dep: SpanId,
    recorder: Recorder,
    /// The last stage's token pick and readback.
    readout: Readout,
}

/// What the last stage hands the driver.
enum Payload {
    /// A decoder's picks (and logits when asked).
    Picked(StepOut),
    /// An encoder's pooled embeddings.
    Pooled(Vec<f32>),
}

struct Output {
    group: usize,
    payload: Payload,
    /// The span that delivered the result: the group's next step depends on it.
    dep: SpanId,
}

struct Pending {
    work: Work,
    /// The stage's output (hidden states, picks or pooled embeddings), then the logits when
    /// asked for.
    downloads: Vec<PendingDownload>,
    started: Instant,
    compute: SpanId,
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

struct Stage {
    index: usize,
    count: usize,
    name: String,
    /// The stage's (first) device: faults, labels.
    gpu: Arc<Gpu>,
    backend: Backend,
    comm: Arc<Collectives>,
    input: Receiver<Work>,
    next: Option<Sender<Work>>,
    output: Sender<Result<Output>>,
    stats: Arc<Mutex<Vec<StageStats>>>,
    fault: Arc<Mutex<Vec<Option<Fault>>>>,
    /// Micro-batches this stage has taken since it started (what a fault's `after` counts).
    jobs: usize,
    /// Device-side timing of compute spans while a trace is recorded.
    timer: SpanTimer,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

impl Stage {
    fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    fn fail(&self, cause: WgparError) {
        let e = match cause {
            e @ WgparError::WorkerPanicked { .. } => e,
            cause => WgparError::WorkerFailed {
                worker: self.name.clone(),
                source: Box::new(cause),
            },
        };
        let _ = self.output.send(Err(e));
    }

    /// The stage's thread: take work, overlap each micro-batch's compute with the previous
    /// one's hand-off, stop at the first failure or when the input closes.
    fn run(mut self) {
        let mut pending: Option<Pending> = None;
        loop {
            let work = if pending.is_some() {
                match self.input.try_recv() {
                    Ok(w) => w,
                    Err(TryRecvError::Empty) => {
                        // Nothing to overlap with: hand the finished micro-batch on now.
                        if let Err(e) = self.flush(&mut pending) {
                            return self.fail(e);
                        }
                        continue;
                    }
                    Err(TryRecvError::Disconnected) => {
                        let _ = self.flush(&mut pending);
                        return;
                    }
                }
            } else {
                match self.input.recv() {
                    Ok(w) => w,
                    Err(_) => return,
                }
            };
            let outcome = catch_unwind(AssertUnwindSafe(|| self.process(work, &mut pending)));
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return self.fail(e),
                Err(payload) => {
                    return self.fail(WgparError::WorkerPanicked {
                        worker: self.name.clone(),
                        message: panic_text(&*payload),
                    })
                }
            }
        }
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

    fn process(&mut self, work: Work, pending: &mut Option<Pending>) -> Result<()> {
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
                // A new group reuses its cache when the slots match (the prefill's table
                // starts every row at position 0).
                if work.new_cache && caches.get(&work.group).map(KvCache::slots) != Some(step.batch)
                {
                    caches.insert(work.group, model.kv_cache(step.batch)?);
                }
                if let std::collections::hash_map::Entry::Vacant(slot) = acts.entry(key) {
                    slot.insert(model.activations(step.tokens(), step.batch)?);
                }
                let (Some(act), Some(kv)) = (acts.get_mut(&key), caches.get_mut(&work.group))
                else {
                    return Err(WgparError::InvalidCall(format!(
                        "micro-batch {} decoded before its prefill",
                        work.group
                    )));
                };
                // Inputs staged and the step's ops configured: everything that needs the
                // activation set and cache mutably.
                let m = &*model;
                if self.index == 0 {
                    m.write_ids(act, &work.ids)?;
                }
                if let Some(e) = &work.encoder {
                    m.write_encoder_inputs(act, &step, &e.types, &e.lens)?;
                }
                if self.index + 1 == self.count && !m.config().is_encoder() {
                    act.set_readout(work.readout.pick, work.readout.logits);
                    if !work.readout.draws.is_empty() {
                        m.write_draws(act, &work.readout.draws)?;
                    }
                }
                m.begin_step(act, kv, &step, &step.rows())?;
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
        let (Some(act), Some(kv)) = (acts.get(&key), caches.get(&work.group)) else {
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
        let mut dep = work.dep;
        let upload_start = Instant::now();
        let is_last = self.index + 1 == self.count;
        let picks = is_last && !m.config().is_encoder();
        if self.index != 0 {
            let want = step.tokens() * m.config().hidden * 4;
            if work.hidden.len() != want {
                return Err(WgparError::Shape {
                    op: "pipeline hand-off".into(),
                    detail: format!("received {} bytes, expected {want}", work.hidden.len()),
                });
            }
            self.comm.upload(&gpu, act.x(), 0, &work.hidden)?;
            if let Some(p) = &work.pacer {
                p.pace(
                    Direction::HostToDevice,
                    work.hidden.len() as u64,
                    upload_start,
                );
            }
            let end = Instant::now();
            lock(&self.stats)[self.index].handoff_s += (end - upload_start).as_secs_f64();
            let bytes = work.hidden.len() as u64;
            dep = rec.record_with(upload_start, end, || {
                SpanAttrs::h2d("activations", dev, bytes)
                    .microbatch(mb)
                    .after(dep)
            });
        }
        let start = Instant::now();
        let mut enc = gpu.encoder();
        timer.begin(&mut enc);
        if self.index == 0 {
            m.embed(&mut enc, act)?;
        }
        m.layers(&mut enc, act, kv)?;
        if is_last {
            m.finish(&mut enc, act)?;
        }
        timer.end(&mut enc);
        gpu.submit(enc);
        // Double buffering: the previous micro-batch's download was queued before this
        // compute; finishing and sending it now overlaps this compute.
        let flush_start = Instant::now();
        self.flush(pending)?;
        let flush_s = flush_start.elapsed().as_secs_f64();
        gpu.wait()?;
        let end = Instant::now();
        let device_us = timer.read_us(&gpu)?;
        let work_cost = cost::total(
            m.config(),
            &m.placement().shard,
            m.num_layers(),
            &step,
            m.weight_dtype(),
            self.index == 0,
            self.is_last(),
        );
        let layers = m.placement().layers.clone();
        let compute = rec.record_with(start, end, || {
            SpanAttrs::compute(format!("layers {}..{}", layers.start, layers.end), dev)
                .microbatch(mb)
                .flops(work_cost.flops)
                .bytes(work_cost.bytes)
                .kernels(work_cost.kernels)
                .family(KernelFamily::Matmul)
                .device_us(device_us)
                .after(dep)
        });
        {
            let mut stats = lock(&self.stats);
            let s = &mut stats[self.index];
            // The flush ran on this thread while the GPU computed; it is hand-off time, not
            // compute.
            s.busy_s += (end - start).as_secs_f64() - flush_s;
            s.microbatches += 1;
        }
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
        } else if is_last {
            let (result, width) = m.output(act).ok_or_else(no_output)?;
            downloads.push(
                self.comm
                    .begin_download_range(&gpu, result, 0..step.batch * width)?,
            );
        } else {
            let len = step.tokens() * m.config().hidden;
            downloads.push(self.comm.begin_download_range(&gpu, act.x(), 0..len)?);
        }
        if work.release {
            if let Backend::Device { caches, .. } = &mut self.backend {
                caches.remove(&work.group);
            }
        }
        *pending = Some(Pending {
            work,
            downloads,
            started: Instant::now(),
            compute,
        });
        Ok(())
    }

    /// Finishes the pending download and hands it to the next stage (or the driver).
    fn flush(&self, pending: &mut Option<Pending>) -> Result<()> {
        let Some(p) = pending.take() else {
            return Ok(());
        };
        let wait_start = Instant::now();
        let parts = (p.downloads.into_iter())
            .map(PendingDownload::finish)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let n: u64 = parts.iter().map(|b| b.len() as u64).sum();
        if let Some(pacer) = &p.work.pacer {
            pacer.pace(Direction::DeviceToHost, n, p.started);
        }
        let end = Instant::now();
        let dev = self.gpu.ordinal() as u32;
        let mb = p.work.group as u32;
        let d2h = p.work.recorder.record_with(p.started, end, || {
            SpanAttrs::d2h(
                if self.is_last() {
                    "tokens"
                } else {
                    "activations"
                },
                dev,
                n,
            )
            .microbatch(mb)
            .after(p.compute)
        });
        {
            let mut stats = lock(&self.stats);
            stats[self.index].handoff_s += (end - wait_start).as_secs_f64();
            stats[self.index].bytes_out += n;
        }
        let mut parts = parts.into_iter();
        let first = parts.next().unwrap_or_default();
        match &self.next {
            Some(_) => self.hand_on(p.work, first, d2h),
            None => {
                let batch = p.work.step.batch;
                let payload = if p.work.encoder.is_some() {
                    Payload::Pooled(bytemuck::pod_collect_to_vec(&first))
                } else {
                    let words: Vec<u32> = bytemuck::pod_collect_to_vec(&first);
                    if words.len() < 2 * batch {
                        return Err(WgparError::Shape {
                            op: "pipeline output".into(),
                            detail: format!("{} picks for {batch} sequences", words.len()),
                        });
                    }
                    Payload::Picked(StepOut {
                        tokens: words[..batch].to_vec(),
                        non_finite: words[batch..2 * batch].to_vec(),
                        logits: parts.next().map(|b| bytemuck::pod_collect_to_vec(&b)),
                    })
                };
                self.deliver(p.work.group, payload, d2h)
            }
        }
    }

    /// Sends a finished micro-batch's hidden states to the next stage.
    fn hand_on(&self, work: Work, bytes: Vec<u8>, dep: SpanId) -> Result<()> {
        let next = self.next.as_ref().ok_or_else(|| {
            WgparError::Internal("the last stage has no next stage to hand on to".into())
        })?;
        next.send(Work {
            hidden: bytes,
            dep,
            ..work
        })
        .map_err(|_| WgparError::WorkerStopped {
            worker: format!("stage {}", self.index + 1),
            detail: "it closed its input".into(),
        })
    }

    /// Sends the last stage's result to the driver.
    fn deliver(&self, group: usize, payload: Payload, dep: SpanId) -> Result<()> {
        self.output
            .send(Ok(Output {
                group,
                payload,
                dep,
            }))
            .map_err(|_| WgparError::WorkerStopped {
                worker: "the pipeline's caller".into(),
                detail: "it stopped reading results".into(),
            })
    }

    /// A hybrid stage: the micro-batch runs on the stage's tensor-parallel group; rank 0
    /// returns the hidden states (or logits) to hand on. No double buffering here: the group's
    /// ranks synchronise through their all-reduces anyway.
    fn process_group(&mut self, mut work: Work) -> Result<()> {
        let Backend::Group(group) = &self.backend else {
            return Ok(());
        };
        let input = if self.index == 0 {
            GroupInput::Ids(work.ids.clone())
        } else {
            GroupInput::Hidden(Arc::new(std::mem::take(&mut work.hidden)))
        };
        let job = GroupJob {
            group: work.group,
            input,
            step: work.step,
            new_cache: work.new_cache,
            release: work.release,
            recorder: work.recorder.clone(),
            microbatch: Some(work.group as u32),
            dep: work.dep,
            encoder: work.encoder.clone(),
            pacer: work.pacer.clone(),
            readout: work.readout.clone(),
        };
        let outputs = group.run(job)?;
        let rank0 = outputs
            .into_iter()
            .next()
            .ok_or_else(|| WgparError::Internal("empty tensor-parallel group".into()))?;
        {
            let mut stats = lock(&self.stats);
            let s = &mut stats[self.index];
            s.busy_s += rank0.compute_s;
            s.handoff_s += rank0.handoff_s + rank0.comm_s;
            s.microbatches += 1;
        }
        let dep = rank0.last_span;
        let (bytes, payload) = match rank0.output {
            Some(GroupOutput::Hidden(h)) => (h.len(), Err(h)),
            Some(GroupOutput::Picked(out)) => {
                let words = 2 * out.tokens.len() + out.logits.as_ref().map_or(0, Vec::len);
                (4 * words, Ok(Payload::Picked(out)))
            }
            Some(GroupOutput::Pooled(p)) => (4 * p.len(), Ok(Payload::Pooled(p))),
            None => return Err(WgparError::Internal("rank 0 returned nothing".into())),
        };
        lock(&self.stats)[self.index].bytes_out += bytes as u64;
        match payload {
            Err(hidden) => self.hand_on(work, hidden, dep),
            Ok(payload) => self.deliver(work.group, payload, dep),
        }
    }
}

/// The model split into pipeline stages, one thread per stage.
pub struct PipelineEngine {
    input: Option<Sender<Work>>,
    output: Receiver<Result<Output>>,
    threads: Vec<JoinHandle<()>>,
    ranges: Vec<Range<usize>>,
    labels: Vec<String>,
    config: ModelConfig,
    tp: usize,
    micro_batches: usize,
    stats: Arc<Mutex<Vec<StageStats>>>,
    faults: Arc<Mutex<Vec<Option<Fault>>>>,
    groups: Vec<Range<usize>>,
    group_past: Vec<usize>,
    /// Per sequence group, the span that returned its last logits (the next step waits on it).
    group_deps: HashMap<usize, SpanId>,
    batch: usize,
    /// GPipe steps since the prefill (the prefill is step 0).
    steps: usize,
    picker: Picker,
    last: Option<StepStats>,
    last_run: Option<PipelineStats>,
    failed: Option<String>,
    recorder: Recorder,
    timeout: Duration,
    pacer: Option<Arc<LinkPacer>>,
}

impl PipelineEngine {
    /// Splits `weights` into one stage per device (`partition` decides the layers), stored as
    /// `dtype`, and starts the stage threads. `micro_batches` is the GPipe split of a batch.
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
                            embedding: i == 0,
                            head: i + 1 == p,
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
                        i == 0,
                        i + 1 == p,
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
        let (output_tx, output) = unbounded();
        let (input, mut receiver) = bounded::<Work>(2);
        let mut threads = Vec::new();
        for (index, backend) in backends.into_iter().enumerate() {
            let (next, next_rx) = if index + 1 < p {
                let (tx, rx) = bounded::<Work>(2);
                (Some(tx), Some(rx))
            } else {
                (None, None)
            };
            let devices: Vec<&str> = stage_gpus[index].iter().map(|g| g.label()).collect();
            let name = format!(
                "stage {index} ({} on {}, layers {}..{})",
                devices.join("+"),
                gpus[index].info().label(),
                ranges[index].start,
                ranges[index].end
            );
            let stage = Stage {
                index,
                count: p,
                name: name.clone(),
                gpu: gpus[index].clone(),
                backend,
                comm: comm.clone(),
                input: receiver,
                next,
                output: output_tx.clone(),
                stats: stats.clone(),
                fault: faults.clone(),
                jobs: 0,
                timer: SpanTimer::default(),
            };
            threads.push(
                std::thread::Builder::new()
                    .name(format!("pp-stage-{index}"))
                    .spawn(move || stage.run())
                    .map_err(|e| WgparError::Worker {
                        worker: name,
                        message: format!("could not start thread: {e}"),
                    })?,
            );
            receiver = match next_rx {
                Some(rx) => rx,
                None => bounded(0).1,
            };
        }
        Ok(Self {
            input: Some(input),
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
            stats,
            faults,
            groups: Vec::new(),
            group_past: Vec::new(),
            group_deps: HashMap::new(),
            batch: 0,
            steps: 0,
            picker: Picker::greedy(),
            last: None,
            last_run: None,
            failed: None,
            recorder: Recorder::disabled(),
            timeout: Duration::from_secs(120),
            pacer: None,
        })
    }

    /// Layers of each stage.
    pub fn stage_layers(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Changes the GPipe micro-batch count for later batches.
    pub fn set_micro_batches(&mut self, m: usize) -> Result<()> {
        if m == 0 {
            return Err(WgparError::Config(
                "--micro-batches must be at least 1".into(),
            ));
        }
        self.micro_batches = m;
        Ok(())
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

    fn reset_stats(&self) {
        for s in lock(&self.stats).iter_mut() {
            s.busy_s = 0.0;
            s.handoff_s = 0.0;
            s.bytes_out = 0;
            s.microbatches = 0;
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

    fn work(
        &self,
        group: usize,
        ids: Vec<u32>,
        step: Step,
        new_cache: bool,
        release: bool,
    ) -> Work {
        Work {
            group,
            ids: Arc::new(ids),
            step,
            new_cache,
            release,
            hidden: Vec::new(),
            encoder: None,
            pacer: self.pacer.clone(),
            // A new sequence starts fresh; a decode step waits for its previous logits.
            dep: if new_cache {
                SpanId::NONE
            } else {
                self.group_deps.get(&group).copied().unwrap_or(SpanId::NONE)
            },
            recorder: self.recorder.clone(),
            readout: Readout::default(),
        }
    }

    /// The readout of a decode group of `batch` sequences: the engine's pick with its
    /// draws, and logits when asked for or when the host samples.
    fn readout(&mut self, batch: usize, logits: bool) -> Readout {
        Readout {
            pick: self.picker.device_or_greedy(),
            draws: Arc::new(self.picker.draws(batch)),
            logits: logits || self.picker.needs_logits(),
        }
    }

    /// A step's tokens from the last stage's picks: refused when logits were not finite,
    /// sampled on the host where the device cannot sample that way.
    fn tokens_of(&mut self, step: usize, out: &StepOut, batch: usize) -> Result<Vec<u32>> {
        check_finite(step, &out.non_finite, None)?;
        match (&out.logits, self.picker.needs_logits()) {
            (Some(data), true) => {
                let l = Logits {
                    batch,
                    vocab: self.config.vocab,
                    data: data.clone(),
                };
                check_finite(step, &count_non_finite(&l), None)?;
                Ok(self.picker.host(&l))
            }
            _ => Ok(out.tokens.clone()),
        }
    }

    fn finish_run(&mut self, start: Instant, tokens: usize) {
        let makespan_s = start.elapsed().as_secs_f64();
        let stages = lock(&self.stats).clone();
        let p = stages.len() as f64;
        let m = stages.first().map_or(0, |s| s.microbatches);
        let per_mb: Vec<f64> = stages
            .iter()
            .map(|s| (s.busy_s + s.handoff_s) / s.microbatches.max(1) as f64)
            .collect();
        let slowest = per_mb.iter().cloned().fold(0.0, f64::max);
        let ideal = per_mb.iter().sum::<f64>() + (m.saturating_sub(1)) as f64 * slowest;
        let busy: f64 = stages.iter().map(|s| s.busy_s).sum();
        self.last = Some(StepStats {
            tokens,
            wall_s: makespan_s,
            compute_s: busy / p,
            comm_s: stages.iter().map(|s| s.handoff_s).sum::<f64>() / p,
            collectives: m,
            bytes_sent: stages.first().map_or(0, |s| s.bytes_out),
            bytes_received: stages.first().map_or(0, |s| s.bytes_out),
            encode_s: None,
            encode_cpu_s: None,
        });
        self.last_run = Some(PipelineStats {
            microbatches: m,
            makespan_s,
            measured_bubble: 1.0 - busy / (p * makespan_s),
            theoretical_bubble: (p - 1.0) / (m as f64 + p - 1.0),
            ideal_makespan_s: ideal,
            tokens,
            stages,
        });
    }

    /// One GPipe step: every group's work in, every group's tokens (and logits when asked)
    /// out, in group order.
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
        let batches: Vec<usize> = steps.iter().map(|(_, s)| s.batch).collect();
        for (g, (ids, step)) in steps.into_iter().enumerate() {
            let mut w = self.work(g, ids, step, new_cache, false);
            w.readout = self.readout(step.batch, want_logits);
            self.send(w)?;
        }
        let mut rows: Vec<Option<StepOut>> = vec![None; n];
        for _ in 0..n {
            let out = self.receive()?;
            self.group_deps.insert(out.group, out.dep);
            match out.payload {
                Payload::Picked(p) if out.group < n => rows[out.group] = Some(p),
                _ => return Err(unexpected_output()),
            }
        }
        self.finish_run(start, tokens);
        let mut next = Vec::with_capacity(self.batch);
        let mut logits = Vec::new();
        for (out, batch) in rows.into_iter().zip(batches) {
            let out = out.ok_or_else(unexpected_output)?;
            next.extend(self.tokens_of(self.steps, &out, batch)?);
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

    /// Serves a stream of requests: each request enters the pipeline as soon as fewer than
    /// `in_flight` requests are in it, and each in-flight request moves to its next decode
    /// step as soon as its logits return. Greedy decoding.
    pub fn serve(&mut self, requests: &[Request], in_flight: usize) -> Result<Vec<Response>> {
        self.check_alive()?;
        if in_flight == 0 {
            return Err(WgparError::Config("in_flight must be at least 1".into()));
        }
        for r in requests {
            prompt_shape(&r.prompts)?;
            if r.max_new == 0 {
                return Err(WgparError::Config("max_new must be at least 1".into()));
            }
        }
        self.reset_stats();
        let start = Instant::now();
        let mut queue: VecDeque<usize> = (0..requests.len()).collect();
        let mut past = vec![0usize; requests.len()];
        let mut responses: Vec<Option<Response>> = vec![None; requests.len()];
        let mut active = 0usize;
        let mut done = 0usize;
        let mut tokens = 0usize;
        let vocab = self.config.vocab;
        // Group ids are request indices: each request owns its KV caches on every stage.
        let admit =
            |this: &mut Self, active: &mut usize, queue: &mut VecDeque<usize>| -> Result<()> {
                while *active < in_flight {
                    let Some(r) = queue.pop_front() else { break };
                    let (batch, seq) = prompt_shape(&requests[r].prompts)?;
                    let step = Step {
                        batch,
                        seq,
                        past: 0,
                    };
                    let release = requests[r].max_new == 1;
                    let mut w = this.work(r, requests[r].prompts.concat(), step, true, release);
                    w.readout = greedy_with_logits();
                    this.send(w)?;
                    *active += 1;
                }
                Ok(())
            };
        admit(self, &mut active, &mut queue)?;
        while done < requests.len() {
            let out = self.receive()?;
            let r = out.group;
            self.group_deps.insert(r, out.dep);
            let Payload::Picked(picked) = out.payload else {
                return Err(unexpected_output());
            };
            let batch = picked.tokens.len();
            let produced_before = responses[r].as_ref().map_or(0, |x| x.tokens[0].len());
            check_finite(produced_before, &picked.non_finite, None)?;
            let logits = Logits {
                batch,
                vocab,
                data: picked.logits.unwrap_or_default(),
            };
            let next = picked.tokens;
            let now = start.elapsed().as_secs_f64();
            let resp = responses[r].get_or_insert_with(|| Response {
                request: r,
                tokens: vec![Vec::new(); batch],
                logits: Vec::new(),
                first_token_s: now,
                done_s: now,
            });
            for (t, &n) in resp.tokens.iter_mut().zip(&next) {
                t.push(n);
            }
            resp.logits.push(logits);
            resp.done_s = now;
            let (batch, seq) = prompt_shape(&requests[r].prompts)?;
            let produced = resp.tokens[0].len();
            tokens += if produced == 1 { batch * seq } else { batch };
            past[r] += if produced == 1 { seq } else { 1 };
            if produced >= requests[r].max_new {
                done += 1;
                active -= 1;
                admit(self, &mut active, &mut queue)?;
            } else {
                let step = Step {
                    batch,
                    seq: 1,
                    past: past[r],
                };
                let release = produced + 1 >= requests[r].max_new;
                let mut w = self.work(r, next, step, false, release);
                w.readout = greedy_with_logits();
                self.send(w)?;
            }
        }
        self.finish_run(start, tokens);
        Ok(responses.into_iter().flatten().collect())
    }

    /// Greedy generation with the batch's micro-batches in flight independently (no barrier
    /// between decode steps): the pipeline stays full during generation.
    pub fn generate_in_flight(&mut self, prompts: &[Vec<u32>], steps: usize) -> Result<Generation> {
        let (batch, seq) = prompt_shape(prompts)?;
        let groups = split_groups(batch, self.micro_batches);
        let requests: Vec<Request> = groups
            .iter()
            .map(|g| Request {
                prompts: prompts[g.clone()].to_vec(),
                max_new: steps.max(1),
            })
            .collect();
        let start = Instant::now();
        let responses = self.serve(&requests, groups.len())?;
        let total = start.elapsed().as_secs_f64();
        let first = responses
            .iter()
            .map(|r| r.first_token_s)
            .fold(0.0, f64::max);
        let tokens: Vec<Vec<u32>> = responses.iter().flat_map(|r| r.tokens.clone()).collect();
        let logits = (0..steps.max(1))
            .map(|s| Logits {
                batch,
                vocab: self.config.vocab,
                data: responses
                    .iter()
                    .flat_map(|r| r.logits[s].data.clone())
                    .collect(),
            })
            .collect();
        let decode_steps = steps.max(1) - 1;
        Ok(Generation {
            tokens,
            logits,
            prefill_s: first,
            decode_s: vec![(total - first) / decode_steps.max(1) as f64; decode_steps],
            prompt_tokens: batch * seq,
        })
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
        for (g, range) in groups.iter().enumerate() {
            let (ids, types, lens) = pad_batch(&inputs[range.clone()], seq);
            let step = Step {
                batch: range.len(),
                seq,
                past: 0,
            };
            let mut w = self.work(g, ids, step, true, true);
            w.encoder = Some(Arc::new(EncoderExtras { types, lens }));
            self.send(w)?;
        }
        let mut rows: Vec<Option<Vec<f32>>> = vec![None; groups.len()];
        let dim = self.config.hidden;
        for _ in 0..groups.len() {
            let out = self.receive()?;
            let (Payload::Pooled(mut data), Some(row)) = (out.payload, rows.get_mut(out.group))
            else {
                return Err(unexpected_output());
            };
            data.truncate(groups[out.group].len() * dim);
            *row = Some(data);
        }
        self.finish_run(start, inputs.len() * seq);
        Ok(Embeddings {
            batch: inputs.len(),
            dim,
            data: rows.into_iter().flatten().flatten().collect(),
        })
    }
}

/// A readout of greedy tokens and the logits (the request stream keeps both).
fn greedy_with_logits() -> Readout {
    Readout {
        logits: true,
        ..Readout::default()
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
            "{kind} on {} (layers {:?}, {} micro-batches)",
            self.labels.join(","),
            layers,
            self.micro_batches
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

    fn last_step(&self) -> Option<StepStats> {
        self.last.clone()
    }

    fn set_recorder(&mut self, recorder: Recorder) {
        for (i, label) in self.labels.iter().enumerate() {
            recorder.label_device(i as u32, label.clone());
        }
        // Span ids belong to one recorder: never carry a dependency into another.
        self.group_deps.clear();
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
        // Closing stage 0's input ends stage 0, whose closed output ends stage 1, and so on.
        self.input = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
