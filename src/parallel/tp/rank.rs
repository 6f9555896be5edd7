//! One tensor-parallel rank's worker: a step is a short sequence of phases, each in its own
//! module: the inputs staged here, the hand-off received ([`super::handoff`]), the layers
//! computed with an all-reduce after each half ([`super::compute`], [`super::collective`]),
//! and the output handed back; [`super::pass`] records every phase's span and statistics.

use std::sync::{Arc, Mutex};

use super::collective::RankLink;
use super::compute::Compute;
use super::group::{GroupInput, GroupJob};
use super::handoff::{hand_back, receive};
use super::pass::{HostTime, Pass, RankOutput};
use crate::device::SpanTimer;
use crate::error::{Result, WgparError};
use crate::model::{Activations, GpuModel, KvCache};
use crate::parallel::buffers::StepBuffers;
use crate::parallel::{Fault, FaultKind};

/// One rank's state, owned by its worker thread.
pub(super) struct Rank {
    pub(super) model: GpuModel,
    pub(super) link: RankLink,
    pub(super) buffers: StepBuffers,
    /// Device-side timing of compute spans while a trace is recorded.
    pub(super) timer: SpanTimer,
    /// A fault to inject (tests, `run --inject-fault`), and the jobs run so far.
    pub(super) fault: Arc<Mutex<Option<Fault>>>,
    pub(super) jobs: usize,
}

/// The activations and KV cache of `job`'s step: a new cache where the job asks for one.
fn buffers_for<'b>(
    buffers: &'b mut StepBuffers,
    model: &GpuModel,
    job: &GroupJob,
) -> Result<(&'b mut Activations, &'b mut KvCache)> {
    let step = job.step;
    if job.new_cache {
        buffers.new_cache(model, job.group, job.slots.unwrap_or(step.batch))?;
    }
    buffers.make_acts(model, &step)?;
    buffers
        .get(&step, job.group)
        .ok_or(WgparError::DecodeBeforePrefill)
}

impl Rank {
    pub(super) fn new(model: GpuModel, link: RankLink, fault: Arc<Mutex<Option<Fault>>>) -> Self {
        Self {
            model,
            link,
            buffers: StepBuffers::default(),
            timer: SpanTimer::default(),
            fault,
            jobs: 0,
        }
    }

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

    /// One step: inputs staged, the hand-off received, the layers computed with their
    /// all-reduces, the tail (head or last residual), and on rank 0 the output handed back.
    pub(super) fn run(&mut self, job: GroupJob) -> Result<RankOutput> {
        self.inject_fault()?;
        // A lost device is reported as such, before any call that would trip over it.
        self.model.gpu().check()?;
        let gpu = self.model.gpu().clone();
        let bytes = (job.step.tokens() * self.model.config().hidden * 4) as u64;
        let mut pass = Pass::new(&job, gpu.ordinal() as u32, bytes);
        let (act, kv) = buffers_for(&mut self.buffers, &self.model, &job)?;
        stage_inputs(&self.model, act, kv, &mut pass)?;
        if let GroupInput::Hidden(hidden) = &job.input {
            receive(&self.link, &gpu, act, hidden, &mut pass)?;
        }
        crate::parallel::sync_span_timer(&mut self.timer, &gpu, &job.recorder);
        let compute = Compute {
            model: &self.model,
            gpu: &gpu,
            timer: &self.timer,
            act,
            kv,
        };
        let (enc, host) = compute.layers(&mut self.link, &mut pass)?;
        compute.tail(enc, host, &mut pass)?;
        if self.model.placement().shard.rank == 0 {
            pass.out.output = Some(hand_back(&self.link, &compute, &mut pass)?);
        }
        if job.release {
            self.buffers.release(job.group);
        }
        Ok(pass.out)
    }
}

/// Stages the step's inputs and configures its ops: all that needs the activations and the
/// cache mutably (nothing is allocated once they have met).
fn stage_inputs(
    m: &GpuModel,
    act: &mut Activations,
    kv: &mut KvCache,
    pass: &mut Pass,
) -> Result<()> {
    let job = pass.job;
    let step = job.step;
    let host = HostTime::now();
    if let Some(e) = &job.encoder {
        m.write_encoder_inputs(act, &step, &e.types, &e.lens)?;
    }
    if super::compute::picks(m) {
        act.set_readout(job.readout.pick, job.readout.logits);
        if !job.readout.draws.is_empty() {
            m.write_draws(act, &job.readout.draws)?;
        }
        if !job.readout.allow.is_empty() {
            m.write_allow(act, &job.readout.allow)?;
        }
        if !job.readout.adjust.is_empty() {
            m.write_adjust(act, &job.readout.adjust)?;
        }
    }
    match &job.rows {
        Some(rows) => m.begin_step(act, kv, &step, rows)?,
        None => m.begin_step(act, kv, &step, &step.rows())?,
    }
    // This rank's heads, queued behind its earlier steps and ahead of this one's layers.
    kv.submit_edits(m.gpu(), job.kv_edits.parts())?;
    pass.add_host(host);
    if let GroupInput::Ids(ids) = &job.input {
        let host = HostTime::now();
        m.write_ids(act, ids)?;
        pass.add_host(host);
    }
    Ok(())
}
