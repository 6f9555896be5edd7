//! A device stage's pass, as phases: the stage's buffers and inputs, the upstream hand-off
//! received, the layers computed, and the output's download begun for the hand-off thread
//! ([`super::handoff`]) to finish.

use std::sync::Arc;
use std::time::Instant;

use super::handoff::{Pending, Work};
use super::stage::Place;
use crate::comm::{Collectives, PendingDownload};
use crate::device::SpanTimer;
use crate::error::{Result, WgparError};
use crate::model::{Activations, GpuModel, KvCache};
use crate::parallel::buffers::StepBuffers;
use crate::parallel::cost;
use crate::sim::Direction;
use crate::trace::{KernelFamily, SpanAttrs, SpanId};

/// Downloads a device stage may have out at once (see `Device::buffers`).
const HANDOFF_DEPTH: usize = 3;

/// One device's part of the pipeline: its layers and the buffers it keeps between passes.
pub(super) struct DeviceStage {
    buffers: StepBuffers,
    device: Device,
}

/// What a device stage computes and transfers with.
struct Device {
    model: GpuModel,
    /// Host transfers (the segment's, shared by its stages).
    comm: Arc<Collectives>,
    /// Device-side timing of compute spans while a trace is recorded.
    timer: SpanTimer,
}

impl DeviceStage {
    pub(super) fn new(model: GpuModel, comm: Arc<Collectives>) -> Self {
        Self {
            buffers: StepBuffers::default(),
            device: Device {
                model,
                comm,
                timer: SpanTimer::default(),
            },
        }
    }

    /// One pass of `work`: inputs staged, the hand-off received, the layers computed and
    /// recorded, the output's download begun. The hand-off thread finishes the pending pass.
    pub(super) fn pass(&mut self, place: &Place, work: Work) -> Result<Pending> {
        let device = &mut self.device;
        let (act, kv) = device.buffers(&mut self.buffers, place, &work)?;
        stage_inputs(&device.model, place, &work, act, kv)?;
        crate::parallel::sync_span_timer(&mut device.timer, &place.gpu, &work.recorder);
        let (act, kv) = (&*act, &*kv);
        let begun = Instant::now();
        let deps = match place.embeds {
            true => work.deps.clone(),
            false => vec![device.receive(place, &work, act)?],
        };
        let (start, end, compute) = device.compute(place, &work, (act, kv), deps)?;
        place.account(|s| {
            s.busy_s += (end - start).as_secs_f64();
            s.occupied_s += (end - begun).as_secs_f64();
            s.microbatches += 1;
        });
        let downloads = device.begin_downloads(place, &work, act)?;
        let started = Instant::now();
        if work.release {
            self.buffers.release(work.cache);
        }
        Ok(Pending {
            work,
            downloads,
            started,
            compute,
        })
    }
}

impl Device {
    /// The activations and KV cache of `work`'s pass: a new cache where the pass asks for
    /// one, activations (and their download staging) on a shape's first use.
    fn buffers<'b>(
        &self,
        buffers: &'b mut StepBuffers,
        place: &Place,
        work: &Work,
    ) -> Result<(&'b mut Activations, &'b mut KvCache)> {
        let (m, step) = (&self.model, work.step);
        if work.new_cache {
            buffers.new_cache(m, work.cache, work.slots.unwrap_or(step.batch))?;
        }
        if buffers.make_acts(m, &step)? {
            // Up to three of this shape's downloads are out at once: one in the hand-off
            // thread, one queued for it, one just begun. Holding their staging buffers now
            // keeps the token loop free of allocations however the passes interleave.
            let hidden = step.tokens() * m.config().hidden * 4;
            self.comm
                .reserve_downloads(&place.gpu, hidden as u64, HANDOFF_DEPTH);
        }
        buffers
            .get(&step, work.cache)
            .ok_or(WgparError::DecodeBeforePrefill)
    }

    /// Uploads the previous stage's hidden states (paced to the link), accounted and recorded
    /// after the pass's dependencies; returns the h2d span.
    fn receive(&self, place: &Place, work: &Work, act: &Activations) -> Result<SpanId> {
        let gpu = self.model.gpu();
        let want = work.step.tokens() * self.model.config().hidden * 4;
        if work.hidden.len() != want {
            return Err(WgparError::Shape {
                op: "pipeline hand-off".into(),
                detail: format!("received {} bytes, expected {want}", work.hidden.len()),
            });
        }
        let bytes = work.hidden.len() as u64;
        let start = Instant::now();
        self.comm.upload(gpu, act.x(), 0, &work.hidden)?;
        if let Some(p) = &work.pacer {
            p.pace(Direction::HostToDevice, bytes, start);
        }
        let end = Instant::now();
        place.account(|s| {
            s.upload_s += (end - start).as_secs_f64();
            s.bytes_in += bytes;
            s.transfers += 1;
        });
        let (dev, mb) = (gpu.ordinal() as u32, work.group as u32);
        Ok(work.recorder.record_with(start, end, || {
            SpanAttrs::h2d("activations", dev, bytes)
                .microbatch(mb)
                .after_all(&work.deps)
        }))
    }

    /// Encodes the stage's layers (with the embedding and the head where it holds them),
    /// submits and waits; records the compute span after `deps`. Returns its start, end and
    /// span.
    fn compute(
        &self,
        place: &Place,
        work: &Work,
        (act, kv): (&Activations, &KvCache),
        deps: Vec<SpanId>,
    ) -> Result<(Instant, Instant, SpanId)> {
        let (m, timer) = (&self.model, &self.timer);
        let gpu = m.gpu();
        let start = Instant::now();
        let mut enc = gpu.encoder();
        timer.begin(&mut enc);
        if place.embeds {
            m.embed(&mut enc, act)?;
        }
        m.layers(&mut enc, act, kv)?;
        if place.head {
            m.finish(&mut enc, act)?;
        }
        timer.end(&mut enc);
        gpu.submit(enc);
        gpu.wait()?;
        let end = Instant::now();
        let device_us = timer.read_us(gpu)?;
        // The pass's first span here starts no earlier than its release (the first stage
        // only: later stages wait for the hand-off anyway).
        let release = work.release_us.filter(|_| place.embeds);
        let compute = work.recorder.record_with(start, end, || {
            let a = compute_attrs(m, place, work, gpu.ordinal() as u32)
                .device_us(device_us)
                .after_all(&deps);
            match release {
                Some(us) => a.not_before_us(us),
                None => a,
            }
        });
        Ok((start, end, compute))
    }

    /// Begins the download of the pass's output: the picks (and logits when asked for) of a
    /// decoder's head, an encoder's pooled embeddings, or hidden states for the next stage.
    /// The copy is queued behind this compute and ahead of the next one, so the next
    /// micro-batch may reuse the activations while the hand-off thread waits for it.
    fn begin_downloads(
        &self,
        place: &Place,
        work: &Work,
        act: &Activations,
    ) -> Result<Vec<PendingDownload>> {
        let (m, gpu, comm) = (&self.model, self.model.gpu(), &self.comm);
        let step = work.step;
        // The last stage's activations always hold its picked tokens or pooled output.
        let no_output = || WgparError::Internal("last stage has no output buffer".into());
        let mut downloads = Vec::with_capacity(2);
        if place.head && !m.config().is_encoder() {
            // Token ids (and non-finite counts) always; logits only when asked for.
            let picked = act.picked().ok_or_else(no_output)?;
            downloads.push(comm.begin_download_range(gpu, picked, 0..2 * step.batch)?);
            if work.readout.logits {
                let logits = act.logits().ok_or_else(no_output)?;
                let len = step.batch * m.config().vocab;
                downloads.push(comm.begin_download_range(gpu, logits, 0..len)?);
            }
        } else if place.head {
            let (result, width) = m.output(act).ok_or_else(no_output)?;
            downloads.push(comm.begin_download_range(gpu, result, 0..step.batch * width)?);
        } else {
            let len = step.tokens() * m.config().hidden;
            downloads.push(comm.begin_download_range(gpu, act.x(), 0..len)?);
        }
        Ok(downloads)
    }
}

/// Stages the pass's inputs and configures its ops: all that needs the activations and the
/// cache mutably (nothing is allocated once they have met).
fn stage_inputs(
    m: &GpuModel,
    place: &Place,
    work: &Work,
    act: &mut Activations,
    kv: &mut KvCache,
) -> Result<()> {
    let step = work.step;
    if place.embeds {
        m.write_ids(act, &work.ids)?;
    }
    if let Some(e) = &work.encoder {
        m.write_encoder_inputs(act, &step, &e.types, &e.lens)?;
    }
    if place.head && !m.config().is_encoder() {
        act.set_readout(work.readout.pick, work.readout.logits);
        if !work.readout.draws.is_empty() {
            m.write_draws(act, &work.readout.draws)?;
        }
        if !work.readout.allow.is_empty() {
            m.write_allow(act, &work.readout.allow)?;
        }
        if !work.readout.adjust.is_empty() {
            m.write_adjust(act, &work.readout.adjust)?;
        }
    }
    match &work.rows {
        Some(rows) => m.begin_step(act, kv, &step, rows)?,
        None => m.begin_step(act, kv, &step, &step.rows())?,
    }
    // This stage's layers, queued behind its earlier passes and ahead of this one's compute.
    kv.submit_edits(m.gpu(), work.kv_edits.parts())
}

/// The compute span of a stage's pass: its layers' cost, and the head's part on the last
/// stage.
fn compute_attrs(m: &GpuModel, place: &Place, work: &Work, dev: u32) -> SpanAttrs {
    let (config, dtype, step) = (m.config(), m.weight_dtype(), &work.step);
    let cost = cost::total(
        config,
        &m.placement().shard,
        m.placement().layers.clone(),
        step,
        dtype,
        place.embeds,
        place.head,
    );
    let layers = &m.placement().layers;
    SpanAttrs::compute(format!("layers {}..{}", layers.start, layers.end), dev)
        .microbatch(work.group as u32)
        .flops(cost.flops)
        .bytes(cost.bytes)
        .kernels(cost.kernels)
        .family(KernelFamily::Matmul)
        .blocks_of(config.hidden, m.placement().shard.world)
        .head_part(if place.head {
            cost::head_work(config, step.batch, dtype)
        } else {
            None
        })
}
