//! A stage's worker thread: it takes a pass, computes its layers (on one device, or on a
//! tensor-parallel group for hybrid) and puts the finished pass in its outlet.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam::channel::{Receiver, Sender};

use super::handoff::{
    panic_text, report_failure, Downstream, Output, Payload, Pending, StageOut, Work,
};
use super::StageStats;
use crate::comm::Collectives;
use crate::device::{Gpu, SpanTimer};
use crate::error::{Result, WgparError};
use crate::model::{Activations, GpuModel, KvCache};
use crate::parallel::cost;
use crate::parallel::tp::{GroupInput, GroupJob, GroupOutput, TpGroup};
use crate::parallel::{Fault, FaultKind};
use crate::sim::Direction;
use crate::threads::lock;
use crate::trace::{KernelFamily, SpanAttrs};

/// Downloads a device stage may have out at once (see `Stage::process`).
const HANDOFF_DEPTH: usize = 3;

/// What computes a stage: one device, or a tensor-parallel group (hybrid TP x PP).
// One per stage thread, never copied: the variants' size difference does not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Backend {
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
pub(super) enum Outlet {
    HandOff(Sender<Pending>),
    Direct(Downstream),
}

pub(super) struct Stage {
    pub(super) index: usize,
    pub(super) name: String,
    /// The stage's (first) device: faults, labels.
    pub(super) gpu: Arc<Gpu>,
    pub(super) backend: Backend,
    pub(super) comm: Arc<Collectives>,
    pub(super) input: Receiver<Work>,
    pub(super) outlet: Outlet,
    pub(super) output: Sender<Result<Output>>,
    pub(super) stats: Arc<Mutex<Vec<StageStats>>>,
    pub(super) fault: Arc<Mutex<Vec<Option<Fault>>>>,
    /// Micro-batches this stage has taken since it started (what a fault's `after` counts).
    pub(super) jobs: usize,
    /// Device-side timing of compute spans while a trace is recorded.
    pub(super) timer: SpanTimer,
    /// Embeds token ids (the pipeline's first stage).
    pub(super) embeds: bool,
    /// Holds the head (the pipeline's last stage).
    pub(super) head: bool,
}

impl Stage {
    /// Holds the head: the last stage of the whole pipeline (of every rank's stages).
    fn is_last(&self) -> bool {
        self.head
    }

    /// The stage's thread: take work until the input closes; stop at the first failure.
    pub(super) fn run(mut self) {
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
        crate::parallel::sync_span_timer(&mut self.timer, &self.gpu, &work.recorder);
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
