//! A stage's worker thread: it takes a pass, computes it on its backend (one device, or a
//! tensor-parallel group for hybrid) and puts the finished pass in its outlet.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use crossbeam::channel::{Receiver, Sender};

use super::device::DeviceStage;
use super::handoff::{panic_text, report_failure, Downstream, Output, Pending, Work};
use super::hybrid::group_pass;
use super::StageStats;
use crate::device::Gpu;
use crate::error::{Result, WgparError};
use crate::parallel::tp::TpGroup;
use crate::parallel::{Fault, FaultKind};
use crate::threads::lock;

/// What computes a stage: one device, or a tensor-parallel group (hybrid TP x PP).
// One per stage thread, never copied: the variants' size difference does not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Backend {
    Device(DeviceStage),
    Group(TpGroup),
}

/// Where a stage thread puts a finished pass: its hand-off thread (device stages, which
/// overlap the download with the next compute) or straight downstream (hybrid stages, whose
/// rank 0 has already downloaded).
pub(super) enum Outlet {
    HandOff(Sender<Pending>),
    Direct(Downstream),
}

/// Where a stage sits in its pipeline, and where its accounting goes.
pub(super) struct Place {
    pub(super) index: usize,
    pub(super) name: String,
    /// The stage's (first) device: faults, labels.
    pub(super) gpu: Arc<Gpu>,
    /// Embeds token ids (the pipeline's first stage).
    pub(super) embeds: bool,
    /// Holds the head: the last stage of the whole pipeline (of every rank's stages).
    pub(super) head: bool,
    pub(super) stats: Arc<Mutex<Vec<StageStats>>>,
}

impl Place {
    /// Adds to this stage's statistics.
    pub(super) fn account(&self, add: impl FnOnce(&mut StageStats)) {
        add(&mut lock(&self.stats)[self.index]);
    }
}

pub(super) struct Stage {
    pub(super) place: Place,
    pub(super) backend: Backend,
    pub(super) input: Receiver<Work>,
    pub(super) outlet: Outlet,
    pub(super) output: Sender<Result<Output>>,
    pub(super) fault: Arc<Mutex<Vec<Option<Fault>>>>,
    /// Micro-batches this stage has taken since it started (what a fault's `after` counts).
    pub(super) jobs: usize,
}

impl Stage {
    /// The stage's thread: take work until the input closes; stop at the first failure.
    pub(super) fn run(mut self) {
        while let Ok(work) = self.input.recv() {
            let outcome = catch_unwind(AssertUnwindSafe(|| self.process(work)));
            let failure = match outcome {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e,
                Err(payload) => WgparError::WorkerPanicked {
                    worker: self.place.name.clone(),
                    message: panic_text(&*payload),
                },
            };
            return report_failure(&self.output, &self.place.name, failure);
        }
        // Returning drops the outlet: the hand-off thread drains and stops, then the next
        // stage sees its input close.
    }

    fn inject_fault(&mut self) -> Result<()> {
        let done = self.jobs;
        self.jobs += 1;
        let fault = lock(&self.fault)[self.place.index];
        match fault {
            Some(f) if done >= f.after => match f.kind {
                FaultKind::Error => Err(WgparError::InjectedFault {
                    kind: "error".into(),
                    at: format!("stage {} after {done} micro-batches", self.place.index),
                }),
                FaultKind::Panic => panic!("injected panic"),
                FaultKind::LoseDevice => {
                    self.place.gpu.device().destroy();
                    Ok(())
                }
            },
            _ => Ok(()),
        }
    }

    /// One pass: computed on the backend, then put in the outlet.
    fn process(&mut self, work: Work) -> Result<()> {
        self.inject_fault()?;
        // A lost device is reported as such, before any call that would trip over it.
        self.place.gpu.check()?;
        match (&mut self.backend, &self.outlet) {
            (Backend::Device(device), Outlet::HandOff(handoff)) => {
                let pending = device.pass(&self.place, work)?;
                handoff
                    .send(pending)
                    .map_err(|_| WgparError::WorkerStopped {
                        worker: format!("the hand-off thread of {}", self.place.name),
                        detail: "it stopped taking finished micro-batches".into(),
                    })
            }
            (Backend::Group(group), Outlet::Direct(downstream)) => {
                let (work, out, dep) = group_pass(group, &self.place, work)?;
                downstream.deliver(work, out, dep)
            }
            // The engine builds each backend with its own outlet.
            _ => Err(WgparError::Internal(
                "a device stage hands off through its hand-off thread, a hybrid stage directly"
                    .into(),
            )),
        }
    }
}
