//! The timeline: every span of a run, plus labels for its devices.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use serde::{Deserialize, Serialize};

use super::attrs::SpanAttrs;
use super::error::TraceError;
use super::span::{Span, SpanId, Track};
use super::summary::{Interval, Summary};

/// All spans of one run, in id order.
///
/// Recorded by a [`Recorder`](super::Recorder) while engines run, or built by hand with
/// [`Timeline::push_us`] (tests, synthetic workloads).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    /// Human-readable label per device index, e.g. `"RTX 4090 (Vulkan)"`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub devices: BTreeMap<u32, String>,
    /// Free-form facts about the run (model, command line, machine).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub meta: BTreeMap<String, String>,
    /// The spans, sorted by id.
    pub spans: Vec<Span>,
    /// Dependencies on spans of other processes' timelines (MPI ranks): resolved when the
    /// ranks' traces are merged ([`Timeline::merge_ranks`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remote_deps: Vec<RemoteDep>,
}

/// Span `span` of this timeline depends on span `remote` of rank `rank`'s timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteDep {
    /// The local span.
    pub span: SpanId,
    /// The rank whose timeline holds the dependency.
    pub rank: u32,
    /// The span there.
    pub remote: SpanId,
}

impl Timeline {
    /// An empty timeline.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a span with the next free id; times in nanoseconds.
    pub fn push(&mut self, attrs: SpanAttrs, start_ns: u64, dur_ns: u64) -> SpanId {
        let id = SpanId(self.spans.last().map_or(1, |s| s.id.0 + 1));
        self.spans.push(attrs.into_span(id, start_ns, dur_ns));
        id
    }

    /// Appends a span with the next free id; times in microseconds, rounded to nanoseconds.
    pub fn push_us(&mut self, attrs: SpanAttrs, start_us: f64, dur_us: f64) -> SpanId {
        self.push(attrs, us_to_ns(start_us), us_to_ns(dur_us))
    }

    /// The span with `id`, if present.
    pub fn span(&self, id: SpanId) -> Option<&Span> {
        // Spans are kept sorted by id, so a binary search suffices.
        self.spans
            .binary_search_by_key(&id, |s| s.id)
            .ok()
            .map(|i| &self.spans[i])
    }

    /// Number of devices: one more than the highest device index seen in a span or label.
    pub fn device_count(&self) -> usize {
        let from_spans = self.spans.iter().filter_map(|s| {
            s.device
                .or_else(|| s.track.device())
                .map(|d| d as usize + 1)
        });
        let from_labels = self.devices.keys().map(|d| *d as usize + 1);
        from_spans.chain(from_labels).max().unwrap_or(0)
    }

    /// The distinct tracks, in display order (per device: compute, d2h, h2d; then host, others).
    pub fn tracks(&self) -> Vec<Track> {
        let set: BTreeSet<Track> = self.spans.iter().map(|s| s.track.clone()).collect();
        let mut v: Vec<Track> = set.into_iter().collect();
        v.sort_by_key(track_order);
        v
    }

    /// Time from the earliest span start to the latest span end, in microseconds.
    pub fn makespan_us(&self) -> f64 {
        let start = self.spans.iter().map(|s| s.start_ns).min();
        let end = self.spans.iter().map(|s| s.end_ns()).max();
        match (start, end) {
            (Some(a), Some(b)) => (b - a) as f64 / 1e3,
            _ => 0.0,
        }
    }

    /// The run's steps: maximal stretches of time during which some span was always running,
    /// as `(start_us, end_us)` in time order. Engines are driven by a host loop that waits for
    /// each step's results, so the instants where nothing runs separate prefill and decode
    /// steps (the projection treats them as barriers; see `sim::StepBarriers`).
    pub fn steps(&self) -> Vec<(f64, f64)> {
        let mut order: Vec<&Span> = self.spans.iter().collect();
        order.sort_by_key(|s| (s.start_ns, s.id));
        let mut steps: Vec<(u64, u64)> = Vec::new();
        for s in order {
            match steps.last_mut() {
                Some(last) if s.start_ns <= last.1 => last.1 = last.1.max(s.end_ns()),
                _ => steps.push((s.start_ns, s.end_ns())),
            }
        }
        steps
            .into_iter()
            .map(|(a, b)| (a as f64 / 1e3, b as f64 / 1e3))
            .collect()
    }

    /// True when the recorder declared that every span records all it waited for, the
    /// driver's waits included ([`Recorder::declare_complete_dependencies`]): idle instants
    /// are then not step boundaries.
    ///
    /// [`Recorder::declare_complete_dependencies`]: super::Recorder::declare_complete_dependencies
    pub fn has_complete_dependencies(&self) -> bool {
        self.meta.get(COMPLETE_DEPENDENCIES.0).map(String::as_str) == Some(COMPLETE_DEPENDENCIES.1)
    }

    /// Busy time, communication and bubble shares, bytes moved (see [`Summary`]).
    pub fn summary(&self) -> Summary {
        Summary::from_intervals(
            self.device_count(),
            self.spans.iter().map(|s| Interval {
                kind: s.kind,
                device: s.device.or_else(|| s.track.device()),
                start_us: s.start_us(),
                end_us: s.end_us(),
                bytes: s.bytes,
            }),
        )
    }

    /// Sorts spans by id and checks that ids are unique, every dependency points to an
    /// earlier span of this timeline and no span's head part exceeds its work.
    pub fn validate(&mut self) -> Result<(), TraceError> {
        self.spans.sort_by_key(|s| s.id);
        let mut seen = HashSet::with_capacity(self.spans.len());
        for s in &self.spans {
            if !seen.insert(s.id) {
                return Err(TraceError::DuplicateId { id: s.id });
            }
        }
        for s in &self.spans {
            for &dep in &s.deps {
                if !seen.contains(&dep) {
                    return Err(TraceError::UnknownDependency {
                        span: s.id,
                        name: s.name.clone(),
                        dep,
                    });
                }
                if dep >= s.id {
                    return Err(TraceError::ForwardDependency {
                        span: s.id,
                        name: s.name.clone(),
                        dep,
                    });
                }
            }
            if let Some(h) = s.head.filter(|h| h.flops > s.flops || h.bytes > s.bytes) {
                return Err(TraceError::HeadExceedsSpan {
                    span: s.id,
                    name: s.name.clone(),
                    head_flops: h.flops,
                    head_bytes: h.bytes,
                    flops: s.flops,
                    bytes: s.bytes,
                });
            }
        }
        self.check_totals()
    }

    /// Every sum a summary or a projection takes over the spans (end times, bytes, FLOPs)
    /// fits in 64 bits.
    fn check_totals(&self) -> Result<(), TraceError> {
        let (mut bytes, mut flops) = (0u64, 0u64);
        for s in &self.spans {
            let overflow = |what: String| TraceError::Overflow {
                span: s.id,
                name: s.name.clone(),
                what,
            };
            s.start_ns.checked_add(s.dur_ns).ok_or_else(|| {
                overflow(format!(
                    "start {} ns + duration {} ns",
                    s.start_ns, s.dur_ns
                ))
            })?;
            bytes = bytes
                .checked_add(s.bytes)
                .ok_or_else(|| overflow(format!("the byte total with its {} B", s.bytes)))?;
            flops = flops
                .checked_add(s.flops)
                .ok_or_else(|| overflow(format!("the FLOP total with its {} FLOPs", s.flops)))?;
        }
        Ok(())
    }
}

/// Microseconds to whole nanoseconds; negative and NaN inputs become 0.
/// The metadata entry of a timeline whose spans record every dependency.
pub(crate) const COMPLETE_DEPENDENCIES: (&str, &str) = ("dependencies", "complete");

pub(crate) fn us_to_ns(us: f64) -> u64 {
    if us.is_finite() && us > 0.0 {
        (us * 1e3).round() as u64
    } else {
        0
    }
}

/// Sort key that groups a device's tracks together.
pub(crate) fn track_order(t: &Track) -> (u8, u32, u8, String) {
    match t {
        Track::Device(d) => (0, *d, 0, String::new()),
        Track::DeviceToHost(d) => (0, *d, 1, String::new()),
        Track::HostToDevice(d) => (0, *d, 2, String::new()),
        Track::Host => (1, 0, 0, String::new()),
        Track::Other(n) => (2, 0, 0, n.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{HeadWork, SpanAttrs};

    #[test]
    fn push_assigns_ids_and_validate_checks_deps() {
        let mut t = Timeline::new();
        let a = t.push_us(SpanAttrs::compute("a", 0), 0.0, 1.5);
        let b = t.push_us(SpanAttrs::d2h("b", 1, 8).after(a), 1.5, 2.0);
        assert_eq!((a, b), (SpanId(1), SpanId(2)));
        assert_eq!(t.span(b).map(|s| s.start_ns), Some(1500));
        assert_eq!(t.device_count(), 2);
        assert_eq!(t.makespan_us(), 3.5);
        assert!(t.validate().is_ok());
        assert_eq!(t.tracks(), vec![Track::Device(0), Track::DeviceToHost(1)]);

        t.spans[1].deps.push(SpanId(7));
        assert!(matches!(
            t.validate(),
            Err(TraceError::UnknownDependency { dep: SpanId(7), .. })
        ));
        t.spans[1].deps = vec![SpanId(2)];
        assert!(matches!(
            t.validate(),
            Err(TraceError::ForwardDependency { .. })
        ));
        t.spans[1].deps.clear();
        t.spans[1].id = SpanId(1);
        assert!(matches!(t.validate(), Err(TraceError::DuplicateId { .. })));
    }

    #[test]
    fn a_head_part_larger_than_its_span_is_refused() {
        let mut t = Timeline::new();
        t.push_us(
            SpanAttrs::compute("forward", 0)
                .flops(100)
                .bytes(40)
                .head_part(HeadWork {
                    flops: 100,
                    bytes: 40,
                }),
            0.0,
            1.0,
        );
        assert!(t.validate().is_ok());
        t.spans[0].head = Some(HeadWork {
            flops: 60,
            bytes: 41,
        });
        let e = t.validate().unwrap_err();
        assert!(matches!(e, TraceError::HeadExceedsSpan { .. }));
        assert!(e.to_string().contains("41 B) exceeds"), "{e}");
    }

    #[test]
    fn steps_split_at_idle_instants() {
        let mut t = Timeline::new();
        t.push_us(SpanAttrs::compute("a", 0), 0.0, 10.0);
        t.push_us(SpanAttrs::compute("b", 1), 5.0, 10.0);
        // Touching is not idle.
        t.push_us(SpanAttrs::compute("c", 0), 15.0, 5.0);
        t.push_us(SpanAttrs::compute("d", 0), 30.0, 5.0);
        assert_eq!(t.steps(), vec![(0.0, 20.0), (30.0, 35.0)]);
        assert!(Timeline::new().steps().is_empty());
    }

    #[test]
    fn us_to_ns_rounds_and_clamps() {
        assert_eq!(us_to_ns(1.0004), 1000);
        assert_eq!(us_to_ns(1.0006), 1001);
        assert_eq!(us_to_ns(-3.0), 0);
        assert_eq!(us_to_ns(f64::NAN), 0);
    }
}
