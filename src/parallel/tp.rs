//! Tensor parallelism (Megatron pairing): every device holds a shard of every layer and runs it
//! in its own thread; after the attention output and the MLP down projection, whose results
//! are partial sums, a host-staged all-reduce sums them. Those two all-reduces per layer are the
//! only synchronisation between devices.
//!
//! Embedding and LM head are replicated (each device holds the full tables): the embedding is
//! a lookup every rank needs anyway, and a vocab-parallel head would add an all-gather of
//! `batch x vocab` logits per step to save `vocab x hidden` weights per device. Only rank 0
//! computes the head; the other ranks skip it.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::batch::row_logits;
use super::cost;
use super::encoder::{pad_batch, Embeddings, Encoder};
use super::pick::{check_finite, count_non_finite, Picker};
use super::worker::Workers;
use super::{
    check_decode, prompt_shape, BatchStep, Engine, Fault, FaultKind, Logits, StepDone, StepEngine,
    StepOutput, StepStats,
};
use crate::comm::{CommConfig, Communicator, CrossProcessGroup, RankHandle};
use crate::device::{DType, Gpu, SpanTimer};
use crate::error::{Result, WgparError};
use crate::kernels::ops::TokenPick;
use crate::model::sampling::SamplingParams;
use crate::model::{
    Activations, EncoderInput, GpuModel, KvCache, ModelConfig, ModelWeights, Placement, SeqRow,
    ShardSpec, Step, StepOut,
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
    /// The group's ranks in other processes, when it spans processes (one device here).
    remote: Option<Arc<dyn CrossProcessGroup>>,
    /// A fault to inject (tests, `run --inject-fault`), and the jobs run so far.
    fault: Arc<Mutex<Option<Fault>>>,
    jobs: usize,
}

/// Collective group ids of a group that spans processes carry this bit: every process numbers
/// them alike, so a merge of the processes' traces keeps them (and renumbers the others).
pub(crate) const CROSS_PROCESS_GROUP_BIT: u64 = crate::trace::CROSS_PROCESS_GROUP;

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
    /// Time in all-reduces, waits for the slowest rank included.
    pub comm_s: f64,
    /// The part of `comm_s` spent waiting for the slowest rank (the wait spans).
    pub wait_s: f64,
    /// Upload of a pipeline hand-off (the h2d span).
    pub upload_s: f64,
    /// Download of the output (the d2h span), rank 0.
    pub download_s: f64,
    /// Host transfers (uploads and downloads).
    pub transfers: usize,
    /// Bytes uploaded from a previous pipeline stage.
    pub upload_bytes: u64,
    pub collectives: usize,
    pub bytes: u64,
    pub last_span: SpanId,
    /// Host time staging inputs, recording and submitting.
    pub encode_s: f64,
    /// The same in this thread's CPU time (`None`: no thread CPU clock).
    pub encode_cpu_s: Option<f64>,
}

impl Rank {
    /// Fails as an injected fault says, once the rank has run `after` jobs.
    fn inject_fault(&mut self) -> Result<()> {
        let fault = *crate::threads::lock(&self.fault);
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
        if job.new_cache {
            let slots = job.slots.unwrap_or(step.batch);
            // A new cache of the same size reuses the old one (and its bound ops): every row
            // of the step's table starts where the table says.
            if self.caches.get(&job.group).map(KvCache::slots) != Some(slots) {
                let cache = self.model.kv_cache(slots)?;
                self.caches.insert(job.group, cache);
            }
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
            wait_s: 0.0,
            upload_s: 0.0,
            download_s: 0.0,
            transfers: 0,
            upload_bytes: 0,
            collectives: 0,
            bytes: 0,
            last_span: SpanId::NONE,
            encode_s: 0.0,
            encode_cpu_s: Some(0.0),
        };
        // The first span waits for the job's dependencies; each later one for the one before.
        let mut prev: Vec<SpanId> = job.deps.clone();
        // ... and starts no earlier than the job's release, if it has one.
        let mut release = job.release_us;
        let released = |a: SpanAttrs, rel: Option<f64>| match rel {
            Some(us) => a.not_before_us(us),
            None => a,
        };
        let holds_head = m.placement().head;
        let staged = Instant::now();
        let mut cpu_mark = super::thread_cpu_s();
        // Adds the thread CPU time since `mark` to the encode total.
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
        match &job.rows {
            Some(rows) => m.begin_step(act, kv, &step, rows)?,
            None => m.begin_step(act, kv, &step, &step.rows())?,
        }
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
                if let Some(p) = &job.pacer {
                    p.pace(Direction::HostToDevice, bytes, t0);
                }
                let t1 = Instant::now();
                out.upload_s += (t1 - t0).as_secs_f64();
                out.upload_bytes += bytes;
                out.transfers += 1;
                let rel = release.take();
                prev = vec![rec.record_with(t0, t1, || {
                    let a = released(
                        SpanAttrs::h2d("activations", dev, bytes).after_all(&prev),
                        rel,
                    );
                    match mb {
                        Some(k) => a.microbatch(k),
                        None => a,
                    }
                })];
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
                let rel = release.take();
                let compute = rec.record_with(start, end, || {
                    let a = SpanAttrs::compute(name, dev)
                        .layer(layer)
                        .flops(cost.flops)
                        .bytes(cost.bytes)
                        .kernels(cost.kernels)
                        .family(family)
                        .blocks_of(config.hidden, shard.world)
                        .device_us(device_us)
                        .after_all(&prev);
                    let a = released(a, rel);
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
                let all_arrived = match &self.remote {
                    // One device here: the in-process part is a no-op.
                    Some(remote) => {
                        remote.all_reduce(&gpu, partial)?;
                        comm_start
                    }
                    None => self.comm.all_reduce_timed(partial)?,
                };
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
                let group = if self.remote.is_some() {
                    group | CROSS_PROCESS_GROUP_BIT
                } else {
                    group
                };
                self.collectives += 1;
                // Time spent waiting for the slowest rank is a wait span, not communication
                // (the last rank to arrive waits for nobody).
                // What precedes the collective span is waiting, recorded as a span or not.
                out.wait_s += all_arrived
                    .saturating_duration_since(comm_start)
                    .as_secs_f64();
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
                prev = vec![rec.record_with(comm_start, comm_end, || {
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
                })];
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
                // The head is one device's whole matrix.
                .blocks_of(config.hidden, 1)
                .head_part(if holds_head {
                    cost::head_work(config, step.batch, dtype)
                } else {
                    None
                })
                .device_us(device_us)
                .after_all(&prev);
            match mb {
                Some(k) => a.microbatch(k),
                None => a,
            }
        });
        out.last_span = tail;
        if shard.rank == 0 {
            let t0 = Instant::now();
            let (output, name, n) = match (holds_head, m.output(act)) {
                (true, _) if picks => {
                    // The picks (and logits when asked) were copied out with the step.
                    let o = m.read_out(act)?;
                    let n =
                        (4 * (2 * o.tokens.len() + o.logits.as_ref().map_or(0, Vec::len))) as u64;
                    (GroupOutput::Picked(o), "tokens", n)
                }
                (true, Some((result, width))) => {
                    let mut data = gpu.read_f32(result)?;
                    data.truncate(step.batch * width);
                    let n = (data.len() * 4) as u64;
                    (GroupOutput::Pooled(data), "pooled", n)
                }
                _ => {
                    let download = self
                        .comm
                        .communicator()
                        .collectives()
                        .begin_download_range(&gpu, act.x(), 0..tokens * config.hidden)?;
                    (
                        GroupOutput::Hidden(download.finish()?),
                        "activations",
                        bytes,
                    )
                }
            };
            if let Some(p) = &job.pacer {
                p.pace(Direction::DeviceToHost, n, t0);
            }
            let t1 = Instant::now();
            out.last_span = rec.record_with(t0, t1, || {
                let a = SpanAttrs::d2h(name, dev, n).after(tail);
                match mb {
                    Some(k) => a.microbatch(k),
                    None => a,
                }
            });
            out.download_s += (t1 - t0).as_secs_f64();
            out.transfers += 1;
            out.output = Some(output);
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
    remote: Option<Arc<dyn CrossProcessGroup>>,
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
        Self::build(
            gpus,
            weights,
            dtype,
            shards,
            layers,
            first,
            last,
            comm_config,
            None,
        )
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
            return Err(WgparError::Config(format!(
                "--split has {} shares for {n} ranks (one device each)",
                split.len()
            )));
        }
        let shard = ShardSpec::tensor_parallel(&weights.config, split)?
            .into_iter()
            .nth(remote.rank())
            .ok_or_else(|| {
                WgparError::Config(format!("rank {} outside a group of {n}", remote.rank()))
            })?;
        let layers = 0..weights.config.layers;
        Self::build(
            std::slice::from_ref(gpu),
            weights,
            dtype,
            vec![shard],
            layers,
            true,
            true,
            comm_config,
            Some(remote),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        shards: Vec<ShardSpec>,
        layers: Range<usize>,
        first: bool,
        last: bool,
        comm_config: CommConfig,
        remote: Option<Arc<dyn CrossProcessGroup>>,
    ) -> Result<Self> {
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
                    remote: remote.clone(),
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
            remote,
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

/// How a step uses the KV cache and the timeline, beyond its shape.
#[derive(Default)]
struct StepPlan {
    /// Make a fresh KV cache of this many slots first.
    new_cache: Option<usize>,
    /// The sequence table (`None`: the plain batch).
    rows: Option<Arc<Vec<SeqRow>>>,
    /// What the step waits for (`None`: the previous step's logits).
    deps: Option<Vec<SpanId>>,
    /// Earliest start, microseconds since the recorder's epoch.
    release_us: Option<f64>,
    /// Encoder inputs.
    encoder: Option<Arc<EncoderExtras>>,
    /// The head's token pick and readback.
    readout: Readout,
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
    /// Continuous batching: slots reserved, and whether the next step makes the cache.
    serve_slots: usize,
    serve_fresh: bool,
    /// Finished continuous-batching steps not yet collected.
    done: VecDeque<StepDone>,
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
        Ok(Self::with_group(group, config))
    }

    /// Tensor parallelism across processes: this process holds one shard on `gpu`, its peers
    /// the others (`remote`, e.g. MPI ranks); every process gets the logits.
    pub fn spanning(
        gpu: &Arc<Gpu>,
        weights: &ModelWeights,
        dtype: DType,
        split: Option<&[usize]>,
        comm_config: CommConfig,
        remote: Arc<dyn CrossProcessGroup>,
    ) -> Result<Self> {
        let group = TpGroup::spanning(gpu, weights, dtype, split, comm_config, remote)?;
        Ok(Self::with_group(group, weights.config.clone()))
    }

    fn with_group(group: TpGroup, config: ModelConfig) -> Self {
        Self {
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
            serve_slots: 0,
            serve_fresh: false,
            done: VecDeque::new(),
        }
    }

    /// Each rank's shard.
    pub fn shards(&self) -> &[ShardSpec] {
        self.group.shards()
    }

    /// The communicator (its stats log has every all-reduce).
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.group.comm
    }

    /// Whether tokens are picked on the host from read-back logits: where the device cannot
    /// pick this way, or where the group spans processes (every process then gets the
    /// logits and picks alike).
    fn host_picks(&self) -> bool {
        self.picker.needs_logits() || self.group.remote.is_some()
    }

    /// The readout of a step of `batch` sequences.
    fn readout(&mut self, batch: usize, want_logits: bool) -> Readout {
        Readout {
            pick: self.picker.device_or_greedy(),
            draws: Arc::new(self.picker.draws(batch)),
            logits: want_logits || self.host_picks(),
        }
    }

    /// A step's tokens (and logits when asked) from the head's picks: refused when the
    /// logits were not finite, picked here where the host picks.
    fn tokens_of(&mut self, out: StepOut, batch: usize, want_logits: bool) -> Result<StepOutput> {
        let logits = out.logits.map(|data| Logits {
            batch,
            vocab: self.config.vocab,
            data,
        });
        let tokens = match (&logits, self.host_picks()) {
            (Some(l), true) => {
                check_finite(self.steps, &count_non_finite(l), None)?;
                self.picker.host(l)
            }
            (None, true) => return Err(no_output()),
            (_, false) => {
                check_finite(self.steps, &out.non_finite, None)?;
                out.tokens
            }
        };
        Ok(StepOutput {
            tokens,
            logits: logits.filter(|_| want_logits),
        })
    }

    fn step(
        &mut self,
        ids: Vec<u32>,
        step: Step,
        new_cache: bool,
        want_logits: bool,
    ) -> Result<StepOutput> {
        let plan = StepPlan {
            new_cache: new_cache.then_some(step.batch),
            readout: self.readout(step.batch, want_logits),
            ..StepPlan::default()
        };
        let out = match self.run(ids, step, plan)? {
            GroupOutput::Picked(out) => out,
            _ => return Err(no_output()),
        };
        let out = self.tokens_of(out, step.batch, want_logits)?;
        self.steps += 1;
        Ok(out)
    }

    /// One step on every rank; returns rank 0's final output (picks or pooled embeddings).
    fn run(&mut self, ids: Vec<u32>, step: Step, plan: StepPlan) -> Result<GroupOutput> {
        if let Some(why) = &self.failed {
            return Err(WgparError::EngineStopped {
                engine: "tensor-parallel engine".into(),
                cause: why.clone(),
            });
        }
        let start = Instant::now();
        let new_cache = plan.new_cache.is_some();
        let encoder = plan.encoder.is_some();
        let job = GroupJob {
            group: 0,
            input: GroupInput::Ids(Arc::new(ids)),
            step,
            new_cache,
            release: false,
            recorder: self.recorder.clone(),
            microbatch: None,
            deps: plan.deps.unwrap_or_else(|| {
                if new_cache {
                    Vec::new()
                } else {
                    vec![self.last_span]
                }
            }),
            release_us: plan.release_us,
            rows: plan.rows,
            slots: plan.new_cache,
            encoder: plan.encoder,
            pacer: self.pacer.clone(),
            readout: plan.readout,
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
        let output = outputs.into_iter().find_map(|o| o.output);
        match &self.group.remote {
            // Across processes only floats travel: the logits (the readout asked for them)
            // or the pooled embeddings; every process then picks from the logits.
            Some(remote) => {
                let shared = output.map(|o| match o {
                    GroupOutput::Picked(p) => p.logits.unwrap_or_default(),
                    GroupOutput::Pooled(p) => p,
                    GroupOutput::Hidden(_) => Vec::new(),
                });
                let data = remote.share_output(shared)?;
                Ok(if encoder {
                    GroupOutput::Pooled(data)
                } else {
                    GroupOutput::Picked(StepOut {
                        tokens: Vec::new(),
                        non_finite: Vec::new(),
                        logits: Some(data),
                    })
                })
            }
            None => output.ok_or_else(no_output),
        }
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
        let plan = StepPlan {
            new_cache: Some(step.batch),
            encoder: Some(extras),
            ..StepPlan::default()
        };
        let data = match self.run(ids, step, plan)? {
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
        if let Some(remote) = &self.group.remote {
            return format!(
                "tp={} across {} processes (this one: rank {}, {} query heads on {})",
                remote.size(),
                remote.size(),
                remote.rank(),
                shares.iter().sum::<usize>(),
                self.group.labels().join(",")
            );
        }
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

impl StepEngine for TensorParallelEngine {
    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    fn lanes(&self) -> usize {
        1
    }

    /// The ranks make their caches with the next step.
    fn reserve_slots(&mut self, slots: usize) -> Result<()> {
        if slots == 0 {
            return Err(WgparError::InvalidCall(
                "a KV cache needs at least one slot".into(),
            ));
        }
        self.serve_slots = slots;
        self.serve_fresh = true;
        // The plain batch (prefill/decode) lived in the old cache.
        self.batch = 0;
        self.done.clear();
        Ok(())
    }

    fn slots(&self) -> usize {
        self.serve_slots
    }

    /// Runs the step at once on every rank; [`complete`](StepEngine::complete) hands it back.
    fn submit(&mut self, step: BatchStep) -> Result<()> {
        if self.serve_slots == 0 {
            return Err(WgparError::InvalidCall(
                "submit before reserve_slots".into(),
            ));
        }
        let shape = Step {
            batch: step.rows.len(),
            seq: step.seq,
            past: 0,
        };
        let plan = StepPlan {
            new_cache: std::mem::take(&mut self.serve_fresh).then_some(self.serve_slots),
            rows: Some(Arc::new(step.rows)),
            deps: Some(step.deps),
            release_us: step.release_us,
            encoder: None,
            // The device picks greedily; logits come back only for a caller that samples.
            readout: Readout {
                logits: step.logits,
                ..Readout::default()
            },
        };
        let out = match self.run(step.ids, shape, plan)? {
            GroupOutput::Picked(out) => {
                if self.group.remote.is_none() {
                    check_finite(self.steps, &out.non_finite, None)?;
                }
                out
            }
            _ => return Err(no_output()),
        };
        let vocab = self.model_config().vocab;
        self.done.push_back(StepDone {
            lane: step.lane,
            tokens: out.tokens,
            logits: row_logits(out.logits, shape.batch, vocab)?,
            span: self.last_span,
        });
        Ok(())
    }

    fn complete(&mut self, _timeout: Option<Duration>) -> Result<Option<StepDone>> {
        Ok(self.done.pop_front())
    }
}
