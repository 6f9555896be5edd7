//! Building a pipeline segment: the stages' models (or tensor-parallel groups), their threads
//! and the channels between them. In one process the segment is the whole pipeline; under
//! MPI (`dist`) each rank builds one and joins them with remote stage links.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam::channel::{bounded, unbounded, Receiver, Sender};

use super::device::DeviceStage;
use super::handoff::{Downstream, HandOff, Output, Pending, Work};
use super::serve::Serving;
use super::stage::{Backend, Outlet, Place, Stage};
use super::{PipelineEngine, Schedule, StageStats};
use crate::comm::{Collectives, CommConfig};
use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{ModelConfig, ModelWeights, ShardSpec};
use crate::parallel::pick::Picker;
use crate::parallel::tp::{GroupPart, TpGroup};
use crate::parallel::upload::upload_parts;
use crate::parallel::Fault;
use crate::trace::Recorder;

/// A pipeline segment: the layers of its stages, the devices per stage, and where it sits in
/// a pipeline spread over processes (`dist`): which model ends it holds and the channels of
/// its remote stage links. In one process the segment is the whole pipeline: it embeds, holds
/// the head and talks to the driver only.
pub(crate) struct Segment {
    /// Layers of each stage, in pipeline order.
    pub(crate) stages: Vec<Range<usize>>,
    /// Devices per stage: above 1, each stage is a tensor-parallel group (hybrid).
    pub(crate) tp: usize,
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
    /// The whole pipeline in one process: stages holding `stages`, `tp` devices each.
    pub(super) fn whole(stages: Vec<Range<usize>>, tp: usize) -> Self {
        Segment {
            stages,
            tp,
            embeds: true,
            head: true,
            upstream: None,
            downstream: None,
            output: unbounded(),
        }
    }

    /// Refuses devices that do not form the stages, and no micro-batches.
    fn check(&self, devices: usize, micro_batches: usize) -> Result<()> {
        let (p, tp) = (self.stages.len(), self.tp);
        if tp == 0 || p == 0 || devices != p * tp {
            return Err(WgparError::unsupported(format!(
                "{devices} devices do not form {p} pipeline stages of {tp} tensor-parallel devices"
            )));
        }
        if micro_batches == 0 {
            return Err(WgparError::option(
                "--micro-batches",
                "--micro-batches must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// The part of the model stage `i` holds.
    fn part(&self, i: usize) -> GroupPart {
        GroupPart {
            layers: self.stages[i].clone(),
            embeds: i == 0 && self.embeds,
            head: i + 1 == self.stages.len() && self.head,
        }
    }
}

impl PipelineEngine {
    /// A segment of a pipeline: its stages, with the model ends and remote links `seg` gives.
    /// [`hybrid`](Self::hybrid) is the whole pipeline; `dist` builds one segment per MPI rank
    /// and joins them with remote stage links.
    pub(crate) fn segment(
        gpus: &[Arc<Gpu>],
        weights: &ModelWeights,
        dtype: DType,
        micro_batches: usize,
        comm_config: CommConfig,
        seg: Segment,
    ) -> Result<Self> {
        seg.check(gpus.len(), micro_batches)?;
        let backends = backends(gpus, weights, dtype, &seg, comm_config)?;
        let stage_gpus: Vec<&[Arc<Gpu>]> = gpus.chunks(seg.tp).collect();
        let labels: Vec<String> = (stage_gpus.iter())
            .map(|g| g.iter().map(|d| d.label()).collect::<Vec<_>>().join("+"))
            .collect();
        let stats = Arc::new(Mutex::new(
            (seg.stages.iter().zip(&stage_gpus))
                .map(|(r, g)| StageStats {
                    layers: r.clone(),
                    device: g[0].describe(),
                    ..Default::default()
                })
                .collect(),
        ));
        let shape = Shape {
            config: weights.config.clone(),
            ranges: seg.stages.clone(),
            labels,
            tp: seg.tp,
            micro_batches,
            remote_head: !seg.head,
        };
        let threads = Threads::start(seg, backends, &stage_gpus, stats)?;
        Ok(Self::driving(threads, shape))
    }

    /// The driver of a segment's started `threads`.
    fn driving(threads: Threads, shape: Shape) -> Self {
        Self {
            input: threads.input,
            output: threads.output,
            threads: threads.handles,
            ranges: shape.ranges,
            labels: shape.labels,
            config: shape.config,
            tp: shape.tp,
            micro_batches: shape.micro_batches,
            schedule: Schedule::default(),
            stats: threads.stats,
            faults: threads.faults,
            groups: Vec::new(),
            group_past: Vec::new(),
            group_deps: HashMap::new(),
            last_outputs: Vec::new(),
            steps: 0,
            picker: Picker::greedy(),
            remote_head: shape.remote_head,
            batch: 0,
            last: None,
            last_run: None,
            failed: None,
            recorder: Recorder::disabled(),
            timeout: Duration::from_secs(120),
            pacer: None,
            serving: Serving::default(),
            run: 0,
        }
    }
}

/// What the driver knows of a segment's shape.
struct Shape {
    config: ModelConfig,
    ranges: Vec<Range<usize>>,
    /// Each stage's devices, joined by `+`.
    labels: Vec<String>,
    tp: usize,
    micro_batches: usize,
    /// The head is on another rank (`dist`).
    remote_head: bool,
}

/// Each stage's backend: one device's model (all uploaded at once), or a tensor-parallel
/// group per `seg.tp` devices.
fn backends(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    seg: &Segment,
    comm_config: CommConfig,
) -> Result<Vec<Backend>> {
    let comm = Arc::new(Collectives::new(comm_config.clone())?);
    if seg.tp > 1 {
        return (gpus.chunks(seg.tp).enumerate())
            .map(|(i, devices)| {
                let part = seg.part(i);
                TpGroup::new(devices, weights, dtype, None, part, comm_config.clone())
                    .map(Backend::Group)
            })
            .collect();
    }
    let placements = (0..seg.stages.len())
        .map(|i| seg.part(i).placement(ShardSpec::full(&weights.config)))
        .collect();
    upload_parts(gpus, weights, dtype, placements, "a stage")
        .into_iter()
        .map(|model| Ok(Backend::Device(DeviceStage::new(model?, comm.clone()))))
        .collect()
}

/// A segment's threads as they start: a stage thread per stage (and a hand-off thread per
/// device stage), chained by channels.
struct Threads {
    /// The first stage's input, where the driver feeds it (not a remote link).
    input: Option<Sender<Work>>,
    output: Receiver<Result<Output>>,
    handles: Vec<JoinHandle<()>>,
    stats: Arc<Mutex<Vec<StageStats>>>,
    faults: Arc<Mutex<Vec<Option<Fault>>>>,
    /// Where every stage reports failures (and the last stage its results).
    report: Sender<Result<Output>>,
}

impl Threads {
    /// Starts every stage of `seg` on its backend, each fed by the one before.
    fn start(
        seg: Segment,
        backends: Vec<Backend>,
        stage_gpus: &[&[Arc<Gpu>]],
        stats: Arc<Mutex<Vec<StageStats>>>,
    ) -> Result<Self> {
        let p = seg.stages.len();
        let places: Vec<Place> = (0..p)
            .map(|i| {
                let part = seg.part(i);
                Place {
                    index: i,
                    name: stage_name(i, stage_gpus[i], &part.layers),
                    gpu: stage_gpus[i][0].clone(),
                    embeds: part.embeds,
                    head: part.head,
                    stats: stats.clone(),
                }
            })
            .collect();
        let Segment {
            upstream,
            mut downstream,
            output: (report, output),
            ..
        } = seg;
        // The driver feeds the first stage unless a remote link does.
        let (input, mut receiver) = match upstream {
            Some(rx) => (None, rx),
            None => {
                let (tx, rx) = bounded::<Work>(2);
                (Some(tx), rx)
            }
        };
        let mut threads = Threads {
            input,
            output,
            handles: Vec::new(),
            stats,
            faults: Arc::new(Mutex::new(vec![None; p])),
            report,
        };
        for (place, backend) in places.into_iter().zip(backends) {
            let (next, next_rx) = if place.index + 1 < p {
                let (tx, rx) = bounded::<Work>(2);
                (Downstream::Stage(tx), rx)
            } else {
                // The last stage here hands on to a remote stage, or to the driver.
                let next = match downstream.take() {
                    Some(remote) => Downstream::Stage(remote),
                    None => Downstream::Driver(threads.report.clone()),
                };
                (next, bounded(0).1)
            };
            threads.stage(place, backend, receiver, next)?;
            receiver = next_rx;
        }
        Ok(threads)
    }

    /// Starts the thread of the stage at `place` (and a device stage's hand-off thread),
    /// taking work from `input` and handing on to `next`.
    fn stage(
        &mut self,
        place: Place,
        backend: Backend,
        input: Receiver<Work>,
        next: Downstream,
    ) -> Result<()> {
        let index = place.index;
        let outlet = match backend {
            Backend::Device(_) => {
                // One pass may wait for its download while the next computes.
                let (tx, rx) = bounded::<Pending>(1);
                let handoff = HandOff {
                    index,
                    last: place.head,
                    name: place.name.clone(),
                    device: place.gpu.ordinal() as u32,
                    input: rx,
                    downstream: next,
                    output: self.report.clone(),
                    stats: place.stats.clone(),
                };
                self.spawn(format!("pp-handoff-{index}"), &place.name, move || {
                    handoff.run()
                })?;
                Outlet::HandOff(tx)
            }
            Backend::Group(_) => Outlet::Direct(next),
        };
        let name = place.name.clone();
        let stage = Stage {
            place,
            backend,
            input,
            outlet,
            output: self.report.clone(),
            fault: self.faults.clone(),
            jobs: 0,
        };
        self.spawn(format!("pp-stage-{index}"), &name, move || stage.run())
    }

    /// Spawns thread `thread` for worker `name`.
    fn spawn(
        &mut self,
        thread: String,
        name: &str,
        body: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        let handle = std::thread::Builder::new()
            .name(thread)
            .spawn(body)
            .map_err(|e| WgparError::Worker {
                worker: name.to_string(),
                message: format!("could not start thread: {e}"),
            })?;
        self.handles.push(handle);
        Ok(())
    }
}

/// A stage's name in errors and thread listings: its index, devices and layers.
fn stage_name(index: usize, devices: &[Arc<Gpu>], layers: &Range<usize>) -> String {
    let labels: Vec<&str> = devices.iter().map(|g| g.label()).collect();
    format!(
        "stage {index} ({} on {}, layers {}..{})",
        labels.join("+"),
        devices[0].info().label(),
        layers.start,
        layers.end
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(stages: Vec<Range<usize>>, tp: usize) -> Segment {
        Segment::whole(stages, tp)
    }

    #[test]
    fn a_segment_refuses_devices_that_do_not_form_its_stages() {
        let seg = segment(vec![0..2, 2..4], 2);
        assert!(seg.check(4, 1).is_ok());
        assert!(seg.check(3, 1).is_err());
        assert!(seg.check(4, 0).is_err());
        assert!(segment(vec![0..2, 2..4], 0).check(0, 1).is_err());
        assert!(segment(Vec::new(), 1).check(0, 1).is_err());
    }

    #[test]
    fn only_the_ends_of_a_segment_embed_and_hold_the_head() {
        let mut seg = segment(vec![0..1, 1..3, 3..4], 1);
        let ends: Vec<(Range<usize>, bool, bool)> = (0..3)
            .map(|i| seg.part(i))
            .map(|p| (p.layers, p.embeds, p.head))
            .collect();
        assert_eq!(
            ends,
            vec![
                (0..1, true, false),
                (1..3, false, false),
                (3..4, false, true)
            ]
        );
        // A middle rank's segment under MPI holds neither end.
        (seg.embeds, seg.head) = (false, false);
        assert!((0..3).all(|i| !seg.part(i).embeds && !seg.part(i).head));
    }
}
