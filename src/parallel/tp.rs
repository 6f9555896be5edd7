//! Tensor parallelism (Megatron pairing): every device holds a shard of every layer and runs it
//! in its own thread; after the attention output and the MLP down projection, whose results
//! are partial sums, a host-staged all-reduce sums them. Those two all-reduces per layer are the
//! only synchronisation between devices.
//!
//! Embedding and LM head are replicated (each device holds the full tables): the embedding is
//! a lookup every rank needs anyway, and a vocab-parallel head would add an all-gather of
//! `batch x vocab` logits per step to save `vocab x hidden` weights per device. Only rank 0
//! computes the head; the other ranks skip it.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::cost;
use super::encoder::{pad_batch, Embeddings, Encoder};
use super::pick::{check_finite, count_non_finite, Picker};
use super::worker::Workers;
use super::{check_decode, prompt_shape, Engine, Fault, FaultKind, Logits, StepOutput, StepStats};
use crate::comm::{CommConfig, Communicator, RankHandle};
use crate::device::{DType, Gpu, SpanTimer};
use crate::error::{Result, WgparError};
use crate::kernels::ops::TokenPick;
use crate::model::sampling::SamplingParams;
use crate::model::{
    Activations, EncoderInput, GpuModel, KvCache, ModelConfig, ModelWeights, Placement, ShardSpec,
    Step, StepOut,
};
use crate::sim::{Algorithm, Direction, LinkPacer};
use crate::trace::{CollectiveOp, KernelFamily, Recorder, SpanAttrs, SpanId};

/// One rank's state, owned by its worker thread.
struct Rank {
    model: GpuModel,
    comm: RankHandle,
    /// Activations per (tokens, batch): the all-reduced tensors must be exactly the step's size.
    acts: HashMap<(usize, usize), Activations>,
    /// KV caches per sequence group (a pipeline micro-batch; 0 for plain tensor parallelism).
    caches: HashMap<usize, KvCache>,
    collectives: u64,
    group_tag: u64,
    /// Device-side timing of compute spans while a trace is recorded.
    timer: SpanTimer,
    /// A fault to inject (tests, `run --inject-fault`), and the jobs run so far.
    fault: Arc<Mutex<Option<Fault>>>,
    jobs: usize,
}

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
}

impl Default for Readout {
    fn default() -> Self {
        Self {
            pick: TokenPick::Greedy,
            draws: Arc::default(),
            logits: false,
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
    pub dep: SpanId,
    /// Encoders: token types and real lengths of the padded batch (every rank needs the
    /// lengths: they mask attention).
    pub encoder: Option<Arc<EncoderExtras>>,
    /// Slows collectives and hand-offs to a modelled link.
    pub pacer: Option<Arc<LinkPacer>>,
    /// The head's token pick and readback (used by the rank that holds the head).
    pub readout: Readout,
}

/// Per-batch inputs an encoder needs beside the ids.
#[derive(Debug)]
pub(crate) struct EncoderExtras {
    pub types: Vec<u32>,
    pub lens: Vec<u32>,
}

/// One rank's result of a step.
pub(crate) struct RankOutput {
    pub output: Option<GroupOutput>,
    pub compute_s: f64,
    pub comm_s: f64,
    pub handoff_s: f64,
    /// Host time staging inputs, recording and submitting.
    pub encode_s: f64,
    /// The same in this thread's CPU time (`None`: no thread CPU clock).
    pub encode_cpu_s: Option<f64>,
    pub collectives: usize,
    pub bytes: u64,
    pub last_span: SpanId,
}

impl Rank {
    /// Fails as an injected fault says, once the rank has run `after` jobs.
    fn inject_fault(&mut self) -> Result<()> {
        let fault = *self.fault.lock().unwrap_or_else(|e| e.into_inner());
        let done = self.jobs;
        self.jobs += 1;
        match fault {
            Some(f) if done >= f.after => {
                let rank = self.model.placement().shard.rank;
                match f.kind {
                    FaultKind::Error => Err(WgparError::InjectedFault {
                        kind: "error".into(),
                        at: format!("tp rank {rank}, step {done}"),
                    }),
                    FaultKind::Panic => panic!("injected panic at tp rank {rank}, step {done}"),
                    FaultKind::LoseDevice => {
                        self.model.gpu().device().destroy();
                        Ok(())
                    }
                }
            }
            _ => Ok(()),
        }
    }

    fn run(&mut self, job: GroupJob) -> Result<RankOutput> {
        self.inject_fault()?;
        // A lost device is reported as such, before any call that would trip over it.
        self.model.gpu().check()?;
        let step = job.step;
        let rec = &job.recorder;
        // A new sequence group reuses its cache when the slots match (the prefill's table
        // starts every row at position 0).
        if job.new_cache && self.caches.get(&job.group).map(KvCache::slots) != Some(step.batch) {
            let cache = self.model.kv_cache(step.batch)?;
            self.caches.insert(job.group, cache);
        }
        let tokens = step.tokens();
        let key = (tokens, step.batch);
        if !self.acts.contains_key(&key) {
            let act = self.model.activations(tokens, step.batch)?;
            self.acts.insert(key, act);
        }
        let (Some(act), Some(kv)) = (self.acts.get_mut(&key), self.caches.get_mut(&job.group))
        else {
            return Err(WgparError::InvalidCall(format!(
                "sequence group {} decoded before its prefill",
                job.group
            )));
        };
        let m = &self.model;
        let gpu = m.gpu().clone();
        let dev = gpu.ordinal() as u32;
        let shard = &m.placement().shard;
        let config = m.config();
        let dtype = m.weight_dtype();
        let world = shard.world as u32;
        let bytes = (tokens * config.hidden * 4) as u64;
        let mb = job.microbatch;
        let mut out = RankOutput {
            output: None,
            compute_s: 0.0,
            comm_s: 0.0,
            handoff_s: 0.0,
            encode_s: 0.0,
            encode_cpu_s: Some(0.0),
            collectives: 0,
            bytes: 0,
            last_span: SpanId::NONE,
        };
        let mut prev = job.dep;
        let holds_head = m.placement().head;
        let staged = Instant::now();
        let mut cpu_mark = super::thread_cpu_s();
        // Adds the thread CPU time since `cpu_mark` to the encode total.
        let cpu_add = |out: &mut RankOutput, mark: Option<f64>| {
            out.encode_cpu_s = (out.encode_cpu_s.zip(super::thread_cpu_s()).zip(mark))
                .map(|((total, now), mark)| total + now - mark);
        };
        if let Some(e) = &job.encoder {
            m.write_encoder_inputs(act, &step, &e.types, &e.lens)?;
        }
        if holds_head && !config.is_encoder() {
            act.set_readout(job.readout.pick, job.readout.logits);
            if !job.readout.draws.is_empty() {
                m.write_draws(act, &job.readout.draws)?;
            }
        }
        m.begin_step(act, kv, &step, &step.rows())?;
        out.encode_s += staged.elapsed().as_secs_f64();
        cpu_add(&mut out, cpu_mark);
        let (act, kv) = (&*act, &*kv);
        match &job.input {
            GroupInput::Ids(ids) => {
                let t0 = Instant::now();
                cpu_mark = super::thread_cpu_s();
                m.write_ids(act, ids)?;
                out.encode_s += t0.elapsed().as_secs_f64();
                cpu_add(&mut out, cpu_mark);
            }
            GroupInput::Hidden(hidden) => {
                if hidden.len() as u64 != bytes {
                    return Err(WgparError::Shape {
                        op: "hand-off".into(),
                        detail: format!("received {} bytes, expected {bytes}", hidden.len()),
                    });
                }
                let t0 = Instant::now();
                self.comm
                    .communicator()
                    .collectives()
                    .upload(&gpu, act.x(), 0, hidden)?;
                let t1 = Instant::now();
                out.handoff_s += (t1 - t0).as_secs_f64();
                prev = rec.record_with(t0, t1, || {
                    let a = SpanAttrs::h2d("activations", dev, bytes).after(prev);
                    match mb {
                        Some(k) => a.microbatch(k),
                        None => a,
                    }
                });
            }
        }
        super::sync_span_timer(&mut self.timer, &gpu, rec);
        let timer = &self.timer;
        let mut start = Instant::now();
        cpu_mark = super::thread_cpu_s();
        let mut enc = gpu.encoder();
        timer.begin(&mut enc);
        if matches!(job.input, GroupInput::Ids(_)) {
            m.embed(&mut enc, act)?;
        }
        for i in 0..m.num_layers() {
            let layer = (m.placement().layers.start + i) as u32;
            for half in 0..2 {
                let (cost, name, family) = if half == 0 {
                    m.attention(&mut enc, i, act, kv)?;
                    (
                        cost::attention(config, shard, &step, dtype),
                        "attention",
                        KernelFamily::Attention,
                    )
                } else {
                    m.mlp(&mut enc, i, act)?;
                    (
                        cost::mlp(config, shard, &step, dtype),
                        "mlp",
                        KernelFamily::Matmul,
                    )
                };
                timer.end(&mut enc);
                gpu.submit(std::mem::replace(&mut enc, gpu.encoder()));
                out.encode_s += start.elapsed().as_secs_f64();
                cpu_add(&mut out, cpu_mark);
                gpu.wait()?;
                let end = Instant::now();
                let device_us = timer.read_us(&gpu)?;
                // The next span's work goes into the fresh encoder.
                timer.begin(&mut enc);
                out.compute_s += (end - start).as_secs_f64();
                let compute = rec.record_with(start, end, || {
                    let a = SpanAttrs::compute(name, dev)
                        .layer(layer)
                        .flops(cost.flops)
                        .bytes(cost.bytes)
                        .kernels(cost.kernels)
                        .family(family)
                        .device_us(device_us)
                        .after(prev);
                    match mb {
                        Some(k) => a.microbatch(k),
                        None => a,
                    }
                });
                let partial = if half == 0 {
                    act.attn_out()
                } else {
                    act.mlp_out()
                };
                let comm_start = Instant::now();
                let all_arrived = self.comm.all_reduce_timed(partial)?;
                if let Some(p) = &job.pacer {
                    p.collective(
                        CollectiveOp::AllReduce,
                        Algorithm::HostStaged,
                        bytes,
                        world as usize,
                        all_arrived,
                    )
                    .map_err(|source| WgparError::Pacing {
                        target: "the all-reduce".into(),
                        source,
                    })?;
                }
                let comm_end = Instant::now();
                out.comm_s += (comm_end - comm_start).as_secs_f64();
                out.collectives += 1;
                out.bytes += bytes;
                // Collective ids must be unique across the whole timeline: several groups
                // (pipeline stages of a hybrid) count independently, so tag with the group's
                // first device.
                let chunks = self
                    .comm
                    .communicator()
                    .collectives()
                    .config()
                    .chunks(bytes);
                let group = (self.group_tag << 48) | self.collectives;
                self.collectives += 1;
                // Time spent waiting for the slowest rank is a wait span, not communication
                // (the last rank to arrive waits for nobody).
                let waited = if all_arrived > comm_start + Duration::from_micros(1) {
                    rec.record_with(comm_start, all_arrived, || {
                        let a = SpanAttrs::wait("allreduce wait", dev)
                            .layer(layer)
                            .after(compute);
                        match mb {
                            Some(k) => a.microbatch(k),
                            None => a,
                        }
                    })
                } else {
                    compute
                };
                let comm_start = all_arrived.max(comm_start);
                prev = rec.record_with(comm_start, comm_end, || {
                    let a = SpanAttrs::collective(
                        "allreduce",
                        dev,
                        CollectiveOp::AllReduce,
                        "host-staged",
                        world,
                        bytes,
                    )
                    .layer(layer)
                    .group(group)
                    .chunks(chunks)
                    .after(waited);
                    match mb {
                        Some(k) => a.microbatch(k),
                        None => a,
                    }
                });
                start = Instant::now();
                cpu_mark = super::thread_cpu_s();
                if half == 0 {
                    m.attention_residual(&mut enc, i, act)?;
                } else {
                    m.mlp_residual(&mut enc, i, act)?;
                }
            }
        }
        if holds_head {
            m.finish(&mut enc, act)?;
        }
        timer.end(&mut enc);
        let picks = holds_head && !config.is_encoder();
        if picks {
            m.copy_out(&mut enc, act)?;
        }
        gpu.submit(enc);
        out.encode_s += start.elapsed().as_secs_f64();
        cpu_add(&mut out, cpu_mark);
        gpu.wait()?;
        let end = Instant::now();
        let device_us = timer.read_us(&gpu)?;
        out.compute_s += (end - start).as_secs_f64();
        let tail = rec.record_with(start, end, || {
            let head = cost::head(config, step.batch, dtype);
            let a = SpanAttrs::compute(if holds_head { "head" } else { "residual" }, dev)
                .family(if holds_head {
                    KernelFamily::Matmul
                } else {
                    KernelFamily::Elementwise
                })
                .flops(if holds_head { head.flops } else { 0 })
                .bytes(if holds_head { head.bytes } else { bytes * 3 })
                .kernels(if holds_head { head.kernels } else { 1 })
                .device_us(device_us)
                .after(prev);
            match mb {
                Some(k) => a.microbatch(k),
                None => a,
            }
        });
        out.last_span = tail;
        if shard.rank == 0 {
            let t0 = Instant::now();
            out.output = Some(match (holds_head, m.output(act)) {
                (true, _) if picks => GroupOutput::Picked(m.read_out(act)?),
                (true, Some((result, width))) => {
                    let mut data = gpu.read_f32(result)?;
                    data.truncate(step.batch * width);
                    GroupOutput::Pooled(data)
                }
                _ => {
                    let download = self
                        .comm
                        .communicator()
                        .collectives()
                        .begin_download_range(&gpu, act.x(), 0..tokens * config.hidden)?;
                    let hidden = download.finish()?;
                    if let Some(p) = &job.pacer {
                        p.pace(Direction::DeviceToHost, bytes, t0);
                    }
                    let t1 = Instant::now();
                    out.last_span = rec.record_with(t0, t1, || {
                        let a = SpanAttrs::d2h("activations", dev, bytes).after(tail);
                        match mb {
                            Some(k) => a.microbatch(k),
                            None => a,
                        }
                    });
                    GroupOutput::Hidden(hidden)
                }
            });
            out.handoff_s += t0.elapsed().as_secs_f64();
        }
        if job.release {
            self.caches.remove(&job.group);
        }
        Ok(out)
    }
}

/// A tensor-parallel group: one worker thread per device, each holding a shard of the same
/// layers; the group's collective is the only synchronisation between them. Used alone
/// (tensor parallelism) or as one stage of a pipeline (hybrid).
pub(crate) struct TpGroup {
    workers: Workers<GroupJob, RankOutput>,
    comm: Arc<Communicator>,
    shards: Vec<ShardSpec>,
    labels: Vec<String>,
    faults: Vec<Arc<Mutex<Option<Fault>>>>,
}

impl TpGroup {
    /// Shards `layers` of `weights` over `gpus`; `first` adds the embedding, `last` the head
    /// (on rank 0).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        split: Option<&[usize]>,
        layers: Range<usize>,
        first: bool,
        last: bool,
        comm_config: CommConfig,
    ) -> Result<Self> {
        let config = &weights.config;
        let even = vec![1; gpus.len()];
        let split = split.unwrap_or(&even);
        if split.len() != gpus.len() {
            return Err(WgparError::Config(format!(
                "--split has {} shares for {} devices",
                split.len(),
                gpus.len()
            )));
        }
        let shards = ShardSpec::tensor_parallel(config, split)?;
        let comm = Communicator::new(gpus.to_vec(), comm_config)?;
        // Upload every rank's shard at once: each device copies its own weights.
        let models: Vec<Result<GpuModel>> = std::thread::scope(|s| {
            let handles: Vec<_> = gpus
                .iter()
                .zip(&shards)
                .map(|(gpu, shard)| {
                    let placement = Placement {
                        layers: layers.clone(),
                        shard: shard.clone(),
                        embedding: first,
                        head: last && shard.rank == 0,
                    };
                    s.spawn(move || GpuModel::upload(gpu.clone(), weights, placement, dtype))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(WgparError::WorkerPanicked {
                            worker: "weight upload thread".into(),
                            message: "while uploading a shard".into(),
                        })
                    })
                })
                .collect()
        });
        let mut states = Vec::new();
        let faults: Vec<Arc<Mutex<Option<Fault>>>> =
            (0..gpus.len()).map(|_| Arc::default()).collect();
        for (rank, model) in models.into_iter().enumerate() {
            states.push((
                format!(
                    "tp rank {rank} ({}, layers {}..{})",
                    gpus[rank].describe(),
                    layers.start,
                    layers.end
                ),
                Rank {
                    model: model?,
                    comm: comm.join(rank)?,
                    acts: HashMap::new(),
                    caches: HashMap::new(),
                    collectives: 0,
                    group_tag: gpus[0].ordinal() as u64,
                    timer: SpanTimer::default(),
                    fault: faults[rank].clone(),
                    jobs: 0,
                },
            ));
        }
        Ok(Self {
            workers: Workers::spawn(states, Rank::run, |rank, why| rank.comm.abort(why))?,
            comm,
            shards,
            labels: gpus.iter().map(|g| g.label().to_string()).collect(),
            faults,
        })
    }

    /// Makes `rank` fail as `fault` says, after `fault.after` more steps.
    pub(crate) fn inject_fault(&self, rank: usize, fault: Fault) -> Result<()> {
        let slot = self.faults.get(rank).ok_or_else(|| {
            WgparError::InvalidCall(format!(
                "no rank {rank} in a {}-device tensor-parallel group",
                self.faults.len()
            ))
        })?;
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(fault);
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

/// The model sharded over several devices, one worker thread per device.
pub struct TensorParallelEngine {
    group: TpGroup,
    pacer: Option<Arc<LinkPacer>>,
    /// Rank 0's last span of the previous step: the next step starts after the logits are back.
    last_span: SpanId,
    config: ModelConfig,
    batch: usize,
    past: usize,
    /// Steps since the prefill (the prefill is step 0).
    steps: usize,
    picker: Picker,
    last: Option<StepStats>,
    failed: Option<String>,
    recorder: Recorder,
}

impl TensorParallelEngine {
    /// Shards `weights` over `gpus` with relative shares `split` (`None`: even), stored as
    /// `dtype`. Errors list the valid degrees when the heads do not divide.
    pub fn new(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        split: Option<&[usize]>,
        comm_config: CommConfig,
    ) -> Result<Self> {
        let config = weights.config.clone();
        let group = TpGroup::new(
            gpus,
            weights,
            dtype,
            split,
            0..config.layers,
            true,
            true,
            comm_config,
        )?;
        Ok(Self {
            group,
            pacer: None,
            last_span: SpanId::NONE,
            config,
            batch: 0,
            past: 0,
            steps: 0,
            picker: Picker::greedy(),
            last: None,
            failed: None,
            recorder: Recorder::disabled(),
        })
    }

    /// Each rank's shard.
    pub fn shards(&self) -> &[ShardSpec] {
        self.group.shards()
    }

    /// The communicator (its stats log has every all-reduce).
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.group.comm
    }

    fn step(
        &mut self,
        ids: Vec<u32>,
        step: Step,
        new_cache: bool,
        want_logits: bool,
    ) -> Result<StepOutput> {
        let readout = Readout {
            pick: self.picker.device_or_greedy(),
            draws: Arc::new(self.picker.draws(step.batch)),
            logits: want_logits || self.picker.needs_logits(),
        };
        let out = match self.run(ids, step, new_cache, None, readout)? {
            GroupOutput::Picked(out) => out,
            _ => return Err(no_output()),
        };
        let logits = out.logits.map(|data| Logits {
            batch: step.batch,
            vocab: self.config.vocab,
            data,
        });
        check_finite(self.steps, &out.non_finite, None)?;
        let tokens = match (&logits, self.picker.needs_logits()) {
            (Some(l), true) => {
                check_finite(self.steps, &count_non_finite(l), None)?;
                self.picker.host(l)
            }
            _ => out.tokens,
        };
        self.steps += 1;
        Ok(StepOutput {
            tokens,
            logits: logits.filter(|_| want_logits),
        })
    }

    /// One step on every rank; returns rank 0's final output (picks or pooled embeddings).
    fn run(
        &mut self,
        ids: Vec<u32>,
        step: Step,
        new_cache: bool,
        encoder: Option<Arc<EncoderExtras>>,
        readout: Readout,
    ) -> Result<GroupOutput> {
        if let Some(why) = &self.failed {
            return Err(WgparError::EngineStopped {
                engine: "tensor-parallel engine".into(),
                cause: why.clone(),
            });
        }
        let start = Instant::now();
        let job = GroupJob {
            group: 0,
            input: GroupInput::Ids(Arc::new(ids)),
            step,
            new_cache,
            release: false,
            recorder: self.recorder.clone(),
            microbatch: None,
            dep: if new_cache {
                SpanId::NONE
            } else {
                self.last_span
            },
            encoder,
            pacer: self.pacer.clone(),
            readout,
        };
        let outputs = match self.group.run(job) {
            Ok(o) => o,
            Err(e) => {
                self.failed = Some(e.to_string());
                return Err(e);
            }
        };
        let wall_s = start.elapsed().as_secs_f64();
        let n = outputs.len() as f64;
        self.last = Some(StepStats {
            tokens: step.tokens(),
            wall_s,
            compute_s: outputs.iter().map(|o| o.compute_s).sum::<f64>() / n,
            comm_s: outputs.iter().map(|o| o.comm_s).sum::<f64>() / n,
            collectives: outputs[0].collectives,
            bytes_sent: outputs[0].bytes,
            bytes_received: outputs[0].bytes,
            encode_s: Some(outputs.iter().map(|o| o.encode_s).sum::<f64>() / n),
            encode_cpu_s: (outputs.iter().map(|o| o.encode_cpu_s))
                .sum::<Option<f64>>()
                .map(|s| s / n),
        });
        self.past = step.past + step.seq;
        self.last_span = outputs[0].last_span;
        outputs
            .into_iter()
            .find_map(|o| o.output)
            .ok_or_else(no_output)
    }
}

fn no_output() -> WgparError {
    WgparError::Internal("no rank returned the step's output".into())
}

impl Encoder for TensorParallelEngine {
    fn name(&self) -> String {
        Engine::name(self)
    }

    fn encode(&mut self, inputs: &[EncoderInput]) -> Result<Embeddings> {
        let seq = EncoderInput::check_batch(inputs, &self.config)?;
        let (ids, types, lens) = pad_batch(inputs, seq);
        let step = Step {
            batch: inputs.len(),
            seq,
            past: 0,
        };
        let extras = Arc::new(EncoderExtras { types, lens });
        let data = match self.run(ids, step, true, Some(extras), Readout::default())? {
            GroupOutput::Pooled(data) => data,
            _ => return Err(no_output()),
        };
        Ok(Embeddings {
            batch: inputs.len(),
            dim: self.config.hidden,
            data,
        })
    }
}

impl Engine for TensorParallelEngine {
    fn name(&self) -> String {
        let shares: Vec<usize> = self.shards().iter().map(|s| s.local_heads()).collect();
        format!(
            "tp={} on {} (query heads {:?})",
            shares.len(),
            self.group.labels().join(","),
            shares
        )
    }

    fn prefill_step(&mut self, prompts: &[Vec<u32>], logits: bool) -> Result<StepOutput> {
        let (batch, seq) = prompt_shape(prompts)?;
        self.batch = batch;
        self.steps = 0;
        self.step(
            prompts.concat(),
            Step {
                batch,
                seq,
                past: 0,
            },
            true,
            logits,
        )
    }

    fn decode_step(&mut self, tokens: &[u32], logits: bool) -> Result<StepOutput> {
        check_decode(self.batch, tokens)?;
        let step = Step {
            batch: self.batch,
            seq: 1,
            past: self.past,
        };
        self.step(tokens.to_vec(), step, false, logits)
    }

    fn set_sampling(&mut self, params: SamplingParams) -> Result<()> {
        self.picker = Picker::new(params)?;
        Ok(())
    }

    fn last_step(&self) -> Option<StepStats> {
        self.last.clone()
    }

    fn set_recorder(&mut self, recorder: Recorder) {
        for (i, label) in self.group.labels().iter().enumerate() {
            recorder.label_device(i as u32, label.clone());
        }
        // Span ids belong to one recorder: never carry a dependency into another.
        self.last_span = SpanId::NONE;
        self.recorder = recorder;
    }

    fn set_pacer(&mut self, pacer: Option<Arc<LinkPacer>>) {
        self.pacer = pacer;
    }

    fn inject_fault(&mut self, rank: usize, fault: Fault) -> Result<()> {
        self.group.inject_fault(rank, fault)
    }
}
