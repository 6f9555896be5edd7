//! A step's statistics and spans on one rank: every phase of the step (hand-off in, compute,
//! all-reduce, hand-back) records its span here and adds its time to the rank's output, so
//! the statistics are sums of the same intervals the timeline shows.

use std::time::{Duration, Instant};

use super::group::{GroupJob, GroupOutput};
use crate::parallel::thread_cpu_s;
use crate::trace::{CollectiveOp, SpanAttrs, SpanId};

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

impl Default for RankOutput {
    fn default() -> Self {
        Self {
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
        }
    }
}

/// When a stretch of host work (staging, recording, submitting) began, on the wall clock and
/// on the thread's CPU clock.
#[derive(Clone, Copy)]
pub(super) struct HostTime {
    pub(super) start: Instant,
    cpu: Option<f64>,
}

impl HostTime {
    pub(super) fn now() -> Self {
        Self {
            start: Instant::now(),
            cpu: thread_cpu_s(),
        }
    }
}

/// One step in progress on a rank: the job, what its next span waits for, and its statistics
/// so far.
pub(super) struct Pass<'j> {
    pub(super) job: &'j GroupJob,
    /// The rank's device, as spans name it.
    pub(super) dev: u32,
    /// Bytes of one all-reduce or hand-off: the step's hidden states.
    pub(super) bytes: u64,
    /// What the next span waits for: the job's dependencies, then the previous phase's span.
    pub(super) prev: Vec<SpanId>,
    /// The job's earliest start, for the first span that takes it.
    release: Option<f64>,
    pub(super) out: RankOutput,
}

impl<'j> Pass<'j> {
    pub(super) fn new(job: &'j GroupJob, dev: u32, bytes: u64) -> Self {
        Self {
            job,
            dev,
            bytes,
            // The first span waits for the job's dependencies; each later one for the one
            // before ...
            prev: job.deps.clone(),
            // ... and starts no earlier than the job's release, if it has one.
            release: job.release_us,
            out: RankOutput::default(),
        }
    }

    /// Adds the host work since `since` to the encode totals.
    pub(super) fn add_host(&mut self, since: HostTime) {
        self.out.encode_s += since.start.elapsed().as_secs_f64();
        self.out.encode_cpu_s = (self.out.encode_cpu_s.zip(thread_cpu_s()).zip(since.cpu))
            .map(|((total, now), mark)| total + now - mark);
    }

    /// The upload of a pipeline hand-off, `t0..t1`: the step's first span.
    pub(super) fn uploaded(&mut self, t0: Instant, t1: Instant) {
        let (dev, bytes, mb) = (self.dev, self.bytes, self.job.microbatch);
        self.out.upload_s += (t1 - t0).as_secs_f64();
        self.out.upload_bytes += bytes;
        self.out.transfers += 1;
        let release = self.release.take();
        let prev = &self.prev;
        let h2d = self.job.recorder.record_with(t0, t1, || {
            let a = SpanAttrs::h2d("activations", dev, bytes).after_all(prev);
            tagged(released(a, release), mb)
        });
        self.prev = vec![h2d];
    }

    /// A compute span `start..end` after the previous phase; `attrs` describes it. The first
    /// one takes the job's release.
    pub(super) fn computed(
        &mut self,
        start: Instant,
        end: Instant,
        attrs: impl FnOnce() -> SpanAttrs,
    ) -> SpanId {
        let release = self.release.take();
        self.compute_span((start, end), release, attrs)
    }

    /// The step's last compute span (the head or the last residual), after the previous phase.
    pub(super) fn finished(
        &mut self,
        start: Instant,
        end: Instant,
        attrs: impl FnOnce() -> SpanAttrs,
    ) -> SpanId {
        let tail = self.compute_span((start, end), None, attrs);
        self.out.last_span = tail;
        tail
    }

    /// A compute span after the previous phase, starting no earlier than `release`.
    fn compute_span(
        &mut self,
        (start, end): (Instant, Instant),
        release: Option<f64>,
        attrs: impl FnOnce() -> SpanAttrs,
    ) -> SpanId {
        self.out.compute_s += (end - start).as_secs_f64();
        let (mb, prev) = (self.job.microbatch, &self.prev);
        self.job.recorder.record_with(start, end, || {
            tagged(released(attrs().after_all(prev), release), mb)
        })
    }

    /// An all-reduce of layer `layer` after the compute span `compute`: entered at `entered`,
    /// every rank there at `all_arrived`, done at `end`. Time before the last rank arrived is
    /// a wait span, not communication (the last rank to arrive waits for nobody).
    pub(super) fn all_reduced(
        &mut self,
        (entered, all_arrived, end): (Instant, Instant, Instant),
        (layer, compute): (u32, SpanId),
        collective: impl FnOnce() -> SpanAttrs,
    ) {
        let (dev, mb, rec) = (self.dev, self.job.microbatch, &self.job.recorder);
        self.out.comm_s += (end - entered).as_secs_f64();
        self.out.collectives += 1;
        self.out.bytes += self.bytes;
        self.out.wait_s += all_arrived.saturating_duration_since(entered).as_secs_f64();
        // What precedes the collective span is waiting, recorded as a span or not.
        let waited = if all_arrived > entered + Duration::from_micros(1) {
            rec.record_with(entered, all_arrived, || {
                let a = SpanAttrs::wait("allreduce wait", dev).layer(layer);
                tagged(a.after(compute), mb)
            })
        } else {
            compute
        };
        let start = all_arrived.max(entered);
        let span = rec.record_with(start, end, || tagged(collective().after(waited), mb));
        self.prev = vec![span];
    }

    /// The download of the step's output (`n` bytes of `what`), `t0..t1`, after the tail.
    pub(super) fn downloaded(&mut self, t0: Instant, t1: Instant, what: &'static str, n: u64) {
        let (dev, mb, tail) = (self.dev, self.job.microbatch, self.out.last_span);
        self.out.last_span = (self.job.recorder).record_with(t0, t1, || {
            tagged(SpanAttrs::d2h(what, dev, n).after(tail), mb)
        });
        self.out.download_s += (t1 - t0).as_secs_f64();
        self.out.transfers += 1;
    }
}

/// `a` tagged with micro-batch `mb`, if the job has one.
fn tagged(a: SpanAttrs, mb: Option<u32>) -> SpanAttrs {
    match mb {
        Some(k) => a.microbatch(k),
        None => a,
    }
}

/// `a` starting no earlier than `release`, if given.
fn released(a: SpanAttrs, release: Option<f64>) -> SpanAttrs {
    match release {
        Some(us) => a.not_before_us(us),
        None => a,
    }
}

/// The attributes of a host-staged all-reduce of `bytes` over `world` ranks.
pub(super) fn allreduce_attrs(dev: u32, world: u32, bytes: u64) -> SpanAttrs {
    SpanAttrs::collective(
        "allreduce",
        dev,
        CollectiveOp::AllReduce,
        "host-staged",
        world,
        bytes,
    )
}
