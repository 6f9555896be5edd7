//! One tensor-parallel rank's worker: a step's compute on its shard, the all-reduces after
//! the attention output and the MLP down projection, and the spans and statistics of both.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::group::{GroupInput, GroupJob, GroupOutput};
use crate::comm::{CrossProcessGroup, RankHandle};
use crate::device::SpanTimer;
use crate::error::{Result, WgparError};
use crate::model::{Activations, GpuModel, KvCache};
use crate::parallel::{cost, Fault, FaultKind};
use crate::sim::{Algorithm, Direction};
use crate::trace::{CollectiveOp, KernelFamily, SpanAttrs, SpanId};

/// One rank's state, owned by its worker thread.
pub(super) struct Rank {
    pub(super) model: GpuModel,
    pub(super) comm: RankHandle,
    /// Activations per (tokens, batch): the all-reduced tensors must be exactly the step's size.
    pub(super) acts: HashMap<(usize, usize), Activations>,
    /// KV caches per sequence group (a pipeline micro-batch; 0 for plain tensor parallelism).
    pub(super) caches: HashMap<usize, KvCache>,
    pub(super) collectives: u64,
    pub(super) group_tag: u64,
    /// Device-side timing of compute spans while a trace is recorded.
    pub(super) timer: SpanTimer,
    /// The group's ranks in other processes, when it spans processes (one device here).
    pub(super) remote: Option<Arc<dyn CrossProcessGroup>>,
    /// A fault to inject (tests, `run --inject-fault`), and the jobs run so far.
    pub(super) fault: Arc<Mutex<Option<Fault>>>,
    pub(super) jobs: usize,
}

/// Collective group ids of a group that spans processes carry this bit: every process numbers
/// them alike, so a merge of the processes' traces keeps them (and renumbers the others).
pub(crate) const CROSS_PROCESS_GROUP_BIT: u64 = crate::trace::CROSS_PROCESS_GROUP;

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

    pub(super) fn run(&mut self, job: GroupJob) -> Result<RankOutput> {
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
        let mut cpu_mark = crate::parallel::thread_cpu_s();
        // Adds the thread CPU time since `mark` to the encode total.
        let cpu_add = |out: &mut RankOutput, mark: Option<f64>| {
            out.encode_cpu_s = (out
                .encode_cpu_s
                .zip(crate::parallel::thread_cpu_s())
                .zip(mark))
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
                cpu_mark = crate::parallel::thread_cpu_s();
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
        crate::parallel::sync_span_timer(&mut self.timer, &gpu, rec);
        let timer = &self.timer;
        let mut start = Instant::now();
        cpu_mark = crate::parallel::thread_cpu_s();
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
                cpu_mark = crate::parallel::thread_cpu_s();
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
