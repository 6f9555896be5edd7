//! Hand-offs between stages: the work that travels from stage to stage, a device stage's
//! hand-off thread (finishes a download, paces it, sends the bytes on) and where a stage's
//! output goes next ([`Downstream`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crossbeam::channel::{Receiver, Sender};

use super::{Readout, StageStats};
use crate::comm::PendingDownload;
use crate::error::{Result, WgparError};
use crate::model::{SeqRow, Step, StepOut};
use crate::parallel::tp::EncoderExtras;
use crate::parallel::KvEdits;
use crate::sim::{Direction, LinkPacer};
use crate::threads::lock;
use crate::trace::{Recorder, SpanAttrs, SpanId};

/// One pass of one micro-batch (sequence group) through the pipeline, as it travels from
/// stage to stage.
pub(crate) struct Work {
    pub(crate) encoder: Option<Arc<EncoderExtras>>,
    pub(crate) pacer: Option<Arc<LinkPacer>>,
    /// The sequence group (micro-batch, or serving lane): what the output is returned as.
    pub(crate) group: usize,
    /// The KV cache the pass reads and writes (the group's own, or the serving cache).
    pub(crate) cache: usize,
    /// The pass's sequence table (`None`: row b in slot b, all at `step.past`).
    pub(crate) rows: Option<Arc<Vec<SeqRow>>>,
    /// Slots of the cache `new_cache` makes (`None`: one per sequence of the step).
    pub(crate) slots: Option<usize>,
    /// Earliest start of the pass's first span (microseconds since the recorder's epoch).
    pub(crate) release_us: Option<f64>,
    pub(crate) ids: Arc<Vec<u32>>,
    pub(crate) step: Step,
    pub(crate) new_cache: bool,
    pub(crate) release: bool,
    pub(crate) hidden: Vec<u8>,
    /// What the pass's first span on this stage waits for.
    pub(crate) deps: Vec<SpanId>,
    pub(crate) recorder: Recorder,
    /// The driver's run (GPipe step, in-flight decode, served stream) this work belongs to:
    /// stages in other processes start their accounting afresh when it changes.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) run: u64,
    /// The last stage's token pick and readback.
    pub(crate) readout: Readout,
    /// Block tables, then copies of cached KV between slots, applied by each stage (to its
    /// own layers) when the pass reaches it, before its layers run.
    pub(crate) kv_edits: Arc<KvEdits>,
}

/// What the last stage hands the driver.
pub(crate) enum Payload {
    /// A decoder's picks: tokens and non-finite counts (and the logits when asked for).
    Picked(StepOut),
    /// An encoder's pooled embeddings.
    Pooled(Vec<f32>),
}

/// What the last stage returns to the driver.
pub(crate) struct Output {
    pub(crate) group: usize,
    pub(crate) batch: usize,
    pub(crate) payload: Payload,
    /// The span that delivered the result: the group's next step depends on it.
    pub(crate) dep: SpanId,
}

/// What a stage hands on: hidden states to the next stage, or the pipeline's result.
pub(super) enum StageOut {
    Hidden(Vec<u8>),
    Final(Payload),
}

/// A finished compute whose output is still being downloaded.
pub(super) struct Pending {
    pub(super) work: Work,
    /// The stage's output (hidden states, picks or pooled embeddings), then the logits when
    /// the readout asks for them.
    pub(super) downloads: Vec<PendingDownload>,
    pub(super) started: Instant,
    pub(super) compute: SpanId,
}

/// Where a stage's output goes: the boundary between a stage and whatever follows it. A stage
/// in another process or on another node plugs in here as one more variant (its hand-off
/// serialises `Work` instead of sending it over a channel).
pub(crate) enum Downstream {
    /// The next stage, in this process.
    Stage(Sender<Work>),
    /// The driver (the engine), from the last stage: logits or pooled embeddings.
    Driver(Sender<Result<Output>>),
}

impl Downstream {
    /// Hands `work`'s output, delivered by span `dep`, to what follows.
    pub(super) fn deliver(&self, work: Work, out: StageOut, dep: SpanId) -> Result<()> {
        match (self, out) {
            (Downstream::Stage(next), StageOut::Hidden(bytes)) => next
                .send(Work {
                    hidden: bytes,
                    deps: vec![dep],
                    ..work
                })
                .map_err(|_| WgparError::WorkerStopped {
                    worker: "the next stage".into(),
                    detail: "it closed its input".into(),
                }),
            (Downstream::Driver(driver), StageOut::Final(payload)) => driver
                .send(Ok(Output {
                    group: work.group,
                    batch: work.step.batch,
                    payload,
                    dep,
                }))
                .map_err(|_| WgparError::WorkerStopped {
                    worker: "the pipeline's caller".into(),
                    detail: "it stopped reading results".into(),
                }),
            // Only the last stage makes final results, and only it hands off to the driver.
            _ => Err(WgparError::Internal(
                "a stage's output does not fit what follows it (hidden states go to a stage, \
                 results to the driver)"
                    .into(),
            )),
        }
    }
}

/// A device stage's hand-off thread: finishes downloads and sends the bytes on.
pub(super) struct HandOff {
    pub(super) index: usize,
    pub(super) last: bool,
    pub(super) name: String,
    pub(super) device: u32,
    pub(super) input: Receiver<Pending>,
    pub(super) downstream: Downstream,
    pub(super) output: Sender<Result<Output>>,
    pub(super) stats: Arc<Mutex<Vec<StageStats>>>,
}

pub(super) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    crate::threads::panic_message(payload)
        .unwrap_or("panic")
        .to_string()
}

/// Sends `cause` to the driver as the failure of worker `name` (a panic names its worker
/// already).
pub(super) fn report_failure(output: &Sender<Result<Output>>, name: &str, cause: WgparError) {
    let e = match cause {
        e @ WgparError::WorkerPanicked { .. } => e,
        cause => WgparError::WorkerFailed {
            worker: name.to_string(),
            source: Box::new(cause),
        },
    };
    let _ = output.send(Err(e));
}

impl HandOff {
    /// The hand-off thread: deliver each finished pass in order; stop at the first failure
    /// or when the stage thread has gone and everything it started is delivered.
    pub(super) fn run(self) {
        // The stage's outgoing link carries one download at a time.
        let mut link_free: Option<Instant> = None;
        for pending in self.input.iter() {
            let outcome = catch_unwind(AssertUnwindSafe(|| self.deliver(pending, &mut link_free)));
            let failure = match outcome {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e,
                Err(payload) => WgparError::WorkerPanicked {
                    worker: format!("the hand-off thread of {}", self.name),
                    message: panic_text(&*payload),
                },
            };
            return report_failure(&self.output, &self.name, failure);
        }
    }

    fn deliver(&self, p: Pending, link_free: &mut Option<Instant>) -> Result<()> {
        let started = link_free.map_or(p.started, |t| t.max(p.started));
        let parts = (p.downloads.into_iter())
            .map(PendingDownload::finish)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let n: u64 = parts.iter().map(|b| b.len() as u64).sum();
        if let Some(pacer) = &p.work.pacer {
            pacer.pace(Direction::DeviceToHost, n, started);
        }
        let end = Instant::now();
        *link_free = Some(end);
        let mb = p.work.group as u32;
        let (dev, last) = (self.device, self.last);
        let what = match (last, p.work.encoder.is_some()) {
            (false, _) => "activations",
            (true, false) => "tokens",
            (true, true) => "pooled",
        };
        let d2h = p.work.recorder.record_with(started, end, || {
            SpanAttrs::d2h(what, dev, n).microbatch(mb).after(p.compute)
        });
        {
            let mut stats = lock(&self.stats);
            let s = &mut stats[self.index];
            s.download_s += (end - started).as_secs_f64();
            s.bytes_out += n;
            s.transfers += 1;
        }
        let out = if last {
            StageOut::Final(payload_of(&p.work, parts)?)
        } else {
            StageOut::Hidden(parts.into_iter().next().unwrap_or_default())
        };
        self.downstream.deliver(p.work, out, d2h)
    }
}

/// The last stage's result from its downloads: pooled embeddings for an encoder; for a
/// decoder the picks (`[2][batch]` u32: tokens, then non-finite counts) and, when the readout
/// asked for them, the logits.
fn payload_of(work: &Work, parts: Vec<Vec<u8>>) -> Result<Payload> {
    let mut parts = parts.into_iter();
    let first = parts.next().unwrap_or_default();
    if work.encoder.is_some() {
        return Ok(Payload::Pooled(bytemuck::pod_collect_to_vec(&first)));
    }
    let batch = work.step.batch;
    let words: Vec<u32> = bytemuck::pod_collect_to_vec(&first);
    if words.len() < 2 * batch {
        return Err(WgparError::Shape {
            op: "pipeline output".into(),
            detail: format!("{} picks for {batch} sequences", words.len()),
        });
    }
    Ok(Payload::Picked(StepOut {
        tokens: words[..batch].to_vec(),
        non_finite: words[batch..2 * batch].to_vec(),
        logits: parts.next().map(|b| bytemuck::pod_collect_to_vec(&b)),
    }))
}
