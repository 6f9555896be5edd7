//! Thread-safe span recorder shared by engine and comm threads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::attrs::SpanAttrs;
use super::span::{Span, SpanId};
use super::timeline::{us_to_ns, Timeline};

/// Records spans from any number of threads into one timeline.
///
/// Cloning is cheap (an `Arc`). A disabled recorder ([`Recorder::disabled`], also the
/// `Default`) holds nothing: recording returns [`SpanId::NONE`] after one branch, and
/// [`Recorder::record_with`] does not even build the attributes.
///
/// ```
/// use std::time::Instant;
/// use wgpar::trace::{Recorder, SpanAttrs};
/// let rec = Recorder::new();
/// let t0 = Instant::now();
/// // ... run kernels on device 0 and wait for them ...
/// let up = rec.record(t0, Instant::now(), SpanAttrs::compute("layer0.attn", 0).layer(0));
/// let t1 = Instant::now();
/// rec.record(t1, Instant::now(), SpanAttrs::d2h("layer0.partial", 0, 4096).after(up));
/// assert_eq!(rec.timeline().spans.len(), 2);
/// ```
#[derive(Clone, Default)]
pub struct Recorder {
    inner: Option<Arc<Inner>>,
    device_timing: DeviceTiming,
}

/// Whether engines also time compute spans on the device, with timestamp queries, while they
/// record (the span's `device_ns`). Spans always keep host clocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceTiming {
    /// Where the adapter has `TIMESTAMP_QUERY` and is not a CPU driver. On lavapipe a
    /// submission with timestamp writes takes 0.1-0.2 ms longer (the writes drain its queue),
    /// which would inflate the very spans being timed.
    #[default]
    Auto,
    /// Wherever the adapter has `TIMESTAMP_QUERY`.
    On,
    /// Host clocks only.
    Off,
}

impl DeviceTiming {
    /// Parses `auto`, `on` or `off`.
    pub fn parse(text: &str) -> Option<DeviceTiming> {
        match text {
            "auto" => Some(DeviceTiming::Auto),
            "on" => Some(DeviceTiming::On),
            "off" => Some(DeviceTiming::Off),
            _ => None,
        }
    }
}

struct Inner {
    epoch: Instant,
    next_id: AtomicU64,
    timeline: Mutex<Timeline>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("enabled", &self.is_enabled())
            .finish()
    }
}

impl Recorder {
    /// An enabled recorder whose epoch (time zero) is now.
    pub fn new() -> Self {
        Self::with_epoch(Instant::now())
    }

    /// An enabled recorder with a chosen epoch; spans starting before it are clamped to 0.
    pub fn with_epoch(epoch: Instant) -> Self {
        Recorder {
            inner: Some(Arc::new(Inner {
                epoch,
                next_id: AtomicU64::new(1),
                timeline: Mutex::new(Timeline::new()),
            })),
            device_timing: DeviceTiming::default(),
        }
    }

    /// A recorder that records nothing.
    pub fn disabled() -> Self {
        Recorder::default()
    }

    /// The same recorder with device-side timing chosen by `timing`.
    pub fn with_device_timing(mut self, timing: DeviceTiming) -> Self {
        self.device_timing = timing;
        self
    }

    /// Whether engines should time spans on the device (see [`DeviceTiming`]).
    pub fn device_timing(&self) -> DeviceTiming {
        self.device_timing
    }

    /// True if spans are being kept.
    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The epoch all span times are measured from (`None` when disabled).
    pub fn epoch(&self) -> Option<Instant> {
        self.inner.as_ref().map(|i| i.epoch)
    }

    /// Microseconds from the epoch to `t` (0 when disabled or before the epoch).
    pub fn us_since_epoch(&self, t: Instant) -> f64 {
        self.inner
            .as_ref()
            .map_or(0.0, |i| ns_since(i.epoch, t) as f64 / 1e3)
    }

    /// Records a span that ran from `start` to `end`; returns its id for later dependencies.
    pub fn record(&self, start: Instant, end: Instant, attrs: SpanAttrs) -> SpanId {
        let Some(inner) = &self.inner else {
            return SpanId::NONE;
        };
        let start_ns = ns_since(inner.epoch, start);
        let dur_ns = ns_since(start, end);
        inner.push(attrs, start_ns, dur_ns)
    }

    /// Like [`Recorder::record`], but builds the attributes only when enabled (for hot loops
    /// whose span names are formatted strings).
    pub fn record_with(
        &self,
        start: Instant,
        end: Instant,
        attrs: impl FnOnce() -> SpanAttrs,
    ) -> SpanId {
        if self.inner.is_none() {
            return SpanId::NONE;
        }
        self.record(start, end, attrs())
    }

    /// Records a span whose times are already microseconds since the epoch (for example from
    /// GPU timestamp queries converted to the host clock).
    pub fn record_us(&self, start_us: f64, dur_us: f64, attrs: SpanAttrs) -> SpanId {
        match &self.inner {
            Some(inner) => inner.push(attrs, us_to_ns(start_us), us_to_ns(dur_us)),
            None => SpanId::NONE,
        }
    }

    /// Notes that span `span` depends on span `remote` of rank `rank`'s trace (a message from
    /// another MPI rank); [`Timeline::merge_ranks`] turns it into a dependency.
    pub fn remote_dep(&self, span: SpanId, rank: u32, remote: SpanId) {
        if let Some(inner) = &self.inner {
            if !span.is_none() && !remote.is_none() {
                inner
                    .lock()
                    .remote_deps
                    .push(super::timeline::RemoteDep { span, rank, remote });
            }
        }
    }

    /// Labels a device in exported traces, e.g. `"NVIDIA RTX 4090 (Vulkan)"`.
    pub fn label_device(&self, device: u32, label: impl Into<String>) {
        if let Some(inner) = &self.inner {
            inner.lock().devices.insert(device, label.into());
        }
    }

    /// Stores a free-form fact about the run (model, command line, machine).
    pub fn set_meta(&self, key: impl Into<String>, value: impl Into<String>) {
        if let Some(inner) = &self.inner {
            inner.lock().meta.insert(key.into(), value.into());
        }
    }

    /// Declares that the engine recording here records, for every span, everything it waited
    /// for (including its driver's waits between steps), so that a projection replays the
    /// dependencies as recorded and infers no step barriers from idle instants.
    pub fn declare_complete_dependencies(&self) {
        let (key, value) = super::timeline::COMPLETE_DEPENDENCIES;
        self.set_meta(key, value);
    }

    /// A copy of everything recorded so far, spans sorted by id (empty when disabled).
    pub fn timeline(&self) -> Timeline {
        match &self.inner {
            Some(inner) => {
                let mut t = inner.lock().clone();
                t.spans.sort_by_key(|s| s.id);
                t
            }
            None => Timeline::new(),
        }
    }
}

impl Inner {
    fn push(&self, attrs: SpanAttrs, start_ns: u64, dur_ns: u64) -> SpanId {
        // The span is built outside the lock; only the push is serialised.
        let id = SpanId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let span: Span = attrs.into_span(id, start_ns, dur_ns);
        self.lock().spans.push(span);
        id
    }

    fn lock(&self) -> MutexGuard<'_, Timeline> {
        // A thread that panicked while pushing cannot leave the Vec half-written, so the data
        // behind a poisoned lock is still sound: keep recording.
        crate::threads::lock(&self.timeline)
    }
}

/// Whole nanoseconds from `from` to `to`, 0 if `to` is earlier.
fn ns_since(from: Instant, to: Instant) -> u64 {
    let d = to.saturating_duration_since(from);
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn disabled_recorder_records_nothing() {
        let r = Recorder::disabled();
        let t = Instant::now();
        assert_eq!(r.record(t, t, SpanAttrs::compute("x", 0)), SpanId::NONE);
        let mut built = false;
        r.record_with(t, t, || {
            built = true;
            SpanAttrs::compute("x", 0)
        });
        assert!(!built);
        assert!(r.timeline().spans.is_empty());
    }

    #[test]
    fn times_are_relative_to_epoch() {
        let epoch = Instant::now();
        let r = Recorder::with_epoch(epoch);
        let a = epoch + Duration::from_micros(10);
        let b = a + Duration::from_micros(5);
        let id = r.record(a, b, SpanAttrs::compute("x", 0));
        // End before start clamps the duration to zero instead of wrapping.
        r.record(b, a, SpanAttrs::compute("y", 0).after(id));
        let t = r.timeline();
        assert_eq!((t.spans[0].start_ns, t.spans[0].dur_ns), (10_000, 5_000));
        assert_eq!((t.spans[1].start_ns, t.spans[1].dur_ns), (15_000, 0));
        assert_eq!(t.spans[1].deps, vec![id]);
    }

    #[test]
    fn concurrent_recording_keeps_every_span_with_unique_ids() {
        let r = Recorder::new();
        std::thread::scope(|s| {
            for d in 0..4u32 {
                let r = r.clone();
                s.spawn(move || {
                    let mut prev = SpanId::NONE;
                    for k in 0..250 {
                        let now = Instant::now();
                        prev = r.record(
                            now,
                            now,
                            SpanAttrs::compute("k", d).microbatch(k).after(prev),
                        );
                    }
                });
            }
        });
        let mut t = r.timeline();
        assert_eq!(t.spans.len(), 1000);
        assert!(t.validate().is_ok());
        assert_eq!(t.spans.last().map(|s| s.id), Some(SpanId(1000)));
    }
}
