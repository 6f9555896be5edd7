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
use crate::model::{GpuModel, ModelWeights, Placement, ShardSpec};
use crate::parallel::pick::Picker;
use crate::parallel::tp::TpGroup;
use crate::trace::Recorder;

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
    pub(super) fn whole() -> Self {
        Segment {
            embeds: true,
            head: true,
            upstream: None,
            downstream: None,
            output: unbounded(),
        }
    }
}

impl PipelineEngine {
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
                            .map(|model| Backend::Device(DeviceStage::new(model, comm.clone())))
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
                Backend::Device(_) => {
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
                place: Place {
                    index,
                    name: name.clone(),
                    gpu: gpus[index].clone(),
                    embeds: embeds && index == 0,
                    head: head && index + 1 == p,
                    stats: stats.clone(),
                },
                backend,
                input: receiver,
                outlet,
                output: output_tx.clone(),
                fault: faults.clone(),
                jobs: 0,
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
}
